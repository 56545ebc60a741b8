"""Issue 43: ``engine.empty_partition_cache()`` (see [Note: the partition cache]): the chunk groups gathered
after a forward (kept for the backward) go from the strict emulated accelerator's ledger, and training goes
on bit for bit as without the call; 2 real gloo ranks (with one nothing is gathered). fp32, ~4K parameters."""
from __future__ import annotations

import torch
from harness import make_config, small_mlp
from multiproc import run_ranks

ZERO = {"emulate_accelerator": True, "device_budget": 1 << 20}


def _run(rank, world_size, empty):
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    import ds_patrickstar  # noqa: F401

    model = small_mlp()
    cfg = make_config("patrickstar", chunk_size=1024, lr=1e-2, extra_zero=ZERO)
    cfg.pop("train_batch_size")
    engine = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())[0]
    ledger, losses, held = engine.optimizer.accel.ledger, [], []
    for step in range(3):
        x = torch.randn(4, 32, generator=torch.Generator().manual_seed(100 * step + rank))
        loss = engine(x).pow(2).mean()
        held.append(ledger.total)
        if empty:
            engine.empty_partition_cache()  # between the forward and its backward: the kept groups go
            held.append(ledger.total)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    params = {n: safe_get_full_fp32_param(p).detach().cpu().clone() for n, p in engine.module.named_parameters()}
    engine.destroy()
    return {"losses": losses, "params": params, "held": held}


def test_empty_partition_cache_releases_the_gathered_groups_and_training_goes_on():
    emptied, plain = run_ranks(_run, 2, True), run_ranks(_run, 2, False)
    for rank in range(2):
        held = emptied[rank]["held"]
        drops = [before - after for before, after in zip(held[::2], held[1::2])]
        assert drops[0] >= 0 and all(drop > 0 for drop in drops[1:]), held  # the first, traced forward keeps none
        assert emptied[rank]["losses"] == plain[rank]["losses"]
        for name, value in plain[rank]["params"].items():
            assert torch.equal(emptied[rank]["params"][name], value), name
