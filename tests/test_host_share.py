"""The default ``keep_gathered`` of a run without placement follows the host memory the ranks share
(see [Note: default kept groups from host memory]): every group while memory is plentiful, none
when the model data fills each rank's share, and an explicit value always wins."""
import pytest
import torch

from multiproc import run_ranks


def _limit(rank, world_size, available, keep_gathered):
    import collections

    import deepspeed
    import psutil

    import ds_patrickstar  # noqa: F401

    memory = collections.namedtuple("memory", "available total")
    psutil.virtual_memory = lambda: memory(available, available)  # a fresh process: the patch dies with it
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 32))
    zero = {"stage": "patrickstar", "chunk_size": 1024}
    if keep_gathered is not None:
        zero["keep_gathered"] = keep_gathered
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": zero,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}}
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    engine.backward(engine(torch.randn(2, 16)).square().mean())
    engine.step()
    return engine.optimizer.manager.keep.limit, engine.get_patrickstar_counters()["all_gathers"]


@pytest.mark.parametrize("available,keep_gathered,expected", [
    (1 << 40, None, None),  # plentiful: every group stays gathered (ZeRO-3's volume)
    (0, None, 0),  # the model data fills the share: groups are released after use
    (0, 1 << 30, 1 << 30),  # an explicit value wins
])
def test_default_keep_gathered_follows_the_shared_host_memory(available, keep_gathered, expected):
    results = run_ranks(_limit, 2, available, keep_gathered, fresh=True, memo=True)
    assert [limit for limit, _ in results] == [expected, expected]


def test_a_released_default_gathers_more_than_the_kept_one():
    # the runs of the first two cases above (memo: the same deterministic runs, made once)
    kept = run_ranks(_limit, 2, 1 << 40, None, fresh=True, memo=True)[0][1]
    released = run_ranks(_limit, 2, 0, None, fresh=True, memo=True)[0][1]
    assert released > kept, (released, kept)


def test_the_rule():
    from ds_patrickstar.integration.host_share import keep_limit
    from ds_patrickstar.memory.preflight import local_world_size
    from ds_patrickstar.memory.preflight import ModelDataPlan

    plan = ModelDataPlan(owned_elements=500, total_elements=1000, lp_bytes=2, accumulate=False)  # 7000 B
    # room 2000 B covers every group's storage: the 1000 elements in bf16 (the other ranks' and the
    # place of this rank's among them, see [Note: gathered group storage]); 1999 B does not
    assert keep_limit(plan, 2 * (7000 + 2 * 2000), 2) is None
    assert keep_limit(plan, 2 * (7000 + 2 * 1999), 2) == 1999
    assert keep_limit(plan, 2 * (7000 + 2 * 400), 2) == 400
    assert keep_limit(plan, 1000, 2) == 0
    assert local_world_size(8) in range(1, 9)
