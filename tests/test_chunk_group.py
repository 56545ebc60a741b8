"""One chunk group (groups/group.py): its bytes, counted alike by the gather plan, the keep decision
and the pre-flight (see [Note: chunk group bytes]), and its states (see [Note: chunk group states]).
Built on the host at two ranks without a process group: nothing here runs a collective."""
from __future__ import annotations

import harness
import pytest
import torch


def _specs(frozen):
    from ds_patrickstar.chunks.layout import plan_chunks

    model = torch.nn.Sequential(torch.nn.Linear(10, 10), torch.nn.Linear(10, 3))
    named = list(model.named_parameters())
    return plan_chunks([], 1000, 2, frozen=named) if frozen else plan_chunks([named], 1000, 2)


def _groups(accumulate: bool, frozen: bool = False):
    """Two ranks, rank 0, fp32: 143 elements in one group of two 72-element chunks; the first
    weight (100 elements) straddles the cut. ``frozen``: every parameter frozen."""
    from ds_patrickstar.chunks.chunk_map import ChunkMap
    from ds_patrickstar.counters import StepCounters
    from ds_patrickstar.groups.comm import ChunkComm
    from ds_patrickstar.groups.group import build_groups
    from ds_patrickstar.memory.accelerator import HostAccelerator
    from ds_patrickstar.placement.interface import NullPlacement
    from ds_patrickstar.store.binding import build_chunk_map
    from ds_patrickstar.store.chunk_store import ChunkStore

    comm = ChunkComm(None, StepCounters())
    comm.world_size = 2
    store = ChunkStore(HostAccelerator(), comm.counters, movable=False)
    specs = _specs(frozen)
    chunk_map = build_chunk_map(ChunkMap(2, 0), specs, store, lambda p: True)
    assert [info.numel for info in chunk_map.straddling(0)] == [100]
    return specs, chunk_map, comm, build_groups(chunk_map, comm, store, NullPlacement(), accumulate)



class _OneMomentPlacement:
    """What the gather plan asks of placement, for a traced iteration of one forward moment and the
    step, a movable room of 10,000 B, now at that forward moment."""

    @staticmethod
    def gathered_rooms(trace, held):
        from ds_patrickstar.placement.planner import gathered_rooms

        return gathered_rooms([m.non_model for m in trace.moments], 10_000, held)

    @staticmethod
    def last_iteration():
        from ds_patrickstar.placement.trace import Moment, Trace

        trace = Trace()
        trace.add(Moment("fwd:0", (0,), 0))
        trace.add(Moment("step", (), 0))
        return trace

    @staticmethod
    def recorded_moment() -> tuple[int, str]:
        return 0, "fwd:0"

def test_the_plan_counts_a_kept_group_as_the_keep_decision_does():
    """Two ranks, gradient accumulation, a tensor straddling the two chunks of its group: the room the
    gather plan leaves for a group a later moment holds is what that group adds to the gathered bytes
    the keep decision compares with the room: its storage, this rank's chunk, the joined buffer and
    the accumulator; and the pre-flight, from the chunk plan, counts the group alike."""
    from ds_patrickstar.chunks.group_bytes import planned_group_bytes
    from ds_patrickstar.groups.gather_plan import GatherPlan
    from ds_patrickstar.groups.residency import GroupResidency
    from ds_patrickstar.placement.interface import NullPlacement

    specs, chunk_map, comm, groups = _groups(accumulate=True)
    # the pre-flight's count, from the plan before anything is built (a bound parameter may read empty)
    assert [g.nbytes for g in groups] == planned_group_bytes(_specs(False), 4, 2, True)
    residency = GroupResidency(chunk_map, comm, groups, NullPlacement(), None, 0, None)
    before = residency.gathered_bytes
    residency.gather(0, fill=False)
    counted = residency.gathered_bytes - before
    assert counted == 3 * 72 * 4 + 100 * 4 + 72 * 4  # storage of two chunks, own chunk, joined, accumulator

    plan = GatherPlan([g.nbytes for g in groups], comm, _OneMomentPlacement())
    plan.agree()  # one process: its own plan (two ranks' plans: tests/test_rank_agreement.py)
    assert plan.allows_keep(10_000 - counted) and not plan.allows_keep(10_000 - counted + 1)


def test_a_frozen_tensor_across_the_cut_is_a_view_of_its_group_storage():
    """A frozen tensor straddling its group's two chunks has no joined buffer: it is a view of the group's
    storage (the other rank's chunk and this rank's landing slot, filled by the all-gather), and neither
    the group nor the pre-flight counts joined bytes for it."""
    from ds_patrickstar.chunks.group_bytes import planned_group_bytes

    specs, chunk_map, _, (group,) = _groups(accumulate=False, frozen=True)
    (info,) = chunk_map.straddling(0)
    other = group.members[1].payload  # a view of the group's storage
    no_buffer = info.joined is None  # (no tensor in an assert: pytest's repr of an unbacked one crashes)
    # released: an empty tensor of its own (see [Note: released parameters read as empty])
    released = info.param.numel() == 0 and info.param.untyped_storage()._cdata != other.untyped_storage()._cdata
    assert no_buffer and released
    assert group.nbytes.joined == 0 and [group.nbytes] == planned_group_bytes(_specs(True), 4, 2, False)
    group.gather(fill=False, keep=frozenset())  # the storage gets memory; here filled by hand
    assert info.param.untyped_storage()._cdata == other.untyped_storage()._cdata  # a view of it again
    group._store.group_storage(group.members).copy_(torch.arange(144.0))
    assert torch.equal(info.param.detach().reshape(-1), torch.arange(100.0))


def test_a_group_moves_only_between_the_states_its_table_allows():
    from ds_patrickstar.chunks.state import IllegalTransition
    from ds_patrickstar.groups.group import GroupState

    _, _, _, (group,) = _groups(accumulate=False)
    assert group.state is GroupState.RELEASED and not group.present
    with pytest.raises(IllegalTransition, match="released -> kept"):
        group.keep()
    group.gather(fill=False, keep=frozenset())
    assert group.present and group.fresh
    group.keep()
    group.keep()  # kept again: still kept
    assert group.kept
    group.unkeep()
    assert group.state is GroupState.GATHERED
    group.release()
    assert group.state is GroupState.RELEASED and not group.fresh


def test_one_rank_with_accumulation_and_a_keep_limit_between_groups_trains():
    """One rank, gradient accumulation, ``keep_gathered`` between one and two groups' bytes: nothing is
    gathered at one rank, so nothing is kept (trimming the kept groups looped forever: releasing a
    group does nothing at one rank). An alarm turns a hang into a failure."""
    import signal

    import deepspeed

    import ds_patrickstar  # noqa: F401

    harness.ensure_distributed()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(4)])
    cfg = harness.make_config("patrickstar", chunk_size=1100, gas=2)
    cfg["zero_optimization"]["keep_gathered"] = int(1.5 * 1100 * 4)

    def hung(*_):
        raise TimeoutError("training did not finish in 60 s")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(60)
    try:
        engine, *_ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
        for _ in range(4):
            engine.backward(engine(torch.randn(4, 32)).pow(2).mean())
            engine.step()
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert engine.global_steps == 2
    engine.destroy()
