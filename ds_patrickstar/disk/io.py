"""Reads and writes of the disk tier: one small interface, its thread implementation, aligned buffers.

[Note: disk I/O]
:class:`DiskIO` reads or writes one host buffer at one offset of an open file and returns a
:class:`DiskPending` whose :meth:`~DiskPending.wait` returns once the bytes are there, or raises
an ``OSError`` naming the request, the file (:meth:`DiskPending.of_file`) and the error number
(``ENOSPC``: a full disk, ``EIO``: a device error) that the system call returned.
:class:`ThreadDiskIO` is the implementation that needs no build step and sees the result of every
system call: a few threads calling ``os.preadv``/``os.pwritev``, which release the GIL, each
request cut into ``block_size`` pieces so that the threads share one large request. Files opened
with ``O_DIRECT`` bypass the page cache; their buffers, offsets and lengths are multiples of
:data:`ALIGNMENT` (:func:`aligned_empty`; :meth:`DiskIO.empty` gives the buffers an implementation
serves best). DeepSpeed's ``aio_handle`` is the second implementation
(:class:`~ds_patrickstar.disk.aio.AioDiskIO`, see [Note: aio disk I/O]).

Under the strict emulated accelerator (``poison=True``) a read fills its destination with NaN at
once and the bytes arrive only when the read is waited on (from a staging buffer), and a write whose
source changed before it was waited on raises :class:`~ds_patrickstar.memory.pending.CopyHazard`:
a missing wait fails a CPU test, as emulated copies do.

Every request is counted: bytes read and written, seconds the threads spent in system calls
(:attr:`DiskIO.io_seconds`) and seconds callers spent waiting (:attr:`DiskIO.wait_seconds`).
"""

from __future__ import annotations

import errno
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ..memory.pending import CopyHazard, Pending

ALIGNMENT = 4096  # O_DIRECT: buffer address, file offset and length are multiples of this
DEFAULT_BLOCK_SIZE = 1 << 20
DEFAULT_THREADS = 4


def align_up(nbytes: int) -> int:
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


def aligned_empty(nbytes: int) -> torch.Tensor:
    """A uint8 host tensor of ``align_up(nbytes)`` bytes whose address is a multiple of :data:`ALIGNMENT`."""
    length = align_up(nbytes)
    raw = torch.empty(length + ALIGNMENT, dtype=torch.uint8)
    start = -raw.data_ptr() % ALIGNMENT
    return raw[start : start + length]


class DiskPending(Pending):
    """A read or write in flight; :meth:`wait` returns when it has completed or raises its error."""

    def __init__(self, io: DiskIO, futures: list[Future[float]], what: str, finish: object = None) -> None:
        self._io, self._futures, self._what, self._finish = io, futures, what, finish
        self._path = ""
        self._waited = False
        self._error: BaseException | None = None

    def of_file(self, path: str) -> DiskPending:
        """Name ``path`` in this request's error; returns ``self``."""
        self._path = path
        return self

    def wait(self) -> None:
        """Return once the request completed; raise its error (again at every later wait)."""
        if self._error is not None:
            raise self._error
        if self._waited:
            return
        start = time.perf_counter()
        try:
            errors = []
            for future in self._futures:
                try:
                    self._io.add_io_seconds(future.result())
                except OSError as err:
                    errors.append(err)
            if errors:
                self._error = _named(errors[0], self._what, self._path)
                raise self._error from errors[0]
            if callable(self._finish):
                self._finish()
        finally:
            self._waited = True
            self._io.wait_seconds += time.perf_counter() - start

    def done(self) -> bool:
        return all(f.done() for f in self._futures)


