"""Issue 43: ``managed_gradient_accumulation: false`` (see [Note: unmanaged gradient accumulation]): the caller's
backward calls accumulate until ``engine.step()``, the boundary; losses, gradients before the step and fp32 values
after it match stock ZeRO-3 on the same model and seed at 1 and 2 real gloo ranks. fp32, ~4K parameters."""
from __future__ import annotations

import pytest
import torch
from harness import make_config, small_mlp
from multiproc import run_ranks

BACKWARDS = (3, 1)  # backward calls before each step


def _run(rank, world_size, stage):
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad

    import ds_patrickstar  # noqa: F401

    model = small_mlp()
    cfg = make_config(stage, chunk_size=1024, lr=1e-2)
    cfg.pop("train_batch_size")
    cfg["managed_gradient_accumulation"] = False
    engine = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())[0]
    losses, grads, micro = [], [], 0
    for backwards in BACKWARDS:
        for _ in range(backwards):
            x = torch.randn(4, 32, generator=torch.Generator().manual_seed(100 * micro + rank))
            loss = engine(x).pow(2).mean()
            engine.backward(loss)
            losses.append(loss.item())
            micro += 1
        grads.append({n: safe_get_full_grad(p).detach().cpu().clone() for n, p in engine.module.named_parameters()})
        engine.step()
    params = {n: safe_get_full_fp32_param(p).detach().cpu().clone() for n, p in engine.module.named_parameters()}
    try:
        with engine.coalesce_grad_reduction():
            pass
        coalesce = None
    except AssertionError as err:
        coalesce = str(err)
    engine.destroy()
    return {"losses": losses, "grads": grads, "params": params, "coalesce": coalesce}


@pytest.mark.parametrize("world_size", [1, 2])
def test_unmanaged_accumulation_matches_zero3(world_size):
    ours, stock = run_ranks(_run, world_size, "patrickstar"), run_ranks(_run, world_size, 3)
    for rank in range(world_size):
        torch.testing.assert_close(ours[rank]["losses"], stock[rank]["losses"], rtol=0, atol=1e-6)
        for step, grads in enumerate(stock[rank]["grads"]):
            for name, value in grads.items():
                torch.testing.assert_close(ours[rank]["grads"][step][name], value, rtol=0, atol=2e-6,
                                           msg=f"rank {rank} step {step} {name}")
        for name, value in stock[rank]["params"].items():
            torch.testing.assert_close(ours[rank]["params"][name], value, rtol=0, atol=2e-6, msg=name)
        assert ours[rank]["coalesce"] == stock[rank]["coalesce"] and "owns the accumulation boundary" in ours[rank][
            "coalesce"]
