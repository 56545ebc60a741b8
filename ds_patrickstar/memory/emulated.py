"""The accelerator's strict CPU twin.

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
  :class:`~ds_patrickstar.memory.ledger.DeviceBudgetExceeded` naming it.
* **Every pinned host byte is counted.** A host buffer the pool pins is recorded at its
  exact size, in one registry for the process as the driver keeps it (pinning an address
  pinned already, or unpinning one that is not, raises); the host side of a
  copy that did not come from the pool is what torch's caching host allocator would have
  pinned: its block rounded up to the next power of two, and cached once the buffer dies
  for a later buffer of that block size (never returned). :meth:`host_bytes_allocated`
  is their sum, what a GPU run would hold on the host (see [Note: pinned host memory]).
* **Activations leave pieces in the caching allocator.** The activations the tracer's meter counts
  (not charged to the ledger) are blocks of :attr:`EmulatedAccelerator.activation_memory`, a model of
  the CUDA caching allocator (see [Note: caching allocator model]); :meth:`fragmentation` is the
  free pieces stranded in its partly used segments, as CUDA's ``inactive_split_bytes``, so
  placement's rule for them (see [Note: stranded allocator bytes]) runs here. Where placement
  checks the budget (at every moment, and every ledger charge) it compares the memory a GPU would
  hold reserved: model data, the activations and the stranded pieces. Between moments a request
  that fits no piece takes a new segment beside them, so reserved memory may pass the budget by at
  most the pieces: on a GPU the 1 GiB the default budget leaves out covers that; the twin, with no
  device beyond its budget, checks at moments only, as it does the tide.
* **Host work runs when it is waited on.** A host job (the overlapped CPU Adam) poisons the buffers
  it writes until it is waited on, and runs then (see [Note: overlapped host Adam]).
* **A collective holds its buffers until it is waited on.** Freeing (resizing to zero bytes) a buffer
  that an all-gather or a reduce-scatter issued and not waited on reads or writes raises
  :class:`CopyHazard`, as a GPU would let the caching allocator hand its block to other work while the
  collective's stream still used it (see [Note: collective buffers] in groups/comm.py).

The CUDA counterpart is :mod:`~ds_patrickstar.memory.cuda`.
"""

from __future__ import annotations

import weakref
from collections import Counter, deque
from collections.abc import Callable

import torch

from .accelerator import Accelerator, CollectiveIssue
from .caching_allocator import TWIN_GEOMETRY, CachingAllocatorModel
from .host_work import DeferredHostJob
from .pending import CopyHazard, Pending


class _EmulatedCopy(Pending):
    def __init__(self, stream: EmulatedAccelerator, dst: torch.Tensor, src: torch.Tensor) -> None:
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
            raise CopyHazard(
                f"emulated accelerator: the source of a pending copy ({self.src.numel()} elements, "
                f"{self.src.dtype}) was freed before the copy completed; free it with "
                f"Accelerator.free(..., after=pending)"
            )
        if self.src._version != self.src_version:
            raise CopyHazard(
                f"emulated accelerator: the source of a pending copy ({self.src.numel()} elements, "
                f"{self.src.dtype}) was overwritten before the copy completed; wait on the copy first"
            )
        self.dst.data.copy_(self.src)  # the NaN fill at issue was the write a GPU's copy_ is (one version bump)
        self.completed = True


_PINNED: dict[int, int] = {}  # address -> bytes pinned by any emulated accelerator of the process


class TorchPinnedModel:
    """The bytes torch's caching host allocator would hold for host buffers pinned its way: each
    block rounded up to the next power of two; a freed block is cached for a later request of
    the same block size and never returned (see [Note: pinned host memory])."""

    def __init__(self) -> None:
        self.allocated = 0
        self._cached: Counter[int] = Counter()  # block size -> free blocks
        self._live: dict[int, int] = {}  # storage data_ptr -> block size

    def see(self, tensor: torch.Tensor) -> None:
        """``tensor`` was pinned the torch way (counted once, while it is alive)."""
        storage = tensor.untyped_storage()
        if storage.data_ptr() in self._live or not storage.nbytes():
            return
        block = 1 << (storage.nbytes() - 1).bit_length()
        if self._cached[block]:
            self._cached[block] -= 1
        else:
            self.allocated += block
        self._live[storage.data_ptr()] = block
        weakref.finalize(tensor, self._freed, storage.data_ptr())

    def _freed(self, ptr: int) -> None:
        self._cached[self._live.pop(ptr)] += 1


