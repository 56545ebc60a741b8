"""A step's time predicted from the trace, the moves the planner predicts and a device profile.

[Note: step-time model]
:func:`predict_step` prices one steady-state iteration of a trace as two streams run it: the compute stream
runs the moments in order, the copy stream the moves (:class:`~ds_patrickstar.placement.move_model.MovePlan`,
see [Note: predicted moves]) in the order the driver issues them. At moment ``k`` the driver issues, before
the moment's compute is queued, the bytes brought on demand, then the bytes sent back and the bytes brought
ahead for later moments; each copy starts when the copy stream is free and the compute queued before it
(moments up to ``k - 1``) is done. Moment ``k``'s compute starts when moment ``k - 1``'s is done, its
on-demand bytes have arrived and so have the bytes brought ahead for it (at any earlier moment: the prefetch
distance, see [Note: prefetch distance] in state_choice.py). With one moment ahead, a moment costs

    t_k = demand_k / to_device + max(compute_k, ahead_k / to_device + evicted_k / to_host)

when the copy stream is not behind. The step moment runs its moves, then its own measured time beyond the
Adam priced here (the gradient norm, the step's bookkeeping and waits; on an H200 0.58 s of a 1.42 s step,
which a model without it left out), the device Adam (elements / the device's Adam rate) and the host Adam:
all of it serially without overlap; with the overlapped host
Adam (see [Note: overlapped host Adam] in memory/host_work.py) only what the next forward waits for:
the jobs run one after the other from the step's start, in the order the forward first uses their
chunks, and chunk ``i`` is needed once the step and the forward's moments before its first use are
done, so ``max(0, max_i(finish_i - needed_i))`` is exposed.

``compute_k`` is a moment's measured time (the accelerator's clock: CUDA events on the compute stream,
the host's clock on the strict twin) less the demand transfers the model prices in it. The figures of
:class:`DeviceProfile` are measured at initialize on a GPU (see [Note: device profile] in
integration/device_profile.py); :data:`H100_PROFILE` holds the figures this project measured on an H100, and
the strict twin prices its moves with them.
What the model leaves out: the collectives (with several ranks the moments' measured times hold what they made the
compute wait; the move model reads their buffers' room, see [Note: predicted moves]), two copy directions running
at once, and host Adam slowing the host's compute.

Where host updates begin during backward (:attr:`HostOverlap.FROM_BACKWARD`, see [Note: host updates in
backward] in optim/early_updates.py), each host-updated chunk is released at the moment after its last use
before the step, and the worker runs them one after the other from then, a chunk beginning only while the
worker is idle (the rule of ``"auto"``), each :data:`BEGUN_COST` times as long as the update in place (it writes
other buffers): those begun are not the step's jobs, and
what the worker still runs of them when the step starts delays the step's jobs. The copy of the gradient to the
host before the job is left out (it runs behind backward's compute), and so is the rank's collective with several
ranks (the gradient is final once its reduce-scatter completed: later).

Offloaded activations (see [Note: activation offload]) share the copy stream with the chunks: their copies
(:class:`ActivationMoves`, from the plan's blocks, see :func:`~ds_patrickstar.activations.plan.planned_copies`)
go on it at the moments the offloader issues them, a copy out beside the moment's evictions, a copy back for the
moment that issues it beside its on-demand bytes and one for a later moment (the prefetch of the block before)
beside the bytes brought ahead for it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

from .move_model import MovePlan
from .planner import update_order
from .trace import Trace

# A host update into spare buffers against one in place (``adam_step_from`` against ``adam_step``, 8 Mi bf16
# elements, benchmarks/bench_adam.py: ours_from / ours): 1.16-1.24x on a 2-core AMD EPYC (avx2, avx512f,
# avx512_bf16), its states written with streaming stores (1.6x before them); not measured on a GPU's host
BEGUN_COST = 1.2


class HostOverlap(IntEnum):
    """When the host Adam runs, as the model prices it (see [Note: step-time model])."""

    OFF = 0  # every update before step() returns (overlap_host_adam: false)
    FROM_STEP = 1  # from step(), in the next forward's order (see [Note: overlapped host Adam])
    FROM_BACKWARD = 2  # those whose gradients leave in backward begin there (see [Note: host updates in backward])


@dataclass(frozen=True)
class DeviceProfile:
    """The rates a step is priced with (see [Note: step-time model])."""

    to_device_bytes_per_s: float
    to_host_bytes_per_s: float
    host_adam_elements_per_s: float
    device_adam_elements_per_s: float


H100_PROFILE = DeviceProfile(
    to_device_bytes_per_s=54e9,  # pinned host to device, measured on an H100 (gpu_suite_trial.py)
    to_host_bytes_per_s=54e9,  # taken as the same (not measured apart)
    host_adam_elements_per_s=5.4e9,  # the host kernel: 1.13e9 elements in 0.21 s on the H100 machine's 16 cores
    device_adam_elements_per_s=9e10,  # 28 B read and written per element at ~2.5 TB/s of HBM (not measured)
)


@dataclass(frozen=True)
class ActivationMoves:
    """Activation offload's copies in an iteration, per moment that issues them (see [Note: step-time model])."""

    out: Mapping[int, int] = field(default_factory=dict)  # bytes to the host
    demand: Mapping[int, int] = field(default_factory=dict)  # bytes back, for this moment
    ahead: Mapping[int, Sequence[tuple[int, int]]] = field(default_factory=dict)  # (later moment, bytes back)

    @property
    def key(self) -> tuple:
        """The copies as a hashable value."""
        ahead = tuple(sorted((k, tuple(copies)) for k, copies in self.ahead.items()))
        return tuple(sorted(self.out.items())), tuple(sorted(self.demand.items())), ahead

    @property
    def moved(self) -> int:
        """Bytes both ways."""
        back = sum(self.demand.values()) + sum(n for copies in self.ahead.values() for _, n in copies)
        return sum(self.out.values()) + back


