"""DeepSpeed's ``aio_handle`` (the async_io op, libaio) as the second implementation of the disk tier's I/O.

[Note: aio disk I/O]
:class:`AioDiskIO` serves the :class:`~ds_patrickstar.disk.io.DiskIO` interface with
DeepSpeed's ``aio_handle``, the engine of ZeRO-Infinity's NVMe swapping: each of its
``intra_op_parallelism`` threads keeps ``queue_depth`` requests of ``block_size`` bytes in flight
through libaio (``single_submit``: one ``io_submit`` call per request; ``overlap_events``: submit
while reaping). Two things of that op shape this adapter:

* ``aio_handle.wait()`` waits for *every* pending operation of the handle, so one handle cannot
  complete one request while another is in flight. Each request therefore runs as a synchronous
  ``sync_pread``/``sync_pwrite`` (which releases the GIL) on one of :data:`STREAMS` worker
  threads, each with handles of its own: a read ahead and a write behind proceed at once, and
  each request gets its own :class:`~ds_patrickstar.disk.io.DiskPending`.
* The op opens files by name, always with ``O_DIRECT``, and splits a request evenly over its
  threads. A request on an open file descriptor goes to ``/proc/self/fd/<fd>`` (the same file,
  reopened); its largest part that splits into :data:`~ds_patrickstar.disk.io.ALIGNMENT`
  pieces per thread goes to the parallel handle, the rest to a one-thread handle. Files that do
  not take ``O_DIRECT`` (tmpfs) cannot be served: the backend choice falls back or refuses at
  initialize (:func:`~ds_patrickstar.disk.tier.open_disk_states`).

Buffers that are not page-locked go through a page-locked bounce buffer of the op (allocated per
request); :meth:`AioDiskIO.empty` hands out page-locked buffers (DeepSpeed's pinned-tensor
manager) that skip that copy. The op reports an error as a return value of -1 (a file that does
not open, a bad size, with the reason on stderr), raised here as ``OSError``. It never reads the
result of a libaio completion (``io_event.res``: the bytes done or the negative error number):
``io_pgetevents`` only counts completions, and ``sync_pread``/``sync_pwrite``/``wait`` return the
number of operations completed, not bytes. A read or write that fails inside a request (``EIO``
from the device, ``ENOSPC`` where an in-place rewrite needs new blocks: copy-on-write or thinly
provisioned storage) is therefore invisible here: ``io_backend: "auto"`` takes the thread
backend, which sees every result, and an explicit ``"aio"`` logs :data:`AIO_UNCHECKED`. Reads
past the end of a file are refused here before the op, which would abort the process.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import queue
import resource
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from .io import ALIGNMENT, DiskIO, aligned_empty

logger = logging.getLogger(__name__)

AIO_UNCHECKED = (
    'disk tier I/O: "aio" (DeepSpeed\'s aio_handle): the op does not check the result of each libaio '
    "completion, so a read or write that fails inside a request (a device error, a full copy-on-write or "
    "thin file system) goes unnoticed and the optimizer states on disk can be wrong without an error; "
    'io_backend "threads" (and "auto") checks every read and write'
)
"""Logged as a warning when ``io_backend`` is ``"aio"``; see [Note: aio disk I/O]."""

STREAMS = 2
"""Requests served at once (a read ahead and a write behind), each on its own handles."""


@functools.cache
def load_async_io() -> tuple[Any | None, str]:
    """DeepSpeed's async_io op (built on first use) and ``""``, or ``None`` and why it cannot load."""
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder

        builder = AsyncIOBuilder()
        if not builder.is_compatible(verbose=False):
            return None, "DeepSpeed's async_io op needs libaio (apt-get install libaio-dev)"
        return builder.load(verbose=False), ""
    except Exception as err:  # a failed build raises anything from a compiler error to ImportError
        return None, f"DeepSpeed's async_io op did not build or load ({type(err).__name__}: {err})"


def async_io_built() -> bool:
    """Whether the async_io op is installed or JIT-built already: loading it then takes seconds,
    where a first JIT build takes minutes."""
    try:
        from deepspeed.git_version_info import installed_ops
        from torch.utils.cpp_extension import _get_build_directory

        if installed_ops.get("async_io"):
            return True
        return os.path.isfile(os.path.join(_get_build_directory("async_io", False), "async_io.so"))
    except Exception:  # a DeepSpeed or torch without these names: treat as not built
        return False


