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


def _run_twin(rank, world_size, rule):
    """Two backward calls a step on the counter runs' GPT, placement on the strict twin at a budget that evicts."""
    import os
    import sys

    import deepspeed

    import ds_patrickstar  # noqa: F401

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    from gpt_model import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=3, n_head=2, n_embd=32, block_size=16, vocab_size=64))
    zero = {"stage": "patrickstar", "chunk_size": 4096, "device_budget": 420_000, "emulate_accelerator": True,
            "optimizer_placement": rule}
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0, "managed_gradient_accumulation": False,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": zero}
    engine = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())[0]
    gen, losses, steps = torch.Generator().manual_seed(1), [], []
    for _ in range(4):
        for _ in range(2):
            idx = torch.randint(0, 64, (2, 17), generator=gen)
            loss = engine(idx[:, :-1].contiguous(), idx[:, 1:].contiguous())[1]
            engine.backward(loss)
            losses.append(loss.item())
        engine.step()
        steps.append(engine.get_patrickstar_counters())
    engine.destroy()
    return losses, steps


def test_unmanaged_accumulation_under_placement_moves_what_the_model_predicts():
    """With the caller owning the boundary the step writes the sums into the slots (see [Note: unmanaged gradient
    accumulation]): the accumulators go then, instead of following their chunks to the host for nothing, and no
    gradient leaves during backward (none is final before the step). The move model predicts that (see [Note:
    predicted moves]): on the strict twin the bytes each way, payloads and accumulators, are those measured, and the
    step-time model's states give the fill rule's losses."""
    (fill_losses, _), = run_ranks(_run_twin, 1, "fill")
    (losses, steps), = run_ranks(_run_twin, 1, "time")
    assert losses == fill_losses
    for counters in steps[2:]:
        for kind in ("", "accumulator_"):
            for way in ("to_device", "to_host"):
                assert counters[f"predicted_{kind}bytes_{way}"] == counters[f"{kind}bytes_{way}"], (kind, way)
        assert counters["accumulator_bytes_to_host"] == counters["accumulator_bytes_to_device"]
        assert counters["bytes_to_host"] > 0 and counters["grads_released_in_backward"] == 0
