"""Activation offload: what autograd saves inside the model's blocks, moved to pinned host memory
between a block's forward and its backward.

[Note: activation offload]
``zero_optimization.offload_activations`` ("none", "all", "auto") turns on
:class:`ActivationOffloader`, which replaces the tracer's saved-tensor hooks around a training
forward (see [Note: moments and the trace]).

* **Blocks.** The blocks are the entries of the model's longest ``nn.ModuleList`` or
  ``nn.Sequential`` (the transformer layers; ties: the first in ``named_modules`` order), see
  :func:`repeated_blocks`. Block ``k``'s *segment* runs from its forward pre-hook to the next
  block's (the last one's to the end of the root forward): it also holds what a checkpoint
  function around the block saves once the block returned (a reentrant checkpoint's input).
  Saved tensors before the first segment (the embeddings) stay on the accelerator. A
  non-reentrant checkpoint holds its input in torch's own frame and
  ``deepspeed.checkpointing.checkpoint`` as attributes of its autograd context, not as saved
  tensors: their inputs are neither offloaded nor counted by the emulated meter (CUDA's
  allocator counts them).
* **What moves.** A saved tensor's whole storage (once per storage, whatever views of it are
  saved), unless it is a chunk payload (the meter's model-storage test): model data has its own
  placement. Parameters never move here.
* **When.** At block ``k + 1``'s pre-forward the storages of segment ``k`` are copied to pinned
  host buffers of the host pool (:meth:`Accelerator.bytes_to_host`: a side stream and an event on
  CUDA, the poisoned asynchronous copy on the emulated accelerator); at block ``k + 2``'s
  (one block of overlap) the copies are waited on and the accelerator storages dropped. At the
  end of the root forward every copy is waited on. In backward, the first unpack of segment
  ``k`` issues the copies back of segment ``k`` (when not issued yet) and of segment ``k - 1``
  (the prefetch: the next block in backward order); every unpack waits on its storage's copy
  before use (:meth:`ActivationOffloader._wait_before_use`), so the strict emulated accelerator
  returns NaN where a wait is missing.
* **Accounting.** While on the accelerator a storage counts in the meter (the tide); once its
  copy out completed it does not, and its bytes count on the host (the host pool's pinned
  buffers, :meth:`Accelerator.host_bytes_allocated`). The counters add the bytes copied out
  and back per step.
* **Which blocks.** "all": every block, every iteration. "auto": see [Note: auto activation
  offload] in ``activation_plan.py``; the iteration that is traced runs as "all".
"""

from __future__ import annotations

import enum
import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch

from ..counters import StepCounters
from ..memory.accelerator import Accelerator, Pending
from .activation_plan import SegmentRecord, plan_offload
from .tracer import MemoryTracer, SavedTensorMeter, Trace

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


class _State(enum.Enum):
    ON_DEVICE = "on device"  # packed; the accelerator storage is the one autograd made
    TO_HOST = "copying to host"
    ON_HOST = "on host"  # the accelerator storage is dropped
    TO_DEVICE = "copying back"
    BACK = "back on device"
    RELEASED = "released"  # every saved tensor of it is gone


_MOVES = {
    _State.ON_DEVICE: {_State.TO_HOST, _State.BACK, _State.RELEASED},
    _State.TO_HOST: {_State.ON_HOST, _State.BACK, _State.RELEASED},
    _State.ON_HOST: {_State.TO_DEVICE, _State.RELEASED},
    _State.TO_DEVICE: {_State.BACK, _State.RELEASED},
    _State.BACK: {_State.RELEASED},
    _State.RELEASED: set(),
}


@dataclass(eq=False)
class _Entry:
    """One saved storage of an offloaded segment."""

    device: torch.Tensor | None  # uint8 view of the accelerator storage, while it is there
    nbytes: int
    state: _State = _State.ON_DEVICE
    host: torch.Tensor | None = None
    pending: Pending | None = None
    refs: int = 0

    def move(self, to: _State) -> None:
        if to not in _MOVES[self.state]:
            raise RuntimeError(f"activation offload: a saved storage cannot go from {self.state.value} to {to.value}")
        self.state = to


