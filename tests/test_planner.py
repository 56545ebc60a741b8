"""The placement planner's decisions as pure functions of hand-made traces (see [Note: placement planner]):
nothing is allocated, moved or traced."""
import pytest

from ds_patrickstar.memory.ledger import DeviceBudgetExceeded
from ds_patrickstar.memory.preflight import OPTIM_BYTES_PER_ELEMENT
from ds_patrickstar.placement.planner import (
    IN_FLIGHT_CHUNKS,
    belady_victims,
    gathered_rooms,
    headroom,
    prefetch_for,
    states_on_device,
)
from ds_patrickstar.placement.trace import Moment, Trace


def _trace(*moments):
    trace = Trace()
    for label, chunks, tide in moments:
        trace.add(Moment(label, chunks, tide))
    return trace


TRACE = _trace(("fwd:a", (0,), 100), ("fwd:b", (1,), 300), ("bwd:b", (1,), 500), ("bwd:a", (0,), 200),
               ("step", (), 0))
CAPS = {0: 10, 1: 10, 2: 10}  # 10 elements: 120 B of optimizer states each
STATE = 10 * OPTIM_BYTES_PER_ELEMENT


def test_optimizer_states_fill_what_the_highest_tide_and_the_busiest_moment_leave():
    needs, chunk = [40, 40, 60, 40, 0], 8
    base = 500 + 60 + IN_FLIGHT_CHUNKS * chunk  # the highest tide, the busiest moment, the moves in flight
    assert states_on_device(TRACE, base + 2 * STATE, "auto", needs, chunk, CAPS) == {0, 1}
    assert states_on_device(TRACE, base + 2 * STATE - 1, "auto", needs, chunk, CAPS) == {0}
    assert states_on_device(TRACE, base + 3 * STATE, "auto", needs, chunk, CAPS) == {0, 1, 2}
    assert states_on_device(TRACE, base - 1, "auto", needs, chunk, CAPS) == set()
    assert states_on_device(TRACE, 10**9, "static", needs, chunk, CAPS) == set()  # the static policy: host Adam


def test_a_higher_tide_at_one_moment_moves_states_back_to_the_host():
    higher = _trace(("fwd:a", (0,), 100), ("fwd:b", (1,), 300 + STATE), ("bwd:b", (1,), 500 + STATE),
                    ("step", (), 0))
    budget = 500 + 2 * STATE
    assert states_on_device(TRACE, budget, "auto", [0], 0, CAPS) == {0, 1}
    assert states_on_device(higher, budget, "auto", [0], 0, CAPS) == {0}


def test_headroom_is_the_budget_less_the_tide_here_and_next_or_now():
    assert headroom(1000, TRACE, 1, 0) == 1000 - 500  # the next moment's tide is higher
    assert headroom(1000, TRACE, 3, 0) == 1000 - 200  # the step (0) after: this moment's
    assert headroom(1000, TRACE, 0, 700) == 300  # the non-model memory now is higher than planned
    assert headroom(1000, None, 0, 50) == 950  # no trace: what is there now
    assert headroom(1000, TRACE, 99, 50) == 950  # off the trace


def test_headroom_over_a_span_is_the_budget_less_its_highest_tide():
    assert headroom(1000, TRACE, 0, 0, span=1) == 1000 - 300  # moments 0 and 1
    assert headroom(1000, TRACE, 0, 0, span=2) == 1000 - 500  # up to moment 2


def test_prefetch_brings_the_next_moments_chunks():
    assert prefetch_for(TRACE, 0, "auto") == ((1, (1,)),)
    assert prefetch_for(TRACE, 0, "auto", distance=3) == ((1, (1,)), (2, (1,)), (3, (0,)))  # nearest first
    assert prefetch_for(TRACE, 3, "auto") == ((4, ()),)  # the step uses none
    assert prefetch_for(TRACE, 3, "auto", distance=4) == ((4, ()),)  # not past the iteration's end
    assert prefetch_for(None, 0, "auto") == ()
    assert prefetch_for(TRACE, 0, "static") == ()


def test_belady_evicts_the_farthest_next_use_first():
    resident = {0: 10, 1: 10}
    assert belady_victims(resident, 10, lambda c: TRACE.next_use(c, 1)) == [0]  # 1 is used at 2, 0 at 3
    assert belady_victims(resident, 15, lambda c: TRACE.next_use(c, 1)) == [0, 1]
    with pytest.raises(DeviceBudgetExceeded):
        belady_victims(resident, 21, lambda c: TRACE.next_use(c, 1))


def test_gathered_rooms_keep_for_the_rest_and_ahead_for_the_next_moments():
    tides = [100, 300, 500, 200]
    keep, ahead = gathered_rooms(tides, 1000, lambda index: 10)
    assert ahead == [500, 500, 500, 800]  # the highest tide of this moment and the next two
    # kept from moment i: beside its tide and, at every later moment (up to the next iteration's first),
    # that moment's tide and the groups it holds
    assert keep == [1000 - 510, 1000 - 510, 1000 - 500, 1000 - 200]


