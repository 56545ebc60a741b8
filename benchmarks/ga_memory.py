"""Peak resident memory per rank with gradient accumulation, beside GA 1 in the same run, and what holds it.

    python benchmarks/ga_memory.py                                   # small GPT, 2 ranks, GA 1 and 2
    python benchmarks/ga_memory.py --n-layer 12 --n-embd 576 --grad-accums 1,2,4

Each GA trains the same bf16 GPT with stage "patrickstar" (``configs/patrickstar_cpu.json``, no placement:
model data in host memory) on ``--world-size`` ranks under ``torch.distributed.run``. After one warm-up
step every rank resets its peak resident size (``VmHWM``, by writing 5 to ``/proc/self/clear_refs``)
and trains ``--steps`` steps; it then reports its peak resident size over the whole run (initialize
included), its peak growth over the resident size before the measured steps, what the backend held at
its own highest (the device ledger by kind: ``chunk`` payloads and gathered storages, ``grad_acc``
accumulators, ``grad_buffer`` micro-step buffers, ``optim`` fp32 states) and glibc's heap at the end of
each forward and backward (bytes in use, and bytes free in the heap, resident or given back). The
table gives each GA's figures per parameter, and GA > 1 less GA 1 beside the bound
``1.25 x 4 / W`` B/param + 32 MiB (the owned fp32 accumulators are ``4 / W``).
"""

import argparse
import ctypes
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                              "fsmblks", "uordblks", "fordblks", "keepcost")]


def heap() -> tuple[int, int]:
    """glibc's (bytes in use, bytes free but kept by the heap)."""
    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = _Mallinfo2
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd, info.fordblks


def status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def run_case(args):
    """One GA, inside torch.distributed.run."""
    sys.path[:0] = [str(HERE), str(HERE.parent)]
    import bench_utils as bu
    import deepspeed
    import gpt_model
    import torch

    import ds_patrickstar  # noqa: F401  (registers the stage)

    torch.manual_seed(0)
    overrides = {k: v for k, v in (("n_layer", args.n_layer), ("n_embd", args.n_embd)) if v}
    model, cfg = gpt_model.build_model(args.model, **overrides)
    params = gpt_model.count_params(model)
    config = bu.load_config(bu.CONFIG_DIR / "patrickstar_cpu.json")
    config.pop("scheduler", None)
    config.update(train_micro_batch_size_per_gpu=args.batch, gradient_accumulation_steps=args.grad_accum)
    config["zero_optimization"]["chunk_size"] = args.chunk_size
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    ledger = engine.optimizer.accel.ledger
    gen = torch.Generator().manual_seed(int(os.environ["RANK"]))
    seen = {"ledger": 0, "kinds": {}, "heap_used": 0, "heap_free": 0}

    def micro_step():
        x = torch.randint(0, cfg.vocab_size, (args.batch, args.seq_len), generator=gen)
        logits = engine(x)
        sample()
        engine.backward(torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), x.flatten()))
        sample()
        engine.step()

    def sample():
        used, free = heap()
        seen["heap_used"], seen["heap_free"] = max(seen["heap_used"], used), max(seen["heap_free"], free)

    charge = ledger.charge

    def charged(nbytes, kind, what):
        charge(nbytes, kind, what)
        if ledger.total > seen["ledger"]:
            seen["ledger"], seen["kinds"] = ledger.total, dict(ledger.by_kind)

    for _ in range(args.grad_accum):  # the warm-up step
        micro_step()
    warm_peak = status("VmHWM")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    before = status("VmRSS")
    ledger.charge = charged
    for _ in range(args.steps * args.grad_accum):
        micro_step()
    result = {"params": params, "rank": int(os.environ["RANK"]), "rss_before": before,
              "peak_growth": status("VmHWM") - before, "peak": max(warm_peak, status("VmHWM")), **seen}
    Path(f"{args.result}.{result['rank']}").write_text(json.dumps(result))
    engine.destroy()


def measure(args, grad_accum):
    with tempfile.TemporaryDirectory(prefix="ga_memory_") as tmp:
        result = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.world_size),
               "--master_port", str(_free_port()), str(Path(__file__).resolve()), "--case",
               "--model", args.model, "--n-layer", str(args.n_layer), "--n-embd", str(args.n_embd),
               "--batch", str(args.batch), "--seq-len", str(args.seq_len), "--steps", str(args.steps),
               "--chunk-size", str(args.chunk_size), "--grad-accum", str(grad_accum), "--result", str(result)]
        env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // args.world_size)))
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
        files = sorted(Path(tmp).glob("result.json.*"))
        if done.returncode != 0 or len(files) != args.world_size:
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            return {"error": f"exit {done.returncode}: {' | '.join(tail)[:300]}"}
        return {"ranks": [json.loads(f.read_text()) for f in files]}


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small")
    p.add_argument("--n-layer", type=int, default=0, help="override the preset's layers (0: the preset's)")
    p.add_argument("--n-embd", type=int, default=0, help="override the preset's width (0: the preset's)")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--grad-accums", default="1,2")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=2, help="optimizer steps measured, after one warm-up step")
    p.add_argument("--chunk-size", type=int, default=1048576, help="elements per chunk")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per GA")
    p.add_argument("--json", default=None)
    p.add_argument("--case", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--grad-accum", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _row(ga, r, base, bound_b):
    n = r["params"]
    kinds = " ".join(f"{k} {v / n:.2f}" for k, v in sorted(r["kinds"].items()) if v)
    extra = "" if base is None else (f"{(r['peak'] - base['peak']) / n:+.2f} / "
                                     f"{(r['peak_growth'] - base['peak_growth']) / n:+.2f} (bound {bound_b:.2f})")
    return (f"| {ga} | {r['rank']} | {r['peak'] / 2**20:.0f} | {r['peak_growth'] / n:.2f} | {extra} | "
            f"{r['ledger'] / n:.2f} ({kinds}) | {r['heap_used'] / n:.2f} | {r['heap_free'] / n:.2f} |")


def main(argv=None):
    args = parse_args(argv)
    if args.case:
        run_case(args)
        return 0
    rows = ["| GA | rank | peak resident MiB | peak growth in steps B/param | GA - GA 1 B/param: peak / growth | "
            "ledger at its peak B/param (by kind) | heap in use B/param | heap free B/param |",
            "|---|---|---|---|---|---|---|---|"]
    results, ok, base = [], True, {}
    for ga in [int(g) for g in args.grad_accums.split(",")]:
        r = measure(args, ga)
        results.append({"grad_accum": ga, **r})
        if "error" in r:
            ok = False
            rows.append(f"| {ga} | FAILED: {r['error']} | | | | | | |")
            continue
        for rank in r["ranks"]:
            bound = 1.25 * 4 / args.world_size + 32 * 2**20 / rank["params"]
            rows.append(_row(ga, rank, base.get(rank["rank"]), bound))
            base.setdefault(rank["rank"], rank)
        print("\n".join(rows[-args.world_size:]), flush=True)
    print(f"model {args.model} (n_layer {args.n_layer or 'preset'}, n_embd {args.n_embd or 'preset'}), bf16, "
          f"{args.world_size} ranks, batch {args.batch} x seq {args.seq_len}, chunk {args.chunk_size} elements, "
          f"{args.steps} steps measured after 1")
    print("\n".join(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
