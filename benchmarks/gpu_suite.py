#!/usr/bin/env python
"""GPU truth in one command: the measurements a lent GPU should spend its minutes on, within a wall-clock budget.

    python benchmarks/gpu_suite.py --out $OUT                    # a lent GPU: docs/benchmarks.md#gpu-suite-gpu_suitepy
    python benchmarks/gpu_suite.py --dry-run --out /tmp/suite      # the same code on this CPU, tiny sizes
    python benchmarks/gpu_suite.py --to-docs $OUT/gpu_suite.json   # its table into docs/benchmarks.md

Parts, most valuable first; each gets a deadline (its share of what the parts before it left) and is skipped with
the reason when the time runs short. First ``builds``: the JIT-built ops the parts load (ours' CUDA and CPU Adam,
DeepSpeed's CPU Adam and FusedAdam), all at once, each in a process of its own, so that no trial times a build
and no trial dies in one. Then:

1. ``gpu_tests``: ``pytest -m gpu`` over the test files that hold GPU tests, with a timeout;
2. ``throughput``: step time, tokens/s and TFLOPS at three model sizes, ours against stock ZeRO-3 with
   ``offload_param``/``offload_optimizer`` on the CPU and, where its 16 bytes/param and activations fit the GPU,
   ZeRO-3 without offload: one process per trial (``gpu_suite_trial.py``); the practicality ratio of each
   offloaded run is its tokens/s over the no-offload run's;
3. ``max_model``: the largest GPT that trains at a capped host memory, ours against ZeRO-3 offload: a walk up by
   ``--max-grow`` then a bisection, over ``max_model.py``'s tries, stopped by its deadline;
4. ``breakdown`` and 5. ``host_memory``: derived from part 2's trials (forward, backward, ``engine.step()``, the
   host time in Adam and in its CPU kernel, ours' bytes moved and their seconds at the measured pinned bandwidth;
   RSS and the CUDA host allocator's statistics against ours' counted host bytes);
6. ``dynamic_padding``: tokens/s of a GPT-2-medium-class model whose batches are padded to their own longest
   sequence (a length per step) beside the same run at the longest length, ours (device budget below the
   model: 6 bytes/param plus 3 GiB for activations) and ZeRO-3 offload, one process per trial
   (``gpu_suite_trial.py --dynamic-padding``);
   the dry run measures ours only, at the smallest dry size;
7. ``lora``, with the time the parts above leave (it takes none of theirs): LoRA (adapters of rank ``--lora-rank``
   on every linear layer of the blocks, the rest frozen) of a base larger than ours' device budget
   (``--lora-budget``; dry: the emulated accelerator at half the frozen base),
   ours against ZeRO-3 with ``offload_param``/``offload_optimizer`` on the CPU: tokens/s, GPU max allocated,
   peak RSS and the losses; the dry run measures ours only (stock ZeRO-3's ~10 s start);

It writes ``gpu_suite.json`` and ``gpu_suite.md`` into ``--out`` (rewritten after every trial, so a run cut short
still leaves what it measured). ``--dry-run`` runs ours on the strict emulated accelerator and stock ZeRO-3 on the
CPU (standing in for ZeRO-3 offload), skips ``pytest -m gpu`` ("no CUDA") and hides CUDA from its children.
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
import gpu_suite_report as report
import max_model
from bench_utils import free_port
from gpu_suite_env import Budget, child_env, failure, machine, run_process, skipped, tail, wait_process
from gpu_suite_max_model import run_max_model

log = logging.getLogger("gpu_suite")
REPO = HERE.parent
TRIAL = HERE / "gpu_suite_trial.py"
# of what the parts before left
SHARES = {"builds": 0.3, "gpu_tests": 0.25, "throughput": 0.45, "max_model": 0.2, "dynamic_padding": 0.05}
LAST = "lora"  # runs with what the parts above left
BUILDS = {  # op: the Python that builds (or loads from the cache) it
    "ours cuda": "from ds_patrickstar.optim.kernels import adam_backend_name as n; assert n('cuda') == 'cuda_fused'",
    "ours cpu": "from ds_patrickstar.optim.kernels import adam_backend_name as n; assert n('cpu') == 'cpu_fused'",
    "deepspeed cpu_adam": "from deepspeed.ops.op_builder import CPUAdamBuilder as B; B().load()",
    "deepspeed fused_adam": "from deepspeed.ops.op_builder import FusedAdamBuilder as B; B().load()",
}
BACKENDS = ("ours", "zero3-offload", "zero3")
GPU_TESTS_FIRST = ["tests/test_cuda_placement.py", "tests/test_kernels_cuda.py"]
OFFLOADED = ("ours", "zero3-offload")
# (name, gpt_model preset, GPTConfig overrides); batch and sequence length from the command line
GPU_SIZES = [("gpt-114m", "gpt-114m", {}), ("gpt2-medium", "gpt2-medium", {}), ("gpt-1.3b", "gpt-1.3b", {})]
DRY_SIZES = [("dry-s", "tiny", {"n_layer": 1, "n_embd": 32, "n_head": 2, "block_size": 32}),
             ("dry-m", "tiny", {"n_layer": 2, "n_embd": 48, "n_head": 2, "block_size": 32}),
             ("dry-l", "tiny", {"n_layer": 2, "n_embd": 64, "n_head": 2, "block_size": 32})]
DRY_DEVICE_BYTES = 1_000_000  # the dry run's pretend GPU: ours' device_budget, and what ZeRO-3 must fit
NO_OFFLOAD_BYTES_PER_PARAM = 16  # bf16 params and grads, fp32 master, momentum and variance
# Stock ZeRO-3 spends ~10 s of CPU starting a trial on this machine (its optimizer checks import torch.compile),
# so the dry run, which must stay cheap in CI, runs it once: at the smallest size, standing in for ZeRO-3 offload
DRY_STOCK_SKIP = {
    "zero3-offload": "dry run: stock ZeRO-3 runs at the smallest size only",
    "zero3": "dry run: on the CPU, ZeRO-3 without offload is the run that stands in for ZeRO-3 offload",
    "max_model": "dry run: stock ZeRO-3's search is ours' with another backend name, and costs ~10 s per try",
    "lora": "dry run: stock ZeRO-3's LoRA trial is the GPU's comparison; it costs ~10 s to start here",
    "dynamic_padding": "dry run: stock ZeRO-3 costs ~10 s per trial; its throughput part runs it once",
}
DYNAMIC_SIZE = ("gpt2-medium", "gpt2-medium", {})
DYNAMIC_BUDGET_BYTES_PER_PARAM = 6  # ours' device budget: room for under half of its 14 bytes/param of model data,
DYNAMIC_ACTIVATION_ROOM = 3 * 2**30  # plus the non-model peak at batch 8 x 512 (2.2 GB + 0.3 GB stranded, H200)
LORA_GPU_SIZE = ("gpt-1.3b", "gpt-1.3b", {})  # a bf16 base of ~2.6 GB, ~1.1 GB of activations at 8 x 512, 3 GiB budget
DRY_LORA = {"chunk_size": 8192, "budget": 200_000}  # the tiny base's frozen bf16 chunks take ~220 kB


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="folder for gpu_suite.json and gpu_suite.md ($OUT on the lent machine)")
    p.add_argument("--budget-s", type=float, default=None, help="wall-clock seconds for everything (480; dry 60)")
    p.add_argument("--dry-run", action="store_true", help="this CPU: emulated accelerator, tiny sizes")
    p.add_argument("--parts", default=",".join([*SHARES, LAST]), help="which parts to run (the others are skipped)")
    p.add_argument("--sizes", default=",".join(s[0] for s in GPU_SIZES), help="presets of gpt_model.py (GPU)")
    p.add_argument("--batch", type=int, default=None, help="micro-batch (8; dry 2)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (512; dry 16)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps per trial (2; dry 1)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per trial, the median reported (3; dry 2)")
    p.add_argument("--min-trial-s", type=float, default=None, help="start no trial with less left (30; dry 3)")
    p.add_argument("--host-cap-gib", type=float, default=16.0, help="max_model: host memory cap per try")
    p.add_argument("--max-width", type=int, default=2048, help="max_model: width of the GPT (dry 64)")
    p.add_argument("--max-grow", type=float, default=1.5, help="max_model: factor of the walk up")
    p.add_argument("--max-depth", type=int, default=96, help="max_model: deepest try (dry 1)")
    p.add_argument("--lora-rank", type=int, default=16, help="lora: rank of the adapters (dry 4)")
    p.add_argument("--lora-budget", type=float, default=3.0, help="lora: ours' device_budget in GiB (GPU)")
    p.add_argument("--to-docs", metavar="JSON", help="write that suite JSON's tables into --docs and exit")
    p.add_argument("--docs", default=str(REPO / "docs" / "benchmarks.md"), help="page --to-docs rewrites")
    args = p.parse_args(argv)
    if not args.to_docs and not args.out:
        p.error("--out is required (or --to-docs JSON)")
    args.parts = [part for part in args.parts.split(",") if part]
    if set(args.parts) - {*SHARES, LAST}:
        p.error(f"--parts: unknown {sorted(set(args.parts) - {*SHARES, LAST})}; choose from {[*SHARES, LAST]}")
    dry = args.dry_run
    for name, gpu, cpu in (("budget_s", 480.0, 60.0), ("batch", 8, 2), ("seq_len", 512, 16),
                           ("min_trial_s", 30.0, 3.0), ("warmup", 2, 1), ("steps", 3, 2)):
        if getattr(args, name) is None:
            setattr(args, name, cpu if dry else gpu)
    if dry:
        args.max_width, args.max_depth, args.lora_rank = 64, 1, 4
    return args


# ------------------------------------------------------------------ builds, then part 1: pytest -m gpu
def run_builds(ctx, deadline: float) -> dict:
    if not ctx.cuda:
        return skipped("no CUDA: the CPU ops load from the cache as the trials need them")
    procs = {name: subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=ctx.child_env, text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
             for name, code in BUILDS.items()}
    start, ops = time.monotonic(), {}
    for name, proc in procs.items():
        code, out = wait_process(proc, deadline - time.monotonic(), ctx.child_env, ctx.cuda)
        ops[name] = {"ok": code == 0, "seconds": time.monotonic() - start,
                     **({} if code == 0 else {"error": failure(code, out, 4)})}
    return {"status": "measured", "ops": ops}


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
        return skipped(f"deadline: {left:.0f} s left")
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-m", "gpu", *files,
               f"--junitxml={junit}"]
        code, output = run_process(cmd, left, ctx.child_env, REPO, ctx.cuda)
        out = {"status": "measured", "files": files, "command": " ".join(cmd[1:-1]),
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


# ------------------------------------------------------------------ part 2: throughput
def sizes(args) -> list[tuple[str, str, dict]]:
    if args.dry_run:
        return DRY_SIZES
    known = {s[0]: s for s in GPU_SIZES}
    return [known.get(name, (name, name, {})) for name in args.sizes.split(",") if name]


def no_offload_fit(ctx, args, preset: str, overrides: dict) -> tuple[bool, str]:
    """Whether ZeRO-3 without offload should fit the GPU: 16 bytes/param plus an activation estimate
    (34 bytes per token per layer per unit of width, Korthikanti et al. 2022, and fp32 + bf16 logits)."""
    cfg = gpt_model.get_config(preset, **overrides)
    tokens = args.batch * args.seq_len
    need = (NO_OFFLOAD_BYTES_PER_PARAM * gpt_model.count_params_for_config(cfg)
            + tokens * (34 * cfg.n_embd * cfg.n_layer + 6 * cfg.vocab_size))
    room = 0.9 * ctx.device_bytes
    why = f"estimated {need / 2**30:.3f} GiB against 90% of {ctx.device_bytes / 2**30:.3f} GiB"
    return need <= room, why


def trial_command(args, backend: str, preset: str, overrides: dict, json_path: Path) -> list[str]:
    cmd = [sys.executable, str(TRIAL), "--backend", backend, "--model", preset, "--overrides", json.dumps(overrides),
           "--batch", str(args.batch), "--seq-len", str(args.seq_len), "--warmup", str(args.warmup),
           "--steps", str(args.steps), "--json", str(json_path)]
    if args.dry_run and backend == "ours":
        cmd += ["--emulate-budget", str(DRY_DEVICE_BYTES)]
    return cmd


def run_trial(ctx, args, size, backend: str, deadline: float, need: float) -> dict:
    """One trial in a process of its own, unless it does not fit, or less than ``need`` seconds are left."""
    name, preset, overrides = size
    head = {"size": name, "backend": backend}
    if backend == "zero3":
        fits, why = no_offload_fit(ctx, args, preset, overrides)
        if not fits:
            return {**head, "status": "skipped", "reason": f"does not fit the GPU: {why}"}
    if args.dry_run and backend in DRY_STOCK_SKIP and (backend == "zero3" or name != DRY_SIZES[0][0]):
        return {**head, "status": "skipped", "reason": DRY_STOCK_SKIP[backend]}
    left = deadline - time.monotonic()
    if left < need:
        return {**head, "status": "skipped", "reason": f"deadline: {left:.0f} s left, a trial needs {need:.0f} s"}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "trial.json"
        start = time.monotonic()
        port = free_port()
        env = {**ctx.child_env, "MASTER_PORT": str(port)}
        code, output = run_process(trial_command(args, backend, preset, overrides, out), left, env, REPO, ctx.cuda)
        max_model.remove_shm_buffers(port)
        seconds = time.monotonic() - start
        if code != 0 or not out.exists():
            return {**head, "status": "failed", "error": failure(code, output), "seconds": seconds}
        result = json.loads(out.read_text())
    if args.dry_run and backend == "zero3-offload":
        result["stand_in"] = "plain ZeRO-3 on the CPU (no CUDA: nothing to offload from)"
    return {**head, "status": "measured", "seconds": seconds, **result}


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
    trials: list[dict] = []
    took: dict[str, float] = {}  # the last trial's seconds per backend: sizes ascend, so the next needs more
    # ours against ZeRO-3 offload at every size first, then ZeRO-3 without offload (the practicality ratio)
    order = [(size, b) for size in sizes(args) for b in OFFLOADED] + [(size, "zero3") for size in sizes(args)]
    for size, backend in order:
        trial = run_trial(ctx, args, size, backend, deadline, max(args.min_trial_s, took.get(backend, 0.0)))
        if trial["status"] == "measured":
            took[backend] = trial["seconds"]
        log.info("throughput %s %s: %s %s", size[0], backend, trial["status"],
                 f"{trial['tokens_per_s']:.1f} tokens/s" if "tokens_per_s" in trial else trial.get("reason")
                 or trial.get("error", ""))
        trials.append(trial)
        ctx.part_progress("throughput", {"status": "measured", "trials": trials, "ratios": ratios(trials)})
    if not any(t["status"] == "measured" for t in trials):
        return {**skipped("no trial was measured (see trials)"), "trials": trials}
    return {"status": "measured", "trials": trials, "ratios": ratios(trials)}


# ------------------------------------------------------------------ part 6: LoRA past GPU memory
def lora_command(args, backend: str, json_path: Path) -> list[str]:
    """One LoRA trial: the largest throughput size's base (dry) or ``LORA_GPU_SIZE``, ours capped below it."""
    _, preset, overrides = DRY_SIZES[-1] if args.dry_run else LORA_GPU_SIZE
    cmd = trial_command(args, backend, preset, overrides, json_path) + ["--lora", str(args.lora_rank)]
    if backend != "ours":
        return cmd
    if args.dry_run:  # trial_command gave the dry device; the LoRA trial's is below the frozen base
        cmd[cmd.index("--emulate-budget") + 1] = str(DRY_LORA["budget"])
        return cmd + ["--chunk-size", str(DRY_LORA["chunk_size"])]
    return cmd + ["--device-budget", str(int(args.lora_budget * 2**30))]


