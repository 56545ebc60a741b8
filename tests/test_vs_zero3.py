"""ds_patrickstar vs stock DeepSpeed ZeRO-3: same model, same seed, same data, same
DeepSpeed config except ``"stage": "patrickstar"``; per-micro-step losses, final fp32
master weights, final module weights, LR sequence, grad norms must agree.

Both runs happen in this process, stock first. The stock side uses
``stage3_param_persistence_threshold: 0`` so its fetch/release hooks see every quirk.

Self-check of the harness: ``DS_PS_TEST_BACKEND=3 pytest tests/test_vs_zero3.py`` runs
the "ours" side as stock stage 3 too (everything must pass, bit-identically).

Tolerances, and the noise floors they were chosen from
-------------------------------------------------------
Measured on this CPU (torch 2.13, DeepSpeed 0.19.8, 8 steps, lr 1e-3) between stock
ZeRO-3 and an independent plain-torch implementation of the same math
(``run_torch_reference``, removed from tests/harness.py as unused after this measurement: it
is in the git history before issue 17; torch.optim.AdamW foreach on fp32 masters, loss/GA,
fp32 global-norm clipping), over mlp/tied/unused/groups/ckpt x {GA 2, clip 0.1, wd 0.1}:

* fp32: losses rel <= 2.6e-7; weights abs <= 3.0e-7; update-norm rel <= 3.5e-5
  (2.1e-4 on a bias whose only update is weight decay, i.e. a tiny denominator).
  Stock stage 0 / 2 / 3 are bit-identical to each other in fp32.
* bf16: identical losses, weights abs <= 3e-7 (one 5e-6), update rel <= 1.3e-4 --
  provided gradients are accumulated across micro-batches the way ZeRO-3 does (in
  bf16). Accumulating GA micro-batches in fp32 instead (more accurate, also
  legitimate) gives losses rel <= 3.0e-4, weights abs <= 6.1e-5, update rel <= 3.3e-3.
* fp16 (static scale 256 vs DeepSpeed's dynamic 2**8): losses rel <= 4.6e-5,
  weights abs <= 5e-6, update rel <= 2.8e-4.
* For scale: stock *stage 0* with bf16/fp16 (BF16_Optimizer / FP16_Optimizer, which
  round the update through the 2-byte dtype) differs from stage 3 by losses rel up to
  5e-3, weights abs up to 4e-3 (= 4 lr: Adam moves each element by ~lr*sign(grad),
  so a rounding-level change in a near-zero grad flips a 2*lr step) and update rel
  12-15% (62% on the LayerNorm model). That is a *different algorithm*, and the
  low-precision tolerances below are chosen to reject it while accepting both bf16
  and fp32 gradient accumulation.

Chosen (see TOL): fp32 losses/weights rtol 1e-5, atol 1e-6, update rel 1e-3;
bf16/fp16: losses rtol 5e-3 (bf16 has 8 mantissa bits; one weight rounding to the
neighbouring bf16 value shifts the forward by ~2**-9 relative; measured worst 3e-4),
weights elementwise atol 5e-4 (half an LR step; measured worst 6.1e-5), update-norm rel
1e-2 (measured worst 3.3e-3; stage-0-style rounding >= 0.12; a 5% LR error gives 0.05),
module (2-byte) weights atol 5e-4 + rtol 2**-7 (bf16) / 2**-10 (fp16), i.e. the master
tolerance plus one ulp: a master within tolerance can still round to the neighbouring
2-byte value (seen: a LayerNorm weight at 1.0 vs 1.0078 with fp32 GA accumulation).
"""
from __future__ import annotations

import os

import pytest
import torch
from harness import compare, make_config, reference_run, run_training
from quirk_models import QUIRK_MODELS, two_param_groups

_BACKEND_ENV = os.environ.get("DS_PS_TEST_BACKEND", "patrickstar").strip().lower()
OURS_STAGE = 3 if _BACKEND_ENV in ("3", "stage3", "zero3") else "patrickstar"

STEPS = 8
SEED = 1234
LR = 1e-3
CLIP = 0.1  # every model's first-step global grad norm is 0.36 .. 5.6 (checked in the test)

TOL = {
    "fp32": dict(rtol=1e-5, atol=1e-6, loss_rtol=1e-5, loss_atol=1e-6, update_rtol=1e-3),
    "bf16": dict(
        rtol=0.0, atol=5e-4, loss_rtol=5e-3, loss_atol=1e-4, update_rtol=1e-2, lp_rtol=2.0**-7, lp_atol=5e-4
    ),
}
TOL["fp16"] = dict(TOL["bf16"], lp_rtol=2.0**-10)

