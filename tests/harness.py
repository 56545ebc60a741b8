"""Harness that trains a model with a DeepSpeed config and records what a
backend must reproduce: per-micro-step losses, final fp32 master weights,
final low-precision module weights, global grad norms, LRs and loss scales.

Typical use (stock ZeRO-3 first, then the backend under test, same seed)::

    from harness import make_config, run_training, compare
    from quirk_models import QUIRK_MODELS

    ref = run_training(QUIRK_MODELS["mlp"], make_config(3, "fp32"), steps=8, seed=0)
    ours = run_training(QUIRK_MODELS["mlp"], make_config("patrickstar", "fp32"), steps=8, seed=0)
    compare(ours, ref, rtol=1e-5, atol=1e-6)

Runs happen in-process on a single-rank gloo group (see :func:`ensure_distributed`);
each engine is destroyed and garbage-collected before ``run_training`` returns.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import math
import os
import socket
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

# One thread: these models' ops are too small to gain from a second one, and on this 2-core
# machine a second thread mostly spins (tests/test_vs_zero3.py -k quirk_fp32: 43 s user CPU with
# two, 17 s with one). tests/test_kernels.py runs on two (and checks 1, 2 and 3 threads alike).
NUM_THREADS = 1
MICRO_BATCH = 8  # the batch size every quirk model's batch_fn produces

_ENV_READY = False
_DIST_READY = False


# --------------------------------------------------------------------------------------
# Process / distributed setup
# --------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def setup_single_process_env(num_threads: int = NUM_THREADS) -> None:
    """Env for a single-rank DeepSpeed world + fixed threads. Idempotent.

    The thread count is ``OMP_NUM_THREADS`` where the environment sets one: a rank of
    tests/multiproc's pools runs on one thread (ranks sharing this machine's cores with two
    threads each spent most of their CPU time in idle threads' spinning: 5x the CPU time, 5x
    the wall time of a 2-rank run of the GPT in tests/test_dp_overlap.py)."""
    global _ENV_READY
    if _ENV_READY:
        return
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    num_threads = int(os.environ.setdefault("OMP_NUM_THREADS", str(num_threads)))
    torch.set_num_threads(num_threads)
    torch.use_deterministic_algorithms(False)
    _ENV_READY = True


def ensure_distributed() -> None:
    """Create the single-rank gloo group from a file store (once), then let
    DeepSpeed's comm layer adopt it. Safe to call many times."""
    global _DIST_READY
    setup_single_process_env()
    if _DIST_READY:
        return
    import torch.distributed as tdist

    if not tdist.is_initialized():
        store_dir = tempfile.mkdtemp(prefix="ds_ps_store_")
        tdist.init_process_group(
            "gloo", init_method=f"file://{os.path.join(store_dir, 'store')}", rank=0, world_size=1
        )
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    _DIST_READY = True