def lock_problem(needed: int, limit: int | None = None, privileged: bool | None = None) -> str:
    """Why this process cannot page-lock ``needed`` bytes for the op's buffers, or ``""`` (the op
    aborts the process where a lock fails). ``limit``: ``ulimit -l`` in bytes (default: this
    process's ``RLIMIT_MEMLOCK``); ``privileged``: root, whose locks the limit does not bound."""
    privileged = os.geteuid() == 0 if privileged is None else privileged
    limit = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0] if limit is None else limit
    if privileged or limit == resource.RLIM_INFINITY or needed <= limit:
        return ""
    return (
        f"its buffers need {needed:,} bytes of page-locked memory and this process may lock {limit:,} "
        "(raise `ulimit -l`)"
    )


class AioDiskIO(DiskIO):
    """Reads and writes through DeepSpeed's ``aio_handle``; see [Note: aio disk I/O]."""

    def __init__(
        self,
        block_size: int = 1 << 20,
        queue_depth: int = 8,
        single_submit: bool = False,
        overlap_events: bool = True,
        intra_op_parallelism: int = 1,
        poison: bool = False,
    ) -> None:
        super().__init__(poison)
        op, why = load_async_io()
        if op is None:
            raise RuntimeError(why)
        self.parallelism = max(1, intra_op_parallelism)
        self._handles: queue.SimpleQueue[tuple[Any, Any]] = queue.SimpleQueue()
        for _ in range(STREAMS):
            parallel = op.aio_handle(block_size, queue_depth, single_submit, overlap_events, self.parallelism)
            single = op.aio_handle(block_size, queue_depth, single_submit, overlap_events, 1)
            self._handles.put((parallel, single))
        self._free_handle = op.aio_handle(ALIGNMENT, 1, False, False, 1)
        self._pool = ThreadPoolExecutor(max_workers=STREAMS, thread_name_prefix="ds_ps_aio")

    def empty(self, nbytes: int) -> torch.Tensor:
        """A page-locked uint8 host buffer of ``align_up(nbytes)`` bytes (the op reads and writes
        it without a bounce copy), freed when the last tensor viewing it is gone."""
        plain = aligned_empty(nbytes)
        length = plain.numel()
        del plain
        locked = self._free_handle.new_cpu_locked_tensor(length, torch.empty(0, dtype=torch.uint8))
        if locked.data_ptr() == 0:
            raise MemoryError(
                f"disk tier (aio): could not page-lock {length:,} bytes (see `ulimit -l`); raise the limit "
                'or use offload_optimizer.io_backend: "threads"'
            )
        memory = (ctypes.c_uint8 * length).from_address(locked.data_ptr())
        weakref.finalize(memory, self._free_handle.free_cpu_locked_tensor, locked)
        return torch.frombuffer(memory, dtype=torch.uint8)

    def _submit(self, fd: int, offset: int, data: torch.Tensor, write: bool) -> list[Future[float]]:
        nbytes = data.numel()
        if nbytes % ALIGNMENT or offset % ALIGNMENT or data.data_ptr() % ALIGNMENT:
            raise ValueError(f"disk tier (aio): requests must be {ALIGNMENT}-byte aligned (O_DIRECT)")
        if not write and os.fstat(fd).st_size < offset + nbytes:
            raise OSError(f"disk tier (aio): read of {nbytes} bytes at offset {offset} is past the end of the file")
        return [self._pool.submit(self._run, f"/proc/self/fd/{fd}", offset, data, write)]

    def _run(self, path: str, offset: int, data: torch.Tensor, write: bool) -> float:
        start = time.perf_counter()
        parallel, single = self._handles.get()
        try:
            head = data.numel() // (ALIGNMENT * self.parallelism) * (ALIGNMENT * self.parallelism)
            for handle, lo, hi in ((parallel, 0, head), (single, head, data.numel())):
                if hi > lo:
                    call = handle.sync_pwrite if write else handle.sync_pread
                    if call(data[lo:hi], path, offset + lo) < 0:
                        what = "write" if write else "read"
                        raise OSError(
                            f"disk tier (aio): {what} of {hi - lo} bytes at offset {offset + lo} of {path} "
                            "failed (DeepSpeed's async_io printed the reason on stderr)"
                        )
        finally:
            self._handles.put((parallel, single))
        return time.perf_counter() - start

    def close(self) -> None:
        self._pool.shutdown(wait=True)
