"""Offloaded activations in the step-time model (see [Note: step-time model] in placement/step_time.py): their
copies share the copy stream with the chunks', at the moments the offloader issues them, and the bytes priced are
the bytes the offloader moves."""
from __future__ import annotations

from ds_patrickstar.activations.plan import SegmentRecord, planned_copies
from ds_patrickstar.placement.move_model import steady_moves
from ds_patrickstar.placement.step_time import H100_PROFILE, ActivationMoves, predict_step
from ds_patrickstar.placement.trace import Moment, Trace


def _records() -> list[SegmentRecord]:
    """Three blocks of a forward over moments 0-5 and a backward over 6-11: block k is dropped from moment 2 + k;
    block 2's backward begins at 8 and brings it back with block 1 (the prefetch), block 1's at 9 brings back
    block 0 (``away_to``: the moment after the copy back's)."""
    return [SegmentRecord(0, 100, 2, 10, True), SegmentRecord(1, 200, 3, 9, True), SegmentRecord(2, 300, 4, 9, True)]


def test_copies_go_out_after_the_next_block_and_come_back_one_block_ahead():
    copies = planned_copies(_records(), None)
    # out: block k at the pre-forward of block k + 1, where block k - 1 was dropped (block 1 at 1, block 2 at 2);
    # block 0 one moment before its own drop (1)
    assert copies.out == {1: 100 + 200, 2: 300}
    assert copies.demand == {8: 300}  # the last block: brought back for its own backward, nothing prefetched it
    # block 1, issued at 8, needed at 9 (where its backward brings back block 0); block 0, issued at 9, needed one
    # block's moments later (10)
    assert copies.ahead == {8: ((9, 200),), 9: ((10, 100),)}
    assert copies.moved == 2 * 600
    assert planned_copies(_records(), {1}).moved == 2 * 200  # only the blocks offloaded


def _trace(compute_moments: int) -> Trace:
    trace = Trace()
    for k in range(compute_moments):
        trace.add(Moment(f"m{k}", (), 0))
    return trace


def test_copies_behind_compute_cost_nothing_and_exposed_ones_cost_their_transfer():
    from ds_patrickstar.placement.chunk_costs import ChunkCosts

    trace = _trace(12)
    costs = ChunkCosts({}, {}, {})
    plan = steady_moves(trace, 10**9, costs, 0, set(), set())
    big = 54_000_000  # 1 ms each way at the H100 profile's 54 GB/s
    copies = ActivationMoves(out={1: big}, demand={8: big}, ahead={9: ((10, big),)})
    slow = [0.01] * 12  # 10 ms a moment: every copy hides, but the one the moment waits for (demand)
    alone = predict_step(trace, plan, slow, {}, 0, H100_PROFILE, True).total_s
    hidden = predict_step(trace, plan, slow, {}, 0, H100_PROFILE, True, copies).total_s
    assert abs(hidden - alone - 0.001) < 1e-9  # the demand copy, 1 ms
    fast = [0.0] * 12  # no compute to hide behind: the three copies in a row
    assert abs(predict_step(trace, plan, fast, {}, 0, H100_PROFILE, True, copies).total_s - 0.003) < 1e-9


