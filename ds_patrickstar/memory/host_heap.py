"""Large host allocations go back to the system when freed, so that resident memory follows what is held.

[Note: host heap]
Model data lives on the host: the chunks' host homes under placement, the chunks themselves where
the accelerator is the host, the frozen chunks' read buffers with the disk tier (whose
``host_budget`` bounds what this rank keeps in RAM). What the process is resident for must follow
what it holds. glibc's ``malloc`` (what torch's CPU tensors come from) serves a request from its heap
unless it is at least its mmap threshold, and that threshold rises to the size of each mmapped block
freed (up to 32 MiB): after the first such free, the scratch of initialize (a module's fp32 values),
the temporaries of a step (activations, logits, gathered groups on a host accelerator) and the
chunk-sized buffers of the disk tier come from the heap, and the heap keeps what they free, resident,
interleaved with long-lived buffers, so the resident set grows from step to step past what is held.
A run of stage ``"patrickstar"`` therefore fixes the threshold at :data:`MMAP_THRESHOLD`
(``mallopt(M_MMAP_THRESHOLD)``, which also stops it from rising) from the start of its
``ds_patrickstar.Init`` block or of ``deepspeed.initialize``: every later allocation at least that
large is mapped on its own and unmapped when freed (the heap's free space from before still serves
requests of any size, hence as early as that). A threshold the user set (glibc's
``MALLOC_MMAP_THRESHOLD_`` environment variable) is left as it is, and so is a C library without
``mallopt``.
"""

from __future__ import annotations

import ctypes
import logging
import os

logger = logging.getLogger(__name__)

MMAP_THRESHOLD = 1 << 20
"""Bytes from which a host allocation is mapped on its own (see [Note: host heap])."""
_M_MMAP_THRESHOLD = -3  # glibc's malloc.h
_USER_SETTING = "MALLOC_MMAP_THRESHOLD_"


def map_large_allocations(threshold: int = MMAP_THRESHOLD) -> bool:
    """Fix the C library's mmap threshold at ``threshold`` bytes (see [Note: host heap]); False where
    the user set it or the C library has no ``mallopt``."""
    if _USER_SETTING in os.environ:
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (AttributeError, OSError):
        logger.debug("ds_patrickstar: no mallopt in this C library: its heap keeps what it frees")
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, threshold))