# --------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------
def make_config(
    stage: int | str,
    dtype: str = "fp32",
    gas: int = 1,
    clip: float = 0.0,
    lr: float = 1e-3,
    weight_decay: float = 0.0,
    scheduler: None | str | dict = None,
    optimizer_type: str | None = "AdamW",
    chunk_size: int = 4096,
    extra_zero: dict | None = None,
    micro_batch: int = MICRO_BATCH,
) -> dict:
    """A DeepSpeed config dict.

    stage: 0, 1, 2, 3 (stock) or "patrickstar".
    dtype: "fp32", "bf16" or "fp16" (fp16: dynamic loss scale starting at 2**8).
    scheduler: None, "WarmupLR" (linear warmup 0 -> lr over 4 steps), or a full
        DeepSpeed ``"scheduler"`` block (dict with "type" and "params").
    optimizer_type: DeepSpeed optimizer name for the ``"optimizer"`` block, or None
        to leave it out (needed when passing a client optimizer).
    extra_zero: merged into the ``"zero_optimization"`` block last.
    """
    if dtype not in ("fp32", "bf16", "fp16"):
        raise ValueError(f"dtype must be fp32/bf16/fp16, got {dtype!r}")
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": gas,
        "train_batch_size": micro_batch * gas,  # world size 1
        "gradient_clipping": clip,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if optimizer_type is not None:
        cfg["optimizer"] = {
            "type": optimizer_type,
            "params": {"lr": lr, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": weight_decay},
        }
    if scheduler is not None:
        if isinstance(scheduler, str):
            if scheduler != "WarmupLR":
                raise ValueError("string scheduler shortcut only supports 'WarmupLR'; pass a dict")
            scheduler = {
                "type": "WarmupLR",
                "params": {
                    "warmup_min_lr": 0.0,
                    "warmup_max_lr": lr,
                    "warmup_num_steps": 4,
                    "warmup_type": "linear",
                },
            }
        cfg["scheduler"] = copy.deepcopy(scheduler)
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif dtype == "fp16":
        cfg["fp16"] = {
            "enabled": True,
            "loss_scale": 0,  # dynamic
            "initial_scale_power": 8,
            "loss_scale_window": 1000,
            "hysteresis": 2,
            "min_loss_scale": 1,
        }
    if stage == "patrickstar":
        zero: dict[str, Any] = {"stage": "patrickstar", "chunk_size": chunk_size}
    elif stage in (0, 1, 2, 3):
        zero = {"stage": stage}
        if stage == 3:
            # Partition every parameter (the default threshold of 1e5 elements would keep
            # all params of these tiny models persistent, so the stock fetch/release hooks,
            # and so each quirk, would never be exercised on the reference side).
            zero["stage3_param_persistence_threshold"] = 0
    else:
        raise ValueError(f"stage must be 0-3 or 'patrickstar', got {stage!r}")
    if extra_zero:
        zero.update(extra_zero)
    cfg["zero_optimization"] = zero
    return cfg


def config_dtype(config: dict) -> torch.dtype:
    if config.get("bf16", {}).get("enabled") or config.get("bfloat16", {}).get("enabled"):
        return torch.bfloat16
    if config.get("fp16", {}).get("enabled"):
        return torch.float16
    return torch.float32


def is_patrickstar(config: dict) -> bool:
    return config.get("zero_optimization", {}).get("stage") == "patrickstar"


def zero_stage(config: dict) -> int | str:
    return config.get("zero_optimization", {}).get("stage", 0)


# --------------------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------------------
@dataclass
class RunResult:
    losses: list[float]  # one per micro-step, in order
    fp32_weights: dict[str, torch.Tensor]  # full fp32 master weights (CPU), by param name
    lp_weights: dict[str, torch.Tensor]  # full module weights (CPU, module dtype), by param name
    grad_norms: list[float | None] = field(default_factory=list)  # one per optimizer step
    lrs: list[list[float]] = field(default_factory=list)  # per optimizer step, per group (after step)
    loss_scales: list[float | None] = field(default_factory=list)  # per optimizer step (after step)
    skipped_steps: int = 0
    optimizer_class: str = ""  # class of engine.basic_optimizer (what DeepSpeed picked)
    stage: int | str = 0
    dtype: str = "fp32"
    frozen: list[str] = field(default_factory=list)  # names of requires_grad=False params
    init_weights: dict[str, torch.Tensor] = field(default_factory=dict)  # fp32 weights before training
    counters: list[dict[str, int]] = field(default_factory=list)  # patrickstar: per optimizer step


def seed_everything(seed: int) -> None:
    import random

    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:  # pragma: no cover
        pass


def _cast_inputs(obj, dtype: torch.dtype):
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() and dtype != torch.float32 else obj
    if isinstance(obj, tuple):
        return tuple(_cast_inputs(o, dtype) for o in obj)
    if isinstance(obj, list):
        return [_cast_inputs(o, dtype) for o in obj]
    if isinstance(obj, dict):
        return {k: _cast_inputs(v, dtype) for k, v in obj.items()}
    return obj


def extract_loss(out) -> torch.Tensor:
    """The scalar loss of a model output: a tensor, dict['loss'], tuple[0] or `.loss`."""
    if isinstance(out, torch.Tensor):
        loss = out
    elif isinstance(out, dict):
        loss = out["loss"]
    elif isinstance(out, (tuple, list)):
        loss = out[0]
    elif dataclasses.is_dataclass(out) or hasattr(out, "loss"):
        loss = out.loss
    else:
        raise TypeError(f"cannot find a loss in model output of type {type(out)}")
    if loss.dim() != 0:
        raise ValueError(f"loss must be a scalar, got shape {tuple(loss.shape)}")
    return loss


def _to_cpu(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    t = t.detach()
    if dtype is not None:
        t = t.to(dtype)
    return t.to("cpu", copy=True)


def _stock_weights(engine, stage) -> (dict[str, torch.Tensor], dict[str, torch.Tensor]):
    """(fp32 master weights, low-precision module weights) of a stock engine."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    fp32: dict[str, torch.Tensor] = {}
    lp: dict[str, torch.Tensor] = {}
    for name, p in engine.module.named_parameters():
        hp = safe_get_full_fp32_param(p) if p.requires_grad else None
        if stage == 3:
            with deepspeed.zero.GatheredParameters([p], modifier_rank=None):
                lp[name] = _to_cpu(p.data)
        else:
            lp[name] = _to_cpu(p.data)
        if hp is None:
            # Frozen params (no master copy) and stage-0 fp32/fp16 params (no hp mapping):
            # the module weight is the only copy.
            hp = lp[name]
        fp32[name] = _to_cpu(hp, torch.float32)
    return fp32, lp


def _patrickstar_weights(engine) -> (dict[str, torch.Tensor], dict[str, torch.Tensor]):
    sd32 = engine.get_fp32_state_dict()  # every name of a tied parameter; compared once, as for ZeRO-3
    fp32 = {name: _to_cpu(sd32[name], torch.float32) for name, _ in engine.module.named_parameters()}
    sd = engine.module.state_dict()
    lp: dict[str, torch.Tensor] = {}
    for name, _ in engine.module.named_parameters():
        if name not in sd:
            raise KeyError(f"patrickstar engine.module.state_dict() lacks parameter {name!r}")
        lp[name] = _to_cpu(sd[name])
    return fp32, lp


def read_weights(engine, config: dict) -> (dict[str, torch.Tensor], dict[str, torch.Tensor]):
    """(fp32 master weights, module weights) by parameter name, as host copies: the consolidated
    fp32 state dict of a patrickstar engine, DeepSpeed's full fp32 params of a stock one."""
    if is_patrickstar(config):
        return _patrickstar_weights(engine)
    return _stock_weights(engine, zero_stage(config))


def _loss_scale(engine) -> float | None:
    opt = engine.optimizer
    for attr in ("cur_scale", "loss_scale"):
        try:
            v = getattr(opt, attr)
        except Exception:
            continue
        if isinstance(v, torch.Tensor):
            v = v.item()
        if isinstance(v, (int, float)):
            return float(v)
    return None


@contextlib.contextmanager
def allow_fp16_on_cpu():
    """Let ``deepspeed.initialize`` accept an fp16 config on a CPU accelerator.

    DeepSpeed's CPU accelerator reports fp16 as supported only when oneDNN has
    native fp16 kernels (``torch.ops.mkldnn._is_mkldnn_fp16_supported()``), and the
    engine's sanity check then refuses ``"fp16": {"enabled": true}``. torch computes
    fp16 on any CPU (slowly, which is fine for these tiny models), and the stock
    ZeRO fp16 path works once the check passes, so for the duration of
    ``initialize`` we make the accelerator claim support. No-op on other accelerators
    or where fp16 is reported as supported.
    """
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    if acc.device_name() != "cpu" or acc.is_fp16_supported():
        yield
        return
    had_attr = "is_fp16_supported" in vars(acc)
    old = vars(acc).get("is_fp16_supported")
    acc.is_fp16_supported = lambda: True
    try:
        yield
    finally:
        if had_attr:
            acc.is_fp16_supported = old
        else:
            del acc.is_fp16_supported


def run_training(
    model_fn: Callable[[int], Any],
    config: dict,
    steps: int,
    seed: int,
    *,
    client_optimizer: Callable[[Any], torch.optim.Optimizer] | None = None,
    client_scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
    use_engine_backward: bool = True,
    param_groups_fn: Callable[[torch.nn.Module], Any] | None = None,
    scale_torch_backward: bool | None = None,
) -> RunResult:
    """Train ``steps`` optimizer steps (``steps * gradient_accumulation_steps`` micro-steps).

    model_fn(seed) -> (model, batch_fn); batch_fn(micro_step) -> tuple of positional
        inputs (or a dict of keyword inputs); floating inputs are cast to the config dtype.
    client_optimizer: callable(model_parameters) -> torch optimizer, passed to
        ``deepspeed.initialize(optimizer=...)``; use with ``make_config(optimizer_type=None)``.
    client_scheduler: callable(optimizer) -> LR scheduler, passed as ``lr_scheduler=``
        (DeepSpeed calls it with its basic optimizer and steps it in ``engine.step()``).
    use_engine_backward: True -> ``engine.backward(loss)``; False -> torch-style
        ``loss.backward()`` (``engine.scale(loss).backward()`` when ``scale_torch_backward``,
        which defaults to True exactly for fp16, where a loss scaler is required).
    param_groups_fn: callable(model) -> model_parameters (e.g. a list of param-group
        dicts); default: the parameters with requires_grad.
    """
    ensure_distributed()
    import deepspeed

    config = copy.deepcopy(config)
    dtype = config_dtype(config)
    dtype_name = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    stage = zero_stage(config)
    if scale_torch_backward is None:
        scale_torch_backward = dtype == torch.float16

    seed_everything(seed)
    model, batch_fn = model_fn(seed)
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    init_weights = {n: _to_cpu(p, torch.float32) for n, p in model.named_parameters()}
    if param_groups_fn is not None:
        model_parameters = param_groups_fn(model)
    else:
        model_parameters = [p for p in model.parameters() if p.requires_grad]
    optimizer = client_optimizer(model_parameters) if client_optimizer is not None else None

    # Re-seed so anything random inside initialize/training (dropout etc.) is identical
    # across backends regardless of how many random numbers model construction drew.
    seed_everything(seed + 1)
    try:
        with contextlib.ExitStack() as stack:
            if dtype == torch.float16:
                stack.enter_context(allow_fp16_on_cpu())
            return _train(
                deepspeed, model, batch_fn, model_parameters, optimizer, config, client_scheduler, steps,
                use_engine_backward, scale_torch_backward, dtype, dtype_name, stage, frozen, init_weights,
            )
    finally:
        # Drop every reference to the (hooked, partitioned) model before the next run.
        model = optimizer = model_parameters = None
        gc.collect()


def _train(deepspeed, model, batch_fn, model_parameters, optimizer, config, client_scheduler, steps,
           use_engine_backward, scale_torch_backward, dtype, dtype_name, stage, frozen, init_weights):
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        config=config,
        model_parameters=model_parameters,
        optimizer=optimizer,
        lr_scheduler=client_scheduler,
    )
    del model, optimizer, model_parameters
    try:
        gas = engine.gradient_accumulation_steps()
        losses: list[float] = []
        grad_norms: list[float | None] = []
        lrs: list[list[float]] = []
        loss_scales: list[float | None] = []
        counters: list[dict[str, int]] = []
        for micro in range(steps * gas):
            inputs = _cast_inputs(batch_fn(micro), dtype)
            out = engine(**inputs) if isinstance(inputs, dict) else engine(*inputs)
            loss = extract_loss(out)
            losses.append(float(loss.detach().float().item()))
            if use_engine_backward:
                engine.backward(loss)
            elif scale_torch_backward:
                engine.scale(loss).backward()
            else:
                loss.backward()
            engine.step()
            if (micro + 1) % gas == 0:
                gn = engine.get_global_grad_norm()
                if isinstance(gn, torch.Tensor):
                    gn = gn.item()
                grad_norms.append(None if gn is None else float(gn))
                lrs.append([float(x) for x in engine.get_lr()])
                loss_scales.append(_loss_scale(engine))
                if is_patrickstar(config):
                    counters.append(engine.get_patrickstar_counters())
        fp32, lp = read_weights(engine, config)
        return RunResult(
            losses=losses,
            fp32_weights=fp32,
            lp_weights=lp,
            grad_norms=grad_norms,
            lrs=lrs,
            loss_scales=loss_scales,
            skipped_steps=int(getattr(engine, "skipped_steps", 0) or 0),
            optimizer_class=type(engine.basic_optimizer).__name__ if engine.basic_optimizer is not None else "",
            stage=stage,
            dtype=dtype_name,
            frozen=frozen,
            init_weights=init_weights,
            counters=counters,
        )
    finally:
        destroy = getattr(engine, "destroy", None)
        if callable(destroy):
            destroy()
        del engine
        gc.collect()


_REFERENCE_RUNS: dict[tuple, RunResult] = {}


def reference_run(model_fn: Callable[[int], Any], config: dict, steps: int, seed: int, **kwargs) -> RunResult:
    """:func:`run_training`, run once per session for each distinct set of arguments.

    For reference runs (stock ZeRO-3) that several tests compare with: the first call trains,
    later identical calls get a deep copy of its result. Calls passing callables besides
    ``model_fn`` (client optimizers, schedulers, param-group functions: lambdas that cannot be
    told apart) are not cached and simply train.
    """
    import json

    if any(callable(v) for v in kwargs.values()):
        return run_training(model_fn, config, steps, seed, **kwargs)
    # model_fn by identity: the builders (QUIRK_MODELS' values) live for the whole session
    key = (model_fn, json.dumps(config, sort_keys=True), steps, seed, tuple(sorted(kwargs.items())))
    if key not in _REFERENCE_RUNS:
        _REFERENCE_RUNS[key] = run_training(model_fn, config, steps, seed, **kwargs)
    return copy.deepcopy(_REFERENCE_RUNS[key])


# --------------------------------------------------------------------------------------
# Comparing
# --------------------------------------------------------------------------------------
def _err(a: torch.Tensor, b: torch.Tensor):
    """(max abs error, max rel error, index of max abs error) of a vs reference b."""
    a = a.detach().double().flatten()
    b = b.detach().double().flatten()
    d = (a - b).abs()
    if d.numel() == 0:
        return 0.0, 0.0, 0
    idx = int(d.argmax())
    rel = (d / b.abs().clamp_min(1e-12)).max().item()
    return d.max().item(), rel, idx


def update_errors(ours: RunResult, ref: RunResult) -> dict[str, tuple]:
    """Per param: (||d_ours - d_ref||_2, ||d_ref||_2) where d = final fp32 - initial weight.

    Elementwise weight differences after a few Adam steps are dominated by elements whose
    gradient is near zero (Adam's first step moves every element by ~lr * sign(grad), so a
    rounding-level change in a tiny gradient can flip a full 2*lr step); the norm of the
    update difference relative to the norm of the update is a robust, aggregate measure.
    """
    out = {}
    for n, w_ref in ref.fp32_weights.items():
        if n not in ours.fp32_weights or n not in ref.init_weights:
            continue
        init = ref.init_weights[n].double()
        d_ref = w_ref.double() - init
        d_ours = ours.fp32_weights[n].double() - init
        if d_ref.shape != d_ours.shape:
            continue
        out[n] = ((d_ours - d_ref).norm().item(), d_ref.norm().item())
    return out


def _steps_differing(ours: list, ref: list, same: Callable[[Any, Any], bool]) -> int | None:
    """The first optimizer step whose values differ (a value on one side only, or ``not same``), or None;
    lists of different lengths differ at the first step one of them lacks."""
    for step, (a, b) in enumerate(zip(ours, ref)):
        if (a is None) != (b is None) or (a is not None and not same(a, b)):
            return step
    return None if len(ours) == len(ref) else min(len(ours), len(ref))


def compare(
    ours: RunResult,
    ref: RunResult,
    rtol: float,
    atol: float,
    *,
    loss_rtol: float | None = None,
    loss_atol: float | None = None,
    check_lp: bool = False,
    lp_rtol: float | None = None,
    lp_atol: float | None = None,
    update_rtol: float | None = None,
    update_atol: float = 1e-7,
) -> None:
    """Assert ``ours`` matches the reference run ``ref``.

    Losses (per micro-step) are checked with loss_rtol/loss_atol (default rtol/atol);
    final fp32 weights (per name) with rtol/atol: |ours - ref| <= atol + rtol * |ref|
    elementwise. The message names the first differing step / parameter (in
    ``named_parameters`` order) and the max abs/rel errors.
    Global grad norms (with the loss tolerance) and loss scales (exactly) are compared per optimizer
    step; a step where one engine reports a value and the other none differs.
    check_lp additionally compares the low-precision module weights.
    update_rtol (optional): per param, ||d_ours - d_ref||_2 <= update_rtol * ||d_ref||_2
    + update_atol * sqrt(numel), where d = final fp32 weight - initial weight (see
    :func:`update_errors`); a tight aggregate check that stays meaningful when the
    elementwise atol has to be a few LR wide (bf16/fp16). Both runs must start from
    identical initial weights (checked).
    """
    loss_rtol = rtol if loss_rtol is None else loss_rtol
    loss_atol = atol if loss_atol is None else loss_atol
    problems: list[str] = []

    # ---- losses
    if len(ours.losses) != len(ref.losses):
        problems.append(f"number of micro-steps differs: ours {len(ours.losses)} vs ref {len(ref.losses)}")
    else:
        bad = []
        for i, (a, b) in enumerate(zip(ours.losses, ref.losses)):
            if not (math.isfinite(a) and math.isfinite(b)) and not (a == b):
                bad.append(i)
            elif abs(a - b) > loss_atol + loss_rtol * abs(b):
                bad.append(i)
        if bad:
            i = bad[0]
            la = torch.tensor(ours.losses, dtype=torch.float64)
            lb = torch.tensor(ref.losses, dtype=torch.float64)
            d = (la - lb).abs()
            problems.append(
                f"losses differ first at micro-step {i}: ours {ours.losses[i]!r} vs ref {ref.losses[i]!r} "
                f"({len(bad)}/{len(lb)} steps out of tolerance rtol={loss_rtol:g} atol={loss_atol:g}; "
                f"max abs err {d.max().item():.3e} at step {int(d.argmax())}, "
                f"max rel err {(d / lb.abs().clamp_min(1e-12)).max().item():.3e})\n"
                f"    ours: {[round(x, 6) for x in ours.losses]}\n"
                f"    ref:  {[round(x, 6) for x in ref.losses]}"
            )

    # ---- weights
    frozen = set(ref.frozen)
    low_precision = ref.dtype != "fp32"

    def check_weights(kind, wa, wb, rt, at, skip=()):
        missing = [n for n in wb if n not in wa]
        extra = [n for n in wa if n not in wb]
        if missing or extra:
            problems.append(f"{kind} weights: names differ; missing in ours: {missing}, extra in ours: {extra}")
        failing = []
        for n in wb:
            if n not in wa or n in skip:
                continue
            a, b = wa[n].detach().float(), wb[n].detach().float()
            if a.shape != b.shape:
                failing.append(f"{n}: shape ours {tuple(a.shape)} vs ref {tuple(b.shape)}")
                continue
            if not torch.allclose(a, b, rtol=rt, atol=at, equal_nan=True):
                mabs, mrel, idx = _err(a, b)
                failing.append(
                    f"{n}: max abs err {mabs:.3e} (ours {a.flatten()[idx].item():.6g} vs ref "
                    f"{b.flatten()[idx].item():.6g} at flat index {idx}), max rel err {mrel:.3e}"
                )
        if failing:
            problems.append(
                f"{kind} weights differ (rtol={rt:g} atol={at:g}) in {len(failing)}/{len(wb)} params; "
                f"first: {failing[0]}" + "".join(f"\n    also {f}" for f in failing[1:6])
            )

    # Frozen params of a bf16/fp16 stock run have no fp32 master: the module was cast, so
    # the reference only knows their rounded values, while a backend may legitimately keep
    # the original fp32 ones. They are checked through the low-precision weights instead,
    # which must be bit-equal (the rounding of the identical initial value).
    fp32_skip = frozen if low_precision else ()
    check_weights("fp32", ours.fp32_weights, ref.fp32_weights, rtol, atol, skip=fp32_skip)
    if frozen:
        check_weights(
            "frozen (module)",
            {n: ours.lp_weights[n] for n in frozen if n in ours.lp_weights},
            {n: ref.lp_weights[n] for n in frozen},
            0.0,
            0.0,
        )

    # ---- LR sequence (per optimizer step, per group) and skipped (overflow) steps
    if ours.lrs and ref.lrs and ours.lrs != ref.lrs:
        if len(ours.lrs) != len(ref.lrs) or any(
            len(a) != len(b) or any(abs(x - y) > 1e-12 + 1e-9 * abs(y) for x, y in zip(a, b))
            for a, b in zip(ours.lrs, ref.lrs)
        ):
            problems.append(f"LR sequences differ:\n    ours: {ours.lrs}\n    ref:  {ref.lrs}")
    if ours.skipped_steps != ref.skipped_steps:
        problems.append(f"skipped (overflow) steps differ: ours {ours.skipped_steps} vs ref {ref.skipped_steps}")
    # ---- global grad norms (same tolerance as losses; a step with a norm on one side only differs) and loss
    # scales (exactly: both engines halve and double the same powers of two), one per optimizer step
    gn_bad = _steps_differing(
        ours.grad_norms,
        ref.grad_norms,
        lambda a, b: a == b or (math.isnan(a) and math.isnan(b)) or abs(a - b) <= loss_atol + loss_rtol * abs(b),
    )
    if gn_bad is not None:
        problems.append(
            f"global grad norms differ first at step {gn_bad}:\n    ours: {ours.grad_norms}\n"
            f"    ref:  {ref.grad_norms}"
        )
    scale_bad = _steps_differing(ours.loss_scales, ref.loss_scales, lambda a, b: a == b)
    if scale_bad is not None:
        problems.append(
            f"loss scales differ first at step {scale_bad}:\n    ours: {ours.loss_scales}\n    ref:  {ref.loss_scales}"
        )
    if update_rtol is not None:
        init_diff = [
            n for n in ref.init_weights
            if n in ours.init_weights and not torch.equal(ours.init_weights[n], ref.init_weights[n])
        ]
        if init_diff:
            problems.append(f"initial weights differ (test setup is not deterministic): {init_diff[:5]}")
        failing = []
        for n, (e, r) in update_errors(ours, ref).items():
            if n in frozen and low_precision:
                continue
            numel = ref.fp32_weights[n].numel()
            if e > update_rtol * r + update_atol * math.sqrt(numel):
                failing.append(
                    f"{n}: ||d_ours - d_ref|| = {e:.3e}, ||d_ref|| = {r:.3e} (rel {e / r if r else math.inf:.3e})"
                )
        if failing:
            problems.append(
                f"weight updates differ (update_rtol={update_rtol:g}) in {len(failing)} params; "
                f"first: {failing[0]}" + "".join(f"\n    also {f}" for f in failing[1:6])
            )
    if check_lp:
        check_weights(
            "low-precision",
            ours.lp_weights,
            ref.lp_weights,
            rtol if lp_rtol is None else lp_rtol,
            atol if lp_atol is None else lp_atol,
        )

    if problems:
        raise AssertionError(
            f"run (stage={ours.stage!r}, {ours.dtype}) differs from reference "
            f"(stage={ref.stage!r}, {ref.dtype}):\n  - " + "\n  - ".join(problems)
        )


@contextlib.contextmanager
def deepspeed_checkpointing(config):
    """DeepSpeed's activation checkpointing configured from ``config`` (as Megatron-DeepSpeed calls
    it, a "patrickstar" config included) for the block, and reset after it."""
    import deepspeed

    deepspeed.checkpointing.configure(None, deepspeed_config=config)
    try:
        yield
    finally:
        deepspeed.checkpointing.reset()
        deepspeed.checkpointing.configure(None)


def small_mlp() -> torch.nn.Module:
    """A seeded 4,258-parameter MLP (several 1,024-element chunks) for tests of the engine's surface."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32), torch.nn.GELU(),
                               torch.nn.Linear(32, 2))


def mlp_steps(engine, rank: int, steps: int, first: int) -> list[float]:
    """``steps`` training steps of :func:`small_mlp`'s engine on seeded batches (step ``first`` on); the losses."""
    losses = []
    for step in range(first, first + steps):
        x = torch.randn(4, 32, generator=torch.Generator().manual_seed(100 * step + rank))
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def loss_model_steps(engine, rank: int, width: int, steps: int = 3) -> tuple[list[float], dict[str, torch.Tensor]]:
    """``steps`` training steps of an engine whose model returns its loss, on a seeded ``(4, width)`` batch per step
    and rank; the losses, and the full fp32 values after them (a collective: every rank calls it)."""
    from deepspeed.utils import safe_get_full_fp32_param

    losses = []
    for step in range(steps):
        loss = engine(torch.randn(4, width, generator=torch.Generator().manual_seed(10 * step + rank)))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    params = {n: safe_get_full_fp32_param(p).detach().cpu().clone() for n, p in engine.module.named_parameters()}
    return losses, params
