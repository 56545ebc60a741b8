"""Issue 43: ZeRO-3's per-parameter API on chunk parameters against stock ZeRO-3, same model and seed, at 1 and 2
real gloo ranks (see [Note: ZeRO-3 parameter attributes]): ``ds_*`` attributes, ``safe_get/set_full_fp32_param``,
``safe_get/set_full_optimizer_state``, the ``_local_`` shares, ``GatheredParameters(modifier_rank=0)``, and an
engine without an optimizer (a reference model, see [Note: engine without an optimizer]). fp32, ~4K parameters."""
from __future__ import annotations

import pytest
import torch
from harness import make_config
from multiproc import run_ranks

STATE_KEYS = ("exp_avg", "exp_avg_sq")


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32), torch.nn.GELU(),
                               torch.nn.Linear(32, 2))  # 4,258 parameters: several 1,024-element chunks


def _config(stage, optimizer=True):
    cfg = make_config(stage, chunk_size=1024, lr=1e-2, optimizer_type="AdamW" if optimizer else None)
    cfg.pop("train_batch_size")
    return cfg


def _step(engine, rank, step):
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(100 * step + rank))
    engine.backward(engine(x).pow(2).mean())
    engine.step()


def _full(engine):
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    out = {}
    for name, param in engine.module.named_parameters():
        out[name] = safe_get_full_fp32_param(param).detach().cpu().clone()
        for key in STATE_KEYS:
            out[f"{name}:{key}"] = safe_get_full_optimizer_state(param, key).detach().cpu().clone()
    return out


def _api_run(rank, world_size, stage):
    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    from deepspeed.utils import safe_get_local_fp32_param, safe_set_full_fp32_param, safe_set_full_optimizer_state

    import ds_patrickstar  # noqa: F401

    model = _model()
    shapes = {name: p.shape for name, p in model.named_parameters()}
    engine = deepspeed.initialize(model=model, config=_config(stage), model_parameters=model.parameters())[0]
    params = dict(engine.module.named_parameters())
    attrs = {n: (p.ds_shape, p.ds_numel, p.ds_status) for n, p in params.items()}
    assert all(a == (shapes[n], shapes[n].numel(), ZeroParamStatus.NOT_AVAILABLE) for n, a in attrs.items()), attrs
    assert len({p.ds_id for p in params.values()}) == len(params)
    # every tensor of this model is under the persistence threshold: every one persists, as stock's (ours: with data
    # parallelism, by chunk group; see [Note: persistent chunk groups])
    if stage == "patrickstar":
        assert all(p.ds_persist for p in params.values()) is (world_size > 1)
    for step in range(2):
        _step(engine, rank, step)
    trained = _full(engine)
    local = {n: safe_get_local_fp32_param(p).detach().cpu().reshape(-1).clone() for n, p in params.items()}
    safe_set_full_fp32_param(params["2.weight"], trained["2.weight"] * 0.5)
    safe_set_full_optimizer_state(params["2.weight"], torch.zeros(64 * 32), "exp_avg")
    after_set = _full(engine)
    with deepspeed.zero.GatheredParameters([params["0.weight"], params["4.bias"]], modifier_rank=0):
        gathered = params["0.weight"].detach().clone()
        if rank == 0:
            params["0.weight"].data.add_(1.0)
            params["4.bias"].data.fill_(0.25)
    after_gather = _full(engine)
    module = engine._zero3_consolidated_16bit_state_dict()  # the module's values (stock: its 16-bit partitions)
    _step(engine, rank, 2)
    final = _full(engine)
    engine.destroy()
    return {"trained": trained, "local": local, "after_set": after_set, "gathered": gathered,
            "after_gather": after_gather, "module": module, "final": final}


def _close(a, b, what):
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=2e-6, msg=f"{what} {key}")


@pytest.mark.parametrize("world_size", [1, 2])
def test_fp32_params_and_optimizer_states_match_zero3(world_size):
    ours, stock = run_ranks(_api_run, world_size, "patrickstar"), run_ranks(_api_run, world_size, 3)
    for rank in range(world_size):
        for what in ("trained", "after_set"):
            _close(ours[rank][what], stock[rank][what], f"rank {rank} {what}")
        torch.testing.assert_close(ours[rank]["gathered"], stock[rank]["gathered"], rtol=0, atol=2e-6)
    # modifier_rank's change reaches the module's values and the fp32 masters (stock's fp32 masters keep the old
    # values; on this CPU its consolidated state dict did not show the change either), so no stock comparison here
    trained, after_set, after_gather = ours[0]["trained"], ours[0]["after_set"], ours[0]["after_gather"]
    assert torch.equal(ours[0]["module"]["0.weight"], after_set["0.weight"] + 1.0)
    assert torch.equal(after_set["2.weight"], trained["2.weight"] * 0.5)
    assert not after_set["2.weight:exp_avg"].any()
    assert torch.equal(after_gather["0.weight"], after_set["0.weight"] + 1.0)  # rank 0's change, on every rank
    assert torch.equal(after_gather["4.bias"], torch.full((2,), 0.25))
    for name in ours[0]["local"]:  # the ranks' shares, in rank order, are the parameter
        shares = torch.cat([ours[r]["local"][name] for r in range(world_size)])
        torch.testing.assert_close(shares, trained[name].reshape(-1), rtol=0, atol=0, msg=name)


def _reference_model(rank, world_size, stage):
    import deepspeed

    import ds_patrickstar  # noqa: F401

    model = _model()
    engine = deepspeed.initialize(model=model, config=_config(stage, optimizer=False))[0]
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(rank))
    with torch.no_grad():
        out = engine(x).detach().clone()
    engine.destroy()
    return out


@pytest.mark.parametrize("world_size", [1, 2])
def test_an_engine_without_an_optimizer_runs_forwards_as_zero3(world_size):
    ours = run_ranks(_reference_model, world_size, "patrickstar")
    stock = run_ranks(_reference_model, world_size, 3)
    for rank in range(world_size):
        torch.testing.assert_close(ours[rank], stock[rank], rtol=0, atol=1e-6)