class DiskIO:
    """The interface of the disk tier's I/O; see [Note: disk I/O]."""

    def __init__(self, poison: bool = False) -> None:
        self.poison = poison
        self.bytes_read = 0
        self.bytes_written = 0
        self.io_seconds = 0.0
        self.wait_seconds = 0.0
        self._lock = threading.Lock()

    def add_io_seconds(self, seconds: float) -> None:
        with self._lock:
            self.io_seconds += seconds

    def empty(self, nbytes: int) -> torch.Tensor:
        """An aligned uint8 host buffer of ``align_up(nbytes)`` bytes that this implementation reads
        and writes best."""
        return aligned_empty(nbytes)

    def read(self, fd: int, offset: int, dst: torch.Tensor) -> DiskPending:
        """Read ``dst.nbytes`` bytes at ``offset`` into ``dst`` (contiguous, host)."""
        nbytes = dst.numel() * dst.element_size()
        self.bytes_read += nbytes
        what = f"read of {nbytes:,} bytes at offset {offset:,}"
        if not self.poison:
            return DiskPending(self, self._submit(fd, offset, _bytes_of(dst), write=False), what)
        staging = aligned_empty(nbytes)[:nbytes]
        futures = self._submit(fd, offset, staging, write=False)
        dst.view(torch.uint8).view(-1).fill_(0xFF)  # NaN in every float dtype until waited on

        def arrive() -> None:
            _bytes_of(dst).copy_(staging)

        return DiskPending(self, futures, what, arrive)

    def write(self, fd: int, offset: int, src: torch.Tensor) -> DiskPending:
        """Write ``src`` (contiguous, host) at ``offset``; ``src`` must not change until waited on."""
        nbytes = src.numel() * src.element_size()
        self.bytes_written += nbytes
        what = f"write of {nbytes:,} bytes at offset {offset:,}"
        futures = self._submit(fd, offset, _bytes_of(src), write=True)
        if not self.poison:
            return DiskPending(self, futures, what)
        version = src._version

        def check() -> None:
            if src._version != version:
                raise CopyHazard(
                    "disk tier: the source of a pending write was overwritten before the write was waited on"
                )

        return DiskPending(self, futures, what, check)

    def _submit(self, fd: int, offset: int, data: torch.Tensor, write: bool) -> list[Future[float]]:
        raise NotImplementedError

    def close(self) -> None:
        """Stop the workers (requests in flight complete first)."""


class ThreadDiskIO(DiskIO):
    """Threads calling ``os.preadv``/``os.pwritev`` (they release the GIL); see [Note: disk I/O]."""

    def __init__(
        self, threads: int = DEFAULT_THREADS, block_size: int = DEFAULT_BLOCK_SIZE, poison: bool = False
    ) -> None:
        super().__init__(poison)
        self.block_size = max(ALIGNMENT, align_up(block_size))
        self._pool = ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="ds_ps_disk")

    def _submit(self, fd: int, offset: int, data: torch.Tensor, write: bool) -> list[Future[float]]:
        view = memoryview(data.numpy())  # type: ignore[arg-type]
        futures = []
        for start in range(0, max(len(view), 1), self.block_size):
            part = view[start : start + self.block_size]
            futures.append(self._pool.submit(self._run, fd, offset + start, part, write))
        return futures

    def _run(self, fd: int, offset: int, part: memoryview, write: bool) -> float:
        start = time.perf_counter()
        done = 0
        while done < len(part):
            piece = part[done:]
            count = self.pwrite(fd, piece, offset + done) if write else self.pread(fd, piece, offset + done)
            if count <= 0:
                what = "wrote" if write else "read"
                raise OSError(f"disk tier: {what} 0 of {len(piece)} bytes at offset {offset + done} (file too short)")
            done += count
        return time.perf_counter() - start

    def pread(self, fd: int, buffer: memoryview, offset: int) -> int:
        """One system call; a subclass may fail here to inject a fault."""
        return os.preadv(fd, [buffer], offset)

    def pwrite(self, fd: int, buffer: memoryview, offset: int) -> int:
        return os.pwritev(fd, [buffer], offset)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    if not tensor.is_contiguous() or tensor.device.type != "cpu":
        raise ValueError("disk tier: I/O buffers must be contiguous host tensors")
    return tensor.view(-1).view(torch.uint8)


def _named(err: OSError, what: str, path: str) -> OSError:
    """``err`` as an ``OSError`` of the same number saying which request of which file failed."""
    where = path or "a swap file"
    if err.errno is None:
        return OSError(f"disk tier: {what} of {where} failed: {err}")
    name = errno.errorcode.get(err.errno, f"errno {err.errno}")
    return OSError(err.errno, f"disk tier: {what} failed with {name} ({err.strerror or err})", where)
