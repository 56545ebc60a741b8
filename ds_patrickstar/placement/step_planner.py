"""The plans made at an optimizer step, and the moment times they are priced with: the traced step's (activation
offload, then where the optimizer states live, the prefetch distance and the eviction order), its check on the
first iteration that ran it, and the re-plans a risen tide asks for (see [Note: first steps] in runtime.py).

[Note: the plan checked on steady times]
The traced step plans from the moment times its own iteration measured. Those are not a steady iteration's: it
evicts the least recently used chunks and brings nothing ahead, offloads the activations of every block that
may not fit, and pays
what a run pays once (on a GPU the libraries' handles, the kernels loaded, the allocator's and the pinned
buffers' first allocations: the first steps took 4.2-7.1 s on an H200 where the steady ones took 0.19-0.50 s).
Beside such compute every transfer and host update looks hidden, the plans priced tie, and the tie goes to the
fewest bytes moved: the step-time model does not steer. On the strict twin's mirror of the 12 GiB point the
traced iteration's moments took 2.4x the steady ones'. So the traced step plans quickly (see [Note: the
planner's cost] in state_choice.py): the states by the best prefix in each eviction order, then the distance and
the order, and the activations offloaded only so that the chunks fit.

The step after the traced one plans once more, thoroughly, from the same trace and its traced tide and
segments, with the moment times of the iteration just run, the first that ran the plan, less what the model
prices apart: the host's waits for host updates (see [Note: host waits] in memory/host_work.py) and the bytes
it brought on demand (at the profile's rate). The activation offload for optimizer states (see [Note: activations
offloaded for optimizer states] in states_room.py), then the states, the distance and the order are chosen
again. Where the choice is the same nothing moves; where it differs, the states move at this step and the steady
state begins with the third step. Re-plans after a risen tide price with the times the same way.

Counter ``planned_step_s``: the step the kept plan predicted when it was chosen, plus the step moment's own
time (the norm, the bookkeeping) as last measured, which no plan sees before its step: the model's forecast to
hold against the measured step. ``predicted_step_s`` prices the moves again with the last iteration's times,
which hold whatever the plan made the moments wait for on the accelerator (a copy not hidden).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ..counters import StepCounters
from .interface import ActivationPolicy
from .move_model import MovePredictor
from .moves import ChunkMoves
from .snapshot import PlannerSnapshot, chosen
from .state_choice import StateChooser
from .states_room import StatesRoom
from .step_plan import StepPlan
from .step_time import NO_ACTIVATION_MOVES, ActivationMoves, StepTime, StepTimer
from .trace import Trace


class StepPlanner:
    """The plans of [Note: the plan checked on steady times]: their times, their order, their forecast."""

    def __init__(
        self,
        steps: StepPlan,
        moves: ChunkMoves,
        chunk_needs: Callable[[Trace], list[int]],
        predictor: MovePredictor | None,
        timer: StepTimer | None,
        chooser: StateChooser | None,
    ) -> None:
        self.steps, self.moves, self.placer = steps, moves, moves.placer
        self.chunk_needs = chunk_needs  # per traced moment, what its chunks take (see [Note: chunk bytes per moment])
        self.predictor = predictor  # the bytes an iteration moves (see [Note: predicted moves]); None: not predicted
        self.timer = timer if predictor is not None else None  # its time (see [Note: step-time model])
        self.chooser = chooser  # None: every state that fits (see [Note: optimizer states by step time])
        self.activations: ActivationPolicy | None = None  # see [Note: activation offload]
        self.forecast: StepTime | None = None  # the step the kept plan predicted when it was chosen
        self._check: Trace | None = None  # the trace planned at its traced step, checked at the next step
        self.snapshot: PlannerSnapshot | None = None  # the last thorough plan's inputs (see [Note: planner snapshot])

    def stop(self) -> None:
        """No move model from now on (see [Note: accumulation begun by the caller] in groups/grads.py)."""
        self.predictor, self.timer, self.chooser, self._check, self.forecast = None, None, None, None, None

    def plan(
        self, trace: Trace | None, traced: Trace | None, over: dict[int, int], capacities: dict[int, int]
    ) -> set[int] | None:
        """Where the optimizer states live from this step on (None: where they are): ``trace``, the trace placement
        follows (None while an iteration is traced, ``traced`` then); ``over``: moments whose tide rose above the
        plan; ``capacities``: the owned chunks' elements. The host time it takes is not the step's compute."""
        started = time.perf_counter()
        try:
            return self._plan(trace, traced, over, capacities)
        finally:
            if self.timer is not None:
                self.timer.set_aside(time.perf_counter() - started)

    def _plan(
        self, trace: Trace | None, traced: Trace | None, over: dict[int, int], capacities: dict[int, int]
    ) -> set[int] | None:
        if trace is None:  # the step of the iteration being traced plans from it (see [Note: first steps])
            return self._traced(traced, capacities) if traced is not None else None
        check, self._check = self._check, None
        activations = self.activations
        # see [Note: activations give way] in activations/give_way.py
        if activations is not None and activations.gave_way:
            activations.stranded_rose(trace, self.moves.stranded_peak)
        if check is trace and not over:
            return self._checked(trace, capacities)
        # see [Note: a risen tide] in activations/plan.py
        if activations is not None and (over or activations.gave_way):
            over = activations.tide_rose(trace, over)
        return self.steps.decide(trace, over, capacities, lambda t, fill: self._choose(t, fill, self._times(t)))

    def _traced(self, traced: Trace, capacities: dict[int, int]) -> set[int] | None:
        """The traced step's plan: a quick one where the next step checks it (see [Note: the planner's cost])."""
        times = self.timer.traced_times(len(traced)) if self.timer is not None else []  # one reading a plan
        if self.activations is not None:
            room = self.moves.movable_room(), self.chunk_needs, self.moves.stranded_peak
            self.activations.plan(traced, *room)
        self._check = traced if self.chooser is not None else None
        return self.steps.decide(traced, {}, capacities, lambda t, fill: self._choose(t, fill, times, thorough=False))

    def _checked(self, trace: Trace, capacities: dict[int, int]) -> set[int] | None:
        """The traced step's plan made again with the steady times (see [Note: the plan checked on steady times])."""
        times = self._times(trace)
        room = self._states_room(capacities, times)
        if self.activations is not None and room is not None:
            self.activations.replan(trace, room)
        self.steps.forget()
        trace.restart_readings()
        return self.steps.decide(trace, {}, capacities, lambda t, fill: self._choose(t, fill, times))

    def _times(self, trace: Trace) -> list[float]:
        """The iteration's moment times up to now, less the bytes its plan brought on demand."""
        if self.timer is None:
            return []
        times = self.timer.traced_times(len(trace))
        plan = self.predictor.plan if self.predictor is not None else None
        if plan is None or len(plan.demand) != len(times):
            return times
        return self.timer.compute(times, plan, self.copies())

    def copies(self) -> ActivationMoves:
        """The copies of the planned activation offload, as the step-time model prices them (none without it)."""
        return self.activations.priced if self.activations is not None else NO_ACTIVATION_MOVES

    def _choose(self, trace: Trace, fill: set[int], times: list[float], thorough: bool = True) -> set[int]:
        """Of ``fill``, the states the step-time model places (all without a chooser), and the moves' choices;
        ``thorough``: the chooser's thorough search (see [Note: the planner's cost] in state_choice.py)."""
        if self.chooser is None or self.timer is None:
            return fill
        resident, copies = frozenset(self.placer.resident), self.copies()
        choice = self.chooser(trace, fill, resident, times, copies, thorough)
        if thorough:  # see [Note: planner snapshot] in snapshot.py
            rule = self.chooser
            inputs = (tuple(trace.moments), frozenset(fill), resident, tuple(times), copies, chosen(choice))
            self.snapshot = PlannerSnapshot(rule.budget, rule.costs, rule.profile, rule.overlap, *inputs)
        self.placer.distance = choice.distance  # see [Note: prefetch distance]
        self.placer.set_order(choice.order, self.moves.evicts_free)  # see [Note: eviction order]
        self.forecast = choice.step
        return set(choice.on_device)

    def _states_room(self, capacities: dict[int, int], times: list[float]) -> StatesRoom | None:
        """Where the step-time model chooses the states: the room activation offload may make for them."""
        if self.chooser is None or self.timer is None:
            return None
        chooser, resident = self.chooser, self.placer.resident
        return StatesRoom(
            self.steps, capacities, lambda t, fill, copies: chooser(t, fill, resident, times, copies, thorough=False)
        )

    def note(self, counters: StepCounters) -> None:
        """Counter ``planned_step_s`` (see [Note: the plan checked on steady times])."""
        if self.forecast is not None:
            last = self.timer.last if self.timer is not None else None
            counters.planned_step_s = self.forecast.total_s + (last.step_s if last is not None else 0.0)
