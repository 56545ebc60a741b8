"""Compare ds_patrickstar with stock DeepSpeed ZeRO-3 on the same model, data and seed.

    python benchmarks/compare_zero3.py                                   # tiny GPT, quick check
    python benchmarks/compare_zero3.py --model gpt2-medium --batch 2 --seq-len 256 --dtype bf16
    python benchmarks/compare_zero3.py --offload ...   # ZeRO-3 with offload_param + offload_optimizer
    python benchmarks/compare_zero3.py --world-size 2 --model small --seq-lens 256,16   # compute- and comm-bound
    python benchmarks/compare_zero3.py --world-size 2 --grad-accum 2 --backends zero3,zero3-tuned,patrickstar

The machine's load average is recorded before and after each backend; a busy machine (load above
half the cores before a backend starts) is warned about, since a neighbour's work slows torch's
OpenMP pool several times and makes step-time ratios meaningless (volumes stay exact).

Each backend trains in its own child process (``benchmarks/train_gpt.py``), so the peak host
memory (the child's ``ru_maxrss``) and the GPU max allocated are per backend.
"""
import argparse
import json
import logging
import os
import sys
import tempfile
from pathlib import Path

import bench_utils as bu
import torch
from bench_harness import backend_config, error_line, run_logged, steady_summary

logger = logging.getLogger("compare_zero3")
TRAIN_SCRIPT = Path(__file__).resolve().parent / "train_gpt.py"
BASELINE = "zero3"
DIST_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny")
    p.add_argument("--steps", type=int, default=10, help="timed steps (after the warm-up steps)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    p.add_argument("--batch", type=int, default=8, help="micro-batch size")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step (all backends)")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--seq-lens", default=None,
                   help="comma-separated sequence lengths, one table each (e.g. 256,16: a long sequence where "
                        "compute dominates and a short one where communication matters); overrides --seq-len")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--backends", default="zero3,patrickstar",
                   help="comma-separated: zero3, zero3-tuned (ZeRO-3 with its memory knobs turned down, "
                        "bench_utils.ZERO3_MEMORY_TUNED), patrickstar, patrickstar-static (static placement policy)")
    p.add_argument("--device-budget", type=float, default=None,
                   help="patrickstar backends: accelerator budget, bytes (> 1) or a fraction of the GPU; on a "
                        "CPU-only machine this turns on the emulated accelerator")
    p.add_argument("--offload", action="store_true", help="ZeRO-3 offloads params and optimizer to CPU")
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--json", default=None, help="write all results here")
    p.add_argument("--logs", default=str(bu.REPO_ROOT / "runs" / "compare_zero3"), help="child logs")
    p.add_argument("--timeout", type=float, default=None, help="seconds per backend")
    p.add_argument("--world-size", type=int, default=1,
                   help="data-parallel ranks: > 1 runs each child under torchrun --nproc_per_node N")
    return p.parse_args(argv)


def placement_overrides(args, backend):
    """zero_optimization keys for the patrickstar backends: policy and accelerator budget."""
    if not backend.startswith("patrickstar"):
        return {}
    keys = {"placement": "static"} if backend == "patrickstar-static" else {}
    if args.device_budget is not None:
        budget = args.device_budget
        keys["device_budget"] = int(budget) if budget > 1 else budget
        if not torch.cuda.is_available():
            keys["emulate_accelerator"] = True
    return keys


def child_config(args, backend, workdir):
    """The backend's config file; with data parallelism stock ZeRO-3 also gets DeepSpeed's comms
    logger, which measures its all-gather / reduce-scatter bytes (ours come from our counters)."""
    path = backend_config(backend, args.offload)
    stock = backend.startswith(BASELINE)
    overrides = bu.ZERO3_MEMORY_TUNED if backend == "zero3-tuned" else placement_overrides(args, backend)
    if (args.world_size == 1 or not stock) and not overrides:
        return path
    config = bu.load_config(path)
    config["zero_optimization"].update(overrides)
    if args.world_size > 1 and stock:
        config["comms_logger"] = {"enabled": True, "verbose": False}
    out = Path(workdir) / f"{backend}_config.json"
    out.write_text(json.dumps(config, indent=1))
    return out


def launcher_prefix(args):
    if args.world_size == 1:
        return [sys.executable]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.world_size),
            "--master_port", str(bu.free_port())]