def test_the_bytes_priced_are_the_bytes_moved(dist):
    """Offload "all" on the strict twin: the copies the planner prices for a steady step are the bytes the
    offloader counted out and back in it."""
    import deepspeed
    from test_activation_offload import BATCH, SEED, build_checkpointed, steps_then_eval

    import ds_patrickstar  # noqa: F401

    model, batch = build_checkpointed(SEED)
    zero = {"stage": "patrickstar", "chunk_size": 2048, "emulate_accelerator": True, "device_budget": 10**6,
            "offload_activations": "all"}
    config = {"train_micro_batch_size_per_gpu": BATCH, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": zero}
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    steps_then_eval(engine, batch)
    counters = engine.get_patrickstar_counters()  # the last step's
    priced = engine.optimizer.placement.activations.priced
    engine.destroy()
    back = sum(priced.demand.values()) + sum(n for copies in priced.ahead.values() for _, n in copies)
    assert sum(priced.out.values()) == counters["activation_bytes_offloaded"] > 0
    assert back == counters["activation_bytes_restored"]


# ---- activations offloaded for optimizer states (see [Note: activations offloaded for optimizer states]) ----
class _Room:
    """A stand-in for :class:`StatesRoom`: one cap (the tide's peak that lets more states in), and a price that
    makes each block offloaded worth ``gain`` seconds."""

    def __init__(self, cap: int, gain: float) -> None:
        self.cap, self.gain = cap, gain
        self.priced: list[int] = []

    def caps(self, trace):
        return [self.cap]

    def price(self, trace, copies, blocks):
        from ds_patrickstar.placement.states_room import PricedTide

        self.priced.append(max(m.non_model for m in trace.moments))
        return PricedTide(1.0 - self.gain * blocks, copies.moved, blocks)


def _plan(gain: float):
    from ds_patrickstar.activations.plan import plan_for_states, plan_offload

    trace = Trace()
    tide = [100, 400, 700, 700, 400, 100]  # blocks 0 and 1 away at 2-3 (300 B each) bring the peak to 100
    for k, non_model in enumerate(tide):
        trace.add(Moment(f"m{k}", (), non_model))
    records = [SegmentRecord(b, 300, 2, 4, True) for b in (0, 1)]
    traced = [t - 600 if 2 <= k < 4 else t for k, t in enumerate(tide)]  # as traced: every block away
    for k, non_model in enumerate(traced):
        trace.set_non_model(k, non_model)
    need = [0] * 6
    base = plan_offload(traced, need, 1000, records)  # everything fits: nothing offloaded
    room = _Room(cap=400, gain=gain)
    return base, plan_for_states(trace, need, 1000, records, base, room), room


def test_more_blocks_go_where_the_model_prices_the_room_for_states_faster():
    base, (blocks, planned), room = _plan(gain=0.1)
    assert base[0] == set() and max(base[1]) == 700
    assert len(blocks) == 1 and max(planned) == 400  # one block lowers the peak to the cap
    assert room.priced == [700, 400]  # the first plan and the one with more blocks, on their tides


def test_a_tie_keeps_the_first_plan():
    base, (blocks, planned), _ = _plan(gain=0.001)  # within the 2% tie: the fewer bytes moved win
    assert blocks == base[0] == set() and planned == base[1]


def test_on_the_twin_a_slow_host_adam_makes_room_for_states_by_offloading_activations(dist, monkeypatch):
    """A checkpointed GPT whose chunks and block inputs fit a 260 kB budget beside half of the optimizer states: with
    an H100's host Adam every plan hides behind the twin's compute and the first plan (nothing offloaded) is kept;
    with a host Adam a million times slower the check at the second step offloads blocks so that the fill rule
    places more states (the third step's counters), and the losses are the same bit for bit (the same arithmetic
    in other places). No plan prices a candidate twice (see [Note: the planner's cost])."""
    import dataclasses

    from test_activation_offload import BATCH, SEED, build_checkpointed, steps_then_eval

    from ds_patrickstar.integration import device_profile
    from ds_patrickstar.placement import state_choice, step_time

    priced = []  # what each price depends on: the trace, resident chunks, times, copies, candidate, distance, order
    real = state_choice.price

    def counted(trace, budget, costs, on_device, resident, compute_s, profile, overlap, *rest):
        activations = rest[2].key if len(rest) > 2 else None
        priced.append((tuple(trace.moments), frozenset(resident), tuple(compute_s), activations, frozenset(on_device),
                       *rest[:2]))
        return real(trace, budget, costs, on_device, resident, compute_s, profile, overlap, *rest)

    monkeypatch.setattr(state_choice, "price", counted)
    runs = {}
    for name, host_adam in (("h100", step_time.H100_PROFILE.host_adam_elements_per_s), ("slow", 5.4e3)):
        profile = dataclasses.replace(step_time.H100_PROFILE, host_adam_elements_per_s=host_adam)
        monkeypatch.setattr(device_profile, "H100_PROFILE", profile)
        priced.clear()
        runs[name] = _twin_run(build_checkpointed, SEED, BATCH, lambda e, b: steps_then_eval(e, b, steps=3))
        assert priced and len(set(priced)) == len(priced)
    (h100_losses, h100), (slow_losses, slow) = runs["h100"], runs["slow"]
    assert h100["activation_bytes_offloaded"] == 0 < slow["activation_bytes_offloaded"]
    assert slow["adam_chunks_device"] > h100["adam_chunks_device"]
    assert slow_losses == h100_losses


def _twin_run(build, seed, batch_size, steps):
    import deepspeed

    import ds_patrickstar  # noqa: F401

    model, batch = build(seed)
    zero = {"stage": "patrickstar", "chunk_size": 2048, "emulate_accelerator": True, "device_budget": 260_000}
    config = {"train_micro_batch_size_per_gpu": batch_size, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": zero}
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    losses = steps(engine, batch)
    counters = engine.get_patrickstar_counters()  # the last step's
    engine.destroy()
    return losses, counters