# Stock ZeRO-3 cannot run some quirks itself; the reference is then an equivalent model.
# outputs_dataclass: stock ZeRO-3 does not look inside plain @dataclass outputs, so a
# module returning one gets no pre-backward hook while its post-backward hook (attached
# to its inputs) still runs. With a tuple/dict top-level output the submodule's release
# slips through (the top module is in the active backward set); when the top module
# returns a dataclass too, backward dies with "active_backward_submodules is empty during
# backward pass". outputs_dict computes the identical loss with identical parameters.
REFERENCE_MODEL = {"outputs_dataclass": "outputs_dict"}

BF16_MODELS = ["tied", "reused", "frozen", "parent_param", "unused", "ckpt_reentrant", "ckpt_nonreentrant"]
FP16_MODELS = ["mlp", "tied", "ckpt_nonreentrant"]

_CFG_KEYS = {"gas", "clip", "lr", "weight_decay", "scheduler", "optimizer_type", "chunk_size", "extra_zero"}


@pytest.fixture(scope="module")
def backend(dist):
    """The stage under test. Importing ds_patrickstar must work (an error here is a failure)."""
    if OURS_STAGE == "patrickstar":
        import ds_patrickstar  # noqa: F401
    return OURS_STAGE


def run_pair(backend, model, dtype, *, steps=STEPS, **kwargs):
    """(ours, ref): stock ZeRO-3 first, then the backend under test, same seed."""
    if backend == 3 and model in REFERENCE_MODEL:
        pytest.skip(f"harness self-check: stock ZeRO-3 cannot run {model!r} itself")
    cfg_kw = {k: v for k, v in kwargs.items() if k in _CFG_KEYS}
    run_kw = {k: v for k, v in kwargs.items() if k not in _CFG_KEYS}
    cfg_kw.setdefault("lr", LR)
    # stock ZeRO-3 runs are cached for the session: several tests compare with the same one
    ref = reference_run(QUIRK_MODELS[REFERENCE_MODEL.get(model, model)], make_config(3, dtype, **cfg_kw), steps, SEED,
                        **run_kw)
    ours = run_training(QUIRK_MODELS[model], make_config(backend, dtype, **cfg_kw), steps, SEED, **run_kw)
    return ours, ref


def check(ours, ref, dtype):
    tol = dict(TOL[dtype])
    lp_rtol, lp_atol = tol.pop("lp_rtol", tol["rtol"]), tol.pop("lp_atol", tol["atol"])
    compare(ours, ref, check_lp=True, lp_rtol=lp_rtol, lp_atol=lp_atol, **tol)


# --------------------------------------------------------------------------------------
# every quirk model
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("model", list(QUIRK_MODELS))
def test_quirk_fp32(backend, model):
    ours, ref = run_pair(backend, model, "fp32")
    check(ours, ref, "fp32")


@pytest.mark.parametrize("model", BF16_MODELS)
def test_quirk_bf16(backend, model):
    ours, ref = run_pair(backend, model, "bf16")
    check(ours, ref, "bf16")


@pytest.mark.parametrize("model", FP16_MODELS)
def test_quirk_fp16(backend, model):
    ours, ref = run_pair(backend, model, "fp16")
    assert ref.skipped_steps == 0 and ref.loss_scales[-1] == 2.0**8, "reference unexpectedly overflowed"
    check(ours, ref, "fp16")


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_unused_params_get_weight_decay(backend, dtype):
    """Stock ZeRO-3 gives never-used params a *zero* gradient (not None), so AdamW's
    decoupled weight decay still shrinks them every step (torch.optim.AdamW with
    grad=None would leave them untouched). The backend must do the same."""
    ours, ref = run_pair(backend, "unused", dtype, weight_decay=0.1)
    if dtype == "fp32":
        for n in ("unused_param", "unused_layer.weight", "unused_layer.bias"):
            init, final = ref.init_weights[n], ref.fp32_weights[n]
            expected = init * (1 - LR * 0.1) ** STEPS
            assert torch.allclose(final, expected, rtol=1e-6, atol=1e-9), f"stock ZeRO-3 changed: {n}"
    check(ours, ref, dtype)