def run_lora(ctx, args, deadline: float) -> dict:
    trials = []
    for backend in OFFLOADED:
        head = {"size": (DRY_SIZES[-1] if args.dry_run else LORA_GPU_SIZE)[0], "backend": backend}
        if args.dry_run and backend != "ours":
            trials.append({**head, "status": "skipped", "reason": DRY_STOCK_SKIP["lora"]})
            continue
        left = deadline - time.monotonic()
        if left < args.min_trial_s:
            trials.append({**head, "status": "skipped", "reason": f"deadline: {left:.0f} s left"})
            continue
        with tempfile.TemporaryDirectory() as tmp:
            out, port = Path(tmp) / "trial.json", free_port()
            code, output = run_process(lora_command(args, backend, out), left,
                                       {**ctx.child_env, "MASTER_PORT": str(port)}, REPO, ctx.cuda)
            max_model.remove_shm_buffers(port)
            if code != 0 or not out.exists():
                trials.append({**head, "status": "failed", "error": failure(code, output)})
                continue
            trials.append({**head, "status": "measured", **json.loads(out.read_text())})
        log.info("lora %s: %s", backend, trials[-1]["status"])
        ctx.part_progress("lora", {"status": "measured", "trials": trials})
    if not any(t["status"] == "measured" for t in trials):
        return {**skipped("no LoRA trial was measured (see trials)"), "trials": trials}
    return {"status": "measured", "trials": trials}


