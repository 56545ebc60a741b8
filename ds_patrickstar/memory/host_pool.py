"""The host memory pool: every host buffer of model data, pinned once, counted as allocated.

[Note: pinned host memory]
A chunk that lives on the host keeps its values (and its gradient accumulator, and the
optimizer states of the chunks updated on the host) in host buffers that asynchronous
copies read and write, so on a GPU they must be pinned. torch's pinned memory
(``pin_memory()``, ``pin_memory=True``, a non-blocking copy to the host) comes from its
caching host allocator, which rounds every block up to the next power of two and keeps
freed blocks cached: our chunks are sized to their contents, so a chunk of 1.1 x 2^k
bytes would cost nearly twice its size on the host, and every move would pin anew.

:class:`HostPool` is the one accessor for those buffers (through
:meth:`Accelerator.host_empty <ds_patrickstar.memory.accelerator.Accelerator.host_empty>`):

* a buffer has the size asked for (rounded up to the accelerator's pinning alignment: a
  page on CUDA, whose registration works on whole pages) and is pinned once, when the pool
  allocates it, by the accelerator (``cudaHostRegister`` on CUDA), never per move;
* a released buffer that a pending copy still reads or writes is held until that copy has
  completed (torch's allocator does this for its own blocks by recording the copy's event;
  ours are not its blocks); then it goes to a free list keyed by its size, and the next request
  of that size reuses it without pinning again;
* the free list holds at most ``cache_limit`` bytes (the host buffers of one chunk, set by
  the chunk store, plus the payload buffers of the chunks updated on the host, set where the
  optimizer states are placed): past that, the oldest cached buffers are unpinned and freed.
  A chunk updated on the host sends its payload to the accelerator in forward, which frees its
  host buffer, and its gradient back in backward, which takes one of the same size: with one
  chunk's worth cached, every step unpinned and pinned those buffers anew (16 of 27 such chunks
  a step on the strict twin's mirror of the H100 sweep at 12 GiB; ``cudaHostRegister`` of tens of
  MB costs milliseconds each on a GPU, a host cost on the step's critical path). Cached, they
  are counted (:attr:`HostPool.allocated`) and at most the host memory those payloads took
  before they left it;
* :attr:`HostPool.allocated` counts every byte the pool holds (in use, waiting on a copy,
  cached): pinned bytes are counted as allocated, not as requested;
* when the pool goes away (its accelerator with it) it unpins every buffer it still holds
  before the memory can be freed: memory freed while registered would leave a registration
  behind that a later buffer at the same address collides with.

The strict emulated accelerator records each pinning and models torch's rounding and caching
for any host buffer of a copy that did not come from the pool, so a CPU test sees the host
bytes really allocated (see :mod:`~ds_patrickstar.memory.emulated`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .pending import Pending

logger = logging.getLogger(__name__)

_TORCH_ALIGNMENT = 64  # torch's CPU allocator aligns every allocation to 64 bytes


@dataclass(eq=False)
class _Buffer:
    raw: torch.Tensor  # the allocation (uint8), alive while the pool holds the buffer
    start: int  # the pinned range: byte offset in ``raw`` and length
    length: int

    @property
    def nbytes(self) -> int:
        return self.raw.numel()

    @property
    def pinned_ptr(self) -> int:
        return self.raw.data_ptr() + self.start


PinFn = Callable[[int, int], None]  # (address, bytes)
UnpinFn = Callable[[int], None]  # (address)


class HostPool:
    """Exact-size host buffers, pinned once and reused; see [Note: pinned host memory]."""

    def __init__(self, pin: PinFn, unpin: UnpinFn, alignment: int = _TORCH_ALIGNMENT) -> None:
        self._pin, self._unpin = pin, unpin
        self.alignment = alignment
        self.cache_limit = 0
        self._in_use: dict[int, _Buffer] = {}  # data_ptr of the handed-out tensor -> buffer
        self._deferred: list[tuple[Pending, _Buffer]] = []  # (the pending copy, its buffer)
        self._free: dict[int, list[_Buffer]] = {}  # pinned length -> cached buffers
        self._free_order: list[_Buffer] = []  # cached buffers, oldest first
        self._storages: set[int] = set()  # data_ptr of every allocation held
        self.allocated = 0  # bytes held: in use, waiting on a copy, cached
        self.pinnings = 0  # buffers pinned so far (each once)
        self.closed = False  # let go of every buffer (see close)

    # ---- handing out and taking back --------------------------------------------------
    def acquire(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A host buffer of ``numel`` elements of ``dtype`` (contents undefined), pinned."""
        nbytes = numel * dtype.itemsize
        length = max(-(-nbytes // self.alignment) * self.alignment, self.alignment)
        self.reclaim()
        cached = self._free.get(length)
        if cached:
            buffer = cached.pop()
            self._free_order.remove(buffer)
        else:
            buffer = self._allocate(length)
        tensor = buffer.raw[buffer.start : buffer.start + nbytes].view(dtype)
        self._in_use[tensor.data_ptr()] = buffer
        return tensor

    def release(self, tensor: torch.Tensor, after: Pending | None = None) -> None:
        """Take back a buffer from :meth:`acquire`; with ``after`` (a :class:`Pending` copy that
        reads or writes it), only once that copy has completed."""
        buffer = self._in_use.pop(tensor.data_ptr(), None)
        if buffer is None and self.closed:
            return  # the pool let go of every buffer when it closed (a saved activation dying after its run)
        if buffer is None:
            raise RuntimeError(
                f"host pool: releasing a tensor ({tensor.numel()} elements, {tensor.dtype}) it did not hand out"
            )
        if after is not None and not after.done():
            self._deferred.append((after, buffer))
        else:
            self._cache(buffer)

    def owns(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` lives in a buffer the pool holds."""
        return tensor.untyped_storage().data_ptr() in self._storages

    def reclaim(self) -> None:
        """Buffers whose copies have completed go to the free list."""
        still = []
        for pending, buffer in self._deferred:
            if pending.done():
                self._cache(buffer)
            else:
                still.append((pending, buffer))
        self._deferred = still

    @property
    def in_use(self) -> int:
        return sum(b.nbytes for b in self._in_use.values())

    @property
    def cached(self) -> int:
        return sum(b.nbytes for b in self._free_order)

    # ---- allocation ---------------------------------------------------------------------
    def _allocate(self, length: int) -> _Buffer:
        slack = self.alignment - _TORCH_ALIGNMENT if self.alignment > _TORCH_ALIGNMENT else 0
        raw = torch.empty(length + slack, dtype=torch.uint8)
        start = -raw.data_ptr() % self.alignment
        if start + length > raw.numel():
            raise RuntimeError(f"host pool: torch returned host memory at {raw.data_ptr():#x}, not 64-byte aligned")
        buffer = _Buffer(raw, start, length)
        self._pin(buffer.pinned_ptr, length)
        self.pinnings += 1
        self.allocated += buffer.nbytes
        self._storages.add(raw.untyped_storage().data_ptr())
        return buffer

    def _cache(self, buffer: _Buffer) -> None:
        if buffer.nbytes > self.cache_limit:
            self._drop(buffer)
            return
        self._trim(self.cache_limit - buffer.nbytes)
        self._free.setdefault(buffer.length, []).append(buffer)
        self._free_order.append(buffer)

    def _trim(self, keep: int) -> None:
        """Unpin and free the oldest cached buffers until at most ``keep`` bytes are cached."""
        while self._free_order and self.cached > keep:
            oldest = self._free_order.pop(0)
            self._free[oldest.length].remove(oldest)
            self._drop(oldest)

    def _drop(self, buffer: _Buffer) -> None:
        self._unpin(buffer.pinned_ptr)
        self.allocated -= buffer.nbytes
        self._storages.discard(buffer.raw.untyped_storage().data_ptr())

    def close(self, empty: bool = False) -> None:
        """Unpin and let go of every buffer (in use or not): the pool's owner is going away. With
        ``empty`` (the run is over, nothing may use them: see [Note: closing the accelerator] in
        accelerator.py) their storages go to zero bytes too, so the memory goes back though a tensor
        of a buffer may live on; without, such a tensor keeps its memory until it dies."""
        self.closed = True
        held = [*self._in_use.values(), *(b for _, b in self._deferred), *self._free_order]
        self._in_use, self._deferred, self._free, self._free_order = {}, [], {}, []
        for buffer in held:
            self._drop(buffer)
            if empty:
                buffer.raw.untyped_storage().resize_(0)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # at interpreter exit the accelerator may be gone already
            self.close()

    def cache_at_least(self, nbytes: int) -> None:
        """Let the free list hold ``nbytes`` (the chunk store raises it to one chunk's host buffers)."""
        self.cache_limit = max(self.cache_limit, nbytes)
