"""The prefetch distance (see [Note: prefetch distance]): the two-stream step-time model prices a copy issued
several moments ahead behind those moments' compute, the planner keeps the distance it predicts fastest (one
moment where the link hides every copy anyway), and the driver on the strict twin moves the bytes the
planner's replay predicts at every distance, with the losses of one moment ahead."""
import pytest
from counter_runs import CASES, run_case, train_case
from multiproc import run_ranks

from ds_patrickstar.placement.move_model import simulate_moves
from ds_patrickstar.placement.state_choice import ChunkCosts, choose_moves, price
from ds_patrickstar.placement.step_time import DeviceProfile
from ds_patrickstar.placement.trace import Moment, Trace

SLOW = DeviceProfile(to_device_bytes_per_s=1.0, to_host_bytes_per_s=1.0, host_adam_elements_per_s=1.0,
                     device_adam_elements_per_s=1.0)  # seconds are bytes
FAST = DeviceProfile(to_device_bytes_per_s=1e9, to_host_bytes_per_s=1e9, host_adam_elements_per_s=1.0,
                     device_adam_elements_per_s=1.0)
# long and short moments (10, 1, 1, 10, 1, 1 s), chunks 0-5 of 4 B, one a moment, room for four; their evictions
# copy nothing (as frozen chunks on disk), so the copies in are all there is to hide
TRACE = Trace()
for chunk in range(6):
    TRACE.add(Moment(f"fwd:{chunk}", (chunk,), 0))
TRACE.add(Moment("step", (), 0))
COMPUTE = [10.0, 1.0, 1.0, 10.0, 1.0, 1.0, 0.0]
COSTS = ChunkCosts(sizes={c: 4 for c in range(6)}, elements={}, capacities={}, uncopied=frozenset(range(6)))
ROOM = 16


def _priced(distance: int, profile: DeviceProfile = SLOW, room: int = ROOM):
    return price(TRACE, room, COSTS, frozenset(), set(), COMPUTE, profile, False, distance)


def test_copies_issued_two_moments_ahead_hide_behind_the_long_moments_before_the_short_ones():
    one, two = _priced(1), _priced(2)
    # one ahead: chunk 2 is brought during moment 1 (1 s of compute for a 4 s copy: 3 s late), chunk 3 during 2
    assert one.plan.ahead[1] == [(2, 4)] and one.plan.ahead[2] == [(3, 4)]
    assert one.step.exposed_transfers_s == pytest.approx(3.0 + 3.0)
    # two ahead: chunks 1 and 2 come behind moment 0's 10 s, 4 and 5 behind moment 3's; the copy of chunk 4,
    # issued at moment 2, waits for moment 1's compute: 3 s late once, not twice
    assert two.plan.ahead[0] == [(1, 4), (2, 4)] and two.plan.ahead[2] == [(4, 4)]
    assert two.step.exposed_transfers_s == pytest.approx(3.0)
    assert one.step.compute_s == two.step.compute_s == sum(COMPUTE)
    assert two.moved > one.moved  # room held longer: more chunks go and come back each iteration


def test_the_planner_keeps_the_fastest_distance_and_where_every_copy_hides_the_fewest_bytes():
    chosen = choose_moves(TRACE, ROOM, COSTS, _priced(1), set(), COMPUTE, SLOW, False)
    best = min((_priced(d) for d in range(1, 5)), key=lambda c: (c.step.total_s, c.distance))
    assert (chosen.distance, chosen.step.total_s) == (best.distance, best.step.total_s) == (2, 24.0 + 3.0)
    fast = choose_moves(TRACE, ROOM, COSTS, _priced(1, FAST), set(), COMPUTE, FAST, False)
    assert fast.distance == 1 and fast.moved == _priced(1, FAST).moved  # every distance ties: the bytes decide


def test_a_moment_whose_chunks_did_not_all_fit_ends_the_prefetch():
    """Room for two chunks: at moment 0 chunk 1 comes, chunk 2 would need chunk 0 (in use) to go, so nothing
    is brought for moment 2 (nor 3) then; at moment 1 chunk 2 comes in chunk 0's place, never in chunk 1's."""
    plan = simulate_moves(TRACE, 8, COSTS.sizes, 0, {0}, set(), COSTS.uncopied, distance=3)
    assert plan.ahead[0] == [(1, 4)] and plan.ahead[1] == [(2, 4)] and plan.demand[1:] == [0] * 6


def _distance_forced(rank, world_size, case, distance):
    """``case`` trained with the planner's distance replaced by ``distance`` (restored afterwards)."""
    from ds_patrickstar.placement import state_choice

    real = state_choice.choose_moves

    def forced(trace, budget, costs, placed, resident, compute_s, profile, overlap, activations, pricer=None):
        return state_choice.price(trace, budget, costs, placed.on_device, resident, compute_s, profile, overlap,
                                  distance, activations=activations)

    state_choice.choose_moves = forced
    try:
        return train_case(rank, world_size, case)
    finally:
        state_choice.choose_moves = real


@pytest.mark.parametrize("distance", [2, 3])
def test_on_the_twin_the_driver_moves_what_the_replay_predicts_at_every_distance(distance):
    case = CASES["twin_1rank_ga1"]
    one = run_case("twin_1rank_ga1")[0]["steps"]
    far = run_ranks(_distance_forced, 1, case, distance, timeout=240.0)[0]["steps"]
    assert [s["losses"] for s in far] == [s["losses"] for s in one]  # placement moves bytes, never values
    for step in far[1:]:  # the steady state: from the step after the traced one
        c = step["counters"]
        assert c["prefetch_distance"] == distance and c["bytes_to_device"] > 0
        assert c["prefetches_beyond_next"] > 0  # brought for a moment after the next: the distance was used
        assert (c["predicted_bytes_to_device"], c["predicted_bytes_to_host"]) == (c["bytes_to_device"],
                                                                                 c["bytes_to_host"])
    assert (one[-1]["counters"]["prefetch_distance"], one[-1]["counters"]["prefetches_beyond_next"]) == (1, 0)