def child_command(args, backend, json_path, out_dir, config=None):
    steps = args.warmup + args.steps
    config = config or backend_config(backend, args.offload)
    cmd = launcher_prefix(args) + [str(TRAIN_SCRIPT), "--config", str(config),
           "--model", args.model, "--steps", str(steps), "--batch", str(args.batch),
           "--seq-len", str(args.seq_len), "--dtype", args.dtype, "--seed", str(args.seed),
           "--grad-accum", str(args.grad_accum),
           "--log-every", str(max(steps, 1)), "--eval-batches", "0", "--no-progress",
           "--json", str(json_path), "--out", str(out_dir)]
    return cmd + (["--activation-checkpointing"] if args.activation_checkpointing else [])


def child_env():
    env = {k: v for k, v in os.environ.items() if k not in DIST_ENV}
    return env


def load_average():
    """The 1-minute load average (None where the platform has none)."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def busy(load):
    return load is not None and load > 0.5 * (os.cpu_count() or 1)


def run_backend(args, backend, workdir):
    """Train in a child process; return its JSON payload (with the load average before and after),
    or a dict with an ``error``."""
    before = load_average()
    if busy(before):
        logger.warning("%s: the machine is busy before the run (1-min load average %.2f on %d cores): step "
                       "times will be slow and their ratio meaningless", backend, before, os.cpu_count())
    result = _run_backend(args, backend, workdir)
    result["load_before"], result["load_after"] = before, load_average()
    return result


def _run_backend(args, backend, workdir):
    json_path, log_path = Path(workdir) / f"{backend}.json", Path(args.logs) / f"{backend}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    cmd = child_command(args, backend, json_path, Path(workdir) / backend, child_config(args, backend, workdir))
    logger.info("%s: %s (log: %s)", backend, " ".join(cmd), log_path)
    failed = run_logged(cmd, log_path, args.timeout, child_env())
    if failed:
        return failed
    if not json_path.exists():
        return {"error": f"no result: {error_line(log_path.read_text(errors='replace')) or 'no output'}"}
    return json.loads(json_path.read_text())


def measure(payload, warmup):
    """The figures of one backend from its child's payload."""
    summary, records = payload["summary"], payload["records"]
    counters = summary.get("patrickstar_counters") or {}
    timed = records[warmup:] or records[-1:]
    steady = steady_summary([r["seconds"] for r in records[:len(records) - len(timed)]],
                            [r["seconds"] for r in timed])
    step_s = steady["step_s"]
    return {
        "step_time_s": step_s,
        "step_spread": steady["spread"],
        "first_steps_extra_s": steady["first_steps_extra_s"],
        "tokens_per_s": records[0]["tokens"] / step_s,
        "host_peak_bytes": summary["host_peak_rss_bytes"],
        "gpu_max_bytes": summary["gpu_max_allocated_bytes"],
        "model_data_bytes": summary["model_data_bytes"],
        "model_data_bytes_per_param": summary["model_data_bytes_per_param"],
        "final_loss": records[-1]["loss"],
        "params": summary["params"],
        "timed_steps": len(timed),
        "load_before": payload.get("load_before"), "load_after": payload.get("load_after"),
        "peak_kept_gathered_bytes": counters.get("peak_kept_gathered_bytes"),
        **comm_columns(summary),
    }


def comm_columns(summary):
    """Bytes one rank all-gathers / reduce-scatters in one step (the last one), and where from."""
    volume = summary.get("comm_volume")
    if summary.get("world_size", 1) == 1 or not volume:
        return {}
    return {"bytes_all_gathered": volume["bytes_all_gathered"],
            "bytes_reduce_scattered": volume["bytes_reduce_scattered"], "comm_source": volume["source"]}


def gib(b):
    return b / bu.GIB


