"""The bytes floor (see [Note: the bytes floor]): never above what a plan that fits moves, on small random traces
at every state subset, prefetch distance and eviction order; reached where the room holds every payload and a
whole number of states; the round trip's way out left out for a chunk no gradient went into; with gradient
accumulation, the accumulators held between their first gradient and the boundary (in every eviction order,
accumulators kept or not), and one away counted out and back where the payloads a moment does not use are too few
for its shortfall; at several ranks, the storage the groups a moment uses are gathered into."""

import itertools
import random

from ds_patrickstar.placement.bytes_floor import bytes_floor
from ds_patrickstar.placement.chunk_costs import ChunkCosts
from ds_patrickstar.placement.eviction_queue import EvictionOrder
from ds_patrickstar.placement.move_model import steady_moves
from ds_patrickstar.placement.planner import states_on_device
from ds_patrickstar.placement.state_choice import eviction_orders
from ds_patrickstar.placement.trace import Moment, Trace

E = 1000


def _trace(layers: int, tides: list[int], written: bool = True) -> Trace:
    """A forward over ``layers`` (one chunk each), the backward in reverse writing each chunk's gradient, the step."""
    trace = Trace()
    for i in range(layers):
        trace.add(Moment(f"fwd:{i}", (i,), tides[i]))
    for i in reversed(range(layers)):
        trace.add(Moment(f"bwd:{i}", (i,), tides[i], written=frozenset({i}) if written else frozenset()))
    trace.add(Moment("step", (), 0))
    return trace


def _random_case(rng: random.Random) -> tuple[Trace, ChunkCosts, int]:
    layers = rng.randint(3, 5)
    elements = {i: rng.choice([E, 2 * E, 4 * E]) for i in range(layers)}
    tides, tide = [], 0
    for _ in range(layers):
        tide += rng.randint(0, 6 * E)
        tides.append(tide)
    frozen = {c for c in elements if rng.random() < 0.25}
    trainable = {c: n for c, n in elements.items() if c not in frozen}
    costs = ChunkCosts({c: 2 * n for c, n in elements.items()}, trainable, trainable, clean_copies=rng.random() < 0.5)
    budget = int(sum(14 * n for n in elements.values()) * rng.uniform(0.3, 1.1))
    return _trace(layers, tides), costs, budget


def test_no_plan_that_fits_moves_fewer_bytes_than_the_floor():
    rng, compared = random.Random(0), 0
    for _ in range(40):
        trace, costs, budget = _random_case(rng)
        needs = [max(costs.sizes.values())] * len(trace)
        fill = sorted(states_on_device(trace, budget, "auto", needs, max(costs.sizes.values()), costs.capacities))
        floor = bytes_floor(trace, budget, costs)
        orders = [EvictionOrder.BELADY, EvictionOrder.FREE_FIRST] if costs.clean_copies else [EvictionOrder.BELADY]
        for k in range(len(fill) + 1):
            for on_device in itertools.combinations(fill, k):
                fixed = sum(12 * costs.capacities[c] for c in on_device)
                for distance, order in itertools.product(range(1, 4), orders):
                    plan = steady_moves(trace, budget, costs, fixed, set(), set(on_device), distance, order)
                    if plan.over_budget:
                        continue
                    assert plan.moved >= floor, (sorted(on_device), distance, order, plan.moved, floor)
                    compared += 1
    assert compared >= 300


def _four_layers() -> tuple[int, int, Trace, ChunkCosts, int]:
    """Four 1,000-element layers beside a flat 10 kB tide, with a budget for every payload and one chunk's states."""
    layers, tide = 4, 10 * E
    elements = dict.fromkeys(range(layers), E)
    costs = ChunkCosts({c: 2 * E for c in elements}, elements, elements)
    return layers, tide, _trace(layers, [tide] * layers), costs, tide + layers * 2 * E + 12 * E


def test_the_floor_is_reached_where_payloads_and_whole_states_fit():
    layers, tide, trace, costs, budget = _four_layers()
    floor = bytes_floor(trace, budget, costs)
    assert floor == (layers - 1) * 4 * E  # three chunks' round trips
    plan = steady_moves(trace, budget, costs, 12 * E, set(), {0})
    assert (plan.moved, plan.over_budget) == (floor, False)
    # half a chunk's states more room: the relaxation spares half a round trip, no plan does
    assert bytes_floor(trace, budget + 6 * E, costs) == floor - 2 * E
    # no room for the payloads beside the tide: every byte short is brought back once more, at the least
    assert bytes_floor(trace, tide + 6 * E, costs) == layers * 4 * E + 2 * E


