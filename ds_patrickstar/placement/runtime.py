"""The placement runtime: the per-moment driver of the planner's decisions, under the budget.

It is the :class:`~ds_patrickstar.placement.interface.Placement` of a run with an accelerator (see
[Note: placement] in ``policy.py`` and [Note: placement planner] in ``planner.py``): a moment begins and
ends, its moves are made (``moves.py``: room, bring, evict, prefetch), an iteration starts or a forward
is taken back, and the step is a moment too, after the planner placed the optimizer states
(``step_plan.py``, see [Note: optimizer-state placement]). Which moments it records follows the run's phase (see
[Note: run state]).

The step-time model's collaborators (the moves predicted, the moments timed, the optimizer states chosen) and the
gradients leaving in backward (``grad_release.py``) are the runtime's at any number of ranks.

[Note: first steps]
The iteration being traced is planned at its own step, from what it recorded (every moment but the step's
own): "auto" activation offload first (from the traced tide, with no optimizer state on the accelerator, see
[Note: auto activation offload]), then where the optimizer states live, which the step moves there now. So
the next iteration already runs the plan (prefetch, Belady, the states in place, gradients leaving in
backward): one-time costs are paid by the traced step, and the steady state begins with the second step. That
step makes the plan again on its own iteration's moment times (see [Note: the plan checked on steady times] in
step_planner.py); where that changes the plan, the steady state begins with the third.
"""

from __future__ import annotations

from collections.abc import Callable

from ..autograd_state import iter_tensors
from ..counters import StepCounters
from ..memory.ledger import DeviceLedger
from .bytes_floor import FloorMeter
from .grad_release import GradientRelease
from .interface import NO_SNAPSHOT, NO_TIDE, ActivationPolicy
from .move_model import MovePlan, MovePredictor
from .moves import ChunkMoves, unmoved_bytes
from .planner import gathered_rooms
from .policy import Placer
from .positions import TracePositions
from .saved_meter import SavedTensorMeter
from .shapes import RetraceReason
from .state_choice import StateChooser
from .step_plan import StepPlan
from .step_planner import StepPlanner
from .step_time import HostOverlap, StepTimer
from .tide_plot import plot_tide
from .trace import AccumulatorEvent, Trace
from .tracer import MemoryTracer


