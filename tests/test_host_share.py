"""The default ``keep_gathered`` of a run without placement follows the host memory the ranks share
(see [Note: default kept groups from host memory]): every group while memory is plentiful, none
when the model data fills each rank's share, and an explicit value always wins."""
import pytest
import torch
from multiproc import run_ranks


def _limit(rank, world_size, available, keep_gathered):
    import collections

    import psutil

    import ds_patrickstar  # noqa: F401

    memory = collections.namedtuple("memory", "available total")
    real = psutil.virtual_memory
    psutil.virtual_memory = lambda: memory(available, available)
    try:  # a kept process: the patch goes when the job ends
        return _initialize_and_step(keep_gathered)
    finally:
        psutil.virtual_memory = real


def _initialize_and_step(keep_gathered):
    import deepspeed

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
    return engine.optimizer.manager.residency.policy.limit, engine.get_patrickstar_counters()["all_gathers"]


@pytest.mark.parametrize("available,keep_gathered,expected", [
    (1 << 40, None, None),  # plentiful: every group stays gathered (ZeRO-3's volume)
    (0, None, 0),  # the model data fills the share: groups are released after use
    (0, 1 << 30, 1 << 30),  # an explicit value wins
])
def test_default_keep_gathered_follows_the_shared_host_memory(available, keep_gathered, expected):
    results = run_ranks(_limit, 2, available, keep_gathered, memo=True)
    assert [limit for limit, _ in results] == [expected, expected]


def test_a_released_default_gathers_more_than_the_kept_one():
    # the runs of the first two cases above (memo: the same deterministic runs, made once)
    kept = run_ranks(_limit, 2, 1 << 40, None, memo=True)[0][1]
    released = run_ranks(_limit, 2, 0, None, memo=True)[0][1]
    assert released > kept, (released, kept)


def test_the_rule():
    from ds_patrickstar.integration.host_share import NON_MODEL_BYTES, keep_limit
    from ds_patrickstar.memory.preflight import ModelDataPlan, local_world_size

    plan = ModelDataPlan(owned_elements=500, total_elements=1000, lp_bytes=2, accumulate=False)  # 7000 B
    need = 7000 + 700 + NON_MODEL_BYTES + 300  # model data, its tenth, non-model memory, a step's 300 B
    # room 2000 B covers every group's storage: the 1000 elements in bf16 (the other ranks' and the
    # place of this rank's among them, see [Note: gathered group storage]); 1999 B does not
    assert keep_limit(plan, 2 * (need + 2 * 2000), 2, 300) is None
    assert keep_limit(plan, 2 * (need + 2 * 1999), 2, 300) == 1999
    assert keep_limit(plan, 2 * (need + 2 * 400), 2, 300) == 400
    assert keep_limit(plan, 2 * (need + 2 * 400), 2, 301) == 399  # every byte of the step counts
    assert keep_limit(plan, 2 * need, 2, 300) == 0
    assert keep_limit(plan, 1000, 2, 300) == 0
    assert local_world_size(8) in range(1, 9)


def _gpt_plan(shape, world_size, accumulate, lp_bytes=2):
    from ds_patrickstar.chunks.chunk_map import owner_of
    from ds_patrickstar.integration.config import DEFAULT_CHUNK_SIZE
    from ds_patrickstar.memory.preflight import plan_for_rank
    from ds_patrickstar.plan import sizes_from_gpt, specs_for

    sizes = sizes_from_gpt(shape)
    specs = specs_for(sizes, DEFAULT_CHUNK_SIZE, world_size)
    owners = [owner_of(i, world_size) for i in range(len(specs))]
    return sum(sizes), specs, plan_for_rank([s.capacity for s in specs], owners, 0, lp_bytes, accumulate)


def test_near_the_cap_a_1_21b_gpt_at_two_ranks_releases_every_group():
    """Issue 32: two ranks of a 1.21B GPT (bf16, defaults) on a host with what a run releasing
    every group needs, 1.1 x 14 bytes per parameter and 0.5 GiB per rank: the default keeps none."""
    from ds_patrickstar.integration.host_share import keep_limit, step_bytes

    params, specs, plan = _gpt_plan("2048x22x50304x2", 2, accumulate=False)
    assert 1.20e9 < params < 1.22e9
    fits = int(1.1 * 14 * params) + 2 * (1 << 29)
    step = step_bytes(specs, 2, 2, accumulate=False, prefetch=1)
    assert keep_limit(plan, fits, 2, step) == 0
    # the machine's 23.5 GiB less two process baselines: some groups kept, within what is left
    available = int(21.5 * 2**30)
    kept = keep_limit(plan, available, 2, step)
    assert 0 < kept < plan.total_elements * 2
    assert plan.model_data_bytes + step + kept < available // 2


def test_the_step_counts_the_gathered_storage_prefetch_accumulation_buffers_and_gradients():
    """What a step allocates beyond the model data with no group kept, part by part."""
    from ds_patrickstar.integration.host_share import step_bytes
    from ds_patrickstar.memory.reductions import LIMIT
    from ds_patrickstar.plan import specs_for

    chunk_size = 1 << 10
    sizes = [4 * chunk_size] + [chunk_size // 2] * 6  # a tensor of 4 chunk sizes, then six half-chunk ones
    specs = specs_for(sizes, chunk_size, 2)
    assert specs[0].capacity == specs[1].capacity == 2 * chunk_size  # the big tensor: one group, cut in two
    storage = 2 * (2 * chunk_size) * 2  # W chunks of bf16: this rank's landing slot and the other rank's chunk
    joined = 4 * chunk_size * 2  # the big tensor straddles the cut: its joined buffer
    largest_grad = 2 * 4 * chunk_size * 2  # the largest parameter's gradient, twice (a tied weight)
    gathered = storage + joined
    assert step_bytes(specs, 2, 2, accumulate=False, prefetch=0) == gathered + largest_grad
    assert step_bytes(specs, 2, 2, accumulate=False, prefetch=1) == 2 * gathered + largest_grad
    with_buffers = 2 * gathered + (1 + LIMIT) * storage + largest_grad  # a flat buffer is W chunks
    assert step_bytes(specs, 2, 2, accumulate=True, prefetch=1) == with_buffers


def test_parameters_without_storage_add_no_host_memory():
    """A parameter built under Init holds an empty storage until its chunk gives it values: it frees
    nothing at initialize; tied parameters count once."""
    from ds_patrickstar.integration.host_share import own_bytes

    model = torch.nn.Sequential(torch.nn.Linear(8, 8, bias=False), torch.nn.Linear(8, 8, bias=False))
    assert own_bytes(model) == 2 * 64 * 4
    model[1].weight = model[0].weight
    assert own_bytes(model) == 64 * 4
    model[0].weight.data.untyped_storage().resize_(0)
    assert own_bytes(model) == 0