def test_the_move_model_replays_belady_with_prefetch_by_hand():
    """Three chunks of 100 B, room for two beside a tide of 0: forward 0, 1, 2, backward 2, 1, 0, the step
    updates every chunk on the host. Worked by hand (see [Note: predicted moves])."""
    from ds_patrickstar.placement.move_model import simulate_moves

    trace = _trace(("fwd:a", (0,), 0), ("fwd:b", (1,), 0), ("fwd:c", (2,), 0), ("bwd:c", (2,), 0),
                   ("bwd:b", (1,), 0), ("bwd:a", (0,), 0), ("step", (), 0))
    for index, chunk in ((3, 2), (4, 1), (5, 0)):  # each backward moment's gradients go into its chunk
        trace.note_written(index, chunk)
    sizes = {0: 100, 1: 100, 2: 100}
    resident = set()
    first = simulate_moves(trace, 200, sizes, 0, resident, host_updated={0, 1, 2})
    # moment 0 brings 0 and 1 ahead; 1 brings 2 ahead after evicting 0 (next used at 5, after 2); 4 sends 2
    # to the host (its last use is behind: its gradient leaves in backward) and brings 0 ahead; 5 sends 1 (its
    # last use, 4, is behind); the step sends 0 to the host for Adam
    assert first.to_device == [200, 100, 0, 0, 100, 0, 0]
    assert first.to_host == [0, 100, 0, 0, 100, 100, 100]
    assert resident == set()
    # 40 B that do not move leave room for one chunk: nothing fits ahead, every chunk is brought at its use
    # (2 stays from its forward to its backward) and the one before it goes
    again = simulate_moves(trace, 200, sizes, 40, set(), host_updated=set())
    assert again.to_device == [100, 100, 100, 0, 100, 100, 0]
    assert again.to_host == [0, 100, 100, 0, 100, 100, 0]


def test_what_a_replay_reads_of_a_trace_is_what_the_trace_answers():
    """[Note: the planner's cost]: the lists a replay reads (built once per trace) give, at every moment, the
    trace's own tide over each window (wrapping, windows longer than the trace too), the chunks whose last use it
    is, the step's readings as its most; only the chunks that move count as moving."""
    import random

    from ds_patrickstar.placement.replay_arrays import replay_arrays

    rng, trace = random.Random(0), Trace()
    for k in range(9):
        chunks = tuple(rng.sample(range(6), rng.randint(0, 3)))
        trace.add(Moment("step" if k == 8 else f"fwd:{k}", chunks, rng.randint(0, 100), read=rng.randint(0, 100),
                         read_late=rng.randint(0, 100)))
    arrays = replay_arrays(trace, {c: 1 for c in range(4)})
    for window in range(1, 12):
        assert arrays.tide_ahead(window) == [trace.non_model_ahead(k, window) for k in range(9)]
    for k, moment in enumerate(trace.moments):
        assert arrays.last_uses[k] == tuple(sorted(c for c in set(moment.chunks) if trace.next_use(c, k) >= 9))
        assert arrays.movable[k] == tuple(c for c in moment.chunks if c < 4)
    step = trace.moments[8]
    assert arrays.read[8] == arrays.read_late[8] == max(step.read, step.read_late)
    assert (arrays.read[0], arrays.read_late[0]) == (trace.moments[0].read, trace.moments[0].read_late)


def test_the_move_model_makes_room_beside_what_the_driver_read_at_the_moment():
    """The driver makes room beside the higher of the tide planned ahead and what it reads at the moment (the
    tide then and the allocator's stranded pieces, kept per moment as ``Moment.read``): the replay too. Read 60 B
    above the plan at moment 0, the prefetch of chunk 1 no longer fits beside chunk 0 (room 200 - 60)."""
    from dataclasses import replace

    from ds_patrickstar.placement.move_model import simulate_moves

    trace = _trace(("fwd:a", (0,), 0), ("fwd:b", (1,), 0), ("step", (), 0))
    sizes = {0: 100, 1: 100}
    assert simulate_moves(trace, 200, sizes, 0, set(), set()).ahead[0] == [(1, 100)]
    trace.note_read(0, 60)
    assert trace.revision == 1 and trace.moments[0] == replace(trace.moments[0], read=60)
    trace.note_read(0, 20)  # the most of the readings is kept
    assert (trace.revision, trace.moments[0].read) == (1, 60)
    plan = simulate_moves(trace, 200, sizes, 0, set(), set())
    assert plan.ahead[0] == [] and plan.demand[1] == 100


