"""The optimizer step as placement sees it: the tide a batch raised above the plan, and, after a (re-)trace or
a re-plan, the planner's decision of where the optimizer states live (see [Note: placement planner]).

The decision is returned, not carried out: the step's driver (the ZeRO-optimizer adapter) moves the states
(:meth:`~ds_patrickstar.optim.states.OptimizerStates.place`), then tells placement which chunks the step
uses (:meth:`StepPlan.settle`), so the traced step moment names those chunks for the next iteration's
evictions and prefetches.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping

from ..counters import StepCounters
from .planner import IN_FLIGHT_CHUNKS, states_on_device
from .trace import Trace

logger = logging.getLogger(__name__)


class StepPlan:
    """The planner's step decisions, made once per trace (then checked, or re-planned); see the module docstring."""

    def __init__(
        self,
        budget: int,
        policy: str,
        chunk_needs: Callable[[Trace], list[int]],
        largest_chunk: int,
        counters: StepCounters,
    ) -> None:
        self.budget, self.policy = budget, policy
        self.chunk_needs = chunk_needs  # per traced moment, what its chunks take (see [Note: chunk bytes per moment])
        self._largest_chunk = largest_chunk
        self._counters = counters
        self.planned_from: Trace | None = None  # the trace the optimizer states were placed from
        self._replanned = False

    def forget(self) -> None:
        """A (re-)trace begins: the optimizer states go to the host, and the next step places them anew."""
        self.planned_from = None

    def decide(
        self,
        trace: Trace,
        over: dict[int, int],
        capacities: Mapping[int, int],
        choose: Callable[[Trace, set[int]], set[int]] | None = None,
    ) -> set[int] | None:
        """Where the optimizer states live from this step on (None: where they are): after a (re-)trace,
        or where a batch's tide rose above the plan (``over``: moment -> bytes measured), from ``trace``
        planned for it (see [Note: traces across input shapes]); of the chunks whose states fit, ``choose``
        (None: all) picks those placed (see [Note: optimizer states by step time] in state_choice.py)."""
        if raise_tide(trace, over):
            self._counters.tide_replans += 1
            self.planned_from = None
        self._replanned = trace is not self.planned_from
        if not self._replanned:
            return None
        self.planned_from = trace
        started = time.perf_counter()
        fill = self.fill(trace, capacities)
        chosen = choose(trace, fill) if choose is not None else fill
        took = time.perf_counter() - started
        self.note_planning(took)
        logger.info("ds_patrickstar: optimizer states planned in %.2f s", took)
        return chosen

    def note_planning(self, seconds: float) -> None:
        """Host time spent planning from a trace (counter ``plan_seconds``)."""
        self._counters.plan_seconds += seconds

    def fill(self, trace: Trace, capacities: Mapping[int, int]) -> set[int]:
        """The chunks whose states fit beside ``trace``'s planned tide (the fill rule, see
        :func:`~ds_patrickstar.placement.planner.states_on_device`)."""
        needs = self.chunk_needs(trace)
        return states_on_device(trace, self.budget, self.policy, needs, self._largest_chunk, capacities)

    def tide_cap(self, trace: Trace, states: int) -> int:
        """The highest planned tide beside which the fill rule places ``states`` bytes of optimizer states."""
        return self.budget - max(self.chunk_needs(trace), default=0) - IN_FLIGHT_CHUNKS * self._largest_chunk - states

    def settle(self, trace: Trace | None, on_device: set[int]) -> None:
        """The states were placed: after a new decision the traced step moment uses the chunks updated on
        the accelerator (see [Note: optimizer-state placement])."""
        if trace is None or not self._replanned:
            return
        self._replanned = False
        step_moment = next((i for i, m in enumerate(trace.moments) if m.label == "step"), None)
        if step_moment is not None:
            trace.replace_chunks(step_moment, tuple(sorted(on_device)))


def raise_tide(trace: Trace, over: dict[int, int]) -> bool:
    """Where a batch's tide rose above the plan (``over``: moment -> bytes measured), the trace plans for it;
    see [Note: traces across input shapes]."""
    for index, non_model in over.items():
        trace.raise_tide(index, non_model)
    if over:
        logger.info("ds_patrickstar: the tide rose above the plan at %d moment(s); re-planning from it", len(over))
    return bool(over)
