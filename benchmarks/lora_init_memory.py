"""Per-rank resident memory of a LoRA run whose frozen base is built under ``ds_patrickstar.Init`` (issue 30).

    python benchmarks/lora_init_memory.py                          # 2 ranks, a 0.40B bf16 base, keep_gathered 0
    python benchmarks/lora_init_memory.py --layers 4 --json runs/lora_init_memory.json

Each rank (a process of its own, on gloo) builds a GPT of ``gpt_model.py`` (``--width``, ``--layers``, GPT-2
vocabulary, the LM head tied to the embedding) with rank-``--rank`` adapters beside every linear layer of its
blocks (``GPTConfig.lora_rank``; the rest frozen) inside ``ds_patrickstar.Init``, initializes stage
"patrickstar" (bf16, ``keep_gathered`` 0) and trains ``--steps`` steps on random tokens. A rank's peak resident
growth is its peak resident set (``VmHWM``, reset to the current ``VmRSS`` through ``/proc/self/clear_refs``
just before the ``Init`` block) less its resident set then: everything the run added, from the model's
construction through ``deepspeed.initialize`` (materialization, the chunks) to the steps (gathered groups,
adapters and their Adam states, activations, DeepSpeed's and torch's own allocations). The peak is also read
at the end of each phase (construction, initialize, each step), so the phase that set it is known.

``--backends`` runs the same script on stock ZeRO-3 too (``zero3``: ``deepspeed.zero.Init``, stage 3 with
``bench_utils.ZERO3_MEMORY_TUNED`` and ``stage3_max_reuse_distance`` 0, so that a parameter is released after
its use as ``keep_gathered`` 0 releases a group), one backend after the other, each in processes of its own.

The table: per backend and rank its peak growth, beside the target (``--base-share`` x the frozen base's bytes
+ ``--slack-mib``) and the frozen base's bytes; the growth at each phase's end, and the rank's own frozen
chunks (counters).
Exit status 1 when a rank fails or a rank of ours is above the target.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
MIB = 2**20


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", default="patrickstar,zero3", help="comma-separated: patrickstar, zero3")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--layers", type=int, default=28, help="28 at width 1024: a 0.40B base")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--rank", type=int, default=16, help="rank of the adapters")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--keep-gathered", type=int, default=0, help="zero_optimization.keep_gathered (bytes)")
    p.add_argument("--chunk-size", type=int, default=None, help="zero_optimization.chunk_size (default: ours')")
    p.add_argument("--prefetch-groups", type=int, default=None,
                   help="zero_optimization.prefetch_groups (default: ours')")
    p.add_argument("--base-share", type=float, default=0.6, help="target: this share of the base's bytes ...")
    p.add_argument("--slack-mib", type=float, default=192.0, help="... plus this many MiB per rank")
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds for the run")
    p.add_argument("--json", default=None, help="write every figure here")
    p.add_argument("--rank-result", default=None, help=argparse.SUPPRESS)
    p.add_argument("--backend", default="patrickstar", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def proc_status(key):
    with open("/proc/self/status") as f:
        return int(re.search(rf"{key}:\s+(\d+) kB", f.read()).group(1)) * 1024


def reset_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS


def ds_config(args):
    if args.backend == "zero3":
        from bench_utils import ZERO3_MEMORY_TUNED

        zero = {"stage": 3, **ZERO3_MEMORY_TUNED, "stage3_max_reuse_distance": 0}
    else:
        zero = {"stage": "patrickstar", "keep_gathered": args.keep_gathered}
        if args.chunk_size is not None:
            zero["chunk_size"] = args.chunk_size
        if args.prefetch_groups is not None:
            zero["prefetch_groups"] = args.prefetch_groups
    return {"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1,
            "steps_per_print": 10**9, "bf16": {"enabled": True}, "zero_optimization": zero,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0}}}


def run_rank(args):
    """One rank: build under Init, initialize, train; rank r writes its figures to ``args.rank_result``."""
    sys.path[:0] = [str(HERE), str(HERE.parent)]
    import gc

    import deepspeed
    import gpt_model
    import torch

    import ds_patrickstar

    config = ds_config(args)
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    cfg = gpt_model.GPTConfig(n_layer=args.layers, n_head=args.heads, n_embd=args.width, block_size=args.seq_len,
                              vocab_size=args.vocab, lora_rank=args.rank)
    gc.collect()
    baseline = proc_status("VmRSS")
    reset_peak()
    phases = {}

    def mark(phase):
        phases[phase] = {"peak_growth": proc_status("VmHWM") - baseline, "rss_growth": proc_status("VmRSS") - baseline}

    init = ds_patrickstar.Init(config=config) if args.backend == "patrickstar" else deepspeed.zero.Init(
        config_dict_or_path=config)
    with init:
        model = gpt_model.GPT(cfg)
    frozen = {id(p): getattr(p, "ds_numel", p.numel()) for p in model.parameters() if not p.requires_grad}
    trainable = [p for p in model.parameters() if p.requires_grad]
    mark("construction")
    start = time.perf_counter()
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=trainable)
    init_s = time.perf_counter() - start
    mark("initialize")
    gen = torch.Generator().manual_seed(int(os.environ["RANK"]))
    step_s = []
    for step in range(args.steps):
        x = torch.randint(0, args.vocab, (args.batch, args.seq_len), generator=gen)
        start = time.perf_counter()
        _, loss = engine(x, x)
        engine.backward(loss)
        engine.step()
        step_s.append(time.perf_counter() - start)
        mark(f"step {step + 1}")
    counters = engine.get_patrickstar_counters() if args.backend == "patrickstar" else {}
    result = {"backend": args.backend, "rank": int(os.environ["RANK"]), "baseline_rss": baseline,
              "peak_growth": proc_status("VmHWM") - baseline,
              "phases": phases, "frozen_params": sum(frozen.values()),
              "trainable_params": sum(p.numel() for p in trainable), "init_s": init_s, "step_s": step_s,
              "loss": loss.item(), "frozen_bytes_host": counters.get("frozen_bytes_host"),
              "model_bytes_host": counters.get("model_bytes_host"),
              "host_bytes_allocated": counters.get("host_bytes_allocated")}
    Path(args.rank_result).write_text(json.dumps(result))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args, workdir):
    """Start the ranks, wait for them; return their results (or raise with the tail of the failed log)."""
    port, procs, logs = free_port(), [], []
    for rank in range(args.world_size):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(args.world_size),
                   LOCAL_WORLD_SIZE=str(args.world_size), LOCAL_SIZE=str(args.world_size),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // args.world_size)))
        out, log = Path(workdir) / f"rank{rank}.json", Path(workdir) / f"rank{rank}.log"
        logs.append((out, log))
        with open(log, "w") as stdout:
            procs.append(subprocess.Popen(child_command(args, out), env=env, stdout=stdout, stderr=subprocess.STDOUT))
    deadline = time.time() + args.timeout
    try:
        for proc in procs:
            proc.wait(timeout=max(1.0, deadline - time.time()))
    except subprocess.TimeoutExpired:
        for proc in procs:
            proc.kill()
        raise RuntimeError(f"timed out after {args.timeout:.0f} s") from None
    finally:
        for path in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"):
            path.unlink(missing_ok=True)
    results = []
    for proc, (out, log) in zip(procs, logs):
        if proc.returncode != 0 or not out.exists():
            tail = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()][-3:]
            raise RuntimeError(f"a rank failed (exit {proc.returncode}): {' | '.join(tail)[-600:]}")
        results.append(json.loads(out.read_text()))
    return results


def child_command(args, out):
    flags = ["--backend", args.backend, "--world-size", args.world_size, "--width", args.width,
             "--layers", args.layers, "--heads", args.heads,
             "--vocab", args.vocab, "--rank", args.rank, "--seq-len", args.seq_len, "--batch", args.batch,
             "--steps", args.steps, "--keep-gathered", args.keep_gathered]
    if args.chunk_size is not None:
        flags += ["--chunk-size", args.chunk_size]
    if args.prefetch_groups is not None:
        flags += ["--prefetch-groups", args.prefetch_groups]
    return [sys.executable, str(Path(__file__).resolve()), "--rank-result", str(out), *map(str, flags)]


def format_table(args, results):
    base = 2 * results[0]["frozen_params"]
    target = args.base_share * base + args.slack_mib * MIB
    phases = list(results[0]["phases"])
    lines = [f"| backend | rank | peak growth (MiB) | target (MiB) | growth / base | {' | '.join(phases)} "
             f"(peak growth, MiB) "
             f"| own frozen chunks (MiB) | within target |",
             "|---|---|---|---|---|" + "---|" * len(phases) + "---|---|"]
    for r in results:
        cells = " | ".join(f"{r['phases'][p]['peak_growth'] / MIB:.0f}" for p in phases)
        own = "" if r["frozen_bytes_host"] is None else f"{r['frozen_bytes_host'] / MIB:.0f}"
        lines.append(f"| {r['backend']} | {r['rank']} | {r['peak_growth'] / MIB:.0f} | {target / MIB:.0f} | "
                     f"{r['peak_growth'] / base:.3f} | {cells} | {own} | "
                     f"{'yes' if r['peak_growth'] <= target else 'NO'} |")
    return "\n".join(lines), target


def main(argv=None):
    args = parse_args(argv)
    if args.rank_result:
        run_rank(args)
        return 0
    backends = args.backends.split(",")
    unknown = [b for b in backends if b not in ("patrickstar", "zero3")]
    if unknown:
        raise SystemExit(f"--backends: unknown backend {unknown[0]!r}; use patrickstar and/or zero3")
    results = []
    for backend in backends:
        args.backend = backend
        with tempfile.TemporaryDirectory(prefix="lora_init_memory_") as workdir:
            results += launch(args, workdir)
    table, target = format_table(args, results)
    r0 = results[0]
    print(f"lora_init_memory: {args.world_size} ranks, GPT width {args.width} x {args.layers} layers, vocab "
          f"{args.vocab}, frozen base {r0['frozen_params'] / 1e9:.3f}B params = {2 * r0['frozen_params'] / MIB:.0f} "
          f"MiB bf16, rank-{args.rank} adapters ({r0['trainable_params'] / 1e6:.2f}M params), keep_gathered "
          f"{args.keep_gathered}, chunk_size {args.chunk_size or 'default'}, prefetch_groups "
          f"{'default' if args.prefetch_groups is None else args.prefetch_groups}, "
          f"batch {args.batch} x {args.seq_len}, "
          f"{args.steps} steps; target {args.base_share:g} x base + {args.slack_mib:g} MiB; "
          f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}")
    print(table, flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"args": vars(args), "ranks": results, "target": target}, indent=1))
    return 0 if all(r["peak_growth"] <= target for r in results if r["backend"] == "patrickstar") else 1


if __name__ == "__main__":
    sys.exit(main())
