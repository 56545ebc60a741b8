#!/usr/bin/env python
"""GPU benchmark: the longest sequence and tokens/s of a GPT by activation policy, ours against
stock ZeRO-3 offload, on one GPU capped at a fixed memory.

What it measures
    A GPT preset (``--model``: gpt2-medium, gpt-1.3b; bf16, batch 1, a loss over pieces of
    ``--loss-chunk`` tokens so that the logits of one piece live at a time) on a GPU whose caching
    allocator is capped at ``--cap-gib`` (``torch.cuda.set_per_process_memory_fraction``), the same
    cap for every row; ours gets ``device_budget`` = ``--budget-share`` of the cap. Each trial (a row
    at one sequence length) is a process of its own (a fresh engine and allocator: what a failed
    trial leaves cannot shrink the next) that trains ``--steps`` steps; for each row the lengths of
    ``--seqs`` are tried in ascending order until one fails for lack of memory
    (``torch.cuda.OutOfMemoryError`` or our ``DeviceBudgetExceeded``), then once halfway between the
    last that trained and the first that failed: the longest sequence is the last that trained
    (block_size, the position table, is the largest length for every trial). At each length:
    the last step's time (``torch.cuda.synchronize`` around it), tokens/s, model TFLOPS
    (``flops_per_token`` = 6 N + 12 L H T per token: no recomputation, no optimizer), the allocator's
    peak, and for ours the bytes moved per step (chunks host <-> device, activations out and back).
    Rows:

    * stock ZeRO-3 offload (``offload_param`` and ``offload_optimizer`` on the CPU, pinned, the
      memory-tuned knobs of bench_utils) with DeepSpeed's checkpointing, without and with
      ``activation_checkpointing.cpu_checkpointing``;
    * ours with checkpointing (torch's reentrant checkpoint, as Hugging Face's
      ``gradient_checkpointing_enable`` uses), without offload, with DeepSpeed's checkpointing and
      ``cpu_checkpointing``, and with ``offload_activations`` "auto" and "all".

``--deadline`` is shared evenly by the rows (what a row leaves goes to the next); a trial cut by it
is reported as "timed out", which says nothing about whether that length fits. On an H100 a trial of
gpt2-medium takes about 25-35 s (process start, initialize, 3 steps at 16k-32k tokens), the first
stock ZeRO-3 trial longer (DeepSpeed's CPU Adam builds): give each row a few minutes.

Targets (issue 20, GPU): ours "auto" >= 0.9x the tokens/s of checkpointing alone at the same
sequence length, and >= 1.5x its longest sequence.

    python benchmarks/bench_activations_gpu.py --model gpt2-medium --cap-gib 4 \\
        [--seqs 2048,4096,...] [--rows name,...] [--deadline 480] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpt_model
from bench_utils import ZERO3_MEMORY_TUNED, add_repo_to_path, setup_single_process_env

log = logging.getLogger("bench_activations_gpu")

# name: (stage, checkpoint implementation, cpu_checkpointing, offload_activations)
ROWS = {
    "zero3-offload ckpt": (3, "deepspeed", False, "none"),
    "zero3-offload ckpt + cpu_checkpointing": (3, "deepspeed", True, "none"),
    "ours ckpt": ("patrickstar", "torch-reentrant", False, "none"),
    "ours ckpt + cpu_checkpointing": ("patrickstar", "deepspeed", True, "none"),
    'ours ckpt + offload_activations "auto"': ("patrickstar", "torch-reentrant", False, "auto"),
    'ours ckpt + offload_activations "all"': ("patrickstar", "torch-reentrant", False, "all"),
}
BASELINE = "ours ckpt"
TARGET = 'ours ckpt + offload_activations "auto"'


def _config(args, stage, cpu_ckpt: bool, mode: str) -> dict:
    zero: dict = {"stage": stage}
    if stage == "patrickstar":
        zero.update(device_budget=int(args.cap_gib * args.budget_share * 2**30), offload_activations=mode)
    else:
        pinned = {"device": "cpu", "pin_memory": True}
        zero.update(ZERO3_MEMORY_TUNED, offload_param=pinned, offload_optimizer=pinned)
    return {
        "train_micro_batch_size_per_gpu": 1,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0}},
        "zero_optimization": zero,
        "activation_checkpointing": {"cpu_checkpointing": cpu_ckpt},
        "steps_per_print": 10**9,
    }


def _out_of_memory() -> tuple[type[BaseException], ...]:
    from ds_patrickstar.memory.ledger import DeviceBudgetExceeded

    return (torch.cuda.OutOfMemoryError, DeviceBudgetExceeded)


def _step(engine, seq: int, vocab: int, gen: torch.Generator) -> float:
    tok = torch.randint(0, vocab, (1, seq + 1), generator=gen).cuda()
    torch.cuda.synchronize()
    start = time.perf_counter()
    _, loss = engine(tok[:, :-1], tok[:, 1:])
    engine.backward(loss)
    engine.step()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def _measure(args, engine, cfg, n_params: int, seq: int) -> dict:
    gen = torch.Generator().manual_seed(seq)
    seconds = [_step(engine, seq, cfg.vocab_size, gen) for _ in range(args.steps)]
    step_s = seconds[-1]
    tflops = gpt_model.flops_per_token(cfg, n_params, seq) * seq / step_s / 1e12
    out = {"seq": seq, "step_s": step_s, "tokens_s": seq / step_s, "tflops": tflops}
    out["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    if hasattr(engine, "get_patrickstar_counters"):
        c = engine.get_patrickstar_counters()
        act = c["activation_bytes_offloaded"] + c["activation_bytes_restored"]
        out["moved_gb"] = (c["bytes_to_device"] + c["bytes_to_host"] + act) / 1e9
        out["activation_moved_gb"] = act / 1e9
    return out


def trial(args, name: str, seq: int) -> dict:
    """One row at one length in this process: ``{"seq", ...}`` or ``{"oom": why}``."""
    import deepspeed

    stage, impl, cpu_ckpt, mode = ROWS[name]
    config = _config(args, stage, cpu_ckpt, mode)
    cfg = gpt_model.get_config(
        args.model,
        block_size=max(args.seqs),
        activation_checkpointing=True,
        checkpoint_impl=impl,
        loss_chunk=args.loss_chunk,
    )
    deepspeed.checkpointing.configure(None, deepspeed_config=config)
    torch.manual_seed(0)
    model = gpt_model.GPT(cfg)
    n_params = gpt_model.count_params(model, exclude_position_embedding=True)
    start = time.perf_counter()
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    init_s = time.perf_counter() - start
    try:
        return {**_measure(args, engine, cfg, n_params, seq), "init_s": init_s}
    except _out_of_memory() as err:
        return {"oom": f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"}


def _child(args, name: str, seq: int, timeout: float) -> dict:
    """:func:`trial` in a child process; a crash or a timeout is an error, not a fit."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [sys.executable, os.path.abspath(__file__), "--trial", name, "--trial-seq", str(seq), "--json", out.name]
        cmd += ["--model", args.model, "--cap-gib", str(args.cap_gib), "--budget-share", str(args.budget_share)]
        cmd += ["--seqs", ",".join(map(str, args.seqs)), "--loss-chunk", str(args.loss_chunk)]
        cmd += ["--steps", str(args.steps)]
        try:
            env = {k: v for k, v in os.environ.items() if k != "MASTER_PORT"}  # each child a port of its own
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=max(timeout, 1), env=env)
        except subprocess.TimeoutExpired:
            return {"error": f"seq {seq}: timed out after {timeout:.0f} s"}
        if done.returncode != 0:
            tail = [line for line in done.stderr.splitlines() if line.strip()][-3:]
            return {"error": f"seq {seq}: exit {done.returncode}: {' / '.join(tail)[-300:]}"}
        with open(out.name) as f:
            return json.load(f)


