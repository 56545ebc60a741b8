"""Issue 43: ``engine.offload_states()`` / ``reload_states()`` (see [Note: parked engines]) on the strict emulated
accelerator: after the offload its ledger holds nothing of the engine, the reload brings back what was there, and
training after it matches a run without the parking bit for bit; an engine parked and not reloaded trains on as
well (placement brings what is used). One rank (and two, where the partition cache goes first), fp32, ~4K
parameters, a budget that holds the whole model and its optimizer states (so everything starts on the
accelerator)."""
from __future__ import annotations

import pytest
import torch
from harness import make_config, mlp_steps, small_mlp
from multiproc import run_ranks

ZERO = {"emulate_accelerator": True, "device_budget": 1 << 20}


def _run(rank, world_size, park):
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    import ds_patrickstar  # noqa: F401

    model = small_mlp()
    cfg = make_config("patrickstar", chunk_size=1024, lr=1e-2, extra_zero=ZERO)
    cfg.pop("train_batch_size")
    engine = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())[0]
    ledger = engine.optimizer.accel.ledger
    losses = mlp_steps(engine, rank, 3, 0)
    held = [(ledger.total, ledger.by_kind.get("optim", 0))]
    if park:
        engine.offload_states(include=["optim_states"] if park == "states only" else None)
        held.append((ledger.total, ledger.by_kind.get("optim", 0)))
        if park != "no reload":
            engine.reload_states()
            held.append((ledger.total, ledger.by_kind.get("optim", 0)))
    losses += mlp_steps(engine, rank, 3, 3)
    params = {n: safe_get_full_fp32_param(p).detach().cpu().clone() for n, p in engine.module.named_parameters()}
    engine.destroy()
    return {"losses": losses, "params": params, "held": held}


@pytest.mark.parametrize("world_size, park", [(1, "reload"), (1, "no reload"), (1, "states only"), (2, "reload")])
def test_offload_states_empties_the_accelerator_and_training_goes_on_bit_for_bit(world_size, park):
    plain = run_ranks(_run, world_size, None, memo=True)[-1]
    parked = run_ranks(_run, world_size, park)[-1]  # the last rank: with two, it owns fewer chunks
    (total, optim), (parked_total, parked_optim) = parked["held"][:2]
    assert 0 < optim < total and parked_optim == 0, parked["held"]  # the chunks and their fp32 master and moments
    assert parked_total == (total - optim if park == "states only" else 0), parked["held"]  # the chunks stay there
    if park != "no reload":
        assert parked["held"][2] == parked["held"][0]
    assert parked["losses"] == plain["losses"]
    for name, value in plain["params"].items():
        assert torch.equal(parked["params"][name], value), name
