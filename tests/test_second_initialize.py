"""Issue 43: a second ``deepspeed.initialize`` on a model a live engine holds (see [Note: a second initialize on
a live model]): the new engine takes the model over and trains on from the first one's values as stock ZeRO-3's
does (same losses and fp32 values, 2 real gloo ranks), and the old engine refuses further use by name. fp32."""
from __future__ import annotations

import torch
from harness import make_config, mlp_steps, small_mlp
from multiproc import run_ranks


def _run(rank, world_size, stage):
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    import ds_patrickstar  # noqa: F401

    model = small_mlp()
    cfg = make_config(stage, chunk_size=1024, lr=1e-2)
    cfg.pop("train_batch_size")
    first = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())[0]
    losses = mlp_steps(first, rank, 2, 0)
    second = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())[0]
    losses += mlp_steps(second, rank, 2, 2)
    params = {n: safe_get_full_fp32_param(p).detach().cpu().clone() for n, p in second.module.named_parameters()}
    refused = None
    try:
        first(torch.ones(4, 32))
    except RuntimeError as err:
        refused = str(err)
    second.destroy()
    first.destroy()
    return {"losses": losses, "params": params, "refused": refused}


def test_a_second_initialize_takes_the_model_over_as_zero3():
    ours, stock = run_ranks(_run, 2, "patrickstar"), run_ranks(_run, 2, 3)
    for rank in range(2):
        torch.testing.assert_close(ours[rank]["losses"], stock[rank]["losses"], rtol=0, atol=1e-6)
        for name, value in stock[rank]["params"].items():
            torch.testing.assert_close(ours[rank]["params"][name], value, rtol=0, atol=2e-6, msg=name)
        assert "taken over by a later deepspeed.initialize" in ours[rank]["refused"]
        assert stock[rank]["refused"] is None  # stock's old engine still runs (on the partitions it shares)