# --------------------------------------------------------------------------------------
# gradient accumulation, clipping
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "model,dtype",
    [("mlp", "fp32"), ("tied", "fp32"), ("reused", "fp32"), ("tied", "bf16"), ("ckpt_reentrant", "bf16"),
     ("mlp", "fp16")]
)
def test_grad_accumulation(backend, model, dtype):
    ours, ref = run_pair(backend, model, dtype, gas=2)
    assert len(ref.losses) == 2 * STEPS
    check(ours, ref, dtype)


@pytest.mark.parametrize(
    "model,dtype,gas", [("groups", "fp32", 1), ("tied", "fp32", 2), ("groups", "bf16", 1), ("reused", "fp16", 2)]
)
def test_gradient_clipping(backend, model, dtype, gas):
    ours, ref = run_pair(backend, model, dtype, clip=CLIP, gas=gas)
    assert ref.grad_norms[0] is not None and ref.grad_norms[0] > 2 * CLIP, (
        f"clip {CLIP} would not clip: first global grad norm {ref.grad_norms[0]}"
    )
    check(ours, ref, dtype)


# --------------------------------------------------------------------------------------
# param groups, schedulers, client optimizers
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_two_param_groups(backend, dtype):
    """Weight decay 0.1 on matrices; no decay and half the LR on biases and LayerNorms."""
    ours, ref = run_pair(
        backend,
        "groups",
        dtype,
        param_groups_fn=lambda m: two_param_groups(m, weight_decay=0.1, no_decay_lr=LR / 2),
    )
    assert ref.lrs[0] == [LR, LR / 2]
    check(ours, ref, dtype)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_warmup_lr_from_config(backend, dtype):
    ours, ref = run_pair(backend, "mlp", dtype, scheduler="WarmupLR")
    lrs = [g[0] for g in ref.lrs]
    assert lrs[0] < lrs[2] < lrs[-1] == pytest.approx(LR), lrs
    check(ours, ref, dtype)


def test_client_torch_scheduler(backend):
    ours, ref = run_pair(
        backend,
        "groups",
        "fp32",
        client_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + s)),
        param_groups_fn=lambda m: two_param_groups(m, weight_decay=0.1),
    )
    assert ref.lrs[0][0] == pytest.approx(LR / 2) and ref.lrs[-1][0] == pytest.approx(LR / (1 + STEPS))
    check(ours, ref, "fp32")


_CLIENT_OPTIMIZERS = {
    # decoupled weight decay
    "torch-AdamW": lambda ps: torch.optim.AdamW(ps, lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1),
    # L2 weight decay (added to the gradient before the moments)
    "torch-Adam": lambda ps: torch.optim.Adam(ps, lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1),
}


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("opt", list(_CLIENT_OPTIMIZERS))
def test_client_optimizer(backend, opt, dtype):
    ours, ref = run_pair(backend, "groups", dtype, optimizer_type=None, client_optimizer=_CLIENT_OPTIMIZERS[opt])
    assert ref.optimizer_class == opt.split("-")[1]
    check(ours, ref, dtype)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_config_adam_means_adamw(backend, dtype):
    """``"type": "Adam"`` in a DeepSpeed config builds FusedAdam with adam_w_mode=True
    (decoupled decay) unless ``"adam_w_mode": false`` is given; match that."""
    ours, ref = run_pair(backend, "groups", dtype, optimizer_type="Adam", weight_decay=0.1)
    check(ours, ref, dtype)


# --------------------------------------------------------------------------------------
# backward styles
# --------------------------------------------------------------------------------------
# engine.backward on the tied model is test_quirk_fp32[tied] (fp32, GA 1) and
# test_grad_accumulation[tied-bf16] (bf16, GA 2): the same runs and checks, not repeated here.
@pytest.mark.parametrize(
    "style,dtype,gas",
    [
        ("torch", "fp32", 1),
        ("torch", "fp32", 2),
        ("torch", "bf16", 2),
        ("torch", "fp16", 1),  # engine.scale(loss).backward(): fp16 needs the loss scaler
    ],
)
def test_backward_style(backend, style, dtype, gas):
    ours, ref = run_pair(backend, "tied", dtype, gas=gas, use_engine_backward=(style == "engine"))
    check(ours, ref, dtype)
    if style == "torch":
        # ours with torch-style backward must match stock ZeRO-3's engine.backward (DeepSpeed divides by GA in a hook)
        ref_engine = reference_run(QUIRK_MODELS["tied"], make_config(3, dtype, gas=gas, lr=LR), STEPS, SEED)
        check(ours, ref_engine, dtype)
