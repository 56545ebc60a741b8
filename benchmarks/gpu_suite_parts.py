"""``gpu_suite.py``'s measured parts, each a list of trials of ``gpu_suite_trial.py`` (a process each, through
``bench_harness.json_trial``): LoRA past the device budget, dynamic padding, throughput at sizes taken from the
GPU's memory, and the equal-memory sweep. A trial is ``measured``, ``failed`` (its error's last line), ``cut``
(its deadline came first) or ``skipped`` (it does not apply: with the reason); a part is ``cut`` when any of
its trials was."""
from __future__ import annotations

import json
import logging
import sys
import tempfile
from pathlib import Path

import gpt_model
import max_model
import psutil
from bench_harness import GIB, free_port, gpt_overrides_for_params, json_trial
from gpu_suite_env import lock_cleaner

log = logging.getLogger("gpu_suite")
HERE = Path(__file__).resolve().parent
TRIAL = HERE / "gpu_suite_trial.py"
OFFLOADED = ("ours", "zero3-offload")
OURS_BYTES_PER_PARAM = 14  # ours' model data: bf16 params and grads, fp32 master, momentum and variance
NO_OFFLOAD_BYTES_PER_PARAM = 16  # ZeRO-3 without offload: the same with fp32 gradients for the optimizer
ZERO3_OFFLOAD_HOST_BYTES_PER_PARAM = 18  # on the host: fp32 master, m, v, fp32 grads, bf16 params (pinned)
HOST_BASE_BYTES = 6 * GIB  # a trial's process besides model data: torch, CUDA context, buffers
# (up to how many parameters, width, heads): GPT-3's shapes; the dry run's tiny ones
GPU_SHAPES = [(2.2e9, 2048, 16), (4e9, 2560, 32), (1e10, 4096, 32), (float("inf"), 5120, 40)]
DRY_SHAPES = [(5e4, 32, 2), (1.5e5, 48, 2), (float("inf"), 64, 2)]
REFERENCE_GPU_BYTES = 85e9  # an H100 80 GB's memory (79.2 GiB): the sweep's GiB, scaled by a GPU's memory over it
DRY_DEVICE_BYTES = 1_000_000  # the dry run's pretend GPU: ours' device_budget, and what ZeRO-3 must fit
DRY_CHUNK = 8192  # elements: chunks small enough for the dry run's budgets
DRY_STOCK_SKIP = {  # stock ZeRO-3 costs ~10 s of CPU to start a trial here: the dry run runs it once
    "zero3-offload": "dry run: stock ZeRO-3 runs at the smallest size only (~10 s a trial on the CPU)",
    "zero3": "dry run: on the CPU, ZeRO-3 without offload is the run that stands in for ZeRO-3 offload",
    "sweep": "dry run: no GPU memory to hold stock ZeRO-3 to (set_per_process_memory_fraction needs CUDA)",
    "sweep_fill": "dry run: the fill rule's row is a GPU comparison (the twin's is benchmarks/twin_pressure.py)",
    "lora": "dry run: stock ZeRO-3's LoRA trial is the GPU's comparison; it costs ~10 s to start here",
    "dynamic_padding": "dry run: stock ZeRO-3 costs ~10 s per trial; the throughput part runs it once",
    "max_model": "dry run: stock ZeRO-3's search is ours' with another backend name, and costs ~10 s per try",
}
DYNAMIC_SIZE = ("gpt2-medium", "gpt2-medium", {})
DYNAMIC_BUDGET_BYTES_PER_PARAM = 6  # ours' device budget: room for under half of its 14 bytes/param of model data,
DYNAMIC_ACTIVATION_ROOM = 3 * 2**30  # plus the non-model peak at batch 8 x 512 (2.2 GB + 0.3 GB stranded, H200)
LORA_GPU_SIZE = ("gpt-1.3b", "gpt-1.3b", {})  # a bf16 base of ~2.6 GB, ~1.1 GB of activations at 8 x 512
DRY_LORA = {"budget": 200_000}  # the tiny base's frozen bf16 chunks take ~220 kB


