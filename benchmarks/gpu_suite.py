#!/usr/bin/env python
"""GPU truth within a wall-clock budget: the measurements that decide the product, most valuable first.

    python benchmarks/gpu_suite.py --out $OUT                     # a lent GPU: docs/benchmarks.md#gpu-suite-gpu_suitepy
    python benchmarks/gpu_suite.py --out $OUT --parts gpu_tests,max_model --sweep-points 8,24,12/off,16/off
    python benchmarks/gpu_suite.py --merge A/gpu_suite.json B/gpu_suite.json --out merged   # one table of both
    python benchmarks/gpu_suite.py --dry-run --out /tmp/suite      # the same code on this CPU, tiny sizes
    python benchmarks/gpu_suite.py --to-docs $OUT/gpu_suite.json   # its table into docs/benchmarks.md

Parts, in this order; each gets a deadline (its share of what the parts before it left):

* ``builds``: the JIT-built ops the trials load (ours' CUDA and CPU Adam, DeepSpeed's CPU Adam and FusedAdam),
  at once, a process each, so that no trial times a build;
* ``lora``: LoRA (rank ``--lora-rank`` adapters on every linear layer of the blocks, the rest frozen) of a base
  larger than ours' device budget (``--lora-budget``), ours against ZeRO-3 offload;
* ``dynamic_padding``: batches padded to their own longest sequence beside a fixed length, ours (device budget
  below the model) and ZeRO-3 offload;
* ``throughput``: GPTs whose model data (14 bytes/param) is ``--size-fractions`` (0.5, 1.5, 3) of the GPU's
  memory, activation checkpointing on, ours against ZeRO-3 offload and, where it fits, ZeRO-3 without offload;
  a size a backend cannot hold in host memory is its failure, decided by arithmetic before launching;
* ``sweep``: equal memory: at the smallest of those sizes that does not fit the budgets, ours at
  ``device_budget`` B against ZeRO-3 offload held to B (``set_per_process_memory_fraction``), for B in
  ``--sweep-points`` (GiB on an 80 GB GPU, scaled on others; ``16/off``: without activation checkpointing), ours
  once per ``--sweep-rules`` (``optimizer_placement`` ``time``, the default, and ``fill``, the rule before the
  step-time model), with the predicted step beside the measured one;
* ``gpu_tests`` (``pytest -m gpu``) and ``max_model`` (the largest GPT at a capped host memory): not in a GPU
  run's default ``--parts``: a second call runs them, and ``--merge`` makes one table of both calls.

Every trial is a process of its own (``gpu_suite_trial.py``): warm-up until the step time settles (or
``--warmup`` steps), then ``--steps`` timed steps; it is ``measured``, ``failed`` (its error's last line) or
``cut`` (its deadline came first), and so is a part. ``breakdown`` and ``host_memory`` are derived from the
throughput trials. ``gpu_suite.json`` and ``gpu_suite.md`` are rewritten in ``--out`` after every trial, so
a run cut short still leaves what it measured. ``--dry-run`` runs ours on the strict emulated accelerator
(its pretend device standing in for the GPU's memory and budgets) and stock ZeRO-3 on the CPU (standing in
for ZeRO-3 offload, once), skips the builds and ``pytest -m gpu`` ("no CUDA") and hides CUDA from its children.
"""
from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import gpt_model
import gpu_suite_merge
import gpu_suite_parts as parts
import gpu_suite_report as report
from bench_harness import run_process, tail, wait_process
from gpu_suite_env import Budget, child_env, lock_cleaner, machine, skipped
from gpu_suite_max_model import run_max_model

log = logging.getLogger("gpu_suite")
REPO = HERE.parent
# each part's share of what the parts before it left, in the order they run (the dry run's: its trial counts)
SHARES = {"builds": 0.12, "lora": 0.14, "dynamic_padding": 0.16, "throughput": 0.36, "sweep": 0.22,
          "gpu_tests": 1.0, "max_model": 0.5}
DRY_SHARES = {"builds": 0, "lora": 1.5, "dynamic_padding": 1.5, "throughput": 6, "sweep": 2.5, "gpu_tests": 0,
              "max_model": 1.5}