class PlacementRuntime:
    """Carries out the placer's decisions at every moment; see [Note: placement]."""

    def __init__(
        self,
        moves: ChunkMoves,
        chunk_needs: Callable[[Trace], list[int]],
        predictor: MovePredictor | None = None,
        timer: StepTimer | None = None,
        chooser: StateChooser | None = None,
        trainable: set[int] | None = None,
        floor: FloorMeter | None = None,
        notes_unmoved: bool = False,
    ) -> None:
        self.moves = moves  # its collaborators are the driver's: placer, tracer, counters, run, ledger
        self.placer, self.tracer, self.counters, self.run = moves.placer, moves.tracer, moves.counters, moves.run
        self.ledger, self.make_room, self.bring, self.evict = moves.ledger, moves.make_room, moves.bring, moves.evict
        self.after_use, self.movable_room = moves.after_use, moves.movable_room
        self.place_for_update = moves.place_for_update
        self.floor = floor  # the fewest bytes any placement moves (see [Note: the bytes floor]); None: not taken
        # None: gradients leave at the step (see [Note: gradients leave in backward])
        self.release = GradientRelease(moves, self.counters, trainable) if trainable is not None else None
        self._on_device: set[int] = set()  # the chunks whose optimizer states live on the accelerator
        largest = max((c.nbytes for c in moves.chunks), default=0)
        self.steps = StepPlan(self.placer.budget, self.placer.policy, chunk_needs, largest, self.counters)
        # the plans made at a step, their times and forecast (see [Note: the plan checked on steady times])
        self.planning = StepPlanner(self.steps, moves, chunk_needs, predictor, timer, chooser)
        self.label = ""  # the label of the current moment
        self.tide: list[tuple[int, int, int, int]] = []  # (moment, model, non-model, offloaded activation bytes)
        self._activations: ActivationPolicy | None = None  # see [Note: activation offload]
        self.positions = TracePositions(self.placer.budget // 64)  # see [Note: evaluation moments]
        self.notes_unmoved = notes_unmoved  # several ranks: the model data not moved goes into the trace
        self._gathered_ahead: set[int] = set()  # own chunks this hook brought for all-gathers ahead (several ranks)

    def model_bytes_on_device(self) -> int:  # a running total: O(1) per moment, see [Note: placement]
        return self.ledger.total

    # ---- moments ------------------------------------------------------------------
    def begin_moment(self, label: str, chunk_ids: tuple[int, ...]) -> None:
        """A recorded moment (a training moment or the step, see [Note: run state]) advances the trace;
        any other (an evaluation forward's) is a moment of its own, placed without touching the trace
        or the tide (see [Note: evaluation moments])."""
        trace = self.tracer.current_trace()
        self.moves.hook_begins() if label != "step" else self.moves.hook_ends()  # [Note: one reading per hook]
        self._gathered_ahead.clear()
        if self.run.records():
            self.positions.training_moment()
            self.moment = self.moves.at = self.tracer.record(label, chunk_ids, self.ledger)
            self.label, trace = label, self.tracer.current_trace()
            if self.planning.timer is not None:
                self.planning.timer.begin_moment(self.moment)
            if self.moment == 0:
                self.tide = []
                self.moves.stranded_peak = 0
            new_iteration = self.moment == 0
            if self.release is not None:  # once the states were placed from this trace; the step sends the rest
                planned = trace is not None and trace is self.steps.planned_from and label != "step"
                self.release.after_moment(trace if planned else None, self.moment, self._on_device)
        else:
            at = self.positions.evaluation_moment(label, trace)
            trace, self.moves.at, new_iteration = (trace, at, False) if at is not None else (None, -1, False)
        if self.positions.take_rekey():
            self.placer.rekey(trace, self.moves.at)
            new_iteration = False
        self.placer.touch(chunk_ids, trace, self.moves.at, new_iteration)

    @property
    def activations(self) -> ActivationPolicy | None:
        """Activation offload, when on (see [Note: activation offload])."""
        return self._activations

    @activations.setter
    def activations(self, policy: ActivationPolicy | None) -> None:
        self._activations = self.planning.activations = policy
        self.moves.activations = policy

    @property
    def moment(self) -> int:
        """The current recorded moment."""
        return self.moves.moment

    @moment.setter
    def moment(self, value: int) -> None:
        self.moves.moment = value

    # ---- moves (``moves.py``; ``make_room``, ``bring``, ``evict``, ``after_use``, ``place_for_update`` and
    # ``movable_room`` are the driver's own, bound in ``__init__``) ------------------------------------------
    def written(self, chunk_id: int) -> None:
        self.tracer.note_written(chunk_id)

    def gradient_final(self, chunk_id: int) -> None:
        if self.release is not None:
            self.release.gradient_final(chunk_id)

    def gathered_ahead(self, chunk_id: int) -> None:
        self._gathered_ahead.add(chunk_id)

    def accumulator(self, chunk_id: int, event: AccumulatorEvent) -> None:
        self.tracer.note_accumulator(chunk_id, event)
        if event == "acc_gone":
            self.placer.accumulator_left(chunk_id)

    def end_moment(self, in_use: set[int]) -> None:
        """Check the budget (the tide may have risen), record peaks, prefetch the next moment."""
        self.moves.make_room(0, in_use)
        model, non_model = self.ledger.total, self.moves.check_budget()
        trace = self.moves.plan_trace()
        if self.run.records():
            offloaded = self.activations.host_bytes if self.activations is not None else 0
            self.tide.append((self.moment, model, non_model, offloaded))
            if trace is not None:
                # the tide as the plan's own offload would have left it ([Note: a risen tide] in activations/plan.py)
                unplanned = self.activations.unplanned_away(self.moment) if self.activations is not None else 0
                self.positions.note_tide(trace, self.moment, non_model + unplanned)
        note_peaks(self.counters, self.ledger, non_model, self.tracer.meter)
        in_training = self.run.records() or (
            trace is not None and self.positions.prefetches_in_evaluation(trace, self.moves.at)
        )
        if self.notes_unmoved and self.run.records():  # several ranks (see [Note: predicted moves])
            self.tracer.note_beside(unmoved_bytes(self.moves))
            self.tracer.note_gathered_ahead(frozenset(self._gathered_ahead))
        if in_training:
            self.moves.prefetch(self.placer.prefetch(trace, self.moves.at), trace, in_use)
        self.moves.hook_ends()

    def gathered_rooms(self, trace: Trace, held: Callable[[int], int]) -> tuple[list[int], list[int]]:
        """Per moment of ``trace``, the bytes gathered groups may take: see :func:`gathered_rooms`."""
        return gathered_rooms([m.non_model for m in trace.moments], self.movable_room(), held)

    # ---- what the layers above read (see [Note: null placement]) ------------------------
    def current_moment(self) -> int:  # the activation offloader's clock
        return self.moment

    def recorded_moment(self) -> tuple[int, str] | None:
        return (self.moment, self.label) if self.run.records() else None

    def last_iteration(self) -> Trace | None:
        return self.tracer.last_iteration()

    @property
    def meter(self) -> SavedTensorMeter | None:
        return self.tracer.meter

    def budgeted(self) -> bool:
        return True

    def plot_tide(self, path: str, caption: str) -> str:
        """A PNG of the last iteration's tide (see :mod:`~ds_patrickstar.placement.tide_plot`)."""
        if not self.tide:
            raise RuntimeError(NO_TIDE)
        return _plot_last_tide(self.tide, self.tracer, self.placer, path, caption)

    def planner_snapshot(self, path: str) -> str:
        """The last thorough plan's inputs and choice, as JSON (see [Note: planner snapshot] in snapshot.py)."""
        if self.planning.snapshot is None:
            raise RuntimeError(NO_SNAPSHOT)
        return self.planning.snapshot.write(path)

    # ---- iterations and the step (see [Note: optimizer-state placement]) ----------------
    def start_iteration(self, inputs: object) -> bool:
        """The first training forward after a step (see [Note: run state]) starts an iteration (a new
        trace when the input shapes changed); returns whether it traces: then every optimizer state goes
        to the host first (the caller moves them), so that the new tide is measured without them."""
        self.tracer.start_iteration(_signature(inputs))
        self.moment = self.positions.forward_mark = -1
        if self.tracer.tracing:
            self.steps.forget()
        if self.activations is not None:
            self.activations.start_iteration(self.tracer)
        return self.tracer.tracing

    def evaluation_begins(self) -> None:
        """A forward under ``no_grad`` begins (see [Note: evaluation moments])."""
        self.positions.evaluation_begins()

    def forward_begins(self, inputs: object = None) -> bool:
        """A training forward begins: where :meth:`drop_forward` would take its moments back to; a later
        micro-step's ``inputs`` beyond every traced shape offload every block's activations in it (see [Note: a
        risen tide] in activations/plan.py)."""
        self.positions.forward_mark = self.moment
        beyond = inputs is not None and self.tracer.micro_step_inputs(_signature(inputs))
        return beyond and self.activations is not None

    def drop_forward(self) -> None:
        """The last training forward had no backward: its moments go (see [Note: moments and the trace])."""
        mark = self.positions.forward_mark
        self.tracer.rewind(mark)
        self.moment = self.moves.at = mark
        self.tide = [entry for entry in self.tide if entry[0] <= mark]
        self.positions.drop_after(mark)
        if self.activations is not None:
            self.activations.drop_forward()

    def abort_iteration(self) -> None:
        """A backward raised: every moment of the iteration leaves it, as a forward's without backward
        do (see [Note: a backward that raised] in groups/manager.py); the next forward starts it afresh."""
        self.positions.forward_mark = -1
        self.drop_forward()

    def plan_step(self, capacities: dict[int, int]) -> set[int] | None:
        """The step begins: the planner's decision of where the optimizer states of the chunks
        (``capacities``: id -> elements) live from now on, after a (re-)trace or a re-plan; None: where
        they are (see [Note: placement planner]; the traced iteration's own step plans: [Note: first steps];
        the next step checks that plan: [Note: the plan checked on steady times])."""
        self.tracer.cover_previous()  # before any plan is made from a trace for larger inputs
        note_retrace(self.counters, self.tracer.retraced)
        over = self.positions.take_over()
        return self.planning.plan(self.tracer.current_trace(), self.tracer.last_iteration(), over, capacities)

    def host_updates_begin_in_backward(self, begin: bool) -> None:
        planning = self.planning
        for priced in (planning.chooser, planning.timer):
            if priced is not None and priced.overlap:
                priced.overlap = HostOverlap.FROM_BACKWARD if begin else HostOverlap.FROM_STEP

    def step_moment(self, on_device: set[int]) -> None:
        """The optimizer step is a moment, using the chunks whose states live on the accelerator."""
        trace = self.tracer.current_trace()
        self.moves.store.step_begins()  # see [Note: clean evictions] in store/clean_copies.py
        self.steps.settle(trace, on_device)
        predictor = self.planning.predictor
        if predictor is not None and trace is not None:
            placer, fixed = self.placer, self.ledger.by_kind.get("optim", 0)
            predictor.update(trace, fixed, placer.resident, on_device, placer.distance, placer.order)
        self._on_device = set(on_device)
        self.begin_moment("step", tuple(sorted(on_device)))

    def accumulation_begins(self, chunk_needs: Callable[[Trace], list[int]]) -> None:
        """Needs that count accumulators, no move model, a new plan (see [Note: accumulation begun by the caller])."""
        self.steps.chunk_needs = self.planning.chunk_needs = chunk_needs
        self.planning.stop()
        self.release = None
        self.steps.forget()

    def end_step(self) -> None:
        self.moves.store.step_ends()
        note_peaks(self.counters, self.ledger, self.tracer.non_model_now(self.ledger), self.tracer.meter)
        planning = self.planning
        predicted = planning.predictor.plan if planning.predictor is not None else None
        if predicted is not None:
            note_prediction(self.counters, predicted, self.placer, chosen=planning.chooser is not None)
        if self.floor is not None and (planned := self.tracer.current_trace()) is not None:
            self.counters.bytes_floor = self.floor.update(planned)
        trace = self.tracer.last_iteration()
        if planning.timer is not None and predicted is not None and trace is not None:
            step = planning.timer.end_step(trace, predicted, self._on_device, planning.copies())
            self.counters.predicted_step_s = step.total_s if step is not None else 0.0
        planning.note(self.counters)


def _plot_last_tide(
    tide: list[tuple[int, int, int, int]], tracer: MemoryTracer, placer: Placer, path: str, caption: str
) -> str:
    """The tide of ``tracer``'s last iteration as a PNG, titled with the placement and why it re-traced."""
    trace, title = tracer.last_iteration(), f"ds_patrickstar tide ({placer.policy} placement)"
    if tracer.retraced is not None:
        title += f", re-traced: {tracer.retraced.value}"
    recomputations = trace.recomputations() if trace is not None else None
    caption = "\n".join(line for line in (tracer.log.caption(), caption) if line)
    return plot_tide(tide, placer.budget, path, title, recomputations, caption)


def note_retrace(counters: StepCounters, reason: RetraceReason | None) -> None:
    """Whether this step's iteration was traced anew, and why."""
    counters.retraces_shape = int(reason is RetraceReason.SHAPE)
    counters.retraces_order = int(reason is RetraceReason.ORDER)


def note_prediction(counters: StepCounters, predicted: MovePlan, placer: Placer, chosen: bool) -> None:
    """The bytes predicted for the step, and the prefetch distance and eviction order placement runs with (as the
    step-time model ``chosen`` them, else one moment ahead: 0, and Belady's order)."""
    counters.predicted_bytes_to_device = predicted.bytes_to_device
    counters.predicted_bytes_to_host = predicted.bytes_to_host
    counters.predicted_accumulator_bytes_to_device = predicted.accumulator_bytes_to_device
    counters.predicted_accumulator_bytes_to_host = predicted.accumulator_bytes_to_host
    counters.prefetch_distance = placer.distance if chosen else 0
    counters.eviction_order = int(placer.order)


def note_peaks(counters: StepCounters, ledger: DeviceLedger, non_model: int, meter: SavedTensorMeter | None) -> None:
    counters.peak_model_bytes_device = max(counters.peak_model_bytes_device, ledger.peak)
    counters.peak_non_model_bytes_device = max(counters.peak_non_model_bytes_device, non_model)
    counters.peak_device_bytes = max(counters.peak_device_bytes, ledger.total + non_model)
    if meter is not None:  # the saved activations the emulated accelerator's meter counts
        counters.peak_activation_bytes_device = max(counters.peak_activation_bytes_device, meter.bytes)


def _signature(inputs: object) -> tuple:
    """The shapes and dtypes of a forward's input tensors (see [Note: traces across input shapes])."""
    return tuple((tuple(t.shape), t.dtype) for t in iter_tensors(inputs))