# ------------------------------------------------------------------ trials and parts
def trial_argv(args, backend: str, preset: str, overrides: dict) -> list[str]:
    argv = ["--backend", backend, "--model", preset, "--overrides", json.dumps(overrides), "--batch",
            str(args.batch), "--seq-len", str(args.seq_len), "--warmup", str(args.warmup), "--max-warmup",
            str(args.max_warmup), "--steps", str(args.steps)]
    if args.dry_run and backend == "ours":
        argv += ["--emulate-budget", str(DRY_DEVICE_BYTES), "--chunk-size", str(DRY_CHUNK)]
    if args.clip is not None:
        argv += ["--clip", str(args.clip)]
    return argv


def with_option(argv: list[str], flag: str, value) -> list[str]:
    """``argv`` with ``flag`` set to ``value`` (replaced where it is there already)."""
    if flag in argv:
        argv = list(argv)
        argv[argv.index(flag) + 1] = str(value)
        return argv
    return [*argv, flag, str(value)]


def planner_argv(ctx, head: dict) -> list[str]:
    """Ours: the planner's snapshot into the suite's folder (``planner/``, a file a trial; see [Note: planner
    snapshot]), to plan again from a GPU's trace on any machine with ``benchmarks/replan.py``."""
    if head.get("backend") != "ours" or getattr(ctx, "out", None) is None:
        return []
    folder = Path(ctx.out) / "planner"
    folder.mkdir(parents=True, exist_ok=True)
    name = "_".join(str(head[k]) for k in ("size", "point", "rule", "padding") if k in head) or "trial"
    name = "".join(c if c.isalnum() or c in "-_." else "-" for c in name)
    index = len(list(folder.glob("*.json")))
    return ["--planner-snapshot", str(folder / f"{index:02d}_{name}.json")]


def run_trial(ctx, head: dict, argv: list[str], deadline: float, need: float) -> dict:
    """One trial of ``gpu_suite_trial.py`` in a process of its own: ``head`` and its result."""
    with tempfile.TemporaryDirectory() as tmp:
        out, port = Path(tmp) / "trial.json", free_port()
        cmd = [sys.executable, str(TRIAL), *argv, "--json", str(out), *planner_argv(ctx, head)]
        got = json_trial(cmd, out, deadline, need, {**ctx.child_env, "MASTER_PORT": str(port)}, ctx.repo,
                         lock_cleaner(ctx.child_env, ctx.cuda))
        max_model.remove_shm_buffers(port)
    if ctx.args.dry_run and head.get("backend") == "zero3-offload" and got["status"] == "measured":
        got["stand_in"] = "ZeRO-3 with the offload config on the CPU (no CUDA: nothing to offload from)"
    trial = {**head, **got}
    log.info("%s: %s %s", " ".join(str(head[k]) for k in ("size", "point", "backend", "padding") if k in head),
             trial["status"],
             f"{trial['tokens_per_s']:.1f} tokens/s" if "tokens_per_s" in trial else
             trial.get("reason") or trial.get("error", ""))
    return trial


def part_result(trials: list[dict], **extra) -> dict:
    """A part's status from its trials: ``cut`` where its deadline cut any, else ``measured`` where one was,
    ``failed`` where they all failed, ``skipped`` (with their reasons) where none ran."""
    states = [t["status"] for t in trials]
    done = sum(s == "measured" for s in states)
    if "cut" in states:
        out = {"status": "cut", "reason": f"cut by its deadline: {done} of {len(trials)} trials measured"}
    elif done:
        out = {"status": "measured"}
    elif "failed" in states:
        out = {"status": "failed", "reason": "every trial failed (see the trials)"}
    else:
        out = {"status": "skipped", "reason": "; ".join(dict.fromkeys(t.get("reason", "") for t in trials))}
    return {**out, **extra, "trials": trials}