GPU_DEFAULT_PARTS = ("builds", "lora", "dynamic_padding", "throughput", "sweep")  # one lent call of <= 9 minutes
BUILDS = {  # op: the Python that builds (or loads from the cache) it
    "ours cuda": "from ds_patrickstar.optim.kernels import adam_backend_name as n; assert n('cuda') == 'cuda_fused'",
    "ours cpu": "from ds_patrickstar.optim.kernels import adam_backend_name as n; assert n('cpu') == 'cpu_fused'",
    "deepspeed cpu_adam": "from deepspeed.ops.op_builder import CPUAdamBuilder as B; B().load()",
    "deepspeed fused_adam": "from deepspeed.ops.op_builder import FusedAdamBuilder as B; B().load()",
}
GPU_TESTS_FIRST = ["tests/test_cuda_placement.py", "tests/test_kernels_cuda.py"]
DEFAULTS = {  # name: (GPU, dry run)
    "budget_s": (480.0, 70.0), "batch": (8, 2), "seq_len": (512, 16), "min_trial_s": (30.0, 5.0),
    "warmup": ("auto", "auto"), "max_warmup": (6, 3), "steps": (5, 5)}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="folder for gpu_suite.json and gpu_suite.md ($OUT on the lent machine)")
    p.add_argument("--budget-s", type=float, default=None, help="wall-clock seconds for everything (480; dry 70)")
    p.add_argument("--dry-run", action="store_true", help="this CPU: emulated accelerator, tiny sizes")
    p.add_argument("--parts", default=None, help=f"parts to run, of {','.join(SHARES)} (GPU: "
                   f"{','.join(GPU_DEFAULT_PARTS)}; dry: all)")
    p.add_argument("--part-seconds", default="", help="fixed seconds for named parts, e.g. builds=70,gpu_tests=110 "
                   "(the other parts share what those leave)")
    p.add_argument("--size-fractions", default="0.5,1.5,3", help="throughput: model data over the GPU's memory")
    p.add_argument("--sweep-points", default="12,16", help="sweep: GiB on an 80 GB GPU; B/off: no checkpointing")
    p.add_argument("--sweep-absolute", action="store_true", help="sweep: --sweep-points in GiB of this GPU, "
                   "not scaled by its memory over an 80 GB H100's")
    p.add_argument("--sweep-model", default=None, choices=list(gpt_model.PRESETS),
                   help="sweep: this preset (e.g. gpt-1.3b) instead of the smallest size that does not fit")
    p.add_argument("--sweep-rules", default="time,fill", help="sweep: ours' optimizer_placement rules, a row each "
                   "(dry: time; the fill row is skipped, said so)")
    p.add_argument("--backends", default=None, help="backends of the trial parts, of ours,zero3-offload,zero3 "
                   "(GPU: ours,zero3-offload: ZeRO-3 without offload is a second call's; dry: all)")
    p.add_argument("--batch", type=int, default=None, help="micro-batch (8; dry 2)")
    p.add_argument("--clip", type=float, default=None, help="every trial's gradient_clipping (the configs': 1.0); 0: "
                   "none, so that ours' host updates begin in backward (counter host_updates_in_backward)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (512; dry 16)")
    p.add_argument("--warmup", default=None, help="untimed steps per trial: a count or auto (until settled)")
    p.add_argument("--max-warmup", type=int, default=None, help="--warmup auto: at most this many (6; dry 3)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per trial, the median reported (5)")
    p.add_argument("--min-trial-s", type=float, default=None, help="start no trial with less left (30; dry 5)")
    p.add_argument("--host-cap-gib", type=float, default=16.0, help="max_model: host memory cap per try")
    p.add_argument("--max-width", type=int, default=2048, help="max_model: width of the GPT (dry 64)")
    p.add_argument("--max-grow", type=float, default=1.5, help="max_model: factor of the walk up")
    p.add_argument("--max-depth", type=int, default=96, help="max_model: deepest try (dry 1)")
    p.add_argument("--lora-rank", type=int, default=16, help="lora: rank of the adapters (dry 4)")
    p.add_argument("--lora-budget", type=float, default=3.0, help="lora: ours' device_budget in GiB (GPU)")
    p.add_argument("--merge", nargs="+", metavar="JSON", help="merge these runs' gpu_suite.json into --out")
    p.add_argument("--to-docs", metavar="JSON", help="write that suite JSON's tables into --docs and exit")
    p.add_argument("--docs", default=str(REPO / "docs" / "benchmarks.md"), help="page --to-docs rewrites")
    args = p.parse_args(argv)
    if not args.to_docs and not args.out:
        p.error("--out is required (or --to-docs JSON)")
    dry = args.dry_run
    args.parts = [x for x in (args.parts or ",".join(SHARES if dry else GPU_DEFAULT_PARTS)).split(",") if x]
    if set(args.parts) - set(SHARES):
        p.error(f"--parts: unknown {sorted(set(args.parts) - set(SHARES))}; choose from {list(SHARES)}")
    for name, (gpu, cpu) in DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, cpu if dry else gpu)
    args.warmup = args.warmup if args.warmup == "auto" else int(args.warmup)
    args.backends = [x for x in (args.backends or ("ours,zero3-offload,zero3" if dry else "ours,zero3-offload"))
                     .split(",") if x]
    if set(args.backends) - {*parts.OFFLOADED, "zero3"}:
        p.error(f"--backends: unknown {sorted(set(args.backends) - {*parts.OFFLOADED, 'zero3'})}")
    try:
        args.part_seconds = {k: float(v) for k, v in (x.split("=") for x in args.part_seconds.split(",") if x)}
    except ValueError:
        p.error(f"--part-seconds: {args.part_seconds!r}: give PART=SECONDS pairs, e.g. builds=70,gpu_tests=110")
    if set(args.part_seconds) - set(args.parts):
        p.error(f"--part-seconds: {sorted(set(args.part_seconds) - set(args.parts))} not among --parts")
    args.size_fractions = [float(f) for f in args.size_fractions.split(",") if f]
    args.sweep_points = [x for x in args.sweep_points.split(",") if x]
    args.sweep_rules = [x for x in args.sweep_rules.split(",") if x]
    if set(args.sweep_rules) - {"time", "fill"} or not args.sweep_rules:
        p.error(f"--sweep-rules: {args.sweep_rules}: give time, fill or both")
    if dry:
        args.max_width, args.max_depth, args.lora_rank = 64, 1, 4
    return args


