"""The eviction order (see [Note: eviction order]): the queue takes the chunks whose eviction copies nothing first
and notices a write since; on small traces each order wins somewhere and the planner keeps the one the step-time
model prices faster; on the strict twin the planner chooses free evictions first where they save copies, and the
driver moves exactly the bytes the replay predicts, with the losses of Belady's order. With gradient accumulation
the same for the orders that keep accumulators on the accelerator when their payloads go (see [Note: accumulators
kept])."""
from counter_runs import CASES, train_case
from multiproc import run_ranks
from test_bytes_floor import _trace_ga

from ds_patrickstar.placement.eviction_queue import EvictionOrder, EvictionQueue, accumulator_key
from ds_patrickstar.placement.replay import Replay
from ds_patrickstar.placement.state_choice import ChunkCosts, choose_moves, price
from ds_patrickstar.placement.step_time import DeviceProfile
from ds_patrickstar.placement.trace import Moment, Trace

SLOW = DeviceProfile(to_device_bytes_per_s=1.0, to_host_bytes_per_s=1.0, host_adam_elements_per_s=1.0,
                     device_adam_elements_per_s=1.0)  # seconds are bytes


def test_the_queue_takes_free_evictions_first_and_notices_a_write():
    clean = {1, 3}
    queue = EvictionQueue(free=lambda c: c in clean)
    for chunk, next_use in ((0, 10), (1, 5), (2, 8), (3, 1)):
        queue.push(chunk, -next_use)  # farthest next use: lowest priority, evicted first
    assert queue.take(2, lambda c: 1) == [1, 3]  # free ones first, farthest first among them
    for chunk, next_use in ((1, 5), (3, 1)):
        queue.push(chunk, -next_use)
    clean.discard(1)  # a gradient went into chunk 1 since it was pushed: its eviction copies now
    assert queue.take(1, lambda c: 1) == [3]
    assert queue.take(2, lambda c: 1) == [0, 2]  # then farthest next use first: 0, 2 (chunk 1 is used sooner)
    assert queue.take_below(1, lambda c: 1, -6) is None  # chunk 1's next use (5) is not after moment 6
    queue.reorder(None)  # Belady's order alone
    queue.push(3, -1)
    assert queue.take(2, lambda c: 1) == [1, 3]


def test_accumulators_whose_payload_is_away_go_after_every_payload():
    queue = EvictionQueue()
    queue.push(accumulator_key(0), -100)  # farthest next use of all, yet last
    for chunk, next_use in ((1, 5), (2, 8)):
        queue.push(chunk, -next_use)
    assert accumulator_key(accumulator_key(0)) == 0
    assert queue.take(3, lambda c: 1) == [2, 1, accumulator_key(0)]


def _trace(uses: list[tuple[int, bool]]) -> Trace:
    """One chunk a moment (``(chunk, whether its gradients go into it)``), then the step."""
    trace = Trace()
    for index, (chunk, written) in enumerate(uses):
        trace.add(Moment(f"m{index}", (chunk,), 0, written=frozenset({chunk}) if written else frozenset()))
    trace.add(Moment("step", (), 0))
    return trace


# four chunks of 4 B that keep the host buffer they came from (frozen: across the step too), room for three
COSTS = ChunkCosts(sizes={c: 4 for c in range(4)}, elements={}, capacities={}, clean_copies=True)
FREE_WINS = _trace([(1, False), (2, True), (0, False), (3, True)])
BELADY_WINS = _trace([(1, False), (3, False), (0, True), (3, False), (2, False)])


def _priced(trace: Trace, order: EvictionOrder, costs: ChunkCosts = COSTS):
    return price(trace, 12, costs, frozenset(), set(), [0.0] * len(trace), SLOW, False, 1, order)


