"""Accelerator primitives: allocate, free, copy, wait. The only code that differs between a GPU
and its CPU twin; everything above it (chunk moves, placement, Adam) is one code path.

[Note: strict emulated accelerator]
``emulate_accelerator: true`` runs placement on a CPU-only machine against
:class:`EmulatedAccelerator`, built to fail where a GPU would misbehave:

* **Copies are asynchronous.** :meth:`Accelerator.copy` only *enqueues* a copy on the
  emulated copy stream and fills the destination with poison (NaN) at once. The values
  arrive when the copy's :class:`Pending` is waited on (which also completes every copy
  enqueued before it, as a stream would). A consumer that reads, writes, reduces, norms,
  updates or all-gathers a buffer without waiting on its pending copy sees NaN, and the
  numbers change. A source freed (storage released) or overwritten before its copy
  completes raises :class:`CopyHazard`.
* **Every accelerator byte is counted.** Each allocation the backend makes on the
  accelerator (chunk payloads, gathered copies, gradient accumulators, optimizer states,
  temporaries of ``state_dict`` and checkpoints) is charged to the :class:`DeviceLedger`
  with a name; one past the budget raises
  :class:`~ds_patrickstar.placement.DeviceBudgetExceeded` naming it.

On CUDA (:class:`CudaAccelerator`) a copy runs on a dedicated copy stream after the work
already queued on the compute stream, and records an event; waiting is
``current_stream.wait_event`` for a consumer on the device and ``event.synchronize()`` for
one on the host. Pinned host buffers are protected by torch's host allocator, which records
the copy's event.

[Note: deferred frees]
A buffer that a pending copy still reads (an evicted chunk's payload) is not freed at once:
it stays allocated, and charged to the ledger, until the copy has completed, when
:meth:`Accelerator.reclaim` frees it. That is what the memory really does on a GPU (the
host may run ahead of the copy stream), so the budget counts it; when room is needed and
such frees are in flight, placement waits on the oldest copies first. The emulated
accelerator completes its copies only when waited on, so the same code is exercised on CPU.
"""
from __future__ import annotations

import contextlib
from collections import deque
from typing import ContextManager

import torch


class DeviceBudgetExceeded(RuntimeError):
    """Model data plus non-model memory would not fit the accelerator budget."""


class CopyHazard(RuntimeError):
    """A buffer was freed or overwritten while an asynchronous copy still read it."""