def run_row(args, name: str, deadline: float) -> dict:
    """Ascending lengths until one does not fit, then one halfway try; see the module docstring."""
    row: dict = {"trained": [], "stopped": None}

    def attempt(seq: int) -> bool:
        left = deadline - time.perf_counter()
        if left < 20:
            row["stopped"] = row["stopped"] or f"deadline before seq {seq}"
            return False
        got = _child(args, name, seq, left)
        if "seq" in got:
            row["trained"].append(got)
            log.info("%s: %s", name, got)
            return True
        row["stopped"] = got.get("oom") and f"seq {seq}: {got['oom']}" or got["error"]
        log.info("%s: %s", name, row["stopped"])
        return False

    failed = None
    for seq in args.seqs:
        if not attempt(seq):
            failed = seq
            break
    trained = row["trained"]
    if failed is not None and trained and "deadline" not in (row["stopped"] or ""):
        mid = (trained[-1]["seq"] + failed) // 2 // 1024 * 1024
        if trained[-1]["seq"] < mid < failed and attempt(mid):
            row["stopped"] = f"{row['stopped']} (and seq {mid} trained)"
            row["trained"].sort(key=lambda r: r["seq"])
    return row


def table(results: dict) -> list[str]:
    base = results.get(BASELINE, {}).get("trained") or []
    base_by_seq = {r["seq"]: r for r in base}
    base_longest = base[-1]["seq"] if base else None
    lines = [
        "| row | longest seq | x ckpt (ours) | tokens/s at longest | TFLOPS | peak GiB | GB moved/step "
        f"| tokens/s at seq {base_longest} | x ckpt tokens/s | stopped by |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, row in results.items():
        trained = row.get("trained") or []
        if not trained:
            lines.append(f"| {name} | none | | | | | | | | {row.get('stopped') or row.get('error')} |")
            continue
        best = trained[-1]
        ratio = f"{best['seq'] / base_longest:.2f}x" if base_longest else ""
        at = next((r for r in trained if r["seq"] == base_longest), None)
        same = f"{at['tokens_s']:.0f}" if at else ""
        speed = f"{at['tokens_s'] / base_by_seq[base_longest]['tokens_s']:.2f}x" if at and base_longest else ""
        moved = f"{best['moved_gb']:.2f}" if "moved_gb" in best else ""
        lines.append(
            f"| {name} | {best['seq']} | {ratio} | {best['tokens_s']:.0f} | {best['tflops']:.1f} | "
            f"{best['peak_gib']:.2f} | {moved} | {same} | {speed} | {row.get('stopped')} |"
        )
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt2-medium", choices=["gpt2-medium", "gpt-1.3b"])
    p.add_argument("--cap-gib", type=float, default=4.0, help="GPU memory cap for every row")
    p.add_argument("--budget-share", type=float, default=0.9, help="ours: device_budget as a share of the cap")
    p.add_argument("--seqs", default="4096,8192,16384,32768,65536")
    p.add_argument("--loss-chunk", type=int, default=2048)
    p.add_argument("--steps", type=int, default=3, help="steps per length; the last is timed")
    p.add_argument("--rows", default=",".join(ROWS), help="comma-separated row names")
    p.add_argument("--deadline", type=float, default=480.0, help="seconds for all rows (checked between lengths)")
    p.add_argument("--json", default=None)
    p.add_argument("--trial", default=None, help=argparse.SUPPRESS)  # a child: this row ...
    p.add_argument("--trial-seq", type=int, default=0, help=argparse.SUPPRESS)  # ... at this length
    args = p.parse_args()
    args.seqs = sorted(int(s) for s in args.seqs.split(","))
    rows = [r for r in args.rows.split(",") if r]
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        raise SystemExit(f"unknown rows {unknown}; choose from {list(ROWS)}")
    if not torch.cuda.is_available():
        raise SystemExit("bench_activations_gpu needs a CUDA GPU (benchmarks/bench_activations.py is the CPU twin)")
    add_repo_to_path()
    setup_single_process_env()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s")
    log.setLevel(logging.INFO)
    import deepspeed

    import ds_patrickstar  # noqa: F401

    if args.trial:
        deepspeed.init_distributed(dist_backend="nccl")
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gib * 2**30 / total))
        with open(args.json, "w") as f:
            json.dump(trial(args, args.trial, args.trial_seq), f)
        return
    begin = time.perf_counter()
    results: dict = {}
    for i, name in enumerate(rows):
        share = (args.deadline - (time.perf_counter() - begin)) / (len(rows) - i)
        try:
            results[name] = run_row(args, name, time.perf_counter() + share)
        except Exception as err:  # one broken row must not lose the others
            log.exception("%s failed", name)
            results[name] = {"error": f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"}
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), "results": results}, f, indent=1)
    gpu = torch.cuda.get_device_name(0)
    print(
        f"\n{args.model} ({gpt_model.count_params_for_config(gpt_model.get_config(args.model)) / 1e9:.3f}B), bf16, "
        f"batch 1, loss in pieces of {args.loss_chunk} tokens; {gpu}, memory capped at {args.cap_gib} GiB "
        f"(ours: device_budget {args.budget_share:.0%} of it); {os.cpu_count()} CPUs; torch {torch.__version__}, "
        f"DeepSpeed {deepspeed.__version__}\n"
    )
    print("\n".join(table(results)))


if __name__ == "__main__":
    main()