def run_plan(ctx, name: str, plan: list[tuple[dict, list[str] | str]], deadline: float, extra=None,
             rows=lambda trial: [trial]) -> dict:
    """Run ``plan`` (head, trial argv, or the reason it does not run) in order, each trial needing at least what
    the last of its backend took; the part (``rows`` of each trial, ``extra`` of them) is written after each."""
    trials, took = [], {}

    def result() -> dict:
        got = [row for trial in trials for row in rows(trial)]
        return part_result(got, **(extra(got) if extra else {}))

    for head, argv in plan:
        if head["backend"] not in ctx.args.backends:
            argv = "skipped: not among --backends (a call with it fills this row in; --merge joins the calls)"
        if isinstance(argv, str):  # "skipped: why" or "failed: error", decided before launching
            status, _, why = argv.partition(": ")
            trials.append({**head, "status": status, "error" if status == "failed" else "reason": why})
            continue
        need = max(ctx.args.min_trial_s, took.get(head["backend"], 0.0))
        trials.append(run_trial(ctx, head, argv, deadline, need))
        if trials[-1]["status"] == "measured":
            took[head["backend"]] = trials[-1]["seconds"]
        ctx.part_progress(name, result())
    return result()


# ------------------------------------------------------------------ sizes from the GPU's memory
def model_sizes(ctx, args) -> list[tuple[str, str, dict]]:
    """GPTs whose model data (ours' 14 bytes/param) is ``--size-fractions`` of the GPU's memory (the dry run's
    pretend device), activation checkpointing on, at the suite's sequence length."""
    shapes, vocab, preset = (DRY_SHAPES, 256, "tiny") if args.dry_run else (GPU_SHAPES, 50304, "gpt-1.3b")
    out = []
    for fraction in args.size_fractions:
        params = fraction * ctx.device_bytes / OURS_BYTES_PER_PARAM
        overrides = {**gpt_overrides_for_params(params, vocab, args.seq_len, shapes), "activation_checkpointing": True}
        out.append((f"{fraction:g}x", preset, overrides))
    return out


def params_of(preset: str, overrides: dict) -> int:
    return gpt_model.count_params_for_config(gpt_model.get_config(preset, **overrides))


def host_shortfall(ctx, backend: str, params: int, device: float | None = None) -> str | None:
    """Why ``backend`` cannot hold a model of ``params`` in this host's available memory, by arithmetic before
    launching (ZeRO-3 offload: 18 bytes/param on the host; ours: its 14 bytes/param past 90% of the GPU, or past
    its budget ``device``), or None."""
    if backend == "zero3-offload":
        need = ZERO3_OFFLOAD_HOST_BYTES_PER_PARAM * params
    elif backend == "ours":
        need = max(0.0, OURS_BYTES_PER_PARAM * params - (device or 0.9 * ctx.device_bytes))
    else:
        return None
    need += 0 if ctx.args.dry_run else HOST_BASE_BYTES
    available = psutil.virtual_memory().available
    if need <= 0.95 * available:
        return None
    return (f"failed: host memory: needs ~{need / GIB:.0f} GiB on the host, {available / GIB:.0f} GiB available "
            f"(decided by arithmetic before launching; not run)")


def no_offload_fit(ctx, args, preset: str, overrides: dict) -> tuple[bool, str]:
    """Whether ZeRO-3 without offload should fit the GPU: 16 bytes/param plus an activation estimate
    (34 bytes per token per layer per unit of width, Korthikanti et al. 2022, and fp32 + bf16 logits)."""
    cfg = gpt_model.get_config(preset, **overrides)
    tokens = args.batch * args.seq_len
    per_layer = 2 * cfg.n_embd if cfg.activation_checkpointing else 34 * cfg.n_embd
    need = (NO_OFFLOAD_BYTES_PER_PARAM * gpt_model.count_params_for_config(cfg)
            + tokens * (per_layer * cfg.n_layer + 6 * cfg.vocab_size))
    why = f"estimated {need / 2**30:.3f} GiB against 90% of {ctx.device_bytes / 2**30:.3f} GiB"
    return need <= 0.9 * ctx.device_bytes, why


