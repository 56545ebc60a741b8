"""A client's torch.optim.SGD on stage 'patrickstar' (see [Note: SGD on chunks]): the math against torch's,
training against stock ZeRO-3 with the same SGD (1 and 2 ranks), an exact checkpoint round trip read by
DeepSpeed's fp32 reader too, and the refusals."""
from __future__ import annotations

import pytest
import torch
from harness import compare, make_config, reference_run, run_training
from multiproc import run_ranks
from quirk_models import QUIRK_MODELS, two_param_groups
from test_vs_zero3 import TOL

from ds_patrickstar.optim.sgd_math import SgdHyper, sgd_step_reference

STEPS, SEED, LR = 8, 1234, 0.05

SGDS = {
    "plain": dict(momentum=0.0),
    "nesterov": dict(momentum=0.9, nesterov=True),
    "dampened-maximize": dict(momentum=0.8, dampening=0.3, maximize=True),
}


@pytest.mark.parametrize("kind", list(SGDS))
@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_sgd_math_is_torch_sgd(kind, weight_decay):
    """The reference against torch.optim.SGD over several steps, at float64: bit-identical."""
    gen = torch.Generator().manual_seed(0)
    param = torch.randn(257, generator=gen, dtype=torch.float64)
    torch_param = torch.nn.Parameter(param.clone())
    opt = torch.optim.SGD([torch_param], lr=0.1, weight_decay=weight_decay, foreach=False, **SGDS[kind])
    hyper = SgdHyper.from_group(opt.param_groups[0])
    master, buf, unused = param.clone(), torch.zeros_like(param), torch.zeros_like(param)
    for step in range(1, 5):
        grad = torch.randn(257, generator=gen, dtype=torch.float64)
        torch_param.grad = grad.clone()
        opt.step()
        slot = grad * 4.0  # the slot holds the scaled gradient; grad_scale undoes it
        sgd_step_reference(slot, master, buf, unused, step=step, hyper=hyper, grad_scale=0.25)
        assert torch.equal(master, torch_param.detach()) and torch.equal(slot, master), step
        if hyper.momentum:
            assert torch.equal(buf, opt.state[torch_param]["momentum_buffer"]), step
    assert not unused.any()


def _sgd(kind):
    return lambda groups: torch.optim.SGD(groups, lr=LR, **SGDS[kind])


def _run_pair(kind, dtype, gas=1, scheduler=None):
    cfg = dict(gas=gas, lr=LR, optimizer_type=None)
    kw = dict(client_optimizer=_sgd(kind), client_scheduler=scheduler,
              param_groups_fn=lambda m: two_param_groups(m, weight_decay=0.01))
    configs = [make_config(stage, dtype, **cfg) for stage in (3, "patrickstar")]
    for config in configs:
        config["zero_allow_untested_optimizer"] = True  # stock ZeRO-3 with a torch SGD
    ref = reference_run(QUIRK_MODELS["groups"], configs[0], STEPS, SEED, **kw)
    ours = run_training(QUIRK_MODELS["groups"], configs[1], STEPS, SEED, **kw)
    return ours, ref


@pytest.mark.parametrize("kind,dtype", [("plain", "fp32"), ("nesterov", "fp32"), ("plain", "bf16"),
                                        ("nesterov", "bf16"), ("nesterov", "fp16")])
def test_client_sgd_matches_zero3(dist, kind, dtype):
    ours, ref = _run_pair(kind, dtype, gas=2 if dtype == "bf16" else 1)
    assert ref.optimizer_class == ours.optimizer_class == "SGD"
    assert ref.skipped_steps == ours.skipped_steps == 0
    tol = dict(TOL[dtype])
    lp_rtol, lp_atol = tol.pop("lp_rtol", tol["rtol"]), tol.pop("lp_atol", tol["atol"])
    compare(ours, ref, check_lp=True, lp_rtol=lp_rtol, lp_atol=lp_atol, **tol)


def test_client_sgd_follows_a_client_scheduler(dist):
    ours, ref = _run_pair("nesterov", "fp32", scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 2, 0.5))
    assert ref.lrs[-1][0] == pytest.approx(LR / 16) and ours.lrs == ref.lrs
    tol = dict(TOL["fp32"])
    compare(ours, ref, check_lp=True, lp_rtol=tol["rtol"], lp_atol=tol["atol"], **tol)


# ---- 2 ranks, real processes -------------------------------------------------------------------
STEPS_DP, HALF = 6, 3


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 96), torch.nn.GELU(), torch.nn.Linear(96, 32), torch.nn.GELU(),
                               torch.nn.Linear(32, 4))  # 4868 elements: 6 chunks of 1024


def _engine(stage, optimizer="sgd", zero_extra=None):
    import deepspeed

    import ds_patrickstar  # noqa: F401

    model = _model()
    groups = [{"params": [m.weight for m in model if hasattr(m, "weight")], "weight_decay": 0.01},
              {"params": [m.bias for m in model if hasattr(m, "bias")], "weight_decay": 0.0}]
    opt = (torch.optim.SGD(groups, lr=0.1, momentum=0.9, nesterov=True) if optimizer == "sgd"
           else torch.optim.Adam(groups, lr=1e-2))
    zero = {"stage": stage, "chunk_size": 1024, **(zero_extra or {})} if stage == "patrickstar" else {"stage": stage}
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "zero_optimization": zero,
           "zero_allow_untested_optimizer": True, "gradient_clipping": 1.0}
    return deepspeed.initialize(model=model, config=cfg, optimizer=opt, model_parameters=model.parameters())[0]


