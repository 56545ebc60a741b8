"""Accelerator primitives: allocate, free, copy, wait. The only code that differs between a GPU
and its CPU twin (:mod:`~ds_patrickstar.memory.cuda`, :mod:`~ds_patrickstar.memory.emulated`); everything
above it (chunk moves, placement, Adam) is one code path. :class:`HostAccelerator` is the plain CPU run
without placement: host memory, synchronous copies.

[Note: deferred frees]
A buffer that a pending copy still reads (an evicted chunk's payload) is not freed at once:
it stays allocated, and charged to the ledger, until the copy has completed, when
:meth:`Accelerator.reclaim` frees it. That is what the memory really does on a GPU (the
host may run ahead of the copy stream), so the budget counts it; when room is needed and
such frees are in flight, placement waits on the oldest copies first. The emulated
accelerator completes its copies only when waited on, so the same code is exercised on CPU.

[Note: closing the accelerator]
Every backed allocation is recorded (by storage) until it is freed, so that when its run ends
(``engine.destroy()``) :meth:`Accelerator.close` can give back everything still held, whichever
part allocated it: the copies in flight are waited for, each allocation's storage goes to zero
bytes (the ledger to zero) and the host pool unpins and empties its buffers. Memory goes back at
the destroy, not when the last reference to a buffer dies: a caller may keep the engine, and a
view of a chunk (a parameter, a tensor autograd saved) keeps its storage object alive.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .host_pool import HostPool
from .host_work import HostWaits, HostWorker
from .ledger import DeviceLedger
from .pending import Pending
from .released_views import ReleasedViews


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class Accelerator:
    """Primitives shared by both kinds; see [Note: strict emulated accelerator]."""

    device: torch.device
    host_alignment = 64  # pinned host buffers start and end on multiples of this (see host_pool.py)

    def __init__(self, budget: int) -> None:
        self.ledger = DeviceLedger(budget)
        self._deferred: list[tuple[Pending, torch.Tensor, int, str]] = []  # frees waiting on a copy
        self._backed: dict[int, tuple[torch.Tensor, int, str]] = {}  # storage data_ptr -> (tensor, bytes, kind)
        self.host_pool = HostPool(self._pin_host, self._unpin_host, self.host_alignment)
        self.host_waits = HostWaits()  # see [Note: host waits] in host_work.py
        self.host_worker = HostWorker(self.host_waits)
        self.released_views = ReleasedViews()  # see [Note: released parameters read as empty]

    # ---- memory -------------------------------------------------------------------
    def empty(self, numel: int, dtype: torch.dtype, kind: str, what: str) -> torch.Tensor:
        """A charged accelerator tensor (release it with :meth:`free`)."""
        self.ledger.charge(numel * dtype.itemsize, kind, what)
        tensor = torch.empty(numel, dtype=dtype, device=self.device)
        self._record(tensor, kind)
        return tensor

    def materialize(self, tensor: torch.Tensor, kind: str, what: str) -> None:
        """Give an unbacked tensor its memory (contents undefined until filled); a free of the same
        buffer still waiting on its copy completes first."""
        storage = tensor.untyped_storage()
        for index, (pending, other, nbytes, other_kind) in enumerate(self._deferred):
            if other.untyped_storage().data_ptr() == storage.data_ptr() and storage.nbytes():
                pending.wait_host()
                del self._deferred[index]
                self._free_now(other, nbytes, other_kind)
                break
        self.ledger.charge(_nbytes(tensor), kind, what)
        tensor.untyped_storage().resize_(_nbytes(tensor))
        self._record(tensor, kind)
        self.released_views.backed(tensor)

    def _record(self, tensor: torch.Tensor, kind: str) -> None:
        """A backed allocation: :meth:`close` frees it if nothing did before (see [Note: closing the accelerator])."""
        if _nbytes(tensor):
            self._backed[tensor.untyped_storage().data_ptr()] = (tensor, _nbytes(tensor), kind)

    def free(self, tensor: torch.Tensor, kind: str, after: Pending | None = None) -> None:
        """Release ``tensor``'s memory (its storage goes to zero bytes); with ``after``, once that
        copy, which reads ``tensor``, has completed: until then the bytes stay charged (they are
        still occupied on a device) and :meth:`reclaim` frees them (see [Note: deferred frees])."""
        if after is None or after.done():
            self._free_now(tensor, _nbytes(tensor), kind)
        else:
            self._deferred.append((after, tensor, _nbytes(tensor), kind))

    def _free_now(self, tensor: torch.Tensor, nbytes: int, kind: str) -> None:
        self._check_free(tensor)
        self._backed.pop(tensor.untyped_storage().data_ptr(), None)
        tensor.untyped_storage().resize_(0)
        self.ledger.release(nbytes, kind)
        self.released_views.released(tensor)

    def _check_free(self, tensor: torch.Tensor) -> None:
        """Raise where freeing ``tensor`` now is a hazard (the strict twin checks collectives in flight)."""

    def close(self) -> None:
        """The run is over: every allocation still backed is freed, once the copies in flight have
        completed, and the host pool lets go of its buffers (see [Note: closing the accelerator]).
        The accelerator is not used after this; closing again does nothing."""
        self.host_worker.close()
        self._drain()
        self._deferred = []
        for tensor, nbytes, kind in list(self._backed.values()):
            self._free_now(tensor, nbytes, kind)
        self.host_pool.close(empty=True)

    def _drain(self) -> None:
        """Wait for every copy still in flight (their buffers are about to be freed)."""
        for pending, *_ in self._deferred:
            pending.wait_host()

    def reclaim(self, need_below: int | None = None) -> None:
        """Free the buffers whose copies have completed; with ``need_below``, also wait on the
        oldest copies until the ledger's total is at most that (or nothing is left in flight).
        Host buffers released behind a completed copy go back to the host pool."""
        self.host_pool.reclaim()
        still = []
        for entry in self._deferred:
            if entry[0].done():
                self._free_now(*entry[1:])
            else:
                still.append(entry)
        self._deferred = still
        while need_below is not None and self.ledger.total > need_below and self._deferred:
            pending, tensor, nbytes, kind = self._deferred.pop(0)
            pending.wait_host()
            self._free_now(tensor, nbytes, kind)

    def in_flight_bytes(self) -> int:
        return sum(entry[2] for entry in self._deferred)

    def host_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A host buffer for model data, pinned where copies need it (release it with
        :meth:`host_free`): the one accessor, see [Note: pinned host memory]."""
        return self.host_pool.acquire(numel, dtype)

    def check_clean(self, payload: torch.Tensor, host: torch.Tensor, chunk_id: int, copying: Pending | None) -> None:
        """A payload evicted without a copy holds what its kept host buffer holds (see [Note: clean evictions]
        in store/clean_copies.py): the strict emulated accelerator compares them; a GPU trusts the version."""

    def host_free(self, tensor: torch.Tensor, after: Pending | None = None) -> None:
        """Give back a buffer of :meth:`host_empty`; with ``after``, once that copy has completed."""
        self.host_pool.release(tensor, after)

    def pin_host_range(self, address: int, nbytes: int) -> None:
        """Pin a host range that is not the pool's (the disk tier's read buffers) for asynchronous copies;
        undo with :meth:`unpin_host_range` before it is freed."""
        self._pin_host(address, nbytes)

    def unpin_host_range(self, address: int) -> None:
        self._unpin_host(address)

    def _pin_host(self, address: int, nbytes: int) -> None:
        """Pin a host range for asynchronous copies (nothing to do without an accelerator)."""

    def _unpin_host(self, address: int) -> None:
        """Undo :meth:`_pin_host`."""

    def host_bytes_allocated(self) -> int:
        """Pinned host bytes held (see [Note: pinned host memory])."""
        return self.host_pool.allocated

    # ---- the clock of the step-time model (see [Note: step-time model] in placement/step_time.py) ----
    def clock(self) -> Any:
        """A mark of now on the accelerator's clock (the host's here; CUDA: an event on the compute stream)."""
        return time.perf_counter()

    def seconds_between(self, start: Any, end: Any) -> float:
        """Seconds between two marks of :meth:`clock` (NaN where the accelerator has not reached them)."""
        return float(end - start)

    def reach(self, mark: Any) -> None:
        """Wait until the accelerator has run up to ``mark`` (the host's clock is always there)."""

    # ---- host work (see [Note: overlapped host Adam] in host_work.py) ---------------
    def host_work(self, work: Callable[[], None], writes: list[torch.Tensor], after: list[Pending]) -> Pending:
        """Run ``work``, which reads and writes the host tensors ``writes``, on the host worker once the
        copies in ``after`` have completed; wait on the result before touching ``writes``."""
        return self.host_worker.submit(work, after)

    def host_jobs_waiting(self) -> int:
        """Host jobs handed over and not finished (see [Note: host updates in backward] in
        optim/early_updates.py)."""
        return self.host_worker.waiting()

    # ---- copies -------------------------------------------------------------------
    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Pending:
        """Enqueue ``dst.copy_(src)`` after the work already queued; wait on the result before
        using ``dst``, and do not touch ``src`` until then."""
        raise NotImplementedError

    def bytes_to_host(self, src: torch.Tensor, host: torch.Tensor) -> Pending:
        """An asynchronous copy of the accelerator bytes ``src`` (1-d uint8, not charged to the ledger:
        a saved activation) into ``host``, pinned host bytes of the pool's (see [Note: activation host
        stack] in activations/host_stack.py); keep both alive until it has completed."""
        return self._copy_activation(host, src, src)

    def bytes_to_device(self, host: torch.Tensor) -> tuple[torch.Tensor, Pending]:
        """An asynchronous copy of host bytes into a new (uncharged) accelerator buffer; wait on the
        :class:`Pending` before reading the buffer."""
        device = torch.empty(host.numel(), dtype=torch.uint8, device=self.device)
        return device, self._copy_activation(device, host, device)

    def _copy_activation(self, dst: torch.Tensor, src: torch.Tensor, on_device: torch.Tensor) -> Pending:
        """:meth:`copy` for an activation, ``on_device`` being its accelerator side."""
        return self.copy(dst, src)

    @contextlib.contextmanager
    def collective_stream(self, kind: str, *buffers: torch.Tensor) -> Iterator[CollectiveIssue]:
        """Where a collective of ``kind`` (:data:`COLLECTIVE_KINDS`) over ``buffers`` is issued: the
        calling thread on the host; on CUDA the stream of its kind (see [Note: collective buffers] in
        groups/comm.py). The issue it yields completes when the collective is waited on."""
        if kind not in COLLECTIVE_KINDS:
            raise ValueError(f"collective kind {kind!r}: one of {COLLECTIVE_KINDS}")
        issue = self._issue(kind, buffers)
        yield issue

    def _issue(self, kind: str, buffers: tuple[torch.Tensor, ...]) -> CollectiveIssue:
        return CollectiveIssue(kind)

    # ---- memory statistics (non-model memory; see placement/tracer.py) ---------------------------
    def memory_in_use(self) -> tuple[int, int]:
        """``(allocated now, highest allocated since the previous call)`` for the whole process, or
        ``(0, 0)`` where the process's accelerator memory cannot be read (the emulated one)."""
        return 0, 0

    def fragmentation(self) -> int:
        """Accelerator bytes the allocator holds that only requests fitting them can use (0 where there is
        no allocator; see [Note: stranded allocator bytes] in cuda.py)."""
        return 0

    def memory_reading(self) -> tuple[int, int, int]:
        """:meth:`memory_in_use` and :meth:`fragmentation` at once (CUDA: from one read of the allocator's
        statistics, see [Note: one reading per hook] in placement/moves.py)."""
        return (*self.memory_in_use(), self.fragmentation())

    def release_cached(self) -> None:
        """Give the allocator's segments with no block in use back to the device (nothing where there is
        no allocator), so that the activations made next lay out segments of their own."""