def size_plan(ctx, args) -> list[tuple[dict, list[str] | str]]:
    """Ours and ZeRO-3 offload at every size, smallest first, then ZeRO-3 without offload where it fits."""
    plan = []
    for i, (name, preset, overrides) in enumerate(model_sizes(ctx, args)):
        for backend in (*OFFLOADED, "zero3"):
            head = {"size": name, "backend": backend, "params": params_of(preset, overrides), "shape": overrides}
            fits, why = no_offload_fit(ctx, args, preset, overrides) if backend == "zero3" else (True, "")
            if not fits:
                plan.append((head, f"skipped: does not fit the GPU: {why}"))
            elif args.dry_run and backend != "ours" and (backend == "zero3" or i):
                plan.append((head, f"skipped: {DRY_STOCK_SKIP[backend]}"))
            else:
                short = host_shortfall(ctx, backend, params_of(preset, overrides))
                plan.append((head, short or [*trial_argv(args, backend, preset, overrides), "--init"]))
    # stable: sizes ascend per pair, no offload last; in a dry run the costly stand-in after ours' sizes
    return sorted(plan, key=lambda p: p[0]["backend"] == "zero3" or args.dry_run and p[0]["backend"] != "ours")


def ratios(trials: list[dict]) -> list[dict]:
    """Per size: ours over ZeRO-3 offload (tokens/s), and each offloaded run over ZeRO-3 without offload."""
    out = []
    for name in dict.fromkeys(t["size"] for t in trials):
        got = {t["backend"]: t["tokens_per_s"] for t in trials if t["size"] == name and t["status"] == "measured"}
        row = {"size": name, "ours_over_zero3_offload": None, "practicality": {}}
        if "ours" in got and "zero3-offload" in got:
            row["ours_over_zero3_offload"] = got["ours"] / got["zero3-offload"]
        if "zero3" in got:
            row["practicality"] = {b: got[b] / got["zero3"] for b in OFFLOADED if b in got}
        out.append(row)
    return out


def run_throughput(ctx, args, deadline: float) -> dict:
    return run_plan(ctx, "throughput", size_plan(ctx, args), deadline, lambda trials: {"ratios": ratios(trials)})


# ------------------------------------------------------------------ the equal-memory sweep
def sweep_points(args) -> list[tuple[float, bool]]:
    """``--sweep-points`` as (GiB on an 80 GB GPU, activation checkpointing): ``12`` or ``12/off``."""
    return [(float(p.split("/")[0]), not p.endswith("/off")) for p in args.sweep_points]


def sweep_scale(ctx, args) -> float:
    """Bytes per GiB of ``--sweep-points``: scaled by the GPU's memory over an H100's, or 1 GiB with
    ``--sweep-absolute``."""
    return GIB * (1.0 if args.sweep_absolute else ctx.device_bytes / REFERENCE_GPU_BYTES)


def sweep_size(ctx, args) -> tuple[str, str, dict]:
    """``--sweep-model``'s preset, or the smallest of the sizes whose model data does not fit the largest budget
    of the sweep."""
    if args.sweep_model:
        return args.sweep_model, args.sweep_model, {}
    largest = max((b for b, _ in sweep_points(args)), default=0) * sweep_scale(ctx, args)
    sizes = model_sizes(ctx, args)
    return next((s for s in sizes if OURS_BYTES_PER_PARAM * params_of(s[1], s[2]) > largest), sizes[-1])


def sweep_plan(ctx, args) -> list[tuple[dict, list[str] | str]]:
    """Per point: ours with each of ``--sweep-rules`` (``optimizer_placement``), then ZeRO-3 offload."""
    name, preset, overrides = sweep_size(ctx, args)
    plan = []
    for gib, checkpointing in sweep_points(args):
        budget = int(gib * sweep_scale(ctx, args))
        sized = {**overrides, "activation_checkpointing": checkpointing}
        point = {"size": name, "point": f"{gib:g} GiB" + ("" if checkpointing else " no ckpt"), "budget_bytes": budget,
                 "checkpointing": checkpointing, "params": params_of(preset, sized)}
        for backend, rule in [*(("ours", r) for r in args.sweep_rules), ("zero3-offload", None)]:
            head = {**point, "backend": backend, **({"rule": rule} if rule else {})}
            skip = None if not args.dry_run or rule == "time" else "sweep_fill" if rule else "sweep"
            if skip:
                plan.append((head, f"skipped: {DRY_STOCK_SKIP[skip]}"))
                continue
            argv = [*trial_argv(args, backend, preset, sized), "--init"]
            if backend == "ours":
                argv = with_option(argv, "--emulate-budget" if args.dry_run else "--device-budget", budget)
                argv += ["--optimizer-placement", rule, "--profile-step"]  # where the host's time goes
            else:
                argv += ["--memory-fraction", f"{budget / ctx.device_bytes:.6f}"]
            plan.append((head, host_shortfall(ctx, backend, params_of(preset, sized), budget) or argv))
    return plan