# ------------------------------------------------------------------ builds and pytest -m gpu
def run_builds(ctx, deadline: float) -> dict:
    if not ctx.cuda:
        return skipped("no CUDA: the CPU ops load from the cache as the trials need them")
    procs = {name: subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=ctx.child_env, text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
             for name, code in BUILDS.items() if name in needed_builds(ctx.args.backends, ctx.args.parts)}
    start, ops = time.monotonic(), {}
    for name, proc in procs.items():
        code, out = wait_process(proc, deadline - time.monotonic(), lock_cleaner(ctx.child_env, ctx.cuda))
        ops[name] = {"ok": code == 0, "seconds": time.monotonic() - start,
                     **({} if code == 0 else {"error": out.splitlines()[0] if code is None
                                              else f"exit {code}: {tail(out, 4)}"})}
    cut = any(op.get("error", "").startswith("timed out") for op in ops.values())
    return {"status": "cut" if cut else "measured", "ops": ops}


def needed_builds(backends, parts) -> list[str]:
    """The ops this run loads: ours' where ours trains, DeepSpeed's where stock ZeRO-3 does, both for ``pytest -m
    gpu`` (a build the run does not need only takes the cores and the deadline from those it does)."""
    ours = "ours" in backends or "gpu_tests" in parts
    stock = any(b.startswith("zero3") for b in backends) or "gpu_tests" in parts
    return [name for name in BUILDS if (ours if name.startswith("ours") else stock)]


def gpu_test_files() -> list[str]:
    """The test files with GPU tests, the placement-against-ZeRO-3 checks first (pytest keeps this order)."""
    files = [str(p.relative_to(REPO)) for p in sorted((REPO / "tests").glob("test_*.py"))
             if "mark.gpu" in p.read_text()]
    return sorted(files, key=lambda f: (GPU_TESTS_FIRST.index(f) if f in GPU_TESTS_FIRST else len(GPU_TESTS_FIRST), f))


def count_outcomes(out: str) -> dict:
    """Per-test outcomes from ``pytest -v`` lines (``path::test PASSED [ 10%]``): what a killed run got to."""
    words = {"PASSED": "passed", "FAILED": "failures", "ERROR": "errors", "SKIPPED": "skipped"}
    counts = dict.fromkeys(words.values(), 0)
    for line in out.splitlines():
        if "::" in line:
            for word, key in words.items():
                if f" {word}" in line:
                    counts[key] += 1
                    break
    return counts


