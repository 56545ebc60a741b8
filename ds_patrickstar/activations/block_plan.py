"""The blocks ``offload_activations: "auto"`` offloads, from one traced iteration: chosen at its step, checked at
the next (see [Note: auto activation offload] in plan.py) and chosen again where a batch's tide rose above the
plan (see [Note: a risen tide] in plan.py). The offloader applies the choice."""

from __future__ import annotations

from dataclasses import replace

from ..placement.states_room import StatesRoom, with_tide
from ..placement.trace import Trace
from .plan import SegmentRecord, away_bytes, bare_tide, micro_step_places, plan_for_states, plan_offload

Choice = tuple[set[int], list[int]]
"""The blocks offloaded and the tide planned with them."""


class BlockPlan:
    """What a traced iteration's plan is made from, and the choices made from it."""

    def __init__(self, trace: Trace, budget: int, need: list[int], stranded: int, records: list[SegmentRecord]):
        self.trace = trace  # the trace planned
        self.budget = budget  # the room the chunks and the tide share at a moment, at the traced step
        self.need = need  # per moment planned, the chunks' bytes
        self.stranded = stranded  # the most allocator bytes the traced iteration stranded at a moment
        self.records = records  # the traced iteration's segments
        # the tide with no block offloaded, each micro-step's own (planned alike in every micro-step where their
        # batches differed: ``places``, see [Note: a risen tide] in plan.py)
        self.bare = bare_tide([m.non_model for m in trace.moments[: len(need)]], records)
        self.varying = _uneven(records)  # the shapes vary: room for the pieces they strand ([Note: a risen tide])
        self.places = micro_step_places(trace, len(need)) if self.varying else None

    def choose(self, trace: Trace, states: StatesRoom | None = None) -> Choice:
        """The blocks offloaded from the tide with no offload, ``trace``'s step moment as it stands; with
        ``states``, also plans offloading more blocks for optimizer states, priced (see [Note: activations
        offloaded for optimizer states] in placement/states_room.py)."""
        base, records = with_tide(trace, self.bare), [replace(r, offloaded=False) for r in self.records]
        tide = [m.non_model for m in base.moments[: len(self.need)]]
        chosen, planned = plan_offload(tide, self.need, self.budget, records, self.places)
        if (chosen or self.varying) and self.stranded:  # see [Note: auto activation offload] in plan.py
            chosen, planned = plan_offload(tide, self.need, self.budget - self.stranded, records, self.places)
        if states is not None:
            room = self.budget - self.stranded
            chosen, planned = plan_for_states(base, self.need, room, records, (chosen, planned), states, self.places)
        return chosen, planned

    def rise(self, trace: Trace, over: dict[int, int], chosen: set[int]) -> tuple[Choice, dict[int, int]] | None:
        """``over`` (moment -> the tide read there, the blocks ``chosen`` offloaded) rose above the plan: the choice
        made from the tide with no offload raised there, and the readings as it would have had them; None where it
        keeps ``chosen`` (see [Note: a risen tide] in plan.py)."""
        moments = len(self.bare)
        before = away_bytes(self.records, chosen, moments)
        for index, non_model in over.items():
            if index < moments:
                self.bare[index] = max(self.bare[index], non_model + before[index])
        self.varying, self.places = True, micro_step_places(trace, moments)
        choice = self.choose(trace)
        if choice[0] == chosen:
            return None
        after = away_bytes(self.records, choice[0], moments)
        return choice, {i: n + before[i] - after[i] if i < moments else n for i, n in over.items()}


def _uneven(records: list[SegmentRecord]) -> bool:
    """Whether some block saved other bytes in one micro-step than in another (their batches differed)."""
    sizes: dict[int, set[int]] = {}
    for record in records:
        sizes.setdefault(record.block, set()).add(record.nbytes)
    return any(len(seen) > 1 for seen in sizes.values())
