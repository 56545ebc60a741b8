"""Activation offload: what autograd saves inside the model's blocks, and the blocks' inputs, moved to
pinned host memory between a block's forward and its backward.

[Note: activation offload]
``zero_optimization.offload_activations`` ("none", "all", "auto") turns on
:class:`ActivationOffloader`, which replaces the tracer's saved-tensor hooks around a training
forward (see [Note: moments and the trace]).

* **Blocks.** The blocks are the entries of the model's longest ``nn.ModuleList`` or
  ``nn.Sequential`` (the transformer layers; ties: the first in ``named_modules`` order), see
  :func:`repeated_blocks`. Block ``k``'s *segment* runs from its forward pre-hook to the next
  block's (the last one's to the end of the root forward): it also holds what a checkpoint
  function around the block saves once the block returned (a reentrant checkpoint's input), and
  the block's inputs, which DeepSpeed's checkpoints hold outside saved tensors (see [Note: held
  inputs] in ``activation_storages.py``). torch's non-reentrant checkpoint saves its input before
  the block's pre-forward: in the previous segment. Saved tensors before the first segment (the
  embeddings) stay on the accelerator.
* **What moves.** A saved tensor's whole storage (once per storage, whatever views of it are
  saved), or a held input's, unless it is a chunk payload (the meter's model-storage test): model
  data has its own placement. Parameters never move here.
* **When.** At block ``k + 1``'s pre-forward the storages of segment ``k`` are copied to pinned
  host buffers of the host pool (:meth:`Accelerator.bytes_to_host`: a side stream and an event on
  CUDA, the poisoned asynchronous copy on the emulated accelerator); at block ``k + 2``'s
  (one block of overlap) the copies are waited on and the accelerator storages dropped. At the
  end of the root forward every copy is waited on. In backward, the first unpack of segment
  ``k``, or the hook before block ``k``'s backward (see [Note: held inputs]), issues the copies
  back of segment ``k`` (when not issued yet) and of segment ``k - 1`` (the prefetch: the next
  block in backward order); every unpack, and that hook, waits on its storages' copies before use
  (:meth:`ActivationOffloader._wait_before_use`), so the strict emulated accelerator returns NaN
  where a wait is missing.
* **Accounting.** While on the accelerator a storage counts in the meter (the tide); once its
  copy out completed and the storage was freed it does not, and its bytes count on the host (the
  host pool's pinned buffers, :meth:`Accelerator.host_bytes_allocated`). The counters add the bytes
  that left the accelerator and came back per step.
* **Which blocks.** "all": every block, every iteration. "auto": see [Note: auto activation
  offload] in ``activation_plan.py``; the iteration that is traced runs as "all". Once "auto" has
  planned, the allocator's free segments go back to the device
  (:meth:`~ds_patrickstar.memory.accelerator.Accelerator.release_cached`): laid out by the traced
  iteration, which offloaded every block, they would be split by the planned iteration's
  activations, whose stranded pieces the plan does not count (see [Note: caching allocator model]:
  on the emulated accelerator "auto" failed at 128 kB where keeping the activations fit).
"""

from __future__ import annotations

import functools
import logging
import weakref
from collections.abc import Callable
from typing import Literal

import torch

from ..counters import StepCounters
from ..memory.accelerator import Accelerator
from ..placement.tracer import MemoryTracer, SavedTensorMeter, Trace
from .plan import plan_offload
from .storages import Entry, Handle, HeldInput, Segment, State

logger = logging.getLogger(__name__)

OffloadMode = Literal["none", "all", "auto"]


