"""Issue 43: gradient accumulation the caller begins at ``gradient_accumulation_steps`` 1 (see [Note: accumulation
begun by the caller]): ``set_gradient_accumulation_boundary(False)`` before backward calls, and several backward
calls in ``coalesce_grad_reduction()``, as DeepSpeed's own tests and clients do. Losses and fp32 values after each
step match stock ZeRO-3 on the same model, seed and calls at 1 and 2 real gloo ranks; on the strict twin with a
budget that moves chunks, the switch comes after a traced GA-1 step (at 1 rank with the move model in scope, at 2
with the agreed gather plan) and trains the same.
fp32, ~4K parameters."""
from __future__ import annotations

import contextlib

import pytest
import torch
from harness import make_config, small_mlp
from multiproc import run_ranks

BACKWARDS = (1, 3, 1, 2)  # backward calls per step; the first step is an ordinary GA-1 step (traced)


def _run(rank, world_size, stage, coalesce=False, budget=None):
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    import ds_patrickstar  # noqa: F401

    model = small_mlp()
    extra = {"emulate_accelerator": True, "device_budget": budget} if budget else None
    cfg = make_config(stage, chunk_size=1024, lr=1e-2, extra_zero=extra)
    cfg.pop("train_batch_size")
    engine = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())[0]
    losses, params, micro = [], [], 0
    for backwards in BACKWARDS:
        with engine.coalesce_grad_reduction() if coalesce else contextlib.nullcontext():
            for i in range(backwards):
                x = torch.randn(4, 32, generator=torch.Generator().manual_seed(100 * micro + rank))
                loss = engine(x).pow(2).mean()
                engine.set_gradient_accumulation_boundary(i == backwards - 1)
                engine.backward(loss)
                losses.append(loss.item())
                micro += 1
        engine.step()
        params.append({n: safe_get_full_fp32_param(p).detach().cpu().clone()
                       for n, p in engine.module.named_parameters()})
    counters = engine.get_patrickstar_counters() if stage == "patrickstar" else {}
    engine.destroy()
    return {"losses": losses, "params": params, "counters": counters}


def _assert_matches(ours, stock, label):
    torch.testing.assert_close(ours["losses"], stock["losses"], rtol=0, atol=1e-6, msg=label)
    for step, values in enumerate(stock["params"]):
        for name, value in values.items():
            torch.testing.assert_close(ours["params"][step][name], value, rtol=0, atol=2e-6,
                                       msg=f"{label}: step {step} {name}")


@pytest.mark.parametrize("world_size", [1, 2])
def test_accumulation_begun_by_the_caller_matches_zero3(world_size):
    stock = run_ranks(_run, world_size, 3)
    coalesced = run_ranks(_run, world_size, "patrickstar", True)
    for rank in range(world_size):
        _assert_matches(coalesced[rank], stock[rank], f"coalesced, rank {rank}")
    if world_size == 1:
        _assert_matches(run_ranks(_run, 1, "patrickstar")[0], stock[0], "manual boundary")


@pytest.mark.parametrize("world_size,budget", [(1, 24_000), (2, 48_000)])
def test_accumulation_begun_after_a_traced_step_on_the_strict_twin(world_size, budget):
    stock = run_ranks(_run, world_size, 3)
    ours = run_ranks(_run, world_size, "patrickstar", world_size > 1, budget)
    for rank in range(world_size):
        _assert_matches(ours[rank], stock[rank], f"strict twin, rank {rank}")
        assert ours[rank]["counters"]["bytes_to_device"] > 0  # the budget moved chunks: placement ran