NO_ACTIVATION_MOVES = ActivationMoves()


@dataclass(frozen=True)
class StepTime:
    """A predicted step, in seconds: the total and what it is made of."""

    compute_s: float
    exposed_transfers_s: float
    optimizer_s: float  # the step's Adam on the critical path (with overlap, the host jobs the forward waits for)
    step_s: float = 0.0  # of ``compute_s``, the step moment's own time beyond the Adam priced (norm, bookkeeping)

    @property
    def total_s(self) -> float:
        return self.compute_s + self.exposed_transfers_s + self.optimizer_s


def predict_step(
    trace: Trace,
    plan: MovePlan,
    compute_s: Sequence[float],
    host_updated: Mapping[int, int],
    device_updated: int,
    profile: DeviceProfile,
    overlap: HostOverlap,
    activations: ActivationMoves = NO_ACTIVATION_MOVES,
) -> StepTime:
    """One iteration of ``trace`` with the moves of ``plan`` and of ``activations``, and moment times ``compute_s``
    (one per moment); ``host_updated``: elements of each chunk Adam updates on the host, ``device_updated``:
    elements updated on the accelerator (see [Note: step-time model])."""
    device_adam = device_updated / profile.device_adam_elements_per_s
    host_adam = sum(host_updated.values()) / profile.host_adam_elements_per_s
    priced_adam = device_adam + (0.0 if overlap else host_adam)  # what the step moment's own time already holds
    streams = _Streams(profile)
    compute, step_at = 0.0, -1
    for k, moment in enumerate(trace.moments):
        work = compute_s[k] if k < len(compute_s) else 0.0
        if moment.label == "step":  # its own time beyond the Adam priced below (norm, bookkeeping, host waits)
            step_at, work = k, max(0.0, work - priced_adam)
            streams.serial(plan.to_device[k], plan.evicted(k), work)
        else:
            demand, out = plan.demand[k] + activations.demand.get(k, 0), plan.evicted(k) + activations.out.get(k, 0)
            streams.moment(k, demand, out, [*plan.brought_ahead(k), *activations.ahead.get(k, ())], work)
        compute += work
    exposed = streams.done - compute
    own = streams.moment_s[step_at] - streams.step_moves if step_at >= 0 else 0.0
    if not overlap or step_at < 0:
        return StepTime(compute, exposed, device_adam + host_adam, own)
    begun: tuple[frozenset[int], float] = (frozenset(), 0.0)
    if overlap is HostOverlap.FROM_BACKWARD:
        begun = _begun_in_backward(trace, streams.moment_s, step_at, host_updated, profile)
    waited = _host_adam_waited(trace, streams.moment_s, step_at, device_adam, host_updated, profile, begun)
    return StepTime(compute, exposed, device_adam + waited, own)


