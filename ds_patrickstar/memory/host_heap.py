"""Large host allocations go back to the system when freed, so that resident memory follows what is held.

[Note: host heap]
With the disk tier, ``host_budget`` bounds the model data this rank keeps in RAM; what the process is
resident for must follow what it holds. glibc's ``malloc`` (what torch's CPU tensors come from) serves
a request from its heap unless it is at least its mmap threshold, and that threshold rises to the size
of each mmapped block freed (up to 32 MiB): after the first such free, the scratch of initialize (a
module's fp32 values), the temporaries of a step and the chunk-sized buffers of the tier come from the
heap, and the heap keeps what they free, resident, interleaved with long-lived buffers. A run with the
disk tier fixes the threshold at :data:`MMAP_THRESHOLD` (``mallopt(M_MMAP_THRESHOLD)``, which also stops
it from rising) from the start of its ``ds_patrickstar.Init`` block or of ``deepspeed.initialize`` until
the block ends and the run is destroyed (or its initialize rolled back): every allocation at least that
large meanwhile is mapped on its own and unmapped when freed (the heap's free space from before still
serves requests of any size, hence as early as that). A threshold the user set (glibc's
``MALLOC_MMAP_THRESHOLD_`` environment variable, or ``glibc.malloc.mmap_threshold`` in
``GLIBC_TUNABLES``) is left as it is, and so is a C library without ``mallopt``.

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
freed (a fixed threshold stops rising: set it, it cannot be given back to glibc's rule, and glibc has no
call that reads it). A run with the disk tier keeps its lower threshold while it lives, and
:data:`DYNAMIC_CEILING` follows when nothing holds a lower one; a threshold the user set is left alone.
:func:`threshold_set` says what this package set last; the engine's record of process-wide effects
releases its hold (see [Note: process-wide effects]).
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
_TUNABLE = "glibc.malloc.mmap_threshold"


def user_setting() -> str | None:
    """Where the user set the mmap threshold (glibc's environment variable or tunable), else None."""
    if _USER_SETTING in os.environ:
        return _USER_SETTING
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    if _TUNABLE in {part.split("=", 1)[0].strip() for part in tunables.split(":")}:
        return f"GLIBC_TUNABLES={_TUNABLE}"
    return None


class _Threshold:
    """The process's mmap threshold as this package sets it: the disk tier's while a run with it holds it,
    else the build windows', else what it was before (see [Note: host heap])."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.windows = 0  # open build windows (Init blocks of any thread, initialize)
        self.disk = 0  # holders of the disk tier's threshold (runs, Init blocks)
        self.value: int | None = None  # what this package set last; None: glibc's own rule

    def wanted(self) -> int | None:
        if self.disk:
            return MMAP_THRESHOLD
        if self.windows:
            return BUILD_THRESHOLD
        return None if self.value is None else DYNAMIC_CEILING  # glibc's rule cannot be given back

    def apply(self) -> bool:
        """Set the threshold :meth:`wanted` names; False where the user set it or there is no ``mallopt``."""
        wanted = self.wanted()
        if wanted is None or wanted == self.value:
            return wanted is not None
        if user_setting() is not None:
            return False
        try:
            mallopt = ctypes.CDLL(None).mallopt
        except (AttributeError, OSError):
            logger.debug("ds_patrickstar: no mallopt in this C library: its heap keeps what it frees")
            return False
        mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
        if not mallopt(_M_MMAP_THRESHOLD, wanted):
            return False
        self.value = wanted
        return True


_THRESHOLD = _Threshold()


def threshold_set() -> int | None:
    """The mmap threshold this package set last (None: it never set one, glibc's own rule holds)."""
    return _THRESHOLD.value


class LargeAllocations:
    """The disk tier's threshold held (see [Note: host heap]): from :func:`map_large_allocations` until
    :meth:`release` (once; again does nothing), after which the threshold is what the other holders and
    the open build windows want, or :data:`DYNAMIC_CEILING` when nothing holds it."""

    def __init__(self) -> None:
        self._held = True

    def release(self) -> None:
        with _THRESHOLD.lock:
            if not self._held:
                return
            self._held = False
            _THRESHOLD.disk -= 1
            _THRESHOLD.apply()


def map_large_allocations() -> LargeAllocations:
    """Fix the C library's mmap threshold at :data:`MMAP_THRESHOLD` until the returned hold is released
    (the disk tier, see [Note: host heap]); nothing where the user set it or there is no ``mallopt``."""
    with _THRESHOLD.lock:
        _THRESHOLD.disk += 1
        _THRESHOLD.apply()
    return LargeAllocations()


def release_free_pages() -> bool:
    """Give the pages of the C heap's free blocks back to the system (glibc's ``malloc_trim(0)``, which
    also returns whole free pages inside the heap, not only at its top); False without it. See
    [Note: gradient accumulation] in groups/grads.py for why."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return bool(trim(0))


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
            _THRESHOLD.apply()

    def close(self) -> None:
        with _THRESHOLD.lock:
            if not self._open:
                return
            self._open = False
            _THRESHOLD.windows -= 1
            _THRESHOLD.apply()

    def __enter__(self) -> BuildWindow:
        self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