def run_dynamic_padding(ctx, args, deadline: float) -> dict:
    """Part 6: dynamic padding against a fixed length, ours and ZeRO-3 offload, tokens/s side by side."""
    name, preset, overrides = DRY_SIZES[0] if args.dry_run else DYNAMIC_SIZE
    params = gpt_model.count_params_for_config(gpt_model.get_config(preset, **overrides))
    trials = []
    for backend in OFFLOADED:
        for padding in ("fixed", "dynamic"):
            head = {"size": name, "backend": backend, "padding": padding}
            left = deadline - time.monotonic()
            if args.dry_run and backend != "ours":
                trials.append({**head, "status": "skipped", "reason": DRY_STOCK_SKIP["dynamic_padding"]})
                continue
            if left < args.min_trial_s:
                trials.append({**head, "status": "skipped", "reason": f"deadline: {left:.0f} s left"})
                continue
            extra = ["--dynamic-padding"] if padding == "dynamic" else []
            if backend == "ours" and not args.dry_run:
                extra += ["--device-budget", str(DYNAMIC_BUDGET_BYTES_PER_PARAM * params + DYNAMIC_ACTIVATION_ROOM)]
            with tempfile.TemporaryDirectory() as tmp:
                out, port = Path(tmp) / "trial.json", free_port()
                cmd = trial_command(args, backend, preset, overrides, out) + extra
                code, output = run_process(cmd, left, {**ctx.child_env, "MASTER_PORT": str(port)}, REPO, ctx.cuda)
                max_model.remove_shm_buffers(port)
                if code != 0 or not out.exists():
                    trials.append({**head, "status": "failed", "error": failure(code, output)})
                    continue
                result = json.loads(out.read_text())
            trials.append({**head, "status": "measured", "tokens_per_s": result["tokens_per_s"],
                           "counters": [r.get("counters", {}) for r in result["records"]]})
            ctx.part_progress("dynamic_padding", {"status": "measured", "trials": trials})
    if not any(t["status"] == "measured" for t in trials):
        return {**skipped("no trial was measured (see trials)"), "trials": trials}
    return {"status": "measured", "trials": trials}


