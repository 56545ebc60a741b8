"""Room for optimizer states made by offloading activations, where the step-time model predicts a faster step.

[Note: activations offloaded for optimizer states]
``"auto"`` activation offload (see [Note: auto activation offload] in activations/plan.py) first offloads the
fewest blocks that let the chunks fit beside the tide; the optimizer states are then placed in what the planned
tide leaves (see [Note: optimizer-state placement]). Where that leaves some chunks' states on the host, their
host Adam and their payloads' trips out and back can cost more than offloading more activations would: on an
H200 (gpt-1.3b without checkpointing, 24 GiB) 13 of 100 chunks' states stayed on the host and the step took
0.211 s against 0.189 s with everything resident, where some 2 GB of activations could have gone to the host
behind the compute.

So where the step-time model chooses the states (``optimizer_placement: "time"``), the
plan made at the step after the traced one (see [Note: the plan checked on steady times] in step_planner.py) also
prices plans that offload more blocks: for half and all of the chunks whose states the first plan leaves on the
host (in the fill rule's order), the fewest more blocks that lower the planned tide's peak enough for the fill rule
to place them (:meth:`StatesRoom.caps`), each priced by the states the step-time model then chooses on that tide,
beside the activations' copies (see [Note: step-time model] in step_time.py). The fastest plan is kept; predicted
steps within :data:`~ds_patrickstar.placement.state_choice.TIE` of it are a tie, which goes to the fewest bytes
moved (chunks and activations), then to the fewest blocks offloaded. Logged; counters
``activation_bytes_offloaded`` and ``adam_chunks_device`` show the outcome, ``plan_seconds`` the search's host time
beside the states' plan (each plan priced is a quick search of the states, the one kept a thorough one, see [Note:
the planner's cost] in state_choice.py). They are priced on the moment times of the iteration that ran the traced
step's plan: the traced iteration's own hide everything, so the traced step offloads only what lets the chunks fit.
On the strict twin the H100 profile's transfers hide behind the CPU's compute, every plan ties and the first is
kept."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ..memory.preflight import OPTIM_BYTES_PER_ELEMENT
from .state_choice import TIE, StateChoice
from .step_plan import StepPlan
from .step_time import ActivationMoves
from .trace import Trace

FRACTIONS = (0.5, 1.0)
"""Of the chunks whose states the first plan leaves on the host, those priced with more blocks offloaded."""


@dataclass(frozen=True)
class PricedTide:
    """A planned tide priced: the predicted step, the bytes both ways (chunks and activations), the blocks."""

    step_s: float
    moved: int
    blocks: int


def with_tide(trace: Trace, tide: list[int]) -> Trace:
    """A copy of ``trace`` whose planned tide is ``tide``."""
    copy = trace.copy()
    for index, non_model in enumerate(tide):
        copy.set_non_model(index, non_model)
    return copy


class StatesRoom:
    """What a planned tide leaves for optimizer states, and its price; see [Note: activations offloaded for
    optimizer states]."""

    def __init__(
        self,
        steps: StepPlan,
        capacities: Mapping[int, int],
        choose: Callable[[Trace, set[int], ActivationMoves], StateChoice],
    ) -> None:
        self.steps, self.capacities, self.choose = steps, capacities, choose

    def caps(self, trace: Trace) -> list[int]:
        """The peaks of the planned tide under which the fill rule places the states of more chunks than on
        ``trace``'s tide: those of :data:`FRACTIONS` of the chunks it leaves on the host (none where it leaves
        none)."""
        placed = len(self.steps.fill(trace, self.capacities))
        order = sorted(self.capacities)
        rest = len(order) - placed
        if rest <= 0:
            return []
        counts = sorted({max(1, round(rest * fraction)) for fraction in FRACTIONS})
        states = [OPTIM_BYTES_PER_ELEMENT * self.capacities[c] for c in order]
        return [self.steps.tide_cap(trace, sum(states[: placed + count])) for count in counts]

    def price(self, trace: Trace, copies: ActivationMoves, blocks: int) -> PricedTide:
        """The step the model predicts on ``trace``'s planned tide with the states it chooses there."""
        started = time.perf_counter()
        choice = self.choose(trace, self.steps.fill(trace, self.capacities), copies)
        self.steps.note_planning(time.perf_counter() - started)
        return PricedTide(choice.step.total_s, choice.moved + copies.moved, blocks)


def best_tide(priced: list[PricedTide]) -> int:
    """The index of the plan kept (see [Note: activations offloaded for optimizer states]): the fastest, ties
    (within :data:`TIE`) to the fewest bytes moved, then the fewest blocks, then the earliest."""
    fastest = min(p.step_s for p in priced)
    tied = [i for i, p in enumerate(priced) if p.step_s <= fastest * (1 + TIE)]
    return min(tied, key=lambda i: (priced[i].moved, priced[i].blocks, i))
