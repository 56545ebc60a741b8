"""The tensor state machine: every legal move works, every illegal one raises."""
import itertools

import pytest
import torch

from ds_patrickstar.chunks.chunk import Chunk, Piece, TensorInfo
from ds_patrickstar.chunks.state import ChunkState, IllegalTransition, TensorState, check_transition

S = TensorState
LEGAL = {
    (S.FREE, S.HOLD),
    (S.HOLD, S.FREE), (S.HOLD, S.COMPUTE), (S.HOLD, S.HOLD_AFTER_BWD),
    (S.COMPUTE, S.COMPUTE), (S.COMPUTE, S.HOLD), (S.COMPUTE, S.HOLD_AFTER_FWD), (S.COMPUTE, S.HOLD_AFTER_BWD),
    (S.HOLD_AFTER_FWD, S.FREE), (S.HOLD_AFTER_FWD, S.HOLD), (S.HOLD_AFTER_FWD, S.COMPUTE),
    (S.HOLD_AFTER_FWD, S.HOLD_AFTER_BWD),
    (S.HOLD_AFTER_BWD, S.HOLD), (S.HOLD_AFTER_BWD, S.FREE),
}
ALL_PAIRS = list(itertools.product(S, S))


@pytest.mark.parametrize("old,new", [p for p in ALL_PAIRS if p in LEGAL], ids=lambda s: s.name)
def test_legal_transition(old, new):
    check_transition(old, new)


@pytest.mark.parametrize("old,new", [p for p in ALL_PAIRS if p not in LEGAL], ids=lambda s: s.name)
def test_illegal_transition_raises(old, new):
    with pytest.raises(IllegalTransition, match=f"{old.name} -> {new.name}"):
        check_transition(old, new, "w")


def _store():
    from ds_patrickstar.counters import StepCounters
    from ds_patrickstar.memory.accelerator import HostAccelerator
    from ds_patrickstar.store.chunk_store import ChunkStore

    return ChunkStore(HostAccelerator(), StepCounters(), movable=False)


_GROUPS: dict[int, tuple] = {}  # id of a chunk -> (its store, the members of its group, the owned one)


def _release(chunk):
    store, members, owner = _GROUPS[id(chunk)]
    store.release_group(members, owner)


def _materialize(chunk):
    store, members, owner = _GROUPS[id(chunk)]
    store.materialize_group(members, owner)


def _chunk_with_two_tensors():
    """Another rank's chunk of a two-chunk group, gathered (a view of the group's storage)."""
    chunk, owner = Chunk(0, 64, torch.float32, 0), Chunk(1, 64, torch.float32, 0)
    store = _store()
    store.create_group([chunk, owner], owner)
    _GROUPS[id(chunk)] = (store, [chunk, owner], owner)
    params = [torch.nn.Parameter(torch.randn(4, 4)), torch.nn.Parameter(torch.randn(8))]
    infos = []
    offset = 0
    for i, p in enumerate(params):
        piece = Piece(0, offset, 0, p.numel())
        info = TensorInfo(f"p{i}", p, [piece], p.numel(), p.shape, 0)
        chunk.append(info, piece)
        chunk.view_of(info).copy_(p.data)
        p.data = chunk.view_of(info)
        infos.append(info)
        offset += 32
    return chunk, params, infos


def test_grad_slot_cannot_be_used_for_compute():
    _, _, (a, _) = _chunk_with_two_tensors()
    a.start_compute()
    a.grad_written()
    with pytest.raises(IllegalTransition, match="HOLD_AFTER_BWD -> COMPUTE"):
        a.start_compute()


def test_chunk_state_is_derived_from_tensors():
    chunk, _, (a, b) = _chunk_with_two_tensors()
    assert chunk.state is ChunkState.HOLD and chunk.movable
    a.start_compute()
    assert chunk.state is ChunkState.COMPUTE and not chunk.movable
    with pytest.raises(IllegalTransition, match="in use"):
        _release(chunk)
    a.end_forward()
    _release(chunk)
    assert chunk.state is ChunkState.RELEASED and not chunk.is_materialized
    assert {a.state, b.state} == {S.FREE}


def test_release_keeps_views_valid():
    chunk, params, infos = _chunk_with_two_tensors()
    saved = params[0] * 1  # a view autograd would keep is the param itself
    before = params[0].detach().clone()
    _release(chunk)
    assert params[0].untyped_storage().nbytes() == 0
    _materialize(chunk)
    chunk.view_of(infos[0]).copy_(before)
    assert torch.equal(params[0].detach(), before)
    assert params[0].data_ptr() == chunk.payload.data_ptr()
    assert saved.shape == params[0].shape


def test_packing_is_first_fit_and_a_large_tensor_gets_its_own_chunk():
    from ds_patrickstar.chunks.layout import ALIGN, plan_first_fit

    sizes = {"w1": 900, "b1": 10, "big": 5000, "w2": 900, "b2": 10}
    named = [(n, torch.nn.Parameter(torch.zeros(s))) for n, s in sizes.items()]
    plans = plan_first_fit(named, chunk_size=1024)
    layout = [[name for name, _, _ in plan] for plan in plans]
    # b1 and b2 fill the gap w1 leaves (first fit); the 5000-element tensor is alone; w2 opens a chunk
    assert layout == [["w1", "b1", "b2"], ["big"], ["w2"]]
    assert all(offset % ALIGN == 0 for plan in plans for _, _, offset in plan)