class _Streams:
    """The compute stream and the copy stream through one iteration (see [Note: step-time model]): when
    each has run what was queued so far, and each moment's time from the end of the one before."""

    def __init__(self, profile: DeviceProfile) -> None:
        self.profile = profile
        self.done = 0.0  # the compute stream has run the moments so far
        self.copied = 0.0  # the copy stream has run the moves issued so far
        self.ready: dict[int, float] = {}  # moment -> its chunks brought ahead have arrived
        self.moment_s: list[float] = []
        self.step_moves = 0.0  # the step moment's own moves

    def moment(self, k: int, demand: int, evicted: int, ahead: list[tuple[int, int]], work: float) -> None:
        before = self.done
        copied = max(self.copied, before) + demand / self.profile.to_device_bytes_per_s
        start = max(before, copied, self.ready.get(k, 0.0))
        copied += evicted / self.profile.to_host_bytes_per_s
        for target, nbytes in ahead:
            copied += nbytes / self.profile.to_device_bytes_per_s
            self.ready[target] = max(self.ready.get(target, 0.0), copied)
        self.copied, self.done = copied, start + work
        self.moment_s.append(self.done - before)

    def serial(self, to_device: int, to_host: int, work: float) -> None:
        """The step moment: its moves after the copies in flight, then its own time (the wait for those
        copies is the moment before's)."""
        waited = max(0.0, self.copied - self.done)
        if self.moment_s:
            self.moment_s[-1] += waited
        moves = to_device / self.profile.to_device_bytes_per_s + to_host / self.profile.to_host_bytes_per_s
        self.step_moves = moves
        self.done += waited + moves + work
        self.copied = self.done
        self.moment_s.append(moves + work)


def _begun_in_backward(
    trace: Trace, moment_s: list[float], step_at: int, host_updated: Mapping[int, int], profile: DeviceProfile
) -> tuple[frozenset[int], float]:
    """The host updates that begin in backward, and the seconds the worker still runs them after the step starts."""
    begins = [0.0]  # seconds from the iteration's start to the start of each moment
    for seconds in moment_s:
        begins.append(begins[-1] + seconds)
    last = {chunk: k for k, moment in enumerate(trace.moments[:step_at]) for chunk in moment.chunks}
    released = sorted((begins[k + 1] - begins[step_at], c) for c, k in last.items() if c in host_updated)
    free, begun = float("-inf"), set()  # when the worker has run the jobs begun so far
    for at, chunk in released:
        if at < 0 and free <= at:  # released before the step, the worker idle
            free = at + BEGUN_COST * host_updated[chunk] / profile.host_adam_elements_per_s
            begun.add(chunk)
    return frozenset(begun), max(0.0, free)


def _host_adam_waited(
    trace: Trace,
    moment_s: list[float],
    step_at: int,
    device_adam: float,
    host_updated: Mapping[int, int],
    profile: DeviceProfile,
    begun: tuple[frozenset[int], float],
) -> float:
    """The time the next forward waits for the host jobs (they start with the step, in the forward's order, after
    what the worker still runs of those ``begun`` in backward)."""
    started = [0.0]  # seconds from the step's start to the start of each moment after it (wrapping around)
    order = list(range(step_at + 1, len(trace))) + list(range(step_at))
    for k in order:
        started.append(started[-1] + moment_s[k])
    position = {k: i for i, k in enumerate(order)}
    (early, finished), waited = begun, 0.0
    for chunk in update_order(trace, host_updated):
        if chunk in early:
            continue
        finished += host_updated[chunk] / profile.host_adam_elements_per_s
        first = trace.next_use(chunk, step_at)
        first = first - len(trace) if first >= len(trace) else first
        if first < 0 or first not in position:
            continue
        needed = moment_s[step_at] + device_adam + started[position[first]] + waited
        waited += max(0.0, finished - needed)
    return waited


