"""The optimizer states the step-time model places on the accelerator (see [Note: optimizer states by step time]):
fewer than fit where their room keeps payloads from a round trip, all that fit where the host Adam would be
exposed, the choice against every subset on small traces, the search over many candidates, and on the strict
twin fewer bytes moved than the fill rule with the same losses."""
import itertools
import random
from dataclasses import replace

import pytest
from counter_runs import CASES, run_case, train_case
from multiproc import run_ranks

from ds_patrickstar.placement.move_model import MovePlan
from ds_patrickstar.placement.planner import states_on_device
from ds_patrickstar.placement.state_choice import (
    TIE,
    ChunkCosts,
    StateChoice,
    _search,
    choose_states,
    eviction_orders,
    price,
)
from ds_patrickstar.placement.step_time import H100_PROFILE, DeviceProfile, StepTime
from ds_patrickstar.placement.trace import Moment, Trace


def _model_trace(chunks: int, tide_per_layer: int) -> Trace:
    """A forward over ``chunks`` layers (one chunk each), the backward in reverse, the step; the tide rises by
    ``tide_per_layer`` per layer in forward and stays until the layer's backward."""
    trace = Trace()
    for i in range(chunks):
        trace.add(Moment(f"fwd:{i}", (i,), tide_per_layer * (i + 1)))
    for i in reversed(range(chunks)):
        trace.add(Moment(f"bwd:{i}", (i,), tide_per_layer * (i + 1)))
    trace.add(Moment("step", (), 0))
    return trace


def _fill_and_costs(trace: Trace, elements: dict[int, int], budget: int) -> tuple[list[int], ChunkCosts]:
    sizes = {c: 2 * n for c, n in elements.items()}
    needs = [max(sizes.values())] * len(trace)
    fill = states_on_device(trace, budget, "auto", needs, max(sizes.values()), elements)
    return sorted(fill), ChunkCosts(sizes, elements, elements)


E = 1_000_000
LAYERS = 8
TRACE = _model_trace(LAYERS, int(0.05 * LAYERS * 14 * E))
BUDGET = LAYERS * 14 * E  # the model data's size: the tide leaves room for some states, or for the payloads
COMPUTE = [1e-4] * (2 * LAYERS) + [0.0]


def test_states_give_their_room_to_payloads_where_that_saves_round_trips():
    elements = dict.fromkeys(range(LAYERS), E)
    fill, costs = _fill_and_costs(TRACE, elements, BUDGET)
    chosen = choose_states(TRACE, BUDGET, costs, fill, set(), COMPUTE, H100_PROFILE, overlap=True)
    every = price(TRACE, BUDGET, costs, set(fill), set(), COMPUTE, H100_PROFILE, overlap=True)
    assert len(chosen.on_device) < len(fill)
    assert chosen.moved < every.moved  # the fill rule's states push payloads out and back every iteration
    assert chosen.step.total_s < every.step.total_s


def test_states_stay_where_the_host_adam_would_be_exposed():
    slow_host = DeviceProfile(54e9, 54e9, host_adam_elements_per_s=1e6, device_adam_elements_per_s=9e10)
    elements = dict.fromkeys(range(LAYERS), E)
    fill, costs = _fill_and_costs(TRACE, elements, BUDGET)
    chosen = choose_states(TRACE, BUDGET, costs, fill, set(), COMPUTE, slow_host, overlap=True)
    assert sorted(chosen.on_device) == fill


def _random_case(rng: random.Random) -> tuple[Trace, dict[int, int], int, DeviceProfile, list[float]]:
    layers = rng.randint(3, 6)
    elements = {i: rng.choice([1000, 2000, 4000]) for i in range(layers)}
    trace, tide = Trace(), 0
    for i in range(layers):
        tide += rng.randint(0, 6000)
        trace.add(Moment(f"fwd:{i}", (i,), tide))
    for i in reversed(range(layers)):
        trace.add(Moment(f"bwd:{i}", (i,), tide))
        tide = max(0, tide - rng.randint(0, 6000))
    trace.add(Moment("step", (), 0))
    budget = int(sum(14 * n for n in elements.values()) * rng.uniform(0.4, 1.2))
    rates = [1e3, 1e4, 1e5]
    profile = DeviceProfile(rng.choice(rates), rng.choice(rates), rng.choice([1e2, 1e3, 1e4]), 1e5)
    return trace, elements, budget, profile, [rng.choice([0.0, 0.01, 0.1])] * (2 * layers) + [0.0]


def test_the_choice_against_every_subset_on_small_traces():
    rng, compared = random.Random(0), 0
    for _ in range(60):
        trace, elements, budget, profile, compute = _random_case(rng)
        fill, costs = _fill_and_costs(trace, elements, budget)
        if not fill:
            continue
        chosen = choose_states(trace, budget, costs, fill, set(), compute, profile, overlap=True)
        subsets = (set(s) for k in range(len(fill) + 1) for s in itertools.combinations(fill, k))
        best = min(price(trace, budget, costs, s, set(), compute, profile, True).step.total_s for s in subsets)
        assert chosen.step.total_s <= best * (1 + TIE) + 1e-12, (fill, sorted(chosen.on_device))
        compared += 1
    assert compared >= 40