def test_at_several_ranks_the_storage_a_moment_gathers_takes_its_room():
    """The gathered storage of the groups a moment uses stands beside the tide (not the step's, which gathers
    nothing): less room for states, so a higher floor, by at most the round trips the lost room spared."""
    _, _, trace, costs, budget = _four_layers()
    alone = bytes_floor(trace, budget, costs)
    gathered = bytes_floor(trace, budget, costs, lambda moment: 2 * E if moment.label != "step" else 10**9)
    assert alone < gathered <= alone + 4 * E * 2 * E // (12 * E) + 1, (alone, gathered)


def test_a_chunk_no_gradient_went_into_goes_back_for_nothing_with_clean_evictions():
    layers, tide = 3, 10 * E
    trace = _trace(layers, [tide] * layers, written=False)
    elements = dict.fromkeys(range(layers), E)
    budget = tide + layers * 2 * E
    copies = ChunkCosts({c: 2 * E for c in elements}, elements, elements, clean_copies=True)
    assert bytes_floor(trace, budget, copies) == layers * 2 * E
    plain = ChunkCosts({c: 2 * E for c in elements}, elements, elements)
    assert bytes_floor(trace, budget, plain) == layers * 4 * E


def _trace_ga(layers: int, tides: list[int]) -> Trace:
    """Two micro-steps of :func:`_trace`'s shape: each chunk's accumulator comes into being at its first backward
    moment and goes at its boundary backward moment (as the traced iteration records them at one rank)."""
    trace = Trace()
    for micro in range(2):
        for i in range(layers):
            trace.add(Moment(f"fwd:{i}", (i,), tides[i]))
        for i in reversed(range(layers)):
            born = frozenset({i}) if micro == 0 else frozenset()
            gone = frozenset({i}) if micro == 1 else frozenset()
            trace.add(Moment(f"bwd:{i}", (i,), tides[i], written=gone, acc_born=born, acc_gone=gone))
    trace.add(Moment("step", (), 0))
    return trace


def test_with_accumulation_no_plan_that_fits_moves_fewer_bytes_than_the_floor():
    rng, compared, raised = random.Random(1), 0, 0
    for _ in range(25):
        _, costs, budget = _random_case(rng)
        layers = len(costs.sizes)
        tides, tide = [], 0
        for _ in range(layers):
            tide += rng.randint(0, 6 * E)
            tides.append(tide)
        trace = _trace_ga(layers, tides)
        accumulated = ChunkCosts(
            costs.sizes,
            costs.elements,
            costs.capacities,
            clean_copies=costs.clean_copies,
            accumulators={c: 2 * n for c, n in costs.sizes.items() if c in costs.elements},
        )
        floor = bytes_floor(trace, budget, accumulated)
        raised += floor > bytes_floor(trace, budget, costs)
        needs = [max(costs.sizes.values()) * 3] * len(trace)
        fill = sorted(states_on_device(trace, budget, "auto", needs, max(costs.sizes.values()), costs.capacities))
        for k in range(len(fill) + 1):
            for on_device in itertools.combinations(fill, k):
                fixed = sum(12 * costs.capacities[c] for c in on_device)
                for distance, order in itertools.product((1, 2), eviction_orders(accumulated)):
                    plan = steady_moves(trace, budget, accumulated, fixed, set(), set(on_device), distance, order)
                    if not plan.over_budget:
                        assert plan.moved >= floor, (sorted(on_device), distance, order, plan.moved, floor)
                        compared += 1
    assert compared >= 200 and raised >= 5


def test_an_accumulator_away_counts_its_bytes_out_and_back():
    layers, tide = 3, 10 * E
    trace = _trace_ga(layers, [tide] * layers)
    elements = dict.fromkeys(range(layers), E)
    costs = ChunkCosts({c: 2 * E for c in elements}, elements, elements, accumulators=dict.fromkeys(elements, 4 * E))
    # the second micro-step holds 6E of payloads and 12E of accumulators beside the tide: 10E must be away, of
    # which the 4E of payloads its moment does not use come back once, the 6E of accumulators go out and back
    budget = tide + 8 * E
    floor = bytes_floor(trace, budget, costs)
    assert floor == layers * 4 * E + 4 * E + 2 * 6 * E
    plan = steady_moves(trace, budget, costs, 0, set(), set())
    assert not plan.over_budget and plan.moved >= floor, (plan.moved, floor)