class StepTimer:
    """The moments' times on the accelerator's clock, less the host's waits for host jobs in them (see [Note:
    host waits] in memory/host_work.py) and the plans' searches, and, at the end of each steady-state step, the
    prediction of the step just taken (see [Note: step-time model]). The times of an iteration are read one step
    later, when the accelerator has run its marks (no synchronization)."""

    def __init__(
        self,
        clock: Callable[[], Any],
        seconds: Callable[[Any, Any], float],
        elements: Mapping[int, int],
        profile: DeviceProfile,
        overlap: HostOverlap,
        waited: Callable[[], float] = lambda: 0.0,
        reach: Callable[[Any], None] = lambda mark: None,
    ) -> None:
        self._clock, self._seconds, self._waited, self._reach = clock, seconds, waited, reach
        self._elements = dict(elements)  # trainable owned chunk -> elements Adam updates
        self.profile, self.overlap = profile, overlap
        self._marks: list[tuple[Any, float]] = []  # per moment begun: (the clock's mark, the host's waits so far)
        self._closed: list[tuple[Any, float]] | None = None  # the marks of the previous iteration and its end
        self._aside = 0.0  # host time spent planning, a running total (see :meth:`set_aside`)
        self.last: StepTime | None = None

    def begin_moment(self, index: int) -> None:
        if index == 0:
            self._marks = []
        if index == len(self._marks):
            self._marks.append(self._mark())

    def _mark(self) -> tuple[Any, float]:
        return self._clock(), self._waited() + self._aside

    def set_aside(self, seconds: float) -> None:
        """``seconds`` of host time in the current moment that no step repeats (a plan's search, see [Note: the
        planner's cost] in state_choice.py), taken out of its time as the host's waits are."""
        self._aside += seconds

    def end_step(
        self,
        trace: Trace,
        plan: MovePlan,
        on_device: AbstractSet[int],
        activations: ActivationMoves = NO_ACTIVATION_MOVES,
    ) -> StepTime | None:
        """The prediction for ``trace`` priced with the moment times of the previous iteration (None before two
        iterations of the same length were timed)."""
        closed, self._closed = self._closed, [*self._marks, self._mark()]
        if closed is None or len(closed) != len(trace) + 1:
            return None
        compute = self.compute(self._between(closed), plan, activations)
        host = {c: n for c, n in self._elements.items() if c not in on_device}
        device = sum(n for c, n in self._elements.items() if c in on_device)
        self.last = predict_step(trace, plan, compute, host, device, self.profile, self.overlap, activations)
        return self.last

    def compute(self, times: Sequence[float], plan: MovePlan, activations: ActivationMoves) -> list[float]:
        """The moments' compute: ``times`` less the bytes ``plan`` and ``activations`` bring on demand there, at
        the profile's rate (the model prices them apart)."""
        rate = self.profile.to_device_bytes_per_s
        return [max(0.0, t - (plan.demand[k] + activations.demand.get(k, 0)) / rate) for k, t in enumerate(times)]

    def traced_times(self, moments: int) -> list[float]:
        """The moment times of the iteration under way, the last one up to now, and 0 for the moments still to
        come (the step's): the compute a plan made at the step prices (see [Note: optimizer states by step time]
        in state_choice.py). The accelerator is waited for up to now first (the backward it still runs would
        read 0; the step's gradient norm waits for it a moment later anyway)."""
        now = self._mark()
        self._reach(now[0])
        return (self._between([*self._marks, now]) + [0.0] * moments)[:moments]

    def _between(self, marks: list[tuple[Any, float]]) -> list[float]:
        """Seconds between consecutive marks (0 where not reached) less the host's waits between them."""
        times = []
        for (start, waited), (end, waited_then) in zip(marks, marks[1:]):
            seconds = self._seconds(start, end)
            times.append(max(0.0, seconds - (waited_then - waited)) if seconds == seconds else 0.0)  # NaN: not reached
        return times