def test_each_order_wins_on_some_trace_and_the_planner_keeps_the_faster():
    belady, free = _priced(FREE_WINS, EvictionOrder.BELADY), _priced(FREE_WINS, EvictionOrder.FREE_FIRST)
    # Belady sends chunk 2 (written, used again last) out with a copy; free-first sends chunk 1 (clean) instead
    assert (belady.plan.bytes_to_device, belady.plan.bytes_to_host) == (8, 8)
    assert (free.plan.bytes_to_device, free.plan.bytes_to_host) == (8, 4)
    assert free.step.total_s < belady.step.total_s
    assert choose_moves(FREE_WINS, 12, COSTS, belady, set(), [0.0] * 5, SLOW, False).order is EvictionOrder.FREE_FIRST
    belady, free = _priced(BELADY_WINS, EvictionOrder.BELADY), _priced(BELADY_WINS, EvictionOrder.FREE_FIRST)
    # free-first sends out the clean chunk needed next: it comes back at once
    assert (belady.plan.bytes_to_device, free.plan.bytes_to_device) == (4, 8)
    assert choose_moves(BELADY_WINS, 12, COSTS, belady, set(), [0.0] * 6, SLOW, False).order is EvictionOrder.BELADY


def test_states_searched_in_free_first_order_still_get_belady_priced_one_moment_ahead():
    """The states may come from the search in free-first order: the choice still prices Belady's at distance 1."""
    placed = _priced(BELADY_WINS, EvictionOrder.FREE_FIRST)
    chosen = choose_moves(BELADY_WINS, 12, COSTS, placed, set(), [0.0] * 6, SLOW, False)
    assert (chosen.order, chosen.distance) == (EvictionOrder.BELADY, 1)
    assert chosen.step.total_s < placed.step.total_s


def test_without_free_evictions_only_belady_is_priced():
    """No kept host buffers and no chunk on disk: every eviction copies, the two orders are the same one."""
    costs = ChunkCosts(sizes=COSTS.sizes, elements={}, capacities={})
    belady = _priced(FREE_WINS, EvictionOrder.BELADY, costs)
    assert choose_moves(FREE_WINS, 12, costs, belady, set(), [0.0] * 5, SLOW, False).order is EvictionOrder.BELADY


def test_keeping_accumulators_wins_at_some_budgets_and_loses_at_others():
    """Three layers, GA 2: 2 kB payloads that keep the copy they came from, 4 kB accumulators, no tide."""
    trace, chunks = _trace_ga(3, [0, 0, 0]), range(3)
    elements = dict.fromkeys(chunks, 1000)
    costs = ChunkCosts(sizes=dict.fromkeys(chunks, 2000), elements=elements, capacities=elements, clean_copies=True,
                       accumulators=dict.fromkeys(chunks, 4000))
    for budget, wins in ((10_000, True), (12_000, False)):
        priced = {order: price(trace, budget, costs, frozenset(), set(), [0.0] * len(trace), SLOW, False, 1, order)
                  for order in (EvictionOrder.BELADY, EvictionOrder.BELADY_KEEPING_ACCUMULATORS)}
        belady, kept = (priced[o].moved for o in priced)
        # 10 kB: the second forward sends payloads out for free where Belady sends accumulators out and back
        assert (belady, kept) == ((52_000, 38_000) if wins else (32_000, 34_000))
        chosen = choose_moves(trace, budget, costs, priced[EvictionOrder.BELADY], set(), [0.0] * len(trace), SLOW,
                              False)
        assert chosen.order.keeps_accumulators is wins and chosen.moved == min(belady, kept)


def test_a_clean_payload_whose_accumulator_would_go_along_is_not_a_free_eviction():
    trace = _trace_ga(1, [0])
    for order, free in ((EvictionOrder.FREE_FIRST, False), (EvictionOrder.FREE_FIRST_KEEPING_ACCUMULATORS, True)):
        replay = Replay(trace, 100, {0: 2}, 0, {0}, set(), order, {0: 4})
        replay.clean.add(0)
        assert replay.free(0)
        replay.acc.add(0)  # its first gradient went into its accumulator: the payload is still as it came
        assert replay.free(0) is free


# the counter runs' GPT at a budget where free-first saves a copy out per step (8 of 10 chunks' states do not fit)
CASE = {"world": 1, "ga": 1, "zero": {"device_budget": 460_000}}


