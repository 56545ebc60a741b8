"""Which blocks ``offload_activations: "auto"`` offloads from one trace on: the traced step's choice, its check at
the next step, and the choices again where a batch's tide or the allocator's stranded pieces rose (see [Note: auto
activation offload] and [Note: a risen tide] in plan.py). The offloader runs the segments; this holds its plan."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Literal

from ..memory.accelerator import Accelerator
from ..placement.states_room import StatesRoom
from ..placement.step_time import NO_ACTIVATION_MOVES
from ..placement.trace import Trace
from .block_plan import BlockPlan
from .host_stack import HostStack
from .plan import SegmentRecord, planned_copies

logger = logging.getLogger(__name__)


class BlockChoice:
    """The blocks offloaded now, the plan they were chosen by, and what their copies cost."""

    def __init__(self, accel: Accelerator, host_stack: HostStack, mode: Literal["none", "all", "auto"]) -> None:
        self.accel, self.host_stack, self.mode = accel, host_stack, mode
        self.chosen: set[int] | None = None  # None: every block
        self._plan: BlockPlan | None = None  # the traced step's, made again at the check and where the tide rose
        self.priced = NO_ACTIVATION_MOVES  # the planned iteration's copies, as the step-time model prices them

    def plan(
        self,
        trace: Trace,
        budget: int,
        chunk_needs: Callable[[Trace], list[int]],
        stranded: int,
        records: list[SegmentRecord],
    ) -> None:
        """With "auto", at the step of the iteration that made ``trace`` (its segments ``records``): which blocks
        to offload from now on; ``trace``'s tide becomes the planned one. ``stranded``: the most allocator bytes that
        iteration stranded at a moment, room an offload keeps for the pieces it strands (see [Note: auto activation
        offload] in plan.py). More blocks where that makes room for optimizer states are the next step's to choose
        (:meth:`replan`, see [Note: activations offloaded for optimizer states] in placement/states_room.py)."""
        if self._plan is not None and trace is self._plan.trace:
            return
        self._plan = BlockPlan(trace, budget, chunk_needs(trace), stranded, records)
        if self.mode == "auto":
            _log_traced(records)
            self._apply(trace, *self._plan.choose(trace))
        self.priced = planned_copies(records, self.chosen)  # see [Note: step-time model] in placement/step_time.py

    def _auto_plan(self, trace: Trace) -> BlockPlan | None:
        """The plan of ``trace``'s traced step where "auto" made one."""
        return self._plan if self.mode == "auto" and self._plan is not None and trace is self._plan.trace else None

    def replan(self, trace: Trace, states: StatesRoom) -> None:
        """The plan of ``trace``'s traced step made again from the same tide and segments, ``states`` priced on
        other moment times (see [Note: the plan checked on steady times] in placement/step_planner.py); nothing
        changes where it keeps the same blocks."""
        plan = self._auto_plan(trace)
        if plan is None:
            return
        chosen, planned = plan.choose(trace, states)
        if chosen != self.chosen:
            self._apply(trace, chosen, planned)

    def stranded_rose(self, trace: Trace, stranded: int) -> None:
        """This iteration's activations gave way, beside ``stranded`` allocator bytes at a moment at most: the plan
        of ``trace`` keeps that much room for them from now on (see [Note: activations give way] in give_way.py)."""
        plan = self._auto_plan(trace)
        if plan is not None:
            plan.stranded = max(plan.stranded, stranded)

    def tide_rose(self, trace: Trace, over: dict[int, int]) -> dict[int, int]:
        """A batch's tide rose above the plan of ``trace`` (``over``: moment -> the tide read then, the blocks
        chosen now offloaded; none where only the stranded pieces rose): with "auto", the blocks are chosen again
        (see [Note: a risen tide] in plan.py); returns the readings as that choice would have had them."""
        plan = self._auto_plan(trace)
        risen = plan.rise(trace, over, self.chosen) if plan is not None and self.chosen is not None else None
        if risen is None:
            return over
        (chosen, planned), readings = risen
        logger.info(
            "ds_patrickstar: the tide rose above the plan: the activations of blocks %s are offloaded from now on "
            "(were %s)",
            sorted(chosen),
            sorted(self.chosen or ()),
        )
        self._apply(trace, chosen, planned)
        return readings

    def _apply(self, trace: Trace, chosen: set[int], planned: list[int]) -> None:
        """Offload ``chosen`` from now on; ``trace`` plans with the tide ``planned``."""
        records = self._plan.records if self._plan is not None else []
        self.chosen = chosen
        self.priced = planned_copies(records, chosen)
        for index, non_model in enumerate(planned):
            trace.set_non_model(index, non_model)
        self.accel.release_cached()  # see [Note: activation offload] in offloader.py, "Which blocks"
        total = sum(r.nbytes for r in records if r.block in chosen)
        self.host_stack.reset(total)  # see [Note: activation host stack] in host_stack.py
        _log_choice(chosen, total, sum(r.nbytes for r in records))


def _log_traced(records: list[SegmentRecord]) -> None:
    kept = [r for r in records if not r.offloaded]
    logger.info(
        "ds_patrickstar: the traced iteration kept %d of %d block segments' activations on the accelerator (%d B)",
        len(kept),
        len(records),
        sum(r.nbytes for r in kept),
    )


def _log_choice(chosen: set[int], total: int, saved: int) -> None:
    if not chosen:
        logger.info("ds_patrickstar: the activations fit beside the chunks: none is offloaded from now on")
        return
    logger.info(
        "ds_patrickstar: offloading the activations of blocks %s (%d B per step of %d B saved in blocks)",
        sorted(chosen),
        total,
        saved,
    )