def sweep_ratios(trials: list[dict]) -> list[dict]:
    """Per point: ours' tokens/s over ZeRO-3 offload's at the same memory."""
    out = []
    for point in dict.fromkeys(t["point"] for t in trials):
        got = {(t["backend"], t.get("rule", "time")): t for t in trials
               if t["point"] == point and t["status"] == "measured"}
        stock = got.get(("zero3-offload", "time"))
        out.append({"point": point, **{
            f"{'ours' if rule == 'time' else 'ours_fill'}_over_zero3_offload":
                got[("ours", rule)]["tokens_per_s"] / stock["tokens_per_s"] if ("ours", rule) in got and stock else None
            for rule in ("time", "fill")}})
    return out


def run_sweep(ctx, args, deadline: float) -> dict:
    return run_plan(ctx, "sweep", sweep_plan(ctx, args), deadline, lambda trials: {"ratios": sweep_ratios(trials)})


# ------------------------------------------------------------------ LoRA and dynamic padding
def offloaded_plan(args, part: str, head: dict, argv_of) -> list[tuple[dict, list[str] | str]]:
    """Ours' and ZeRO-3 offload's trials (``argv_of(backend)``); in a dry run stock ZeRO-3's is skipped."""
    return [({**head, "backend": b}, f"skipped: {DRY_STOCK_SKIP[part]}" if args.dry_run and b != "ours"
             else argv_of(b)) for b in OFFLOADED]


def run_lora(ctx, args, deadline: float) -> dict:
    """LoRA of a base larger than ours' device budget (dry: the largest size's base, the emulated device below
    its frozen chunks), ours against ZeRO-3 offload."""
    name, preset, overrides = model_sizes(ctx, args)[-1] if args.dry_run else LORA_GPU_SIZE

    def argv_of(backend: str) -> list[str]:
        argv = [*trial_argv(args, backend, preset, overrides), "--lora", str(args.lora_rank)]
        if backend != "ours":
            return argv
        budget = DRY_LORA["budget"] if args.dry_run else int(args.lora_budget * GIB)
        return with_option(argv, "--emulate-budget" if args.dry_run else "--device-budget", budget)

    return run_plan(ctx, "lora", offloaded_plan(args, "lora", {"size": name}, argv_of), deadline)


def run_dynamic_padding(ctx, args, deadline: float) -> dict:
    """Dynamic padding against a fixed length, ours (device budget below the model) and ZeRO-3 offload: one
    process per backend, the fixed length first (``gpu_suite_trial.py --paddings``), a row each."""
    name, preset, overrides = model_sizes(ctx, args)[0] if args.dry_run else DYNAMIC_SIZE
    budget = DYNAMIC_BUDGET_BYTES_PER_PARAM * params_of(preset, overrides) + DYNAMIC_ACTIVATION_ROOM

    def argv_of(backend: str) -> list[str]:
        argv = with_option(trial_argv(args, backend, preset, overrides), "--warmup", min(args.max_warmup, 3))
        ours_budget = ["--device-budget", str(budget)] if backend == "ours" and not args.dry_run else []
        return [*argv, "--paddings", *ours_budget]

    plan = offloaded_plan(args, "dynamic_padding", {"size": name}, argv_of)
    return run_plan(ctx, "dynamic_padding", plan, deadline, rows=by_padding)


def by_padding(trial: dict) -> list[dict]:
    """A trial of both paddings as a row per padding (a trial that did not run: the same status in both)."""
    runs = trial.get("paddings") or {}
    common = {k: v for k, v in trial.items() if k not in ("paddings", "records")}
    return [{**common, **runs.get(padding, {}), "padding": padding} for padding in ("fixed", "dynamic")]