@dataclass(eq=False)
class _Segment:
    """What one block's forward saved, in one forward of the iteration."""

    block: int
    offload: bool
    entries: list[_Entry] = field(default_factory=list)
    nbytes: int = 0  # every storage saved in it (offloaded or not)
    drop_at: int = -1  # the moment after which its offloaded storages are off the accelerator
    restore_at: int = -1  # the moment its storages are needed again (copied back)
    previous: _Segment | None = None

    def record(self) -> SegmentRecord:
        return SegmentRecord(self.block, self.nbytes, self.drop_at + 1, self.restore_at, self.offload)


class _Handle:
    """What autograd keeps for a saved tensor of a segment."""

    __slots__ = ("segment", "entry", "tensor", "dtype", "offset", "size", "stride", "__weakref__")

    def __init__(self, segment: _Segment, entry: _Entry | None, tensor: torch.Tensor | object) -> None:
        self.segment, self.entry = segment, entry
        if entry is None:
            self.tensor = tensor  # kept on the accelerator (the meter's holder, or the tensor itself)
            return
        assert isinstance(tensor, torch.Tensor)
        self.tensor = None
        self.dtype, self.offset = tensor.dtype, tensor.storage_offset()
        self.size, self.stride = tensor.size(), tensor.stride()


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
        self._records: list[_Segment] = []  # this iteration's segments
        self._forward: list[_Segment] = []  # this forward's segments
        self._current: _Segment | None = None
        self._outgoing: list[_Segment] = []  # segments whose copies out are in flight, oldest first
        self._by_storage: dict[int, _Entry] = {}  # accelerator storage -> its entry, while held
        self.host_bytes = 0  # bytes of offloaded activations off the accelerator now

    # ---- iterations -----------------------------------------------------------------
    def start_iteration(self, tracer: MemoryTracer) -> None:
        """At the first forward after a step: an iteration that is traced offloads every block
        ("auto" too: see [Note: auto activation offload])."""
        if self.mode == "auto" and tracer.current_trace() is None:
            self.chosen = None
        self._records = []

    def plan(self, trace: Trace, budget: int, moment_bytes: Callable[[tuple[int, ...]], int]) -> None:
        """With "auto", at the step of the iteration that made ``trace``: which blocks to offload
        from now on, from this iteration's records; ``trace``'s tide becomes the planned one."""
        if self.mode != "auto" or trace is self._planned:
            return
        tide = [m.non_model for m in trace.moments]
        need = [moment_bytes(chunks) for chunks in trace.held_chunks()]
        self.chosen, planned = plan_offload(tide, need, budget, [s.record() for s in self._records])
        for index, non_model in enumerate(planned):
            trace.set_non_model(index, non_model)
        self._planned = trace
        total = sum(s.nbytes for s in self._records if s.block in self.chosen)
        logger.info(
            "ds_patrickstar: offloading the activations of blocks %s (%d B per step of %d B saved in blocks)",
            sorted(self.chosen),
            total,
            sum(s.nbytes for s in self._records),
        )

    def start_forward(self) -> None:
        self._forward, self._current = [], None

    def enter_block(self, block: int) -> None:
        """Block ``block``'s forward begins: the previous segment's storages go to the host, the one
        before it is waited on and leaves the accelerator."""
        self._end_segment()
        offload = self.chosen is None or block in self.chosen
        segment = _Segment(block, offload, previous=self._forward[-1] if self._forward else None)
        self._forward.append(segment)
        self._records.append(segment)
        self._current = segment

    def end_forward(self) -> None:
        self._end_segment()
        self._current = None
        self._settle(keep=0)

    def _end_segment(self) -> None:
        segment = self._current
        if segment is None:
            return
        if segment.offload:
            for entry in segment.entries:
                if entry.state is _State.ON_DEVICE:
                    assert entry.device is not None
                    entry.move(_State.TO_HOST)
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
                if entry.state is _State.TO_HOST:
                    assert entry.pending is not None and entry.device is not None
                    entry.pending.wait_host()
                    self._by_storage.pop(entry.device.untyped_storage().data_ptr(), None)
                    entry.device = None
                    entry.move(_State.ON_HOST)
                    self._charge(-entry.nbytes)
                    self.host_bytes += entry.nbytes

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
            return _Handle(segment, None, self.meter.pack(tensor))
        if entry is None:
            entry = _Entry(torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage), storage.nbytes())
            self._by_storage[storage.data_ptr()] = entry
            segment.entries.append(entry)
            segment.nbytes += entry.nbytes
            self._charge(entry.nbytes)
        entry.refs += 1
        handle = _Handle(segment, entry, tensor)
        weakref.finalize(handle, self._release, entry)
        return handle

    def unpack(self, packed: object) -> torch.Tensor:
        if not isinstance(packed, _Handle):
            return self.meter.unpack(packed)  # type: ignore[arg-type]
        segment = packed.segment
        if segment.restore_at < 0:
            self._bring_back(segment)
            if segment.previous is not None and segment.previous.restore_at < 0:
                self._bring_back(segment.previous)  # the prefetch: the next block in backward order
        entry = packed.entry
        if entry is None:
            return self.meter.unpack(packed.tensor)  # type: ignore[arg-type]
        if entry.state is _State.TO_DEVICE:
            self._wait_before_use(entry)
        assert entry.device is not None, entry.state
        out = torch.empty(0, dtype=packed.dtype, device=entry.device.device)
        return out.set_(entry.device.untyped_storage(), packed.offset, packed.size, packed.stride)

    def _wait_before_use(self, entry: _Entry) -> None:
        """The copy back has completed before the storage is read (see [Note: activation offload])."""
        assert entry.pending is not None
        entry.pending.wait()
        self._back_home(entry)

    def _back_home(self, entry: _Entry) -> None:
        entry.move(_State.BACK)
        assert entry.host is not None
        self.accel.host_free(entry.host, after=entry.pending)
        self.host_bytes -= entry.nbytes
        entry.host = None

    def _bring_back(self, segment: _Segment) -> None:
        segment.restore_at = self._clock()
        for entry in segment.entries:
            if entry.state in (_State.ON_DEVICE, _State.TO_HOST):  # never left: keep the accelerator storage
                if entry.state is _State.TO_HOST:
                    assert entry.host is not None
                    self.accel.host_free(entry.host, after=entry.pending)
                    entry.host = None
                entry.move(_State.BACK)
            elif entry.state is _State.ON_HOST:
                assert entry.host is not None
                entry.move(_State.TO_DEVICE)
                entry.device, entry.pending = self.accel.bytes_to_device(entry.host)
                self._charge(entry.nbytes)
                self.counters.activation_bytes_restored += entry.nbytes

    def _release(self, entry: _Entry) -> None:
        """A saved tensor is gone (autograd freed it); the storage goes with the last one."""
        entry.refs -= 1
        if entry.refs:
            return
        if entry.state in (_State.TO_HOST, _State.TO_DEVICE):
            assert entry.pending is not None
            entry.pending.wait_host()  # the source (resp. destination) must outlive its copy
        if entry.host is not None:
            self.accel.host_free(entry.host, after=entry.pending)
            self.host_bytes -= entry.nbytes if entry.state in (_State.ON_HOST, _State.TO_DEVICE) else 0
        if entry.state is not _State.ON_HOST:
            self._charge(-entry.nbytes)
        if entry.device is not None:
            self._by_storage.pop(entry.device.untyped_storage().data_ptr(), None)
        entry.device, entry.host = None, None
        entry.move(_State.RELEASED)

    def _charge(self, nbytes: int) -> None:
        self.meter.add(nbytes)
        counters = self.counters
        counters.peak_activation_bytes_device = max(counters.peak_activation_bytes_device, self.meter.bytes)
