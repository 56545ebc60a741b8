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
  inputs] in ``storages.py``). torch's non-reentrant checkpoint saves its input before
  the block's pre-forward: in the previous segment. Saved tensors before the first segment (the
  embeddings) stay on the accelerator.
* **What moves.** A saved tensor's whole storage (once per storage, whatever views of it are
  saved), or a held input's, unless it is a chunk payload (the meter's model-storage test): model
  data has its own placement. Parameters never move here.
* **When.** At block ``k + 1``'s pre-forward the storages of segment ``k`` are copied to pinned
  host buffers kept across steps (see [Note: activation host stack] in ``host_stack.py``;
  :meth:`Accelerator.bytes_to_host`: a side stream and an event on CUDA, the poisoned asynchronous
  copy on the emulated accelerator); at block ``k + 2``'s
  (one block of overlap) the copies are waited on and the accelerator storages dropped. At the
  end of the root forward every copy is waited on. In backward, the first unpack of segment
  ``k``, or the hook before block ``k``'s backward (see [Note: held inputs]), issues the copies
  back of segment ``k`` (when not issued yet) and of segment ``k - 1`` (the prefetch: the next
  block in backward order); every unpack, and that hook, waits on its storages' copies before use
  (:meth:`~ds_patrickstar.activations.copies.StorageCopies.wait_before_use`), so the strict
  emulated accelerator returns NaN where a wait is missing.
* **Accounting.** While on the accelerator a storage counts in the meter (the tide); once its
  copy out completed and the storage was freed it does not, and its bytes count on the host (the
  stack's pinned slabs, buffers of the host pool held across steps,
  :meth:`Accelerator.host_bytes_allocated`). The counters add the bytes that left the accelerator and
  came back per step.