def _order_forced(rank, world_size, case, order):
    """``case`` trained with the planner's eviction order replaced by ``order`` (restored afterwards)."""
    from ds_patrickstar.placement import state_choice

    real = state_choice.choose_moves

    def forced(trace, budget, costs, placed, resident, compute_s, profile, overlap, activations, pricer=None):
        return state_choice.price(trace, budget, costs, placed.on_device, resident, compute_s, profile, overlap,
                                  placed.distance, EvictionOrder(order), activations)

    state_choice.choose_moves = forced
    try:
        return train_case(rank, world_size, case)
    finally:
        state_choice.choose_moves = real


def test_on_the_twin_free_first_is_chosen_where_it_saves_copies_and_moves_what_the_replay_predicts():
    chosen = run_ranks(train_case, 1, CASE, timeout=240.0)[0]["steps"]
    belady = run_ranks(_order_forced, 1, CASE, int(EvictionOrder.BELADY), timeout=240.0)[0]["steps"]
    assert [s["losses"] for s in chosen] == [s["losses"] for s in belady]  # the order moves bytes, never values
    for ours, theirs in zip(chosen[2:], belady[2:]):  # the steady state: from the step after the check
        c, b = ours["counters"], theirs["counters"]
        assert (c["eviction_order"], b["eviction_order"]) == (1, 0)
        for counters in (c, b):
            assert (counters["predicted_bytes_to_device"], counters["predicted_bytes_to_host"]) == (
                counters["bytes_to_device"], counters["bytes_to_host"])
        assert c["bytes_to_device"] == b["bytes_to_device"] and c["bytes_to_host"] < b["bytes_to_host"]
        assert c["clean_evictions"] > b["clean_evictions"]


# the counter runs' GPT with gradient accumulation where keeping accumulators saves bytes
GA_CASE = {"world": 1, "ga": 2, "zero": {"device_budget": 400_000}}


def test_on_the_twin_accumulators_stay_where_that_saves_bytes_and_the_driver_moves_what_the_replay_predicts():
    chosen = run_ranks(train_case, 1, GA_CASE, timeout=240.0)[0]["steps"]
    belady = run_ranks(_order_forced, 1, GA_CASE, int(EvictionOrder.BELADY), timeout=240.0)[0]["steps"]
    assert [s["losses"] for s in chosen] == [s["losses"] for s in belady]
    ways = ("bytes_to_device", "bytes_to_host", "accumulator_bytes_to_device", "accumulator_bytes_to_host")
    for ours, theirs in zip(chosen[1:], belady[1:]):
        c, b = ours["counters"], theirs["counters"]
        assert EvictionOrder(c["eviction_order"]).keeps_accumulators and b["eviction_order"] == 0
        for counters in (c, b):
            assert [counters[f"predicted_{way}"] for way in ways] == [counters[way] for way in ways]
        assert c["accumulator_bytes_to_host"] < b["accumulator_bytes_to_host"]
        assert sum(c[way] for way in ways) < sum(b[way] for way in ways)


def test_with_frozen_chunks_on_disk_the_orders_keeping_accumulators_move_what_the_replay_predicts():
    """Frozen chunks whose home is their disk record (evictions that copy nothing) beside trainable ones with
    accumulators: each order that keeps accumulators moves the replay's bytes from the third step (the second brings
    one chunk less at its first moment: the traced step left it on the accelerator), with Belady's losses."""
    case = {**CASES["frozen_on_disk_twin"], "ga": 2}
    belady = run_ranks(_order_forced, 1, case, int(EvictionOrder.BELADY), timeout=240.0, fresh=True)[0]["steps"]
    ways = ("bytes_to_device", "bytes_to_host", "accumulator_bytes_to_device", "accumulator_bytes_to_host")
    for order in (EvictionOrder.BELADY_KEEPING_ACCUMULATORS, EvictionOrder.FREE_FIRST_KEEPING_ACCUMULATORS):
        steps = run_ranks(_order_forced, 1, case, int(order), timeout=240.0, fresh=True)[0]["steps"]
        assert [s["losses"] for s in steps] == [s["losses"] for s in belady]
        counters = steps[2]["counters"]
        assert counters["eviction_order"] == order
        assert [counters[f"predicted_{way}"] for way in ways] == [counters[way] for way in ways], order