def repeated_blocks(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The entries of ``module``'s longest ``ModuleList`` / ``Sequential`` (at least two); see
    [Note: activation offload]."""
    best: list[torch.nn.Module] = []
    for sub in module.modules():
        if isinstance(sub, (torch.nn.ModuleList, torch.nn.Sequential)) and len(sub) > max(len(best), 1):
            best = list(sub)
    return best


class ActivationOffloader:
    """Saved-tensor hooks that offload the chosen blocks' activations; see [Note: activation offload]."""

    def __init__(
        self,
        accel: Accelerator,
        meter: SavedTensorMeter,
        mode: OffloadMode,
        counters: StepCounters,
        clock: Callable[[], int],
    ) -> None:
        self.accel, self.meter, self.mode, self.counters = accel, meter, mode, counters
        self._clock = clock  # the current moment of the iteration
        self.chosen: set[int] | None = None  # None: every block
        self._planned: Trace | None = None
        self._records: list[Segment] = []  # this iteration's segments
        self._forward: list[Segment] = []  # this forward's segments
        self._current: Segment | None = None
        self._outgoing: list[Segment] = []  # segments whose copies out are in flight, oldest first
        self._by_storage: dict[int, Entry] = {}  # accelerator storage -> its entry, while held
        self._held_ids: dict[int, Entry] = {}  # id of a held input -> its entry, while it is alive
        self.host_bytes = 0  # bytes of offloaded activations off the accelerator now

    # ---- iterations -----------------------------------------------------------------
    def start_iteration(self, tracer: MemoryTracer) -> None:
        """At the first forward after a step: an iteration that is traced offloads every block
        ("auto" too: see [Note: auto activation offload])."""
        if self.mode == "auto" and tracer.current_trace() is None:
            self.chosen = None
        self._records = []

    def plan(self, trace: Trace, budget: int, chunk_needs: Callable[[Trace], list[int]], stranded: int = 0) -> None:
        """With "auto", at the step of the iteration that made ``trace``: which blocks to offload
        from now on, from this iteration's records; ``trace``'s tide becomes the planned one.
        ``stranded``: the most allocator bytes that iteration stranded at a moment, room an offload
        keeps for the pieces it strands (see [Note: auto activation offload])."""
        if self.mode != "auto" or trace is self._planned:
            return
        tide = [m.non_model for m in trace.moments]
        need = chunk_needs(trace)
        records = [s.record() for s in self._records]
        self.chosen, planned = plan_offload(tide, need, budget, records)
        if self.chosen and stranded:
            self.chosen, planned = plan_offload(tide, need, budget - stranded, records)
        for index, non_model in enumerate(planned):
            trace.set_non_model(index, non_model)
        self._planned = trace
        self.accel.release_cached()  # see [Note: activation offload], "Which blocks"
        total = sum(s.nbytes for s in self._records if s.block in self.chosen)
        logger.info(
            "ds_patrickstar: offloading the activations of blocks %s (%d B per step of %d B saved in blocks)",
            sorted(self.chosen),
            total,
            sum(s.nbytes for s in self._records),
        )

    def start_forward(self) -> None:
        self._forward, self._current = [], None

    def enter_block(self, block: int, inputs: list[torch.Tensor]) -> None:
        """Block ``block``'s forward begins with ``inputs``: the previous segment learns when its
        backward is about to run and its storages go to the host, the one before it is waited on and
        leaves the accelerator; the new segment holds the block's inputs (see [Note: held inputs])."""
        fresh = [t for t in inputs if t.device.type == self.accel.device.type and not self._repeated(t)]
        if self._current is not None and self._current.offload:
            self._watch_backward(self._current, fresh)
        self._end_segment()
        offload = self.chosen is None or block in self.chosen
        segment = Segment(block, offload, previous=self._forward[-1] if self._forward else None)
        self._forward.append(segment)
        self._records.append(segment)
        self._current = segment
        for tensor in fresh:
            self._hold(segment, tensor)

    def end_forward(self) -> None:
        self._end_segment()
        self._current = None
        self._settle(keep=0)

    def _end_segment(self) -> None:
        segment = self._current
        if segment is None:
            return
        for entry in segment.entries if segment.offload else ():
            if entry.state is not State.ON_DEVICE:
                continue
            if entry.pinned or not (entry.refs or segment.triggered):
                segment.nbytes -= 0 if entry.pinned else entry.nbytes  # stays: a held input of the last block
                continue
            entry.device = entry.kept()  # the copy's source, alive until the copy has run
            assert entry.device is not None
            entry.move(State.TO_HOST)
            entry.host, entry.pending = self.accel.bytes_to_host(entry.device)
            self.counters.activation_bytes_offloaded += entry.nbytes
        self._outgoing.append(segment)
        self._settle(keep=1)

    def _settle(self, keep: int) -> None:
        """Wait on the copies out of all but the ``keep`` newest segments; their storages leave."""
        while len(self._outgoing) > keep:
            segment = self._outgoing.pop(0)
            segment.drop_at = self._clock()
            for entry in segment.entries:
                if entry.state is State.TO_HOST:
                    assert entry.pending is not None
                    entry.pending.wait_host()
                    self._leave(entry)

    def _leave(self, entry: Entry) -> None:
        """The copy out has run: the accelerator storage is dropped (a held input emptied), unless
        something else still holds it; then it stays, and nothing moved (see [Note: held inputs])."""
        entry.empty_held()
        entry.device, entry.pending = None, None
        storage = entry.storage() if entry.storage is not None else None
        if storage is not None:
            entry.move(State.BACK)
            entry.refill_held(storage)
            if entry.refs:
                entry.device = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
            assert entry.host is not None
            self.accel.host_free(entry.host)
            entry.host = None
            self.counters.activation_bytes_offloaded -= entry.nbytes
            entry.segment.nbytes -= entry.nbytes
            logger.debug("ds_patrickstar: a %d B activation is held elsewhere too: it stays", entry.nbytes)
            return
        entry.move(State.ON_HOST)
        if self._by_storage.get(entry.ptr) is entry:
            del self._by_storage[entry.ptr]
        self._charge(entry, -entry.nbytes)
        self.host_bytes += entry.nbytes
        if not entry.needed():
            self._release_now(entry)

    # ---- held inputs (see [Note: held inputs]) ------------------------------------------
    def _hold(self, segment: Segment, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        if storage.nbytes() == 0 or self.meter.is_model(storage):
            return
        entry = self._by_storage.get(storage.data_ptr())
        if entry is None and (not segment.offload or self.meter.holds(storage)):
            if not self.meter.holds(storage):
                segment.nbytes += storage.nbytes()
            self.meter.hold(tensor)
            return
        if entry is None:
            entry = self._new_entry(segment, storage, None)
        if entry.held is None:
            entry.held = HeldInput(tensor)
            self._held_ids[id(tensor)] = entry
            weakref.finalize(tensor, self._held_gone, entry, id(tensor))
            weakref.finalize(storage, self._storage_gone, entry, entry.ptr)

    def _repeated(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is (a view of) an earlier block's input (an attention mask): then it is
        back on the accelerator, to stay."""
        entry = self._held_ids.get(id(tensor))
        if entry is None and tensor.untyped_storage().nbytes():
            entry = self._by_storage.get(tensor.untyped_storage().data_ptr())
        if entry is None or entry.held is None or entry.state is State.RELEASED:
            return False
        if not entry.pinned:
            entry.pinned = True
            entry.segment.nbytes -= entry.nbytes
            self._restore(entry)
            if entry.state is State.TO_DEVICE:
                self._wait_before_use(entry)
        return True

    def _watch_backward(self, segment: Segment, inputs: list[torch.Tensor]) -> None:
        """The next block's inputs come from ``segment``'s block: their autograd nodes run just before
        its backward (and its recomputation)."""
        nodes = {id(t.grad_fn): t.grad_fn for t in inputs if t.grad_fn is not None}
        for node in nodes.values():
            node.register_prehook(functools.partial(self._before_backward, segment))
        segment.triggered = segment.triggered or bool(nodes)

    def _before_backward(self, segment: Segment, grad_outputs: object) -> None:
        self._needed_in_backward(segment)
        for entry in segment.entries:
            if entry.state is State.TO_DEVICE:
                self._wait_before_use(entry)

    def _held_gone(self, entry: Entry, ident: int) -> None:
        """A held input was freed: what is off the accelerator for it alone is not needed any more."""
        if self._held_ids.get(ident) is entry:
            del self._held_ids[ident]
        if not entry.needed() and entry.state in (State.TO_HOST, State.ON_HOST, State.TO_DEVICE):
            self._release_now(entry)

    def _storage_gone(self, entry: Entry, ptr: int) -> None:
        """The accelerator storage of a held input was freed (its holder let it go)."""
        if entry.ptr == ptr and entry.state in (State.ON_DEVICE, State.BACK) and not entry.refs:
            self._release_now(entry)

    # ---- saved-tensor hooks ----------------------------------------------------------------
    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def pack(self, tensor: torch.Tensor) -> object:
        segment = self._current
        storage = tensor.untyped_storage()
        if segment is None or storage.nbytes() == 0 or self.meter.is_model(storage):
            return self.meter.pack(tensor)
        entry = self._by_storage.get(storage.data_ptr())
        if entry is None and (not segment.offload or self.meter.holds(storage)):
            if not self.meter.holds(storage):
                segment.nbytes += storage.nbytes()
            return Handle(segment, None, self.meter.pack(tensor))
        if entry is None:
            entry = self._new_entry(segment, storage, torch.empty(0, dtype=torch.uint8, device=tensor.device))
        elif entry.device is None and entry.state is State.ON_DEVICE:
            entry.device = entry.kept()  # a held input now saved: kept for the saved tensor too
        entry.refs += 1
        handle = Handle(segment, entry, tensor)
        weakref.finalize(handle, self._release, entry)
        return handle

    def _new_entry(self, segment: Segment, storage: torch.UntypedStorage, view: torch.Tensor | None) -> Entry:
        """A storage of ``segment``, counted on the accelerator; ``view`` (set to it) keeps it alive."""
        device = view.set_(storage) if view is not None else None
        entry = Entry(device, storage.nbytes(), segment, storage=weakref.ref(storage), ptr=storage.data_ptr())
        self._by_storage[entry.ptr] = entry
        segment.entries.append(entry)
        segment.nbytes += entry.nbytes
        self._charge(entry, entry.nbytes)
        return entry

    def unpack(self, packed: object) -> torch.Tensor:
        if not isinstance(packed, Handle):
            return self.meter.unpack(packed)  # type: ignore[arg-type]
        self._needed_in_backward(packed.segment)
        entry = packed.entry
        if entry is None:
            return self.meter.unpack(packed.tensor)  # type: ignore[arg-type]
        if entry.state is State.TO_DEVICE:
            self._wait_before_use(entry)
        assert entry.device is not None, entry.state
        out = torch.empty(0, dtype=packed.dtype, device=entry.device.device)
        return out.set_(entry.device.untyped_storage(), packed.offset, packed.size, packed.stride)

    def _needed_in_backward(self, segment: Segment) -> None:
        """The first use of ``segment`` in backward brings it back, and the previous one (the prefetch:
        the next block in backward order)."""
        if segment.restore_at < 0:
            self._bring_back(segment)
            if segment.previous is not None and segment.previous.restore_at < 0:
                self._bring_back(segment.previous)

    def _wait_before_use(self, entry: Entry) -> None:
        """The copy back has completed before the storage is read (see [Note: activation offload])."""
        assert entry.pending is not None
        entry.pending.wait()
        self._back_home(entry)

    def _back_home(self, entry: Entry) -> None:
        entry.move(State.BACK)
        assert entry.host is not None
        self.accel.host_free(entry.host, after=entry.pending)
        self.host_bytes -= entry.nbytes
        entry.host, entry.pending = None, None  # the copy keeps its buffers until it is dropped
        if not entry.refs and entry.held is not None:
            entry.device = None  # the storage lives as long as its holder does

    def _bring_back(self, segment: Segment) -> None:
        segment.restore_at = self._clock()
        for entry in segment.entries:
            self._restore(entry)

    def _restore(self, entry: Entry) -> None:
        """Issue ``entry``'s copy back, if it left (a held input points at the new storage at once)."""
        if entry.state in (State.ON_DEVICE, State.TO_HOST):  # never left: keep the accelerator storage
            if entry.state is State.TO_HOST:
                assert entry.host is not None
                self.accel.host_free(entry.host, after=entry.pending)
                entry.host, entry.pending = None, None
            entry.move(State.BACK)
            if not entry.refs and entry.held is not None:
                entry.device = None
        elif entry.state is State.ON_HOST:
            assert entry.host is not None
            entry.move(State.TO_DEVICE)
            entry.device, entry.pending = self.accel.bytes_to_device(entry.host)
            storage = entry.device.untyped_storage()
            entry.storage, entry.ptr = weakref.ref(storage), storage.data_ptr()
            if entry.refill_held(storage):
                weakref.finalize(storage, self._storage_gone, entry, entry.ptr)
            self._charge(entry, entry.nbytes)
            self.counters.activation_bytes_restored += entry.nbytes

    def _release(self, entry: Entry) -> None:
        """A saved tensor is gone (autograd freed it); the storage goes with the last one, unless a
        held input still refers to it."""
        entry.refs -= 1
        if entry.refs:
            return
        if not entry.needed():
            self._release_now(entry)
        elif entry.state in (State.ON_DEVICE, State.BACK):
            entry.device = None  # the storage lives as long as its holder does

    def _release_now(self, entry: Entry) -> None:
        if entry.state in (State.TO_HOST, State.TO_DEVICE):
            assert entry.pending is not None
            entry.pending.wait_host()  # the source (resp. destination) must outlive its copy
        if entry.host is not None:
            self.accel.host_free(entry.host, after=entry.pending)
            self.host_bytes -= entry.nbytes if entry.state in (State.ON_HOST, State.TO_DEVICE) else 0
        if entry.state is not State.ON_HOST:
            self._charge(entry, -entry.nbytes)
        if self._by_storage.get(entry.ptr) is entry:
            del self._by_storage[entry.ptr]
        entry.device, entry.host, entry.pending = None, None, None
        entry.move(State.RELEASED)

    def _charge(self, entry: Entry, nbytes: int) -> None:
        """``entry``'s accelerator storage came (``nbytes`` > 0) or went (< 0)."""
        if nbytes > 0:
            self.meter.allocated(entry, nbytes)
        else:
            self.meter.freed(entry, -nbytes)
        counters = self.counters
        counters.peak_activation_bytes_device = max(counters.peak_activation_bytes_device, self.meter.bytes)
