"""Which chunks' optimizer states live on the accelerator, chosen by the predicted step time.

[Note: optimizer states by step time]
Optimizer states on the accelerator spare their chunk the host update's round trip (the gradient out, the
updated payload back in) and the host Adam, but they take 12 B per element of room that low-precision
payloads (2 B per element) could otherwise keep between uses: where the room is short, every state kept
there may cost several payloads a trip out and back each iteration. So the planner does not fill the room
with states (the ``"fill"`` rule of :func:`~ds_patrickstar.placement.planner.states_on_device`); it prices
candidates among the chunks the fill rule would place, each with the moves of a steady-state iteration
(:func:`~ds_patrickstar.placement.move_model.simulate_moves`, two iterations) and the step-time model
(:func:`~ds_patrickstar.placement.step_time.predict_step`, see [Note: step-time model]):

* the first ``k`` of them for ``k`` from 0 to all (chunk order: the chunks the backward uses last and the
  next forward first, resident at the step anyway);
* then local moves from the best: one chunk's states off, on, or swapped for another's (a prefix may keep
  the one chunk whose room the payloads need most).

Predicted steps within :data:`TIE` of the fastest are a tie (the model is not that exact; where the
transfers hide behind compute either way, candidates differ by little more than their Adam), which goes to
the fewest bytes moved (a copy engine less busy, and less exposed where the compute was over-estimated),
then to more states on the accelerator. A candidate never needs more room than the fill rule's, so no
budget the fill rule met is refused.

The moments' compute times are those an iteration measured on the accelerator's clock, where it has reached
them (else 0: the transfers priced as exposed); the profile's rates price the rest. With many candidates the
search takes a grid of :data:`GRID` points, then halves the interval around the best until neighbours are
compared. ``tests/test_state_choice.py`` checks the choice against every subset of the candidates on small
traces.

[Note: the planner's cost]
Every candidate priced is two replays of an iteration (see [Note: predicted moves] in move_model.py), and a
replay's work grows with moments x chunks: at gpt-1.3b's trace size (24 blocks, some 300 moments, 85-100
chunks) a replay took a few ms of host time on a 2-core EPYC, and the plans of the first two steps priced some
900 candidates there (prefixes and local moves in every eviction order, for each tide the activation offload
priced, at the traced step and again at its check): 0.7-8.7 s of planning while the steady step took 0.2 s. So:

* the traced step plans quickly: the best prefix in each eviction order, then the distance and the order, with
  no local moves and no extra activation offload for states: its own moment times cannot steer (see [Note: the
  plan checked on steady times] in step_planner.py), and the next step plans again;
* the check prices each tide the activation offload weighs the same quick way, then searches the tide kept
  thoroughly: local moves from each order's best prefix (where :data:`LOCAL_WORK` allows);
* one :class:`Pricer` per trace, resident set, times and activation copies prices each candidate once: the
  thorough search reuses the quick one's prices, the moves' choices the searches';
* the prefix search is exhaustive up to ``2 * GRID`` chunks (18), a grid with halving beyond;
* a replay reads what it needs of the trace from lists built once per trace (``replay_arrays.py``), and the
  eviction queue counts its entries instead of summing its heaps at every push;
* the search's host time is not the step's compute: the step-time model's clock sets it aside
  (:meth:`~.step_time.StepTimer.set_aside`), as it does the host's waits.

On the twin at that trace size the first two steps' planning went from 0.7-8.7 s to 0.2-1.5 s
(``benchmarks/bench_planning.py``, table in docs/benchmarks.md); counter ``plan_seconds``. Where the traced
step's quick plan and the check differ, the states move at the second step and the steady state starts at the
third.

[Note: prefetch distance]
After a moment the driver brings ahead the chunks of the next ``distance`` moments, nearest first, each
where it fits at every moment up to the one it is for (after evicting chunks used only after that moment;
never a chunk needed sooner), and none of a farther moment once one moment's chunks did not all fit (they
would take the room its chunks then need on demand). One moment ahead hides a copy behind one moment's
compute; where moments are uneven (a short one before a long copy) or the link is slow, copies issued
earlier run behind several moments' compute, at the price of room held longer (more evictions where room is
short). With the optimizer states placed, the planner prices each distance from 1 to :data:`MAX_DISTANCE`
(the moves of a steady-state iteration at that distance, then the two-stream step-time model, see [Note:
step-time model]) and keeps the fastest; within :data:`TIE` of it, the fewest bytes moved, then the shortest
distance. The distance is logged and exported (counter ``prefetch_distance``); without the step-time model
(``optimizer_placement: "fill"``) it is one moment.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

from ..memory.preflight import OPTIM_BYTES_PER_ELEMENT
from .bytes_floor import FloorMeter
from .chunk_costs import ChunkCosts
from .eviction_queue import EvictionOrder
from .move_model import MovePlan, steady_moves
from .step_time import NO_ACTIVATION_MOVES, ActivationMoves, DeviceProfile, HostOverlap, StepTime, predict_step
from .trace import Moment, Trace

logger = logging.getLogger(__name__)

GRID = 9
"""Candidates priced in the first pass of a search over more than ``2 * GRID`` of them (see [Note: the planner's
cost])."""
ROUNDS = 2
"""Rounds of local moves (one chunk's states off, on, or swapped) after the search over prefixes."""
NEIGHBOURS = 64
"""The most candidates a round of local moves prices."""
LOCAL_WORK = 40_000
"""Local moves only where chunks x moments (a replay's work) is at most this: at 85 chunks x 300 moments they
took about a second of a thorough search on a 2-core EPYC (see [Note: the planner's cost]); beyond, the prefix
search alone."""
TIE = 0.02
"""Predicted steps within this fraction of the fastest are a tie, settled by the bytes moved."""
MAX_DISTANCE = 4
"""The most moments prefetched ahead (see [Note: prefetch distance])."""
MADE = 8
"""Choices a :class:`StateChooser` keeps for a call with the same arguments (those of one plan)."""


@dataclass(frozen=True)
class StateChoice:
    """A priced candidate: the chunks whose states live on the accelerator, its step and its moves."""

    on_device: frozenset[int]
    step: StepTime
    plan: MovePlan
    distance: int = 1
    order: EvictionOrder = EvictionOrder.BELADY

    @property
    def moved(self) -> int:
        """Bytes to the accelerator and back in the step (accumulators included)."""
        return self.plan.moved


def price(
    trace: Trace,
    budget: int,
    costs: ChunkCosts,
    on_device: AbstractSet[int],
    resident: AbstractSet[int],
    compute_s: Sequence[float],
    profile: DeviceProfile,
    overlap: HostOverlap,
    distance: int = 1,
    order: EvictionOrder = EvictionOrder.BELADY,
    activations: ActivationMoves = NO_ACTIVATION_MOVES,
) -> StateChoice:
    """The steady-state step with the states of ``on_device`` on the accelerator, prefetching ``distance``
    moments ahead, evicting in ``order``, beside the offloaded ``activations``' copies (see [Note: optimizer
    states by step time]): two iterations of the moves from ``resident``, the second priced."""
    trace = with_step_chunks(trace, tuple(sorted(on_device)))
    fixed = sum(OPTIM_BYTES_PER_ELEMENT * costs.capacities[c] for c in on_device)
    host = {c: n for c, n in costs.elements.items() if c not in on_device}
    plan = steady_moves(trace, budget, costs, fixed, resident, on_device, distance, order)
    device = sum(costs.elements[c] for c in on_device)
    step = predict_step(trace, plan, compute_s, host, device, profile, overlap, activations)
    return StateChoice(frozenset(on_device), step, plan, distance, order)


def choose_moves(
    trace: Trace,
    budget: int,
    costs: ChunkCosts,
    placed: StateChoice,
    resident: AbstractSet[int],
    compute_s: Sequence[float],
    profile: DeviceProfile,
    overlap: HostOverlap,
    activations: ActivationMoves = NO_ACTIVATION_MOVES,
    pricer: Pricer | None = None,
) -> StateChoice:
    """``placed`` (priced one moment ahead, in the order its states were searched in) at the prefetch distance
    and in the eviction order the step-time model prefers: see [Note: prefetch distance] and [Note: eviction
    order] in eviction_queue.py (free evictions first only where some eviction can be free). ``pricer``: the
    prices made so far for these arguments (None: none)."""
    of = pricer or Pricer(trace, budget, costs, resident, compute_s, profile, overlap, activations)
    candidates = [
        of(placed.on_device, distance, order)
        for distance in range(1, MAX_DISTANCE + 1)
        for order in eviction_orders(costs)
        if (distance, order) != (placed.distance, placed.order)
    ]
    return best_of([placed, *candidates])


def eviction_orders(costs: ChunkCosts) -> list[EvictionOrder]:
    """The eviction orders worth pricing: free evictions first only where some can be free (see [Note: eviction
    order] in eviction_queue.py), accumulators kept only where there are accumulators (see [Note: accumulators
    kept] there)."""
    orders = [EvictionOrder.BELADY]
    if costs.clean_copies or costs.uncopied:
        orders.append(EvictionOrder.FREE_FIRST)
    if costs.accumulators:
        orders += [EvictionOrder(order + EvictionOrder.BELADY_KEEPING_ACCUMULATORS) for order in orders]
    return orders


class Pricer:
    """:func:`price` for one trace, resident set, moment times and activation copies, each candidate priced once
    (a search, its local moves and the moves' choices share it; see [Note: the planner's cost])."""

    def __init__(
        self,
        trace: Trace,
        budget: int,
        costs: ChunkCosts,
        resident: AbstractSet[int],
        compute_s: Sequence[float],
        profile: DeviceProfile,
        overlap: HostOverlap,
        activations: ActivationMoves = NO_ACTIVATION_MOVES,
    ) -> None:
        self.trace, self.budget, self.costs, self.resident = trace, budget, costs, resident
        self.compute_s, self.profile, self.overlap, self.activations = compute_s, profile, overlap, activations
        self.priced: dict[tuple[frozenset[int], int, EvictionOrder], StateChoice] = {}

    def __call__(
        self, on_device: AbstractSet[int], distance: int = 1, order: EvictionOrder = EvictionOrder.BELADY
    ) -> StateChoice:
        key = (frozenset(on_device), distance, order)
        if key not in self.priced:
            args = (self.trace, self.budget, self.costs, key[0], self.resident, self.compute_s, self.profile)
            self.priced[key] = price(*args, self.overlap, distance, order, self.activations)
        return self.priced[key]

    def in_order(self, order: EvictionOrder) -> Callable[[frozenset[int]], StateChoice]:
        """Candidates priced one moment ahead in ``order``."""
        return lambda chunks: self(chunks, 1, order)


def choose_states(
    trace: Trace,
    budget: int,
    costs: ChunkCosts,
    fill: Sequence[int],
    resident: AbstractSet[int],
    compute_s: Sequence[float],
    profile: DeviceProfile,
    overlap: HostOverlap,
    order: EvictionOrder = EvictionOrder.BELADY,
    activations: ActivationMoves = NO_ACTIVATION_MOVES,
) -> StateChoice:
    """Of ``fill`` (the chunks the fill rule places, in its order), the states placed by the predicted step with
    evictions in ``order``: the best prefix, then local moves from it (where the trace is small enough); see
    [Note: optimizer states by step time]."""
    of = Pricer(trace, budget, costs, resident, compute_s, profile, overlap, activations).in_order(order)
    return search_states(fill, of, local_moves_fit(costs, trace))


def search_states(fill: Sequence[int], of: Callable[[frozenset[int]], StateChoice], local: bool) -> StateChoice:
    """The best of ``fill``'s prefixes (see :func:`_search`), then, with ``local``, local moves from it."""
    best = _search(len(fill), lambda k: of(frozenset(fill[:k])))
    return _improve(best, fill, of) if local else best


def local_moves_fit(costs: ChunkCosts, trace: Trace) -> bool:
    """Whether a search's local moves are worth their replays here (see :data:`LOCAL_WORK`)."""
    return len(costs.sizes) * len(trace) <= LOCAL_WORK


def _search(most: int, at: Callable[[int], StateChoice]) -> StateChoice:
    """The best of ``at(0..most)`` (:func:`best_of`): all of them up to ``2 * GRID``, else a grid, then halving
    the step around its best."""
    if most <= 2 * GRID:
        return best_of([at(k) for k in range(most + 1)])
    best = best_of([at(k) for k in sorted({round(i * most / (GRID - 1)) for i in range(GRID)})])
    step = max(1, most // (GRID - 1))
    while step > 1:
        step = (step + 1) // 2
        k = len(best.on_device)
        best = best_of([at(j) for j in (k - step, k, k + step) if 0 <= j <= most])
    return best


def _improve(best: StateChoice, fill: Sequence[int], of: Callable[[frozenset[int]], StateChoice]) -> StateChoice:
    """Up to :data:`ROUNDS` rounds of local moves from ``best`` where one is better: taking one chunk's states
    off, adding one of ``fill``'s, or swapping one for another (a prefix may keep the one chunk whose room the
    payloads need most); a round prices at most :data:`NEIGHBOURS` candidates (swaps only where they fit in)."""
    for _ in range(ROUNDS):
        chosen = best.on_device
        out = [c for c in fill if c not in chosen]
        moves = [chosen - {c} for c in sorted(chosen)] + [chosen | {c} for c in out]
        if len(moves) + len(chosen) * len(out) <= NEIGHBOURS:
            moves += [(chosen - {a}) | {b} for a in sorted(chosen) for b in out]
        if len(moves) > NEIGHBOURS:
            break
        better = best_of([best, *(of(frozenset(m)) for m in moves)])
        if better is best:
            break
        best = better
    return best


def best_of(choices: Sequence[StateChoice]) -> StateChoice:
    """The fastest of ``choices``, where predicted steps within :data:`TIE` of the fastest are a tie (the model
    is not that exact): of those, the fewest bytes moved, then the most states on the accelerator, then the
    shortest prefetch distance, then Belady's eviction order. A choice whose moves go over the budget somewhere
    only where every one does."""
    choices = [c for c in choices if not c.plan.over_budget] or choices
    fastest = min(c.step.total_s for c in choices)
    tied = [c for c in choices if c.step.total_s <= fastest * (1 + TIE)]
    return min(tied, key=lambda c: (c.moved, -len(c.on_device), c.distance, c.order))


def with_step_chunks(trace: Trace, chunks: tuple[int, ...]) -> Trace:
    """A copy of ``trace`` whose step moment uses ``chunks`` (the trace itself when it already does; a step moment
    added where the trace has none yet: the iteration being traced, at its step, see [Note: first steps])."""
    index = next((i for i, m in enumerate(trace.moments) if m.label == "step"), None)
    if index is not None and trace.moments[index].chunks == chunks:
        return trace
    copy = trace.copy()
    if index is None:
        copy.add(Moment("step", chunks, 0))
    else:
        copy.replace_chunks(index, chunks)
    return copy


class StateChooser:
    """The rule of [Note: optimizer states by step time] for one run: its budget, chunks, profile and whether
    the host Adam overlaps the forward, and the run's bytes floor (logged beside the choice)."""

    def __init__(
        self, budget: int, costs: ChunkCosts, profile: DeviceProfile, overlap: HostOverlap, floor: FloorMeter
    ) -> None:
        self.budget, self.costs, self.profile, self.overlap, self.floor = budget, costs, profile, overlap, floor
        self._made: dict[tuple, StateChoice] = {}  # the latest calls' choices, by their arguments
        self._pricers: dict[tuple, Pricer] = {}  # the latest calls' prices, by what prices depend on

    def __call__(
        self,
        trace: Trace,
        fill: set[int],
        resident: AbstractSet[int],
        compute_s: Sequence[float],
        activations: ActivationMoves = NO_ACTIVATION_MOVES,
        thorough: bool = True,
    ) -> StateChoice:
        """Of ``fill`` (the chunks the fill rule places), those whose states live on the accelerator, the
        prefetch distance and the eviction order (see [Note: prefetch distance], [Note: eviction order]), beside
        the offloaded ``activations``' copies: the best prefix in each eviction order, with ``thorough`` then local
        moves from each (see [Note: the planner's cost]). A call with
        an earlier call's arguments returns its choice, and one with the same trace, resident chunks, times and
        copies reuses its prices: a plan prices the states on the tide it keeps before placing them (see [Note:
        activations offloaded for optimizer states] in states_room.py)."""
        context = (tuple(trace.moments), frozenset(resident), tuple(compute_s), activations.key, self.overlap)
        key = (context, frozenset(fill), thorough)
        if key in self._made:
            return self._made[key]
        of = self._pricer(context, trace, activations)
        fill_order, local = sorted(fill), thorough and local_moves_fit(self.costs, trace)
        placed = best_of(
            [search_states(fill_order, of.in_order(order), local) for order in eviction_orders(self.costs)]
        )
        self._log_states(of, placed, fill_order)
        args, rates = (self.budget, self.costs), (self.profile, self.overlap)
        choice = choose_moves(trace, *args, placed, resident, compute_s, *rates, activations, pricer=of)
        logger.info(
            "ds_patrickstar: prefetch %d moment(s) ahead, %s eviction order, by the step-time model: predicted "
            "step %.4f s, %d B moved (one moment ahead, %s: %.4f s, %d B; no placement moves under %d B)",
            choice.distance,
            choice.order.label,
            choice.step.total_s,
            choice.moved,
            placed.order.label,
            placed.step.total_s,
            placed.moved,
            self.floor.update(trace),  # see [Note: the bytes floor]
        )
        if len(self._made) >= MADE:
            self._made.clear()
        self._made[key] = choice
        return choice

    def _pricer(self, context: tuple, trace: Trace, activations: ActivationMoves) -> Pricer:
        """The prices made so far for ``context``: the trace's moments, resident chunks, times, copies' key."""
        if context not in self._pricers:
            if len(self._pricers) >= MADE:
                self._pricers.clear()
            resident, compute_s, rates = context[1], context[2], (self.profile, self.overlap)
            self._pricers[context] = Pricer(trace, self.budget, self.costs, resident, compute_s, *rates, activations)
        return self._pricers[context]

    def _log_states(self, of: Pricer, placed: StateChoice, fill: list[int]) -> None:
        if logger.isEnabledFor(logging.DEBUG):
            for (chunks, distance, order), c in sorted(of.priced.items(), key=lambda item: sorted(item[0][0])):
                args = (sorted(chunks), distance, order.label, c.step.total_s, c.moved)
                logger.debug("ds_patrickstar: states of %s (%d ahead, %s): %.6f s, %d B moved", *args)
        every = of(frozenset(fill), 1, placed.order)
        logger.info(
            "ds_patrickstar: optimizer states of %d of %d chunk(s) on the accelerator by the step-time model (%s "
            "eviction order): predicted step %.4f s, %d B moved (all %d that fit: %.4f s, %d B)",
            len(placed.on_device),
            len(self.costs.elements),
            placed.order.label,
            placed.step.total_s,
            placed.moved,
            len(fill),
            every.step.total_s,
            every.moved,
        )