# ------------------------------------------------------------------ the run
class Suite:
    """The run's state: what the parts measured so far, written to ``--out`` after every trial."""

    def __init__(self, args):
        import torch

        self.args, self.cuda = args, torch.cuda.is_available() and not args.dry_run
        self.device_bytes = torch.cuda.get_device_properties(0).total_memory if self.cuda else DRY_DEVICE_BYTES
        self.child_env = child_env(REPO, args.dry_run, self.cuda)
        self.result = {"meta": machine(args, self.cuda, self.child_env), "flops": report.FLOPS_FORMULA, "parts": {},
                       "not_run": report.NOT_BUILT}
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)

    def part_progress(self, name: str, part: dict) -> None:
        self.result["parts"][name] = part
        self.write()

    def write(self) -> None:
        self.result["parts"].update(report.derived_parts(self.result["parts"]))
        (self.out / "gpu_suite.json").write_text(json.dumps(self.result, indent=1))
        (self.out / "gpu_suite.md").write_text(report.render(self.result))

    def run(self) -> dict:
        budget = Budget(self.args.budget_s)
        runners = {"builds": lambda d: run_builds(self, d), "gpu_tests": lambda d: run_gpu_tests(self, d),
                   "throughput": lambda d: run_throughput(self, self.args, d),
                   "max_model": lambda d: run_max_model(self, self.args, d, DRY_DEVICE_BYTES,
                                                        DRY_STOCK_SKIP["max_model"]),
                   "dynamic_padding": lambda d: run_dynamic_padding(self, self.args, d),
                   "lora": lambda d: run_lora(self, self.args, d)}
        shares = {name: share for name, share in SHARES.items() if name in self.args.parts}
        for name, runner in runners.items():
            if name not in shares and name != LAST or name not in self.args.parts:
                self.part_progress(name, skipped("not among --parts"))
                continue
            deadline = budget.deadline(shares, name) if name != LAST else time.monotonic() + budget.left()
            started = time.monotonic()
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


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args = parse_args(argv)
    if args.to_docs:
        report.to_docs(Path(args.to_docs), Path(args.docs))
        return 0
    result = Suite(args).run()
    print(report.render(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