* **Which blocks.** "all": every block, every iteration. "auto": see [Note: auto activation
  offload] in ``plan.py``; the iteration that is traced offloads a block unless it surely fits (see
  [Note: the traced iteration's offload] in ``traced_keep.py``). Once "auto" has
  planned, the allocator's free segments go back to the device
  (:meth:`~ds_patrickstar.memory.accelerator.Accelerator.release_cached`): laid out by the traced
  iteration, which offloaded other blocks, they would be split by the planned iteration's
  activations, whose stranded pieces the plan does not count (see [Note: caching allocator model]).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Literal

import torch

from ..counters import StepCounters
from ..memory.accelerator import Accelerator
from ..placement.saved_meter import SavedTensorMeter
from ..placement.states_room import StatesRoom
from ..placement.step_time import ActivationMoves
from ..placement.trace import Trace
from ..placement.tracer import MemoryTracer
from .choice import BlockChoice
from .copies import StorageCopies
from .give_way import give_way, report_give_way
from .held import HeldInputs
from .storages import Handle, Segment, State
from .traced_keep import TracedKeep

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
    """The offload of the chosen blocks' activations over an iteration: its segments, which blocks
    move, and the saved-tensor hooks; see [Note: activation offload]."""

    def __init__(
        self,
        accel: Accelerator,
        meter: SavedTensorMeter,
        mode: OffloadMode,
        counters: StepCounters,
        clock: Callable[[], int],
        keep: TracedKeep | None = None,
    ) -> None:
        self.accel, self.meter, self.mode = accel, meter, mode
        self.keep = keep  # the traced iteration's choice with "auto" (see [Note: the traced iteration's offload])
        self._tracing = False  # this iteration is traced with "auto"
        self.copies = StorageCopies(accel, meter, counters, clock)
        self.held = HeldInputs(meter, self.copies)
        self._clock = clock  # the current moment of the iteration
        self.blocks = 0  # the model's blocks (see :func:`repeated_blocks`)
        self.choice = BlockChoice(
            accel, self.copies.host_stack, mode
        )  # which blocks (see [Note: auto activation offload])
        self._records: list[Segment] = []  # this iteration's segments
        self._forward: list[Segment] = []  # this forward's segments
        self._current: Segment | None = None
        self._outgoing: list[Segment] = []  # segments whose copies out are in flight, oldest first
        self._every_block = False  # this forward offloads every block (see [Note: a risen tide] in plan.py)
        self._unplanned: list[Segment] = []  # this iteration's segments offloaded beyond the plan
        self.gave_way = False  # this iteration's activations left to make room (see [Note: activations give way])
        self._at_own_backward: set[int] = set()  # blocks not brought back ahead (see [Note: activations give way])

    @property
    def host_bytes(self) -> int:
        """Bytes of offloaded activations off the accelerator now."""
        return self.copies.host_bytes

    @host_bytes.setter
    def host_bytes(self, value: int) -> None:  # the protocol's attribute is settable
        self.copies.host_bytes = value

    # ---- iterations -----------------------------------------------------------------
    def blocks_found(self, count: int) -> None:
        """The model has ``count`` blocks: the traced iteration's rule counts those after a segment."""
        self.blocks = count
        if self.keep is not None:
            self.keep.blocks = count

    def start_iteration(self, tracer: MemoryTracer) -> None:
        """At the first forward after a step: an iteration that is traced offloads every block that may not fit
        (see [Note: the traced iteration's offload])."""
        self._tracing = self.mode == "auto" and tracer.current_trace() is None
        if self._tracing:
            self.chosen = None
        self._records, self._unplanned, self.gave_way = [], [], False

    def plan(
        self,
        trace: Trace,
        budget: int,
        chunk_needs: Callable[[Trace], list[int]],
        stranded: int = 0,
    ) -> None:
        """With "auto", at the step of the iteration that made ``trace``: which blocks to offload from now on, from
        this iteration's segments (see :meth:`BlockChoice.plan <.choice.BlockChoice.plan>`)."""
        self.choice.plan(trace, budget, chunk_needs, stranded, [s.record() for s in self._records])

    def replan(self, trace: Trace, states: StatesRoom) -> None:
        self.choice.replan(trace, states)

    def stranded_rose(self, trace: Trace, stranded: int) -> None:
        self.choice.stranded_rose(trace, stranded)

    def tide_rose(self, trace: Trace, over: dict[int, int]) -> dict[int, int]:
        return self.choice.tide_rose(trace, over)

    @property
    def chosen(self) -> set[int] | None:
        """The blocks offloaded (None: every block)."""
        return self.choice.chosen

    @chosen.setter
    def chosen(self, blocks: set[int] | None) -> None:
        self.choice.chosen = blocks

    @property
    def priced(self) -> ActivationMoves:
        """The planned iteration's copies, as the step-time model prices them."""
        return self.choice.priced

    def give_room(self, nbytes: int) -> int:
        """Activations of finished blocks whose backward has not begun leave the accelerator now until ``nbytes``
        did (kept ones, offloaded ones still leaving or brought back ahead), and after a kept one the rest of a
        forward offloads every block; the bytes that left (see [Note: activations give way] in give_way.py)."""
        before = self.meter.bytes
        way = give_way(self._forward, self._current, self.copies, self._clock(), nbytes)
        self._unplanned += way.kept
        self._every_block = self._every_block or (self._current is not None and bool(way.kept))
        self._not_ahead(way.called_back)
        freed = before - self.meter.bytes
        if freed > 0:
            self.gave_way = True
            report_give_way(self.copies.counters, freed, way)
        return freed

    def _not_ahead(self, called_back: list[Segment]) -> None:
        """The blocks brought back ahead whose copies back were undone come back at their own backward from now on
        (see [Note: activations give way] in give_way.py)."""
        blocks = {segment.block for segment in called_back} - self._at_own_backward
        if blocks:
            self._at_own_backward |= blocks
            logger.info(
                "ds_patrickstar: the activations of blocks %s come back at their own backward from now on (brought "
                "back ahead, they gave way)",
                sorted(blocks),
            )

    def keeps_blocks(self) -> bool:
        """Whether the plan keeps some block's activations on the accelerator (a budget error then names "all"),
        unless this forward offloads every block already (see [Note: activations give way] in give_way.py)."""
        return self.chosen is not None and len(self.chosen) < self.blocks and not self._every_block

    def unplanned_away(self, moment: int) -> int:
        """Bytes of this iteration's segments offloaded beyond the plan and away at ``moment`` (as a record counts
        them, see [Note: auto activation offload] in plan.py)."""
        return sum(
            s.nbytes
            for s in self._unplanned
            if 0 <= s.drop_at < moment and (s.restore_at < 0 or moment <= s.restore_at)
        )

    def drop_forward(self) -> None:
        """The last forward had no backward (see [Note: moments and the trace]): its segments leave
        this iteration's records."""
        dropped = {id(segment) for segment in self._forward}
        self._records = [segment for segment in self._records if id(segment) not in dropped]

    # ---- segments ---------------------------------------------------------------------
    def start_forward(self, every_block: bool = False) -> None:
        """A training forward begins; ``every_block``: its blocks' activations are offloaded whatever the plan (a
        micro-step beyond the traced shapes, see [Note: a risen tide] in plan.py)."""
        self._forward, self._current, self._every_block = [], None, every_block
        if self.keep is not None:
            self.keep.start_forward()

    def enter_block(self, block: int, inputs: list[torch.Tensor]) -> None:
        """Block ``block``'s forward begins with ``inputs``: the previous segment learns when its
        backward is about to run and its storages go to the host, the one before it is waited on and
        leaves the accelerator; the new segment holds the block's inputs (see [Note: held inputs])."""
        fresh = [t for t in inputs if t.device.type == self.accel.device.type and not self.held.repeated(t)]
        if self._current is not None and self._current.offload:
            self.held.watch_backward(self._current, fresh)
        self._end_segment()
        planned = self.chosen is None or block in self.chosen
        previous = self._forward[-1] if self._forward else None
        segment = Segment(
            block, planned or self._every_block, previous=previous, ahead=block not in self._at_own_backward
        )
        if not planned and self._every_block:
            self._unplanned.append(segment)
        self._forward.append(segment)
        self._records.append(segment)
        self._current = segment
        for tensor in fresh:
            self.held.hold(segment, tensor)

    def end_forward(self) -> None:
        self._end_segment()
        self._current = None
        self._settle(keep=0)

    def _end_segment(self) -> None:
        segment = self._current
        if segment is None:
            return
        if segment.offload and self._tracing and self.keep is not None:
            segment.offload = not self.keep.keeps(segment.block, segment.nbytes)
        for entry in segment.entries if segment.offload else ():
            if entry.state is not State.ON_DEVICE:
                continue
            if entry.pinned or not (entry.refs or segment.triggered):
                segment.nbytes -= 0 if entry.pinned else entry.nbytes  # stays: a held input of the last block
                continue
            self.copies.copy_out(entry)
        self._outgoing.append(segment)
        self._settle(keep=1)

    def _settle(self, keep: int) -> None:
        """Wait on the copies out of all but the ``keep`` newest segments; their storages leave."""
        while len(self._outgoing) > keep:
            segment = self._outgoing.pop(0)
            segment.drop_at = self._clock()
            for entry in segment.entries:
                if entry.state is State.TO_HOST:
                    self.copies.leave(entry)

    # ---- saved-tensor hooks ----------------------------------------------------------------
    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def pack(self, tensor: torch.Tensor) -> object:
        segment = self._current
        storage = tensor.untyped_storage()
        if segment is None or storage.nbytes() == 0 or self.meter.is_model(storage):
            return self.meter.pack(tensor)
        entry = self.copies.entry_of(storage)
        if entry is None and self.meter.holds(storage):  # a kept held input's (see [Note: held inputs])
            return Handle(segment, None, self.meter.pack(tensor))
        if entry is None:
            view = torch.empty(0, dtype=torch.uint8, device=tensor.device)
            entry = self.copies.new_entry(segment, storage, view)
        elif entry.device is None and entry.state is State.ON_DEVICE:
            entry.device = entry.kept()  # a held input now saved: kept for the saved tensor too
        entry.refs += 1
        handle = Handle(segment, entry, tensor)
        weakref.finalize(handle, self.copies.release, entry)
        return handle

    def unpack(self, packed: object) -> torch.Tensor:
        if not isinstance(packed, Handle):
            return self.meter.unpack(packed)  # type: ignore[arg-type]
        self.copies.needed_in_backward(packed.segment)
        entry = packed.entry
        if entry is None:
            return self.meter.unpack(packed.tensor)  # type: ignore[arg-type]
        if entry.state is State.TO_DEVICE:
            self.copies.wait_before_use(entry)
        assert entry.device is not None, entry.state
        out = torch.empty(0, dtype=packed.dtype, device=entry.device.device)
        return out.set_(entry.device.untyped_storage(), packed.offset, packed.size, packed.stride)