class DeviceLedger:
    """Running totals of the bytes the backend holds on the accelerator, by kind, under a budget.
    A charge fails when it would not fit beside ``non_model`` (the activation tide, kept current
    by the placement runtime)."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.by_kind: dict[str, int] = {}
        self.total = 0
        self.peak = 0
        self._interval_peak = 0  # highest total since the last interval_peak() call
        self.non_model = 0  # non-model bytes now, kept current by the placement runtime

    def charge(self, nbytes: int, kind: str, what: str) -> None:
        if self.total + nbytes + self.non_model > self.budget:
            raise DeviceBudgetExceeded(
                f"allocating {what} ({nbytes:,} B, {kind}) on the accelerator would exceed its budget of "
                f"{self.budget:,} B: the backend holds {self.total:,} B ({self._kinds()}) next to "
                f"{self.non_model:,} B of non-model memory. Raise zero_optimization.device_budget or lower "
                f"chunk_size.")
        self.by_kind[kind] = self.by_kind.get(kind, 0) + nbytes
        self.total += nbytes
        self.peak = max(self.peak, self.total)
        self._interval_peak = max(self._interval_peak, self.total)

    def release(self, nbytes: int, kind: str) -> None:
        held = self.by_kind.get(kind, 0)
        if nbytes > held:
            raise RuntimeError(f"device ledger: releasing {nbytes} B of {kind} but only {held} B are held")
        self.by_kind[kind] = held - nbytes
        self.total -= nbytes

    def reset_peak(self) -> None:
        self.peak = self.total

    def interval_peak(self) -> int:
        """The highest total since the previous call (paired with the allocator's peak, see tracer.py)."""
        peak, self._interval_peak = self._interval_peak, self.total
        return peak

    def _kinds(self) -> str:
        return ", ".join(f"{k} {v:,} B" for k, v in sorted(self.by_kind.items()) if v) or "nothing"


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class Pending:
    """An enqueued copy (or a collective, see comm.py). :meth:`wait` makes its destination safe to
    use for the caller; :meth:`wait_host` blocks the host until the copy has run."""

    collective = False  # a collective in flight: its chunks must not move before it is waited on

    def wait(self) -> None:
        raise NotImplementedError

    def wait_host(self) -> None:
        self.wait()

    def done(self) -> bool:
        raise NotImplementedError


class Accelerator:
    """Primitives shared by both kinds; see [Note: strict emulated accelerator]."""

    device: torch.device
    pin_host: bool = False

    def __init__(self, budget: int) -> None:
        self.ledger = DeviceLedger(budget)
        self._deferred: list[tuple[Pending, torch.Tensor, int, str]] = []  # frees waiting on a copy

    # ---- memory -------------------------------------------------------------------
    def empty(self, numel: int, dtype: torch.dtype, kind: str, what: str) -> torch.Tensor:
        """A charged accelerator tensor (release it with :meth:`free`)."""
        self.ledger.charge(numel * dtype.itemsize, kind, what)
        return torch.empty(numel, dtype=dtype, device=self.device)

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

    def free(self, tensor: torch.Tensor, kind: str, after: Pending | None = None) -> None:
        """Release ``tensor``'s memory (its storage goes to zero bytes); with ``after``, once that
        copy, which reads ``tensor``, has completed: until then the bytes stay charged (they are
        still occupied on a device) and :meth:`reclaim` frees them (see [Note: deferred frees])."""
        if after is None or after.done():
            self._free_now(tensor, _nbytes(tensor), kind)
        else:
            self._deferred.append((after, tensor, _nbytes(tensor), kind))

    def _free_now(self, tensor: torch.Tensor, nbytes: int, kind: str) -> None:
        tensor.untyped_storage().resize_(0)
        self.ledger.release(nbytes, kind)

    def reclaim(self, need_below: int | None = None) -> None:
        """Free the buffers whose copies have completed; with ``need_below``, also wait on the
        oldest copies until the ledger's total is at most that (or nothing is left in flight)."""
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
        return torch.empty(numel, dtype=dtype, device="cpu", pin_memory=self.pin_host)

    # ---- copies -------------------------------------------------------------------
    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Pending:
        """Enqueue ``dst.copy_(src)`` after the work already queued; wait on the result before
        using ``dst``, and do not touch ``src`` until then."""
        raise NotImplementedError

    def collective_stream(self, *tensors: torch.Tensor) -> ContextManager:
        """Where a collective is issued (see [Note: asynchronous collectives] in comm.py): the
        calling thread on the host; a stream of its own on CUDA."""
        return contextlib.nullcontext()

    # ---- memory statistics (non-model memory; see tracer.py) ---------------------------
    def memory_in_use(self) -> tuple[int, int]:
        """``(allocated now, highest allocated since the previous call)`` for the whole process, or
        ``(0, 0)`` where the process's accelerator memory cannot be read (the emulated one)."""
        return 0, 0

    def fragmentation(self) -> int:
        """Accelerator bytes the allocator holds but a new chunk cannot use (0 where there is no allocator)."""
        return 0


# ---- CUDA ------------------------------------------------------------------------------
class _CudaPending(Pending):
    def __init__(self, event: torch.cuda.Event, to_host: bool) -> None:
        self.event = event
        self.to_host = to_host

    def wait(self) -> None:
        if self.to_host:
            self.event.synchronize()  # the consumer is the host
        else:
            torch.cuda.current_stream().wait_event(self.event)  # the consumer is the compute stream

    def wait_host(self) -> None:
        self.event.synchronize()

    def done(self) -> bool:
        return self.event.query()


class CudaAccelerator(Accelerator):
    pin_host = True

    def __init__(self, device: torch.device, budget: int) -> None:
        super().__init__(budget)
        self.device = device
        self.copy_stream = torch.cuda.Stream(device)
        self.comm_stream = torch.cuda.Stream(device)
        stats = torch.cuda.memory_stats(device)
        self._peak_seen = stats.get("allocated_bytes.all.peak", 0)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Pending:
        self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.copy_stream):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.copy_stream)
        return _CudaPending(event, to_host=not dst.is_cuda)

    @contextlib.contextmanager
    def collective_stream(self, *tensors: torch.Tensor):
        """Issue on the collective stream, after the work queued on the compute stream (as FSDP2's
        all-gather and reduce-scatter streams); the buffers are not reused by the caching allocator
        before the collective ran. Its work handle's ``wait()`` makes the compute stream wait."""
        self.comm_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.comm_stream):
            yield
        for tensor in tensors:
            if tensor.is_cuda:
                tensor.record_stream(self.comm_stream)

    def memory_in_use(self) -> tuple[int, int]:
        """Peak since the previous call from deltas of the process-wide peak: never resets torch's
        statistics (the user's, and ZeRO-3's "max allocated", stay intact). When the process-wide
        peak did not grow, the highest value in between is unknown and ``allocated now`` stands in."""
        stats = torch.cuda.memory_stats(self.device)
        now = stats.get("allocated_bytes.all.current", 0)
        peak = stats.get("allocated_bytes.all.peak", 0)
        highest = peak if peak > self._peak_seen else now
        self._peak_seen = peak
        return now, max(now, highest)

    def fragmentation(self) -> int:
        """Free bytes stranded inside partly used allocator blocks (``inactive_split_bytes``): reserved
        memory a new chunk cannot use. Whole cached blocks are not counted: the allocator reuses them."""
        return torch.cuda.memory_stats(self.device).get("inactive_split_bytes.all.current", 0)


