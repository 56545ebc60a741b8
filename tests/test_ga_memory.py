"""What gradient accumulation costs with data parallelism: memory and reduce-scatter volume.

A rank keeps an fp32 accumulator for its owned chunks only; each micro-step's gradient is
reduce-scattered into the owner's accumulator (see [Note: gradient accumulation]). Measured
on a small bf16 GPT at 2 ranks: the accelerator ledger's peak during a step's micro-steps (every
byte the backend holds: chunks, gathered copies, accumulators, gradient buffers, optimizer
states), GA 2 against GA 1.
"""
import os
import sys

import pytest
import torch
from multiproc import run_ranks

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

STEPS = 2
CHUNK = 4096


def _gpt():
    from gpt_model import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=4, n_head=2, n_embd=64, block_size=16, vocab_size=256))


def _worker(rank, world_size, gas):
    import deepspeed

    import ds_patrickstar  # noqa: F401

    model = _gpt()
    n_params = sum(p.numel() for p in model.parameters())
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": gas,
           "zero_optimization": {"stage": "patrickstar", "chunk_size": CHUNK},
           "bf16": {"enabled": True}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    engine, *_ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
    ledger = engine.optimizer.accel.ledger
    gen = torch.Generator().manual_seed(rank)
    peak = 0
    for _ in range(STEPS):
        for _ in range(gas):
            tokens = torch.randint(0, 256, (2, 17), generator=gen)
            logits = engine(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, 256), tokens[:, 1:].reshape(-1))
            engine.backward(loss)
            peak = max(peak, ledger.peak)  # reset at every optimizer step: read before it
            engine.step()
    counters = engine.optimizer.last_step_counters
    return {"peak": peak, "params": n_params, "scattered": counters["bytes_reduce_scattered"],
            "reduce_scatters": counters["reduce_scatters"], "groups": engine.optimizer.chunk_map.num_groups}


def test_accumulation_keeps_fp32_accumulators_for_owned_chunks_only():
    world_size = 2
    ga1 = run_ranks(_worker, world_size, 1)
    ga2 = run_ranks(_worker, world_size, 2)
    for one, two in zip(ga1, ga2):
        extra = (two["peak"] - one["peak"]) / one["params"]
        # owned fp32 accumulators: 4 / W B/param, plus the gradient buffers of the few groups whose
        # reduce-scatter is in flight; an accumulator for every chunk would be 4 B/param and more
        assert extra <= 4 / world_size + 1.0, (extra, one, two)
        # every micro-step reduce-scatters every group once: GA x the reduce-scatter volume of GA 1
        assert two["reduce_scatters"] == 2 * one["reduce_scatters"] == 2 * one["groups"], (one, two)
        assert two["scattered"] == 2 * one["scattered"], (one, two)


def _collectives_worker(rank, world_size, gas):
    """Counts the collectives on lists and on one flat tensor during a step on the strict emulated
    accelerator, and checks that each flat tensor is charged to the device ledger: a group's
    storage (charged as ``chunk`` while gathered) or a micro-step's gradient buffer."""
    import deepspeed
    import torch.distributed as dist

    import ds_patrickstar  # noqa: F401
    from ds_patrickstar.groups import comm

    model = _gpt()
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": gas,
           "zero_optimization": {"stage": "patrickstar", "chunk_size": CHUNK, "emulate_accelerator": True,
                                 "device_budget": 1 << 26},
           "bf16": {"enabled": True}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    engine, *_ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
    opt = engine.optimizer
    ledger, chunk_map, store = opt.accel.ledger, opt.chunk_map, opt.parts.store
    storages = [store.group_storage(chunk_map.group_members(g)) for g in range(chunk_map.num_groups)]
    calls = {"list": 0, "single": 0, "uncharged": 0, "gather_list": 0, "gather_single": 0, "not_views": 0}
    on_lists, gather_lists = dist.reduce_scatter, dist.all_gather
    single = getattr(comm, "_reduce_scatter_single", dist.reduce_scatter_single)
    gather_single = comm._all_gather_single

    def counted_list(*args, **kwargs):
        calls["list"] += 1
        return on_lists(*args, **kwargs)

    def counted_single(output, flat, **kwargs):
        calls["single"] += 1
        group_storage = any(flat.untyped_storage().data_ptr() == s.untyped_storage().data_ptr() for s in storages)
        if not group_storage and ledger.by_kind.get("grad_buffer", 0) < flat.numel() * flat.element_size():
            calls["uncharged"] += 1
        return single(output, flat, **kwargs)

    def counted_gather_list(*args, **kwargs):
        calls["gather_list"] += 1
        return gather_lists(*args, **kwargs)

    def counted_gather_single(output, mine, **kwargs):
        calls["gather_single"] += 1
        return gather_single(output, mine, **kwargs)

    dist.reduce_scatter, dist.all_gather = counted_list, counted_gather_list
    comm._reduce_scatter_single, comm._all_gather_single = counted_single, counted_gather_single
    try:  # a kept process: the counting wrappers go when the job ends
        for group, storage in enumerate(storages):  # the other ranks' chunks are views of the group's storage
            for chunk in chunk_map.group_members(group):
                shared = chunk.payload.untyped_storage()._cdata == storage.untyped_storage()._cdata
                if not chunk_map.is_owned(chunk) and not shared:
                    calls["not_views"] += 1
        gen = torch.Generator().manual_seed(rank)
        for _ in range(gas):
            tokens = torch.randint(0, 256, (2, 17), generator=gen)
            logits = engine(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, 256), tokens[:, 1:].reshape(-1))
            engine.backward(loss)
            engine.step()
    finally:
        dist.reduce_scatter, dist.all_gather = on_lists, gather_lists
        comm._reduce_scatter_single, comm._all_gather_single = single, gather_single
    return {**calls, "groups": chunk_map.num_groups, "all_gathers": opt.last_step_counters["all_gathers"]}


@pytest.mark.parametrize("gas", [1, 2])
def test_collectives_run_in_place_on_flat_tensors_in_the_ledger(gas):
    """Every all-gather receives in place into its group's storage, of which the other ranks'
    chunks are views (all_gather_single; see [Note: gathered group storage]), and every micro-step
    reduce-scatters each group's gradients from one flat tensor charged to the ledger
    (reduce_scatter_single, in place; see [Note: flat group buffers]): never a list, which the
    process group would flatten into a temporary of its own, outside the budget."""
    for rank in run_ranks(_collectives_worker, 2, gas):
        assert rank["single"] == gas * rank["groups"], rank
        assert rank["list"] == 0 and rank["gather_list"] == 0, rank
        assert rank["uncharged"] == 0 and rank["not_views"] == 0, rank
        assert rank["gather_single"] >= rank["groups"], rank