def test_the_prediction_is_made_again_when_the_planned_tide_changes():
    """A tide raised above the plan (or re-planned by activation offload) moves the trace's revision, so the
    predictor replays it instead of keeping the moves predicted from the old tide (see [Note: predicted moves])."""
    from ds_patrickstar.placement.bytes_floor import FloorMeter
    from ds_patrickstar.placement.chunk_costs import ChunkCosts
    from ds_patrickstar.placement.move_model import MovePredictor

    trace = _trace(("fwd:a", (0,), 0), ("fwd:b", (1,), 0), ("bwd:b", (1,), 0), ("bwd:a", (0,), 0), ("step", (), 0))
    costs = ChunkCosts({0: 100, 1: 100}, {}, {})
    predictor, floor = MovePredictor(200, costs), FloorMeter(200, costs)
    assert predictor.update(trace, 0, {0, 1}, set()).bytes_to_device == 0 and floor.update(trace) == 0  # both stay
    trace.raise_tide(1, 60)  # one chunk beside the tide at moment 1 and the one before it
    raised = predictor.update(trace, 0, {0, 1}, set())
    assert raised.bytes_to_device > 0 and floor.update(trace) > 0
    before = trace.revision
    trace.set_non_model(1, 0)
    assert trace.revision > before and predictor.update(trace, 0, {0, 1}, set()).bytes_to_device == 0


def test_an_accumulator_whose_boundary_collective_is_issued_goes_before_any_eviction():
    """With several ranks the boundary's reduce-scatter adds an owned accumulator into its slot, and the driver
    completes the collectives in flight before it evicts (see [Note: predicted moves]): where the trace noted such
    a collective (``acc_folding``), from the moment after the chunk's last use the replay drops the accumulator
    where room is needed instead of sending it to the host. Three backward moments, one chunk of 100 B each (the
    first brings the second ahead) whose accumulator of 400 B comes into being there; 1000 B hold two chunks with
    theirs: the second accumulator needs room. Where the step writes the sums (unmanaged accumulation: nothing
    noted) the first chunk (used again farthest ahead) goes to the host with its accumulator, which goes there at
    the step; noted, nothing moves out."""
    from ds_patrickstar.placement.move_model import simulate_moves

    def trace(folding: bool) -> Trace:
        out = Trace()
        for k in range(3):
            noted = frozenset({k}) if folding else frozenset()
            out.add(Moment(f"bwd:{k}", (k,), 0, acc_born=frozenset({k}), acc_folding=noted))
        out.add(Moment("step", (), 0, acc_gone=frozenset(range(3))))
        return out

    sizes, accumulators = {0: 100, 1: 100, 2: 100}, {0: 400, 1: 400, 2: 400}
    for folding, evicted in ((True, 0), (False, 1)):
        plan = simulate_moves(trace(folding), 1000, sizes, 0, set(), set(), accumulators=accumulators)
        assert plan.to_device == [200, 100, 0, 0] and plan.acc_to_device == [0, 0, 0, 0]
        assert plan.to_host == [0, 100 * evicted, 0, 0], folding
        assert plan.acc_to_host == [0, 400 * evicted, 0, 0], folding


def test_a_chunk_gathered_ahead_comes_at_the_moment_its_all_gather_was_issued():
    """With several ranks the groups' prefetch all-gathers a group ahead of its use (see [Note: gather order]), which
    brings this rank's chunk of it then, a distance in groups and not in moments; the driver notes those chunks at
    the moment (``Moment.gathered_ahead``) and the replay brings them there, for their use (see [Note: predicted
    moves]). Chunk 1 is used at moment 3: by the moments' prefetch it comes at moment 2, ahead for 3; noted at
    moment 0, it comes there. The notes of an iteration add up, and after the plan changed the next replaces."""
    from ds_patrickstar.placement.move_model import simulate_moves

    trace = _trace(("fwd:a", (0,), 0), ("fwd:b", (0,), 0), ("fwd:c", (0,), 0), ("fwd:d", (1,), 0), ("step", (), 0))
    sizes = {0: 100, 1: 100}
    plain = simulate_moves(trace, 200, sizes, 0, set(), set())
    assert plain.to_device == [100, 0, 100, 0, 0] and plain.ahead[2] == [(3, 100)]
    trace.note_gathered_ahead(0, frozenset({1}))
    assert trace.revision == 1 and trace.moments[0].gathered_ahead == {1}
    noted = simulate_moves(trace, 200, sizes, 0, set(), set())
    assert noted.to_device == [200, 0, 0, 0, 0] and noted.ahead[0] == [(3, 100)] and noted.demand[0] == 100
    trace.note_gathered_ahead(0, frozenset({0}))
    assert trace.moments[0].gathered_ahead == {0, 1}
    trace.restart_readings()
    trace.note_gathered_ahead(0, frozenset())
    assert trace.moments[0].gathered_ahead == frozenset() and trace.revision == 3