def _with_several_ranks(rng: random.Random, trace: Trace, elements: dict[int, int]) -> Trace:
    """``trace`` as one rank of several with gradient accumulation reads it (see [Note: predicted moves]): model
    data it does not move beside its chunks at each moment, and an owned accumulator per chunk from its backward
    moment, gone when the completion is reaped up to two moments later; for half the chunks its boundary collective
    is noted there (the others' sums are written at the step, as unmanaged accumulation does)."""
    out, moments = Trace(), trace.moments
    gone = {i: min(len(moments) - 1, len(moments) - 2 - i + rng.randint(0, 2)) for i in elements}
    folded = {i for i in elements if rng.random() < 0.5}
    for index, moment in enumerate(moments):
        born = frozenset(moment.chunks) if moment.label.startswith("bwd:") else frozenset()
        gone_now = frozenset(i for i, at in gone.items() if at == index and i in folded)
        if moment.label == "step":
            gone_now = frozenset(elements.keys() - {i for i, at in gone.items() if at < index and i in folded})
        out.add(replace(moment, beside=rng.randint(0, 3000), acc_born=born, acc_folding=born & folded,
                        acc_gone=gone_now))
    return out


def test_the_choice_against_every_subset_with_what_several_ranks_add():
    """The same search on traces as a rank of several with gradient accumulation reads them: the model data it does
    not move, and accumulators folded by their boundary collectives or kept to the step (payloads and accumulators
    in every eviction order), chunks of one size: the choice within the tie of the best subset whose moves stay in
    the budget (as :func:`best_of` ranks them)."""
    rng, compared = random.Random(1), 0
    for _ in range(40):
        trace, elements, budget, profile, compute = _random_case(rng)
        elements = dict.fromkeys(elements, rng.choice([1000, 2000, 4000]))  # one capacity, as a run's chunks
        trace = _with_several_ranks(rng, trace, elements)
        fill, costs = _fill_and_costs(trace, elements, budget)
        if not fill:
            continue
        costs = replace(costs, accumulators={c: 4 * n for c, n in elements.items()})
        for order in eviction_orders(costs):
            chosen = choose_states(trace, budget, costs, fill, set(), compute, profile, True, order)
            subsets = (set(s) for k in range(len(fill) + 1) for s in itertools.combinations(fill, k))
            priced = [price(trace, budget, costs, s, set(), compute, profile, True, 1, order) for s in subsets]
            best = min(p.step.total_s for p in [p for p in priced if not p.plan.over_budget] or priced)
            assert chosen.step.total_s <= best * (1 + TIE) + 1e-12, (order, fill, sorted(chosen.on_device))
            compared += 1
    assert compared >= 40


def _fake(k: int, seconds: float, moved: int) -> StateChoice:
    return StateChoice(frozenset(range(k)), StepTime(seconds, 0.0, 0.0), MovePlan([moved], [0], [0]))


@pytest.mark.parametrize("optimum", [0, 7, 41, 100, 163, 200])
def test_the_search_over_many_candidates_finds_the_best_prefix(optimum):
    priced: list[int] = []

    def at(k: int) -> StateChoice:
        priced.append(k)
        return _fake(k, 1.0 + abs(k - optimum) / 10, 0)

    assert len(_search(200, at).on_device) == optimum
    assert len(set(priced)) < 40  # a grid and a few halvings, not every prefix


def test_predicted_steps_within_the_tie_go_to_fewer_bytes_then_more_states():
    choices = {k: _fake(k, s, m) for k, s, m in [(0, 1.000, 90), (1, 1.005, 50), (2, 1.010, 50), (3, 1.5, 0)]}
    assert len(_search(3, choices.__getitem__).on_device) == 2


def test_on_the_twin_the_time_rule_moves_fewer_bytes_than_fill_with_the_same_losses():
    case = CASES["twin_1rank_device_adam"]
    fill_case = {**case, "zero": {**case["zero"], "optimizer_placement": "fill"}}
    fill = run_ranks(train_case, 1, fill_case, timeout=240.0)[0]["steps"]
    timed = run_case("twin_1rank_device_adam")[0]["steps"]
    assert [s["losses"] for s in timed] == [s["losses"] for s in fill]
    last = {name: steps[-1]["counters"] for name, steps in (("fill", fill), ("time", timed))}
    moved = {name: c["bytes_to_device"] + c["bytes_to_host"] for name, c in last.items()}
    assert moved["time"] < moved["fill"]
    assert last["time"]["adam_chunks_device"] < last["fill"]["adam_chunks_device"]
    assert last["time"]["grads_released_in_backward"] > 0  # host-updated chunks left during backward
    for c in last.values():  # the move model's prediction is what the twin moved
        assert (c["predicted_bytes_to_device"], c["predicted_bytes_to_host"]) == (c["bytes_to_device"],
                                                                                 c["bytes_to_host"])


def test_with_gradient_accumulation_the_time_rule_moves_fewer_bytes_than_fill_as_predicted():
    """GA 2 on one rank (see [Note: predicted moves]): the accumulators come and go where the trace recorded and
    move with their chunks; the time rule's states move fewer bytes, accumulators included, with the same losses."""
    case = {"world": 1, "ga": 2, "zero": {"device_budget": 640_000}}
    fill_case = {**case, "zero": {**case["zero"], "optimizer_placement": "fill"}}
    timed = run_ranks(train_case, 1, case, timeout=240.0)[0]["steps"]
    fill = run_ranks(train_case, 1, fill_case, timeout=240.0)[0]["steps"]
    assert [s["losses"] for s in timed] == [s["losses"] for s in fill]
    last = {name: steps[-1]["counters"] for name, steps in (("fill", fill), ("time", timed))}
    ways = ("bytes_to_device", "bytes_to_host", "accumulator_bytes_to_device", "accumulator_bytes_to_host")
    moved = {name: sum(c[way] for way in ways) for name, c in last.items()}
    assert moved["time"] < 0.5 * moved["fill"]
    for c in last.values():
        assert all(c[f"predicted_{way}"] == c[way] for way in ways), c
    assert last["fill"]["accumulator_bytes_to_host"] > 0  # the fill rule's evictions carry accumulators
