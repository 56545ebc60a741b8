"""The plans made from a trace count what each moment holds (issue 20): a recomputed module's chunks
are in use from its recomputation to its backward (``Trace.held_chunks``), so the optimizer-state
plan and the gather plan's room for kept groups count them where they are held, beside the tide of
that moment. Model and runs are those of tests/test_activation_offload.py.
"""
from __future__ import annotations

from multiproc import run_ranks
from test_activation_offload import STEPS, _train


def test_optimizer_states_leave_room_for_the_chunks_held_across_a_recomputation():
    """fp32, one rank, 250,000 B, checkpointing, no activation offload. Hand-computed from the trace:
    the tide peaks at 116,736 B; while layer 4 is recomputed and its backward runs it holds chunks
    3, 4 and 5 (24,576 B; the most any moment uses itself is two, 16,384 B); two chunks in flight
    take 16,384 B. That leaves 250,000 - 116,736 - 24,576 - 16,384 = 92,304 B: the states of three
    chunks (24,576 B each), not four. Counting a moment's own chunks the plan put four on the
    accelerator and every iteration then evicted chunks (3) during the recomputations."""
    result = run_ranks(_train, 1, "patrickstar", "fp32", "none", 250_000)[0]
    planned = result.counters[1:]
    assert [c["adam_chunks_device"] for c in planned] == [3] * (STEPS - 1), planned
    assert [c["evictions"] for c in planned] == [0] * (STEPS - 1), planned


class _Comm:
    """Two ranks with the same trace (a world of one process agrees with itself)."""

    world_size = 2

    class agreement:
        @staticmethod
        def agree_plan(meaning: str, values: list[int]):
            from ds_patrickstar.groups.agreement import Agreed

            return Agreed(list(values))


def _keep_room(labels: list[str], chunks: list[tuple[int, ...]], tides: list[int], at: int) -> int:
    """The most gathered bytes the plan agreed from this trace lets stay at moment ``at`` (two
    ranks, groups of 100 B, 1,000 B of room)."""
    plan = _agreed(labels, chunks, tides, at)
    return next(n for n in range(0, 1_001, 10) if not plan.allows_keep(n + 10))


def _agreed(labels: list[str], chunks: list[tuple[int, ...]], tides: list[int], at: int):
    """The gather plan two ranks agree from this trace (groups of 100 B, 1,000 B of room), at moment ``at``."""
    from ds_patrickstar.chunks.group_bytes import GroupBytes
    from ds_patrickstar.groups.gather_plan import GatherPlan
    from ds_patrickstar.placement.runtime import PlacementRuntime
    from ds_patrickstar.placement.trace import Moment, Trace

    trace = Trace()
    for label, ids, tide in zip(labels, chunks, tides):
        trace.add(Moment(label, ids, tide))

    class Placement:
        gathered_rooms = PlacementRuntime.gathered_rooms

        @staticmethod
        def last_iteration():
            return trace

        @staticmethod
        def recorded_moment() -> tuple[int, str]:
            return at, labels[at]

        @staticmethod
        def movable_room() -> int:
            return 1_000

    group = GroupBytes(storage=0, owned=100, joined=0, accumulator=0, grad_buffer=0)
    plan = GatherPlan([group], _Comm(), Placement())
    plan.agree()
    return plan


def test_kept_groups_leave_room_for_what_each_later_moment_holds():
    """Kept groups stay to the end of the iteration: at every later moment they, the groups it holds
    (each counted as the largest, 100 B) and its tide must fit in 1,000 B. Chunk ``c`` is in group
    ``c // 2``. In the first trace layer ``a`` (group 0) is recomputed and stays in use until its
    backward, so ``bwd:b`` holds groups 0 and 1 beside a tide of 500 B: 300 B may stay after
    ``fwd:head`` (counting its own group only, the plan let 400 B stay: 100 B too many there). In the
    second, the highest tide (500 B, at ``bwd:head``, one group) and the moment using two groups
    (``fwd:c``, beside 100 B of tide) are apart: 400 B may stay after ``fwd:b`` (adding the highest
    tide to the most groups, the plan let 300 B stay)."""
    labels = ["fwd:a", "fwd:b", "fwd:head", "bwd:head", "rec:a", "rec:b", "bwd:b", "bwd:a", "step"]
    chunks = [(0,), (2,), (4,), (4,), (0,), (2,), (2,), (0,), ()]
    tides = [0, 100, 200, 500, 300, 500, 500, 300, 0]
    assert _keep_room(labels, chunks, tides, at=2) == 300
    labels = ["fwd:a", "fwd:b", "fwd:c", "fwd:head", "bwd:head", "bwd:c", "bwd:b", "bwd:a", "step"]
    chunks = [(0,), (2,), (0, 2), (4,), (4,), (0, 2), (2,), (0,), ()]
    tides = [0, 100, 100, 200, 500, 300, 200, 100, 0]
    assert _keep_room(labels, chunks, tides, at=1) == 400


def test_a_group_is_gathered_ahead_only_for_a_use_the_room_was_agreed_for():
    """The room to gather ahead at a moment is agreed beside the tides of that moment and the next two; the
    groups' prefetch takes the next groups of the previous step's gather order, which may be used much later
    (after the head, in backward). Gathered then, a group stood through tides the room never saw: on the twin's
    two-rank mirror of 11 GiB one gathered at the last forward moment for a use six moments later pushed kept
    groups out, their gathers changed the next step's order, and one rank's bytes alternated between steps. At
    ``fwd:a`` (moment 0) groups 1 and 2 (used at 1 and 2) may come ahead, group 3 (used at 4) and group 0 (used
    again at 3) may not; at ``fwd:c`` group 3 may. Chunk ``c`` is in group ``c // 2``."""
    labels = ["fwd:a", "fwd:b", "fwd:c", "fwd:head", "bwd:head", "bwd:c", "step"]
    chunks = [(0,), (2,), (4,), (0, 1), (6,), (4,), ()]
    tides = [0] * len(labels)
    plan = _agreed(labels, chunks, tides, at=0)
    assert [plan.allows_prefetch(100, group) for group in range(4)] == [False, True, True, False]
    assert not plan.allows_prefetch(1_001, 1)  # beyond the room
    assert _agreed(labels, chunks, tides, at=2).allows_prefetch(100, 3)