# ---- the CPU twin ----------------------------------------------------------------------
class _EmulatedCopy(Pending):
    def __init__(self, stream: "EmulatedAccelerator", dst: torch.Tensor, src: torch.Tensor) -> None:
        self.stream = stream
        self.dst, self.src = dst, src
        self.src_version = src._version
        self.src_bytes = src.untyped_storage().nbytes()
        self.src_ptr = src.untyped_storage().data_ptr()
        self.completed = False

    def wait(self) -> None:
        self.stream.complete_through(self)

    def done(self) -> bool:
        return self.completed

    def run(self) -> None:
        storage = self.src.untyped_storage()
        if storage.nbytes() != self.src_bytes or storage.data_ptr() != self.src_ptr:
            raise CopyHazard(f"emulated accelerator: the source of a pending copy ({self.src.numel()} elements, "
                             f"{self.src.dtype}) was freed before the copy completed; free it with "
                             f"Accelerator.free(..., after=pending)")
        if self.src._version != self.src_version:
            raise CopyHazard(f"emulated accelerator: the source of a pending copy ({self.src.numel()} elements, "
                             f"{self.src.dtype}) was overwritten before the copy completed; wait on the copy first")
        self.dst.copy_(self.src)
        self.completed = True


class EmulatedAccelerator(Accelerator):
    """The accelerator's CPU twin; see [Note: strict emulated accelerator]."""

    def __init__(self, budget: int) -> None:
        super().__init__(budget)
        self.device = torch.device("cpu")
        self._queue: deque[_EmulatedCopy] = deque()

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Pending:
        pending = _EmulatedCopy(self, dst, src)
        with torch.no_grad():
            if dst.is_floating_point():
                dst.fill_(float("nan"))  # poison until the copy completes
            else:
                dst.fill_(-1)
        self._queue.append(pending)
        return pending

    def complete_through(self, pending: _EmulatedCopy) -> None:
        """Complete every queued copy up to and including ``pending`` (stream order)."""
        while not pending.completed:
            head = self._queue.popleft()
            head.run()
            # a later copy that reads what this one wrote sees the written values as its source
            written = head.dst.untyped_storage().data_ptr()
            for later in self._queue:
                if later.src.untyped_storage().data_ptr() == written:
                    later.src_version = later.src._version


class HostAccelerator(Accelerator):
    """No accelerator (a plain CPU run without placement): host memory, synchronous copies."""

    def __init__(self) -> None:
        super().__init__(budget=1 << 62)
        self.device = torch.device("cpu")

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Pending:
        dst.copy_(src)
        return _Done()


class _Done(Pending):
    def wait(self) -> None:
        pass

    def done(self) -> bool:
        return True
