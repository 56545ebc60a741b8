"""Large host allocations go back to the system when freed, so that resident memory follows what is held.

[Note: host heap]
With the disk tier, ``host_budget`` bounds the model data this rank keeps in RAM; what the process is
resident for must follow what it holds. glibc's ``malloc`` (what torch's CPU tensors come from) serves
a request from its heap unless it is at least its mmap threshold, and that threshold rises to the size
of each mmapped block freed (up to 32 MiB): after the first such free, the scratch of initialize (a
module's fp32 values), the temporaries of a step and the chunk-sized buffers of the tier come from the
heap, and the heap keeps what they free, resident, interleaved with long-lived buffers. A run with the
disk tier fixes the threshold at :data:`MMAP_THRESHOLD` (``mallopt(M_MMAP_THRESHOLD)``, which also stops
it from rising) from the start of its ``ds_patrickstar.Init`` block or of ``deepspeed.initialize``:
every later allocation at least that large is mapped on its own and unmapped when freed (the heap's
free space from before still serves requests of any size, hence as early as that). A
threshold the user set (glibc's ``MALLOC_MMAP_THRESHOLD_`` environment variable) is left as it is, and
so is a C library without ``mallopt``.

Building the model has the same problem in any run. Under ``ds_patrickstar.Init`` each parameter a
module creates is a real, untouched tensor of its full size that is replaced by a meta one at once
(see [Note: deferred init] in io/init.py), and ``deepspeed.initialize`` allocates and frees
full-size scratch while it builds the chunks. Served from the heap (below a threshold that has
risen), those blocks are freed between small long-lived allocations, and the heap grows by
about the model's size in address space, every later allocation scattering pages across it.
So a :class:`BuildWindow` maps every allocation of at least :data:`BUILD_THRESHOLD`
on its own while an ``Init`` block is open and while ``deepspeed.initialize`` builds a
"patrickstar" engine; when the last such window closes, the threshold is fixed at
:data:`DYNAMIC_CEILING`, where glibc's own rising threshold ends after the first large block is
freed (a fixed threshold stops rising: set it, it cannot be given back to glibc's rule). A run
with the disk tier keeps its lower threshold throughout; a threshold the user set is left alone.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading

logger = logging.getLogger(__name__)

MMAP_THRESHOLD = 1 << 20
"""Bytes from which a host allocation is mapped on its own with the disk tier (see [Note: host heap])."""
BUILD_THRESHOLD = 128 << 10
"""The same while a model is built (glibc's initial threshold)."""
DYNAMIC_CEILING = 4 * 1024 * 1024 * ctypes.sizeof(ctypes.c_long)
"""glibc's ``DEFAULT_MMAP_THRESHOLD_MAX``: where its rising threshold stops (32 MiB on 64-bit)."""
_M_MMAP_THRESHOLD = -3  # glibc's malloc.h
_USER_SETTING = "MALLOC_MMAP_THRESHOLD_"


class _Threshold:
    """The process's mmap threshold as this package sets it: the disk tier's, or build windows."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.windows = 0  # open build windows (Init blocks of any thread, initialize)
        self.disk = False  # fixed for the disk tier: nothing else changes it

    def set(self, nbytes: int) -> bool:
        if _USER_SETTING in os.environ:
            return False
        try:
            mallopt = ctypes.CDLL(None).mallopt
        except (AttributeError, OSError):
            logger.debug("ds_patrickstar: no mallopt in this C library: its heap keeps what it frees")
            return False
        mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
        return bool(mallopt(_M_MMAP_THRESHOLD, nbytes))


_THRESHOLD = _Threshold()


def map_large_allocations(threshold: int = MMAP_THRESHOLD) -> bool:
    """Fix the C library's mmap threshold at ``threshold`` bytes for the rest of the process (the disk
    tier, see [Note: host heap]); False where the user set it or the C library has no ``mallopt``."""
    with _THRESHOLD.lock:
        _THRESHOLD.disk = True
        return _THRESHOLD.set(threshold)


class BuildWindow:
    """While open (windows nest, from any thread), a host allocation of at least :data:`BUILD_THRESHOLD`
    that the heap's free space cannot serve is mapped on its own instead of growing the heap; see
    [Note: host heap]. A context manager, or :meth:`open` then :meth:`close` once."""

    def __init__(self) -> None:
        self._open = False

    def open(self) -> None:
        with _THRESHOLD.lock:
            if self._open:
                return
            self._open = True
            _THRESHOLD.windows += 1
            if _THRESHOLD.windows == 1 and not _THRESHOLD.disk:
                _THRESHOLD.set(BUILD_THRESHOLD)

    def close(self) -> None:
        with _THRESHOLD.lock:
            if not self._open:
                return
            self._open = False
            _THRESHOLD.windows -= 1
            if _THRESHOLD.windows == 0 and not _THRESHOLD.disk:
                _THRESHOLD.set(DYNAMIC_CEILING)

    def __enter__(self) -> BuildWindow:
        self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
