"""The placement runtime: carries out the placer's decisions at every moment, under the budget.

It is the :class:`~ds_patrickstar.placement.interface.Placement` of a run with an accelerator (see
[Note: placement] in ``policy.py``): a moment begins and ends, a chunk is brought or evicted, room is
made, a kept or prefetched group is allowed or not; the step is a moment too (see
[Note: optimizer-state placement]). Which moments it records follows the run's phase (see
[Note: run state]).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from ..autograd_state import iter_tensors
from ..chunks.chunk import Chunk
from ..counters import StepCounters
from ..memory.ledger import DeviceBudgetExceeded, DeviceLedger
from ..memory.reductions import InFlightReductions
from ..run_state import RunState
from ..store.chunk_store import ChunkStore
from .interface import NO_TIDE, ActivationPolicy
from .planner import gathered_rooms
from .policy import Placer
from .positions import TracePositions
from .shapes import RetraceReason
from .step_plan import StepPlan
from .tide_plot import plot_tide
from .tracer import MemoryTracer, SavedTensorMeter, Trace

logger = logging.getLogger(__name__)


class PlacementRuntime:
    """Carries out the placer's decisions at every moment; see [Note: placement]."""

    def __init__(
        self,
        placer: Placer,
        tracer: MemoryTracer,
        store: ChunkStore,
        counters: StepCounters,
        chunks: list[Chunk],
        reductions: InFlightReductions,
        chunk_needs: Callable[[Trace], list[int]],
        run: RunState,
    ) -> None:
        self.placer, self.tracer, self.store, self.counters = placer, tracer, store, counters
        self.run = run
        self.ledger, self.chunks, self.reductions = store.accel.ledger, chunks, reductions
        self._chunk_needs = chunk_needs  # per traced moment, what its chunks take (see [Note: chunk bytes per moment])
        largest = max((c.nbytes for c in chunks), default=0)
        self.steps = StepPlan(placer.budget, placer.policy, chunk_needs, largest, counters)
        self.moment = -1
        self.label = ""  # the label of the current moment
        # (moment, model bytes, non-model bytes, offloaded activation bytes) this iteration
        self.tide: list[tuple[int, int, int, int]] = []
        self.stranded_peak = 0  # the most stranded allocator bytes at a moment this iteration
        self.activations: ActivationPolicy | None = None  # see [Note: activation offload]
        self.positions = TracePositions(placer.budget // 64)  # see [Note: evaluation moments]
        self._at = -1  # the trace position the current moment is placed at (-1: none)

    # ---- accounting (running totals: O(1) per moment, see [Note: placement]) -----------
    def model_bytes_on_device(self) -> int:
        return self.ledger.total

    @staticmethod
    def _bytes(chunk: Chunk) -> int:
        """What the chunk occupies on the accelerator when it is there (payload + accumulator)."""
        return chunk.nbytes + chunk.acc_nbytes

    def _evictable(self, keep: set[int]) -> Callable[[int], int | None]:
        chunks = self.chunks

        def size(chunk_id: int) -> int | None:
            chunk = chunks[chunk_id]
            return None if chunk_id in keep or not chunk.movable else self._bytes(chunk)

        return size

    def _to_device(self, chunk: Chunk) -> None:
        self.store.to_device(chunk)
        self.placer.arrived(chunk.chunk_id)

    def evict(self, chunk: Chunk) -> None:
        """``chunk`` to the host (an asynchronous copy; see [Note: chunk locations])."""
        if not chunk.on_host:
            self.store.to_host(chunk)
            self.placer.left(chunk.chunk_id)

    def _headroom(self, trace: Trace | None, moment: int) -> int:
        """Bytes model data may take at ``moment``: the budget less the higher of the tide ahead and the
        memory reserved now (the tide now and the stranded pieces): see [Note: stranded allocator bytes]."""
        self._non_model()
        return self.placer.headroom(trace, moment, self.ledger.non_model)

    def _non_model(self) -> int:
        """The tide now; the ledger's charges must fit beside it and the allocator's stranded pieces
        (reserved memory in use now, see [Note: stranded allocator bytes])."""
        non_model = self.tracer.non_model_now(self.ledger)
        stranded = self.store.accel.fragmentation()
        self.ledger.non_model = non_model + stranded
        if self.run.records():
            self.stranded_peak = max(self.stranded_peak, stranded)
        return non_model

    # ---- moments ------------------------------------------------------------------
    def begin_moment(self, label: str, chunk_ids: tuple[int, ...]) -> None:
        """A recorded moment (a training moment or the step, see [Note: run state]) advances the trace;
        any other (an evaluation forward's) is a moment of its own, placed without touching the trace
        or the tide (see [Note: evaluation moments])."""
        trace = self.tracer.current_trace()
        if self.run.records():
            self.positions.training_moment()
            self.moment = self._at = self.tracer.record(label, chunk_ids, self.ledger)
            self.label, trace = label, self.tracer.current_trace()
            if self.moment == 0:
                self.tide = []
                self.stranded_peak = 0
            new_iteration = self.moment == 0
        else:
            at = self.positions.evaluation_moment(label, trace)
            trace, self._at, new_iteration = (trace, at, False) if at is not None else (None, -1, False)
        if self.positions.take_rekey():
            self.placer.rekey(trace, self._at)
            new_iteration = False
        self.placer.touch(chunk_ids, trace, self._at, new_iteration)

    def _plan_trace(self) -> Trace | None:
        """The trace the current moment is placed from (None while tracing or off the trace)."""
        trace = self.tracer.current_trace()
        return trace if self.run.records() or self._at >= 0 else None

    def make_room(self, need: int, keep: set[int]) -> None:
        """Evict until ``need`` more bytes of model data fit beside the tide. Evictions whose copies
        are still in flight count as occupied until they complete (see [Note: deferred frees]):
        new victims are chosen only for what those will not free, then the oldest are waited on."""
        accel = self.store.accel
        accel.reclaim()
        trace = self._plan_trace()
        headroom = self._headroom(trace, self._at)
        over = self.ledger.total + need - headroom
        if over <= 0:
            return
        if self.reductions.drain():  # reduce-scatters in flight hold gradient buffers: done first
            accel.reclaim()
            over = self.ledger.total + need - headroom
            if over <= 0:
                return
        short = over - accel.in_flight_bytes()
        if short > 0:
            try:
                self._evict_all(self.placer.victims(short, self._evictable(keep)))
            except DeviceBudgetExceeded as err:
                raise DeviceBudgetExceeded(
                    f"the accelerator budget of {self.placer.budget:,} B cannot hold the chunks needed at moment "
                    f"{self.moment}: the backend holds {self.ledger.total:,} B and needs {need:,} B more, next to "
                    f"{self.placer.budget - headroom:,} B of non-model memory ({err}; needed now: {sorted(keep)}). "
                    f"Raise zero_optimization.device_budget or lower chunk_size."
                ) from None
        accel.reclaim(need_below=headroom - need)

    def _evict_all(self, victims: list[int]) -> None:
        for victim in victims:
            self.evict(self.chunks[victim])
            self.counters.evictions += 1

    def bring(self, chunk: Chunk, keep: set[int]) -> None:
        """``chunk`` on the accelerator (room made for it), its copy waited on."""
        if chunk.on_host:
            self.make_room(self._bytes(chunk), keep | {chunk.chunk_id})
            self._to_device(chunk)
        chunk.wait_pending()

    def end_moment(self, in_use: set[int]) -> None:
        """Check the budget (the tide may have risen), record peaks, prefetch the next moment."""
        self.make_room(0, in_use)
        model, non_model = self.ledger.total, self._non_model()
        if model + self.ledger.non_model > self.placer.budget:
            raise DeviceBudgetExceeded(
                f"model data {model:,} B + non-model {non_model:,} B + stranded allocator pieces "
                f"{self.ledger.non_model - non_model:,} B exceed the accelerator budget of "
                f"{self.placer.budget:,} B at moment {self.moment}"
            )
        trace = self._plan_trace()
        if self.run.records():
            offloaded = self.activations.host_bytes if self.activations is not None else 0
            self.tide.append((self.moment, model, non_model, offloaded))
            if trace is not None:
                self.positions.note_tide(trace, self.moment, non_model)
        note_peaks(self.counters, self.ledger, non_model, self.tracer.meter)
        in_training = self.run.records() or (
            trace is not None and self.positions.prefetches_in_evaluation(trace, self._at)
        )
        ahead = self.placer.prefetch(trace, self._at) if in_training else ()
        for chunk_id in ahead:
            chunk = self.chunks[chunk_id]
            if chunk.on_host and self._room_for_prefetch(self._bytes(chunk), trace, in_use | set(ahead)):
                self._to_device(chunk)
                self.counters.prefetches += 1
                chunk.prefetched = True

    def _room_for_prefetch(self, nbytes: int, trace: Trace | None, keep: set[int]) -> bool:
        """Whether ``nbytes`` fit at the next moment, after evicting chunks used only after it (see
        [Note: placement]); nothing is evicted when that would not be enough."""
        if self._fits(nbytes, trace):
            return True
        accel = self.store.accel
        headroom = self._headroom(trace, self._at + 1)
        short = self.ledger.total + nbytes - headroom - accel.in_flight_bytes()
        victims = self.placer.victims_used_after(short, self._evictable(keep), self._at + 1) if short > 0 else []
        if victims is None:
            return False
        self._evict_all(victims)
        accel.reclaim(need_below=headroom - nbytes)
        return True

    def movable_room(self) -> int:
        """The budget less what no moment can move: the optimizer states on the accelerator and the
        allocator's stranded pieces as they are now (a margin for plans: :meth:`make_room` counts them
        only where the tide is lower, see [Note: stranded allocator bytes] in memory/cuda.py); no
        reserve beyond it."""
        return self.placer.budget - self.ledger.by_kind.get("optim", 0) - self.store.accel.fragmentation()

    def gathered_rooms(self, trace: Trace, held: Callable[[int], int]) -> tuple[list[int], list[int]]:
        """Per moment of ``trace``, the bytes gathered groups may take: see :func:`gathered_rooms`."""
        return gathered_rooms([m.non_model for m in trace.moments], self.movable_room(), held)

    def _fits(self, nbytes: int, trace: Trace | None) -> bool:
        return self.ledger.total + nbytes <= self._headroom(trace, self._at + 1)

    def after_use(self, chunk: Chunk) -> None:
        if self.placer.release_after_use(chunk.chunk_id) and chunk.movable:
            self.evict(chunk)

    def place_for_update(self, chunk: Chunk, on_device: bool) -> None:
        """Hybrid Adam updates ``chunk`` where its states live (see [Note: optimizer-state placement])."""
        if on_device:
            self.bring(chunk, {chunk.chunk_id})
            self.counters.adam_chunks_device += 1
        else:
            self.evict(chunk)
            self.counters.adam_chunks_host += 1

    # ---- what the layers above read (see [Note: null placement]) ------------------------
    def current_moment(self) -> int:  # the activation offloader's clock
        return self.moment

    def recorded_moment(self) -> tuple[int, str] | None:
        return (self.moment, self.label) if self.run.records() else None

    def last_iteration(self) -> Trace | None:
        return self.tracer.last_iteration()

    def meter(self) -> SavedTensorMeter | None:
        return self.tracer.meter

    def activation_policy(self) -> ActivationPolicy | None:
        return self.activations

    def budgeted(self) -> bool:
        return True

    def split_model_bytes(self, on_accelerator: int, on_host: int) -> tuple[int, int]:
        return on_accelerator, on_host

    def plot_tide(self, path: str, caption: str) -> str:
        """A PNG of the last iteration's tide (see :mod:`~ds_patrickstar.placement.tide_plot`)."""
        if not self.tide:
            raise RuntimeError(NO_TIDE)
        trace, title = self.tracer.last_iteration(), f"ds_patrickstar tide ({self.placer.policy} placement)"
        if self.tracer.retraced is not None:
            title += f", re-traced: {self.tracer.retraced.value}"
        recomputations = trace.recomputations() if trace is not None else None
        caption = "\n".join(line for line in (self.tracer.log.caption(), caption) if line)
        return plot_tide(self.tide, self.placer.budget, path, title, recomputations, caption)

    # ---- iterations and the step (see [Note: optimizer-state placement]) ----------------
    def start_iteration(self, inputs: object) -> bool:
        """The first training forward after a step (see [Note: run state]) starts an iteration (a new
        trace when the input shapes changed); returns whether it traces: then every optimizer state goes
        to the host first (the caller moves them), so that the new tide is measured without them."""
        self.tracer.start_iteration(tuple((tuple(t.shape), t.dtype) for t in iter_tensors(inputs)))
        self.moment = self.positions.forward_mark = -1
        if self.tracer.tracing:
            self.steps.forget()
        if self.activations is not None:
            self.activations.start_iteration(self.tracer)
        return self.tracer.tracing

    def evaluation_begins(self) -> None:
        """A forward under ``no_grad`` begins (see [Note: evaluation moments])."""
        self.positions.evaluation_begins()

    def forward_begins(self) -> None:
        """A training forward begins: where :meth:`drop_forward` would take its moments back to."""
        self.positions.forward_mark = self.moment

    def drop_forward(self) -> None:
        """The last training forward had no backward: its moments leave the iteration (see
        [Note: moments and the trace])."""
        mark = self.positions.forward_mark
        self.tracer.rewind(mark)
        self.moment = self._at = mark
        self.tide = [entry for entry in self.tide if entry[0] <= mark]
        self.positions.drop_after(mark)
        if self.activations is not None:
            self.activations.drop_forward()

    def plan_step(self, capacities: dict[int, int]) -> set[int] | None:
        """The step begins: the planner's decision of where the optimizer states of the chunks
        (``capacities``: id -> elements) live from now on, after a (re-)trace or a re-plan; None: where
        they are (see [Note: placement planner])."""
        self.tracer.cover_previous()  # before any plan is made from a trace for larger inputs
        self.counters.retraces_shape = int(self.tracer.retraced is RetraceReason.SHAPE)
        self.counters.retraces_order = int(self.tracer.retraced is RetraceReason.ORDER)
        trace = self.tracer.current_trace()
        return self.steps.decide(trace, self.positions.take_over(), capacities) if trace is not None else None

    def step_moment(self, on_device: set[int]) -> None:
        """The optimizer step is a moment, using the chunks whose states live on the accelerator (the
        trace's step moment names them after a new decision); after a trace, "auto" activation offload
        plans from it, before the gather plan is agreed (see [Note: auto activation offload])."""
        self.steps.settle(self.tracer.current_trace(), on_device)
        self.begin_moment("step", tuple(sorted(on_device)))
        traced = self.tracer.last_iteration() if self.tracer.tracing else None
        if self.activations is not None and traced is not None:
            self.activations.plan(traced, self.movable_room(), self._chunk_needs, self.stranded_peak)

    def end_step(self) -> None:
        note_peaks(self.counters, self.ledger, self.tracer.non_model_now(self.ledger), self.tracer.meter)


def note_peaks(counters: StepCounters, ledger: DeviceLedger, non_model: int, meter: SavedTensorMeter | None) -> None:
    counters.peak_model_bytes_device = max(counters.peak_model_bytes_device, ledger.peak)
    counters.peak_non_model_bytes_device = max(counters.peak_non_model_bytes_device, non_model)
    counters.peak_device_bytes = max(counters.peak_device_bytes, ledger.total + non_model)
    if meter is not None:  # the saved activations the emulated accelerator's meter counts
        counters.peak_activation_bytes_device = max(counters.peak_activation_bytes_device, meter.bytes)