def _train(engine, rank, steps):
    gen = torch.Generator().manual_seed(100 + rank)
    batches = [(torch.randn(4, 16, generator=gen), torch.randn(4, 4, generator=gen)) for _ in range(STEPS_DP * 2)]
    losses = []
    for x, y in batches[2 * steps.start:2 * steps.stop]:
        loss = ((engine(x) - y) ** 2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _weights(engine, stage):
    from deepspeed.utils import safe_get_full_fp32_param

    if stage == "patrickstar":
        return engine.get_fp32_state_dict()
    return {n: safe_get_full_fp32_param(p) for n, p in engine.module.named_parameters()}


def _whole(rank, world_size, stage, zero_extra=None):
    from deepspeed.utils import safe_get_full_optimizer_state

    engine = _engine(stage, zero_extra=zero_extra)
    result = {"losses": _train(engine, rank, range(0, STEPS_DP)), "weights": _weights(engine, stage)}
    result["momentum"] = {n: safe_get_full_optimizer_state(p, "momentum_buffer")
                          for n, p in engine.module.named_parameters()}
    if stage == "patrickstar":
        states = engine.optimizer.optim_states
        result.update(on_host=len(states.states) - len(states.on_device), spilled=len(states.spilled))
    return result


def test_two_ranks_match_zero3():
    ref, ours = (run_ranks(_whole, 2, stage) for stage in (3, "patrickstar"))
    for r, o in zip(ref, ours):
        torch.testing.assert_close(torch.tensor(o["losses"]), torch.tensor(r["losses"]), rtol=1e-5, atol=1e-6)
        for name, value in r["weights"].items():
            torch.testing.assert_close(o["weights"][name], value, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(o["momentum"][name], r["momentum"][name], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("where", ["host_states_overlapped", "disk_tier"])
def test_states_on_the_host_or_disk_change_nothing(tmp_path, where):
    """SGD where placement puts some states on the host (updated on the host worker behind the next forward)
    or where the disk tier spills them (updated piece by piece): bit-identical to the run with every state in
    memory beside its chunk."""
    extra = ({"emulate_accelerator": True, "device_budget": 60_000, "overlap_host_adam": True}
             if where == "host_states_overlapped" else
             {"offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path), "buffer_count": 4,
                                    "buffer_size": 1024}, "host_budget": 20_000})
    base = run_ranks(_whole, 1, "patrickstar", memo=True)[0]
    moved = run_ranks(_whole, 1, "patrickstar", extra)[0]
    assert (moved["on_host"] if where == "host_states_overlapped" else moved["spilled"]) >= 2
    assert moved["losses"] == base["losses"]
    assert all(torch.equal(moved["weights"][n], v) for n, v in base["weights"].items())


def _states(engine):
    """The optimizer's state dict, its tensors copied (those of host states are the states themselves)."""
    state = engine.optimizer.state_dict()
    state["chunks"] = {cid: {k: v.clone() for k, v in states.items()} for cid, states in state["chunks"].items()}
    return state


def _save_half(rank, world_size, ckpt_dir):
    engine = _engine("patrickstar")
    losses = _train(engine, rank, range(0, HALF))
    engine.save_checkpoint(ckpt_dir)
    return {"losses": losses, "fp32": engine.get_fp32_state_dict(), "state": _states(engine)}


def _resume(rank, world_size, ckpt_dir):
    engine = _engine("patrickstar")
    engine.load_checkpoint(ckpt_dir)
    state = _states(engine)
    losses = _train(engine, rank, range(HALF, STEPS_DP))
    return {"losses": losses, "state": state, "weights": engine.get_fp32_state_dict()}


def test_checkpoint_round_trip_is_exact(tmp_path):
    """Save after 3 steps, load into a fresh engine: the states (master, momentum) read back bit for bit,
    the resumed run equals the uninterrupted one, and DeepSpeed's fp32 reader reads the masters."""
    whole = run_ranks(_whole, 2, "patrickstar")
    saved = run_ranks(_save_half, 2, str(tmp_path))
    resumed = run_ranks(_resume, 2, str(tmp_path))
    for w, s, r in zip(whole, saved, resumed):
        assert s["state"]["update"] == r["state"]["update"] == "SGD"
        assert s["state"]["group_steps"] == r["state"]["group_steps"] == [HALF, HALF]
        for cid, states in s["state"]["chunks"].items():
            for key, values in states.items():
                assert torch.equal(r["state"]["chunks"][cid][key], values), (cid, key)
        assert any(states["exp_avg"].any() for states in s["state"]["chunks"].values())  # momentum kept
        assert s["losses"] + r["losses"] == w["losses"]
        assert all(torch.equal(r["weights"][n], v) for n, v in w["weights"].items())
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    read = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path))
    assert all(torch.equal(read[n], v) for n, v in saved[0]["fp32"].items())


def _load_into_adam(rank, world_size, ckpt_dir):
    from ds_patrickstar.io.commit import CheckpointError

    engine = _engine("patrickstar", optimizer="adam")
    with pytest.raises(CheckpointError, match=r"saved by SGD and this run's optimizer is Adam"):
        engine.load_checkpoint(ckpt_dir)
    engine = _engine("patrickstar", optimizer="adam")
    engine.load_checkpoint(ckpt_dir, load_optimizer_states=False, load_lr_scheduler_states=False)
    return engine.get_fp32_state_dict()


def test_sgd_states_do_not_load_into_adam(tmp_path):
    saved = run_ranks(_save_half, 1, str(tmp_path))[0]["fp32"]
    loaded = run_ranks(_load_into_adam, 1, str(tmp_path))[0]
    assert all(torch.equal(loaded[n], v) for n, v in saved.items())
