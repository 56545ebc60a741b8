"""Issue 43: ZeRO-3's gradient API on chunks (``safe_get/set_full_grad``, ``safe_get/set_local_grad``,
``safe_update_full_grad_vectorized``) against stock ZeRO-3 on the same model and seed, at 1 and 2 real gloo
ranks, with gradient accumulation: the values before the boundary (the accumulators), after it (the slots), and
what a changed gradient does to the step (see [Note: gradients between backward and step]). fp32, ~4K params."""
from __future__ import annotations

import pytest
import torch
from harness import make_config
from multiproc import run_ranks

GAS = 2


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32), torch.nn.GELU(),
                               torch.nn.Linear(32, 2))  # 4,258 parameters: several 1,024-element chunks


def _micro_step(engine, rank, step):
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(100 * step + rank))
    engine.backward(engine(x).pow(2).mean())


def _grads(engine):
    from deepspeed.utils import safe_get_full_grad

    return {n: safe_get_full_grad(p).detach().cpu().clone() for n, p in engine.module.named_parameters()}


def _grad_run(rank, world_size, stage, clip=0.0):
    import deepspeed
    from deepspeed.utils import safe_get_local_grad, safe_set_full_grad, safe_update_full_grad_vectorized

    import ds_patrickstar  # noqa: F401

    model = _model()
    cfg = make_config(stage, chunk_size=1024, lr=1e-2, gas=GAS, clip=clip)
    cfg.pop("train_batch_size")
    engine = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())[0]
    params = dict(engine.module.named_parameters())
    _micro_step(engine, rank, 0)
    engine.step()  # not the boundary: nothing applied
    mid = _grads(engine)  # the first micro-step's gradient, reduced (stock: its grad partition)
    _micro_step(engine, rank, 1)
    boundary = _grads(engine)
    local = {n: safe_get_local_grad(p).detach().cpu().reshape(-1).clone() for n, p in params.items()}
    safe_set_full_grad(params["2.weight"], boundary["2.weight"] * 0.5)
    safe_update_full_grad_vectorized([params["0.bias"], params["4.weight"]], lambda g, p: g * 0 + 0.125)
    after_set = _grads(engine)
    engine.step()
    from deepspeed.utils import safe_get_full_fp32_param

    stepped = {n: safe_get_full_fp32_param(p).detach().cpu().clone() for n, p in params.items()}
    stepped["global grad norm"] = torch.tensor(float(engine.get_global_grad_norm()), dtype=torch.float64)
    outside = None
    if stage == "patrickstar":
        try:
            _grads(engine)
        except RuntimeError as err:
            outside = str(err)
    engine.destroy()
    return {"mid": mid, "boundary": boundary, "local": local, "after_set": after_set, "stepped": stepped,
            "outside": outside}


@pytest.mark.parametrize("world_size,clip", [(1, 0.0), (2, 0.0), (1, 0.05)], ids=["1", "2", "1-clipped"])
def test_gradients_match_zero3_before_and_at_the_boundary(world_size, clip):
    """With clipping, the gradients set before the step are those clipped (their norm taken again: before, the norm
    taken during backward clipped them)."""
    ours = run_ranks(_grad_run, world_size, "patrickstar", clip)
    stock = run_ranks(_grad_run, world_size, 3, clip)
    for rank in range(world_size):
        for what in ("mid", "boundary", "after_set", "stepped"):
            for name, value in stock[rank][what].items():
                torch.testing.assert_close(ours[rank][what][name], value, rtol=2e-6, atol=2e-6,
                                           msg=f"rank {rank} {what} {name}")
    first = ours[0]
    assert not torch.equal(first["mid"]["0.weight"], first["boundary"]["0.weight"])  # the second micro-step added
    assert torch.equal(first["after_set"]["2.weight"], first["boundary"]["2.weight"] * 0.5)
    assert torch.equal(first["after_set"]["4.weight"], torch.full((2, 32), 0.125))
    for name in first["local"]:  # the ranks' shares, in rank order, are the gradient
        shares = torch.cat([ours[r]["local"][name] for r in range(world_size)])
        torch.testing.assert_close(shares, first["boundary"][name].reshape(-1), rtol=0, atol=0, msg=name)
    assert first["outside"] is not None and "after engine.backward() and before step()" in first["outside"]