def run_gpu_tests(ctx, deadline: float) -> dict:
    if not ctx.cuda:
        return skipped("no CUDA: the GPU tests skip themselves here (the dry run does not run pytest within pytest)")
    files, left = gpu_test_files(), deadline - time.monotonic()
    if left < ctx.args.min_trial_s:
        return {"status": "cut", "reason": f"deadline: {left:.0f} s left"}
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-m", "gpu", *files,
               f"--junitxml={junit}"]
        code, output = run_process(cmd, left, ctx.child_env, REPO, lock_cleaner(ctx.child_env, ctx.cuda))
        out = {"status": "cut" if code is None else "measured", "files": files, "command": " ".join(cmd[1:-1]),
               "outcome": "passed" if code == 0 else output.splitlines()[0] if code is None else f"exit {code}"}
        out.update(count_outcomes(output))  # a killed run writes no JUnit file
        if junit.exists():
            suite = ET.parse(junit).getroot()
            suite = suite if suite.tag == "testsuite" else suite[0]
            out.update({k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")})
            out["passed"] = out["tests"] - out["failures"] - out["errors"] - out["skipped"]
    if code != 0:
        out["failed_tests"] = [ln.split(" ")[0] for ln in output.splitlines() if "::" in ln and " FAILED" in ln][:20]
        out["tail"] = tail(output, 12)
    return out


def run_max_model_part(ctx, deadline: float) -> dict:
    part = run_max_model(ctx, ctx.args, deadline, parts.DRY_DEVICE_BYTES, parts.DRY_STOCK_SKIP["max_model"])
    stopped = [b.get("stopped") or "" for b in part.get("backends", {}).values()]
    if part["status"] == "measured" and any(s.startswith("deadline") for s in stopped):
        part = {**part, "status": "cut", "reason": "cut by its deadline (a lower bound: see stopped)"}
    return part


# ------------------------------------------------------------------ the run
class Suite:
    """The run's state: what the parts measured so far, written to ``--out`` after every trial."""

    def __init__(self, args):
        import torch

        self.args, self.repo, self.cuda = args, REPO, torch.cuda.is_available() and not args.dry_run
        self.device_bytes = (torch.cuda.get_device_properties(0).total_memory if self.cuda
                             else parts.DRY_DEVICE_BYTES)
        self.child_env = child_env(REPO, args.dry_run, self.cuda)
        self.result = {"meta": machine(args, self.cuda, self.child_env), "flops": report.FLOPS_FORMULA, "parts": {},
                       "not_run": []}
        self.result["meta"]["device_bytes"] = self.device_bytes
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)

    def part_progress(self, name: str, part: dict) -> None:
        self.result["parts"][name] = part
        self.write()

    def write(self) -> None:
        write_result(self.result, self.out)

    def runners(self) -> dict:
        args = self.args
        return {"builds": lambda d: run_builds(self, d), "lora": lambda d: parts.run_lora(self, args, d),
                "dynamic_padding": lambda d: parts.run_dynamic_padding(self, args, d),
                "throughput": lambda d: parts.run_throughput(self, args, d),
                "sweep": lambda d: parts.run_sweep(self, args, d), "gpu_tests": lambda d: run_gpu_tests(self, d),
                "max_model": lambda d: run_max_model_part(self, d)}

    def run(self) -> dict:
        budget = Budget(self.args.budget_s)
        shares = {name: share for name, share in (DRY_SHARES if self.args.dry_run else SHARES).items()
                  if name in self.args.parts}
        for name, runner in self.runners().items():
            if name not in shares:
                self.part_progress(name, skipped(gpu_suite_merge.NOT_AMONG))
                continue
            deadline, started = budget.deadline(shares, name, self.args.part_seconds), time.monotonic()
            try:
                part = runner(deadline)
            except Exception as err:  # one broken part must not lose the others
                log.exception("%s failed", name)
                part = {"status": "failed", "error": f"{type(err).__name__}: {err}"[:500]}
            part["seconds_used"], part["deadline_s"] = time.monotonic() - started, deadline - started
            self.part_progress(name, part)
        self.result["meta"]["wall_s"] = budget.used()
        self.write()
        return self.result


def write_result(result: dict, out: Path) -> None:
    result["parts"].update(report.derived_parts(result["parts"]))
    (out / "gpu_suite.json").write_text(json.dumps(result, indent=1))
    (out / "gpu_suite.md").write_text(report.render(result))


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args = parse_args(argv)
    if args.to_docs:
        report.to_docs(Path(args.to_docs), Path(args.docs))
        return 0
    if args.merge:
        result = gpu_suite_merge.merge([json.loads(Path(p).read_text()) for p in args.merge])
        Path(args.out).mkdir(parents=True, exist_ok=True)
        write_result(result, Path(args.out))
    else:
        result = Suite(args).run()
    print(report.render(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