class EmulatedAccelerator(Accelerator):
    """The accelerator's CPU twin; see [Note: strict emulated accelerator]."""

    def __init__(self, budget: int) -> None:
        super().__init__(budget)
        self.device = torch.device("cpu")
        self._queue: deque[_EmulatedCopy] = deque()
        self._activation_storages: set[int] = set()  # data_ptr of the activation being copied, if any
        self._pinned: dict[int, int] = {}  # address -> bytes pinned by this accelerator's host pool
        self.torch_pinned = TorchPinnedModel()
        self.activation_memory = CachingAllocatorModel(TWIN_GEOMETRY)  # fed by the tracer's meter
        self._collective_buffers: Counter[int] = Counter()  # storage data_ptr -> collectives in flight on it
        self._host_jobs: list[DeferredHostJob] = []

    # ---- which memory a buffer is in ----------------------------------------------------
    def _on_device(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is accelerator memory: a backed allocation or an activation being copied."""
        ptr = tensor.untyped_storage().data_ptr()
        return ptr in self._backed or ptr in self._activation_storages

    def _drain(self) -> None:
        """The copies still queued are dropped, not run: every buffer they read or write is freed now
        (running one whose source went would raise :class:`CopyHazard` on the way out); so are the
        collectives' holds on their buffers."""
        for pending in self._queue:
            pending.completed = True
        self._queue.clear()
        self._collective_buffers.clear()
        for job in self._host_jobs:
            job.drop()
        self._host_jobs = []

    # ---- collectives hold their buffers (see [Note: collective buffers]) -------------------
    def _issue(self, kind: str, buffers: tuple[torch.Tensor, ...]) -> CollectiveIssue:
        ptrs = [b.untyped_storage().data_ptr() for b in buffers if b.untyped_storage().nbytes()]
        self._collective_buffers.update(ptrs)
        return CollectiveIssue(kind, lambda: self._collective_buffers.subtract(ptrs))

    def _check_free(self, tensor: torch.Tensor) -> None:
        if self._collective_buffers[tensor.untyped_storage().data_ptr()] > 0:
            raise CopyHazard(
                f"a buffer of {tensor.numel() * tensor.element_size():,} B was freed while a collective that "
                "reads or writes it was in flight: wait on the collective first"
            )

    def _pin_host(self, address: int, nbytes: int) -> None:
        if address in _PINNED:
            raise RuntimeError(f"emulated accelerator: host memory at {address:#x} is pinned already")
        _PINNED[address] = self._pinned[address] = nbytes

    def _unpin_host(self, address: int) -> None:
        if self._pinned.pop(address, None) is None:
            raise RuntimeError(f"emulated accelerator: unpinning host memory at {address:#x} that is not pinned")
        del _PINNED[address]

    def host_bytes_allocated(self) -> int:
        """Pinned host bytes a GPU run would hold: the pool's buffers plus torch's blocks."""
        return sum(self._pinned.values()) + self.torch_pinned.allocated

    def check_clean(self, payload: torch.Tensor, host: torch.Tensor, chunk_id: int, copying: Pending | None) -> None:
        """Bit for bit (a write no version counted fails here); not while the copy in still runs (``copying``:
        it makes them equal, and a write before it was waited on is a hazard of its own)."""
        if copying is not None and not copying.done():
            return
        same = payload.view(torch.uint8).equal(host.view(torch.uint8))
        if not same:
            raise CopyHazard(
                f"emulated accelerator: chunk {chunk_id} was evicted without a copy, but its payload differs from "
                f"the host buffer it came from: a write to it did not change its version (see [Note: clean evictions])"
            )

    def fragmentation(self) -> int:
        """The free pieces of the activations' partly used segments (see [Note: caching allocator model])."""
        return self.activation_memory.stranded

    def release_cached(self) -> None:
        self.activation_memory.release_free()

    # ---- host work ------------------------------------------------------------------------
    def host_work(self, work: Callable[[], None], writes: list[torch.Tensor], after: list[Pending]) -> Pending:
        """Deferred until waited on, its buffers poisoned until then (see [Note: overlapped host Adam])."""
        for pending in after:
            pending.wait_host()
        job = DeferredHostJob(work, writes, self.host_waits)
        self._host_jobs = [j for j in self._host_jobs if not j.done()] + [job]
        return job

    def host_jobs_waiting(self) -> int:
        """The deferred jobs not run yet (they run when waited on)."""
        return sum(not job.done() for job in self._host_jobs)

    # ---- copies ---------------------------------------------------------------------------
    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Pending:
        for operand in (dst, src):
            if not self._on_device(operand) and not self.host_pool.owns(operand):
                self.torch_pinned.see(operand)  # host memory the pool did not pin
        pending = _EmulatedCopy(self, dst, src)
        with torch.no_grad():
            if dst.is_floating_point():
                dst.fill_(float("nan"))  # poison until the copy completes
            else:
                dst.fill_(-1)
        self._queue.append(pending)
        return pending

    def _copy_activation(self, dst: torch.Tensor, src: torch.Tensor, on_device: torch.Tensor) -> Pending:
        """An activation is accelerator memory the ledger does not charge (the tracer's meter counts
        it): not a host buffer torch would have pinned."""
        self._activation_storages.add(on_device.untyped_storage().data_ptr())
        try:
            return self.copy(dst, src)
        finally:
            self._activation_storages.clear()

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