COLLECTIVE_KINDS = ("all_gather", "reduce_scatter")


class CollectiveIssue:
    """One collective issued on its kind's stream, until it is waited on (:meth:`complete`); the strict
    twin holds its buffers until then (see [Note: collective buffers] in groups/comm.py)."""

    def __init__(self, kind: str, on_complete: Callable[[], None] | None = None) -> None:
        self.kind = kind
        self._on_complete = on_complete

    def complete(self) -> None:
        """The collective was waited on: whatever the compute stream does next is ordered after it."""
        on_complete, self._on_complete = self._on_complete, None
        if on_complete is not None:
            on_complete()


class HostAccelerator(Accelerator):
    """No accelerator (a plain CPU run without placement): host memory, synchronous copies."""

    def __init__(self) -> None:
        super().__init__(budget=1 << 62)
        self.device = torch.device("cpu")

    def materialize(self, tensor: torch.Tensor, kind: str, what: str) -> None:
        """As on any accelerator; the memory of a large buffer is backed by huge pages where the
        kernel offers them (a frozen chunk read from disk is materialized and filled at every use:
        2 MiB pages take its first writes' page faults 512 at a time)."""
        super().materialize(tensor, kind, what)
        advise_huge_pages(tensor)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Pending:
        dst.copy_(src)
        return _Done()


class _Done(Pending):
    def wait(self) -> None:
        pass

    def done(self) -> bool:
        return True


_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # Linux


@functools.cache
def _madvise() -> Any:
    libc = ctypes.CDLL(None, use_errno=True)
    madvise = libc.madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return madvise


def advise_huge_pages(tensor: torch.Tensor) -> None:
    """Ask Linux to back the whole 2 MiB pages inside ``tensor``'s storage with transparent huge pages
    (``madvise(MADV_HUGEPAGE)``); nothing where that is not offered or the storage holds none."""
    storage = tensor.untyped_storage()
    start = -(-storage.data_ptr() // _HUGE_PAGE) * _HUGE_PAGE
    end = (storage.data_ptr() + storage.nbytes()) // _HUGE_PAGE * _HUGE_PAGE
    if end <= start or not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        _madvise()(start, end - start, _MADV_HUGEPAGE)
