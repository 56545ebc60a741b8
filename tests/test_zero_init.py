"""Issue 43: ``deepspeed.zero.Init`` and stage "patrickstar" (see [Note: stock zero.Init]), against stock ZeRO-3 on
the same model and seed, at 1 and 2 real gloo ranks:

* a model built under stock's ``zero.Init`` (a stage-3 config) and given to a "patrickstar" initialize is taken over:
  the same losses and weights over three steps as stock ZeRO-3 on the same ``zero.Init``-built model;
* ``deepspeed.zero.Init(config_dict_or_path=<our config>)`` is ``ds_patrickstar.Init`` (no pydantic error; the
  same values as a ``ds_patrickstar.Init`` build); trained, it matches stock ZeRO-3 started from those values.

fp32, ~4K parameters, tolerances of test_vs_zero3.py's fp32 runs."""
from __future__ import annotations

import pytest
import torch
from harness import make_config
from multiproc import run_ranks

RTOL, ATOL = 1e-5, 1e-6
STEPS = 3


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32), torch.nn.GELU(),
                               torch.nn.Linear(32, 2))


def _config(stage):
    cfg = make_config(stage, chunk_size=1024, optimizer_type=None)  # a client AdamW: no JIT-built op for stock
    cfg.pop("train_batch_size")
    return cfg


def _train(model, stage, rank):
    """Losses of STEPS steps and the final fp32 weights (full, on every rank)."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    engine = deepspeed.initialize(model=model, config=_config(stage), optimizer=optimizer)[0]
    losses = []
    for step in range(STEPS):
        x = torch.randn(4, 32, generator=torch.Generator().manual_seed(100 * step + rank))
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    weights = {n: safe_get_full_fp32_param(p).detach().clone() for n, p in engine.module.named_parameters()}
    engine.destroy()
    return losses, weights


def _stock_built(rank, world_size, stage, inside=False):
    import deepspeed

    import ds_patrickstar  # noqa: F401

    with deepspeed.zero.Init(config_dict_or_path=_config(3)):
        model = _model()
        if inside:  # initialize inside the open block (stock pauses the block's wrappers meanwhile)
            losses, weights = _train(model, stage, rank)
    assert inside or all(p.numel() == 0 and hasattr(p, "ds_tensor") for p in model.parameters())
    if not inside:
        losses, weights = _train(model, stage, rank)
    linear_is_torch = torch.nn.functional.linear is torch._C._nn.linear
    return losses, weights, linear_is_torch


def _close(ours, stock, what):
    torch.testing.assert_close(torch.tensor(ours[0]), torch.tensor(stock[0]), rtol=RTOL, atol=ATOL, msg=what)
    for name, value in stock[1].items():
        torch.testing.assert_close(ours[1][name], value, rtol=RTOL, atol=ATOL, msg=f"{what} {name}")


@pytest.mark.parametrize("world_size", [1, 2])
def test_model_built_by_stock_zero_init_is_taken_over(world_size):
    ours = run_ranks(_stock_built, world_size, "patrickstar", timeout=120)
    stock = run_ranks(_stock_built, world_size, 3, timeout=120)
    for rank in range(world_size):
        _close(ours[rank], stock[rank], f"rank {rank}")
        assert ours[rank][2], "torch's F.linear is back after the take-over"


def test_initialize_inside_an_open_stock_zero_init_block():
    ours = run_ranks(_stock_built, 1, "patrickstar", True, timeout=120)
    stock = run_ranks(_stock_built, 1, 3, True, timeout=120)
    _close(ours[0], stock[0], "inside the block")


def _our_config_built(rank, world_size, how):
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    import ds_patrickstar

    block = deepspeed.zero.Init(config_dict_or_path=_config("patrickstar")) if how == "zero" else ds_patrickstar.Init(
        config=_config("patrickstar"))
    assert isinstance(block, ds_patrickstar.Init), type(block)
    with block:
        model = _model()
    assert all(p.is_meta for p in model.parameters())
    engine = deepspeed.initialize(model=model, config=_config("patrickstar"),
                                  optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2))[0]
    initial = {n: safe_get_full_fp32_param(p).detach().clone() for n, p in engine.module.named_parameters()}
    engine.destroy()
    return initial


def _from_values(rank, world_size, stage, initial):
    import ds_patrickstar  # noqa: F401

    model = _model()
    model.load_state_dict(initial)
    return _train(model, stage, rank)


@pytest.mark.parametrize("world_size", [1, 2])
def test_zero_init_with_our_config_is_our_init(world_size):
    initial = run_ranks(_our_config_built, world_size, "zero", timeout=120)
    same = run_ranks(_our_config_built, world_size, "ours", timeout=120)
    for rank in range(world_size):
        for name, value in same[rank].items():
            assert torch.equal(initial[rank][name], value), name
    ours = run_ranks(_from_values, world_size, "patrickstar", initial[0], timeout=120)
    stock = run_ranks(_from_values, world_size, 3, initial[0], timeout=120)
    for rank in range(world_size):
        _close(ours[rank], stock[rank], f"rank {rank}")


def _stock_config_untouched(rank, world_size):
    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import Init as StockInit

    import ds_patrickstar  # noqa: F401

    block = deepspeed.zero.Init(config_dict_or_path=_config(3))
    return type(block) is StockInit


def test_zero_init_with_a_stock_config_is_stock():
    assert run_ranks(_stock_config_untouched, 1, timeout=60) == [True]