# (header, key in the measured dict, format, whether a patrickstar/zero3 ratio makes sense).
# A new column (e.g. data-parallel communication volume) is one more row here plus its key in measure().
COLUMNS = [
    ("step time (ms)", "step_time_s", lambda v: f"{v * 1e3:.1f}", True),
    ("spread", "step_spread", lambda v: f"{v:.0%}", False),
    ("tokens/s", "tokens_per_s", lambda v: f"{v:.0f}", True),
    ("peak host (GiB)", "host_peak_bytes", lambda v: f"{gib(v):.3f}", True),
    ("GPU max alloc (GiB)", "gpu_max_bytes", lambda v: f"{gib(v):.3f}", True),
    ("model data (GiB)", "model_data_bytes", lambda v: f"{gib(v):.3f}", True),
    ("model B/param", "model_data_bytes_per_param", lambda v: f"{v:.2f}", True),
    ("final loss", "final_loss", lambda v: f"{v:.4f}", False),
    ("all-gathered MiB/step", "bytes_all_gathered", lambda v: f"{v / 2**20:.3f}", True),
    ("reduce-scattered MiB/step", "bytes_reduce_scattered", lambda v: f"{v / 2**20:.3f}", True),
    ("comm measured by", "comm_source", str, False),
    ("load avg before/after", "load", str, False),
]


def active_columns(results):
    """Drop the GPU column on CPU-only runs and the communication columns with one rank."""
    on_gpu = any(r.get("gpu_max_bytes") is not None for r in results.values())
    comm = any(r.get("comm_source") is not None for r in results.values())
    return [c for c in COLUMNS if (on_gpu or c[1] != "gpu_max_bytes")
            and (comm or c[1] not in ("bytes_all_gathered", "bytes_reduce_scattered", "comm_source"))]


def ratios(results, columns, baseline=BASELINE):
    base, other = results.get(baseline), results.get("patrickstar")
    if not base or not other or "error" in base or "error" in other:
        return {}
    out = {}
    for _, key, _, use in columns:
        if use and base.get(key) and other.get(key) is not None:
            out[key] = other[key] / base[key]
    return out


def format_table(results, columns):
    header = ["backend"] + [c[0] for c in columns]
    rows = []
    for name, res in results.items():
        if "error" in res:
            rows.append([name, f"FAILED: {res['error']}"])
            continue
        res = dict(res, load=f"{res.get('load_before') or 0:.2f}/{res.get('load_after') or 0:.2f}")
        rows.append([name] + [("n/a" if res.get(key) is None else fmt(res[key])) for _, key, fmt, _ in columns])
    rat = ratios(results, columns)
    for baseline in (BASELINE, "zero3-tuned"):  # one ratio row per ZeRO-3 configuration that ran
        versus = ratios(results, columns, baseline)
        if versus:
            rows.append([f"patrickstar/{baseline}"]
                        + [(f"{versus[key]:.2f}x" if key in versus else "") for _, key, _, _ in columns])
    widths = [max(len(str(r[i])) for r in [header] + rows if i < len(r)) for i in range(len(header))]
    lines = [" | ".join(str(h).ljust(w) for h, w in zip(header, widths))]
    lines.append("-+-".join("-" * w for w in widths))
    lines += [" | ".join(str(c).ljust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(lines), rat


def describe(args):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    zero3 = "ZeRO-3 offload_param+offload_optimizer" if args.offload else "ZeRO-3"
    return (f"model {args.model}, batch {args.batch} x GA {args.grad_accum}, seq {args.seq_len}, {args.dtype}, "
            f"{device} x {args.world_size}, "
            f"{args.warmup} warm-up + {args.steps} timed steps (median), seed {args.seed}; zero3 = {zero3}; "
            f"{os.cpu_count()} cores")


def compare(args, backends):
    """One table for the current ``args.seq_len``; returns (results, ratios)."""
    results = {}
    with tempfile.TemporaryDirectory(prefix="compare_zero3_") as workdir:
        for backend in backends:
            payload = run_backend(args, backend, workdir)
            results[backend] = payload if "error" in payload else measure(payload, args.warmup)
    columns = active_columns(results)
    table, rat = format_table(results, columns)
    print(describe(args))
    print(table, flush=True)
    if any(busy(r.get("load_before")) for r in results.values()):
        print(f"WARNING: the machine was busy (1-min load average above {0.5 * (os.cpu_count() or 1):.1f} before a "
              f"backend): step times and their ratio are not meaningful; volumes are exact", flush=True)
    return results, rat


def main(argv=None):
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args = parse_args(argv)
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    seq_lens = [int(v) for v in args.seq_lens.split(",")] if args.seq_lens else [args.seq_len]
    runs, ok = [], True
    for seq_len in seq_lens:
        args.seq_len = seq_len
        results, rat = compare(args, backends)
        runs.append({"seq_len": seq_len, "results": results, "ratios": rat})
        ok = ok and all("error" not in r for r in results.values())
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"args": vars(args), "runs": runs}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
