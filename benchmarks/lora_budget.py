"""LoRA on the strict twin with a device budget 6x below the frozen base, against stock ZeRO-3 (issue 30).

    python benchmarks/lora_budget.py                                # bf16 and fp32, 6 steps each
    python benchmarks/lora_budget.py --dtypes bf16 --layers 4 --ratio 8 --json runs/lora_budget.json

A GPT of ``gpt_model.py`` (``--width``, ``--layers``, byte vocabulary) gets rank-``--rank`` adapters beside every
linear layer of its blocks (``gpt_model.add_lora``); everything else is frozen. Per dtype, stock ZeRO-3 and
ds_patrickstar train it from the same seed on the same batches of the embedded corpus (``data.py``), each in a
process of its own, ours twice: without an accelerator (no budget) and on the strict emulated accelerator
(``emulate_accelerator``) with ``device_budget`` = the frozen base's bytes / ``--ratio``. That budget is
everything ours may hold on the accelerator at a moment: the chunks in use (frozen and trainable, gathered or
not), the adapters' gradients and optimizer states placed there, and the non-model memory (the activations
autograd saves, the blocks' inputs a checkpoint holds); the twin raises ``DeviceBudgetExceeded`` when any moment
would go past it.

The table, per dtype: the frozen base and the budget, ours' highest accelerator bytes at a moment
(``peak_device_bytes``) against the budget, the chunk bytes copied host -> accelerator and back per step (the
median over the steps after the first, traced one), the median step time of each backend and their ratio, and
the largest difference from ZeRO-3's per-step losses and final adapter weights (fp32 masters) and the largest
relative error of an adapter's update (final - initial), checked against the tolerances of
``tests/test_vs_zero3.py``, and whether the budgeted run's losses and adapters are bit-equal to the unbounded
one's. Exit status 1 when a backend fails or a difference is past tolerance.
"""

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import bench_utils as bu
import data
import gpt_model
import torch
from bench_harness import markdown_table, run_logged, steady_summary

logger = logging.getLogger("lora_budget")
BACKENDS = ("zero3", "patrickstar", "patrickstar-unbounded")
DTYPE_BYTES = {"bf16": 2, "fp32": 4}
# tests/test_vs_zero3.py's TOL: losses |a - b| <= atol + rtol |b| (rtol, atol); per adapter, the update
# d = final - initial fp32 master: ||d_ours - d_zero3|| <= update_rtol ||d_zero3|| + 1e-7 sqrt(numel)
TOLERANCE = {"bf16": {"loss": (5e-3, 1e-4), "update_rtol": 1e-2}, "fp32": {"loss": (1e-5, 1e-6), "update_rtol": 1e-3}}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtypes", default="bf16,fp32", help="comma-separated, of bf16 and fp32")
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--rank", type=int, default=16, help="rank of the adapters")
    p.add_argument("--ratio", type=float, default=6.0, help="device_budget = frozen base bytes / RATIO")
    p.add_argument("--chunk-size", type=int, default=1 << 18, help="ours: chunk_size (elements)")
    p.add_argument("--checkpointing", action=argparse.BooleanOptionalAction, default=True,
                   help="activation checkpointing of every block (torch's non-reentrant), as LoRA runs use it")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--json", default=None, help="write every figure here")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per backend")
    p.add_argument("--child", choices=BACKENDS, help=argparse.SUPPRESS)
    p.add_argument("--dtype", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def build_model(args):
    """The LoRA GPT (adapters on every linear layer of the blocks) and its frozen parameter count."""
    cfg = gpt_model.GPTConfig(n_layer=args.layers, n_head=args.heads, n_embd=args.width, block_size=args.seq_len,
                              vocab_size=256, activation_checkpointing=args.checkpointing)
    model = gpt_model.GPT(cfg)
    gpt_model.add_lora(model, args.rank)
    frozen = {id(p): p.numel() for p in model.parameters() if not p.requires_grad}
    return model, sum(frozen.values())


def ds_config(args, backend, frozen_bytes):
    config = {"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1,
              "steps_per_print": 10**9, "gradient_clipping": 0.0, "bf16": {"enabled": args.dtype == "bf16"},
              "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 0.0}}}
    if backend == "zero3":
        config["zero_optimization"] = {"stage": 3}
    elif backend == "patrickstar-unbounded":  # no accelerator: the same training without a budget
        config["zero_optimization"] = {"stage": "patrickstar", "chunk_size": args.chunk_size}
    else:
        config["zero_optimization"] = {"stage": "patrickstar", "chunk_size": args.chunk_size,
                                       "emulate_accelerator": True, "device_budget": budget(args, frozen_bytes)}
    return config


def budget(args, frozen_bytes):
    return int(frozen_bytes / args.ratio)


def adapter_weights(engine, backend):
    """The trainable parameters' fp32 masters by name, as host copies."""
    names = [n for n, p in engine.module.named_parameters() if p.requires_grad]
    if backend.startswith("patrickstar"):
        state = engine.get_fp32_state_dict()
        return {n: state[n].detach().float().cpu().clone() for n in names}
    from deepspeed.utils import safe_get_full_fp32_param

    params = dict(engine.module.named_parameters())
    return {n: safe_get_full_fp32_param(params[n]).detach().float().cpu().clone() for n in names}


def run_child(args):
    """Train one backend; write losses, step times, counters and adapter weights to ``args.out``."""
    bu.setup_single_process_env()
    bu.add_repo_to_path()
    import deepspeed

    import ds_patrickstar  # noqa: F401  (registers stage "patrickstar")

    torch.manual_seed(args.seed)
    model, frozen = build_model(args)
    frozen_bytes = frozen * DTYPE_BYTES[args.dtype]
    config = ds_config(args, args.child, frozen_bytes)
    trainable = [p for p in model.parameters() if p.requires_grad]
    initial = {n: p.detach().float().clone() for n, p in model.named_parameters() if p.requires_grad}
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=trainable)
    sampler = data.BatchSampler(data.split_corpus(data.load_corpus())[0], args.batch, args.seq_len, seed=args.seed)
    records = []
    for _ in range(args.steps):
        x, y = sampler.next("cpu")
        start = time.perf_counter()
        _, loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        seconds = time.perf_counter() - start
        counters = engine.get_patrickstar_counters() if hasattr(engine, "get_patrickstar_counters") else None
        records.append({"loss": loss.item(), "seconds": seconds, "counters": counters})
    weights = adapter_weights(engine, args.child)
    torch.save({"records": records, "weights": weights, "initial": initial, "frozen_params": frozen,
                "frozen_bytes": frozen_bytes,
                "trainable_params": sum(p.numel() for p in trainable),
                "budget": config["zero_optimization"].get("device_budget"),
                "host_peak_rss_bytes": bu.host_peak_rss_bytes()}, args.out)


def run_backend(args, backend, dtype, workdir):
    out = Path(workdir) / f"{backend}_{dtype}.pt"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", backend, "--dtype", dtype, "--out", str(out),
           "--width", str(args.width), "--layers", str(args.layers), "--heads", str(args.heads),
           "--rank", str(args.rank), "--ratio", str(args.ratio), "--chunk-size", str(args.chunk_size),
           "--batch", str(args.batch), "--seq-len", str(args.seq_len), "--steps", str(args.steps),
           "--lr", str(args.lr), "--seed", str(args.seed),
           "--checkpointing" if args.checkpointing else "--no-checkpointing"]
    failed = run_logged(cmd, Path(workdir) / f"{backend}_{dtype}.log", args.timeout)
    if failed or not out.exists():
        return failed or {"error": "no result"}
    return torch.load(out, weights_only=False)


def loss_difference(ours, ref, rtol_atol):
    """(largest |a - b| over the steps' losses, whether every one is within atol + rtol |b|)."""
    rtol, atol = rtol_atol
    diffs = [(abs(a - b), abs(a - b) <= atol + rtol * abs(b)) for a, b in zip(ours, ref)]
    return max(d for d, _ in diffs), all(ok for _, ok in diffs)


def adapter_differences(ours, ref):
    """(largest elementwise |a - b| of the final fp32 adapters, largest relative update error
    ||d_ours - d_ref|| / ||d_ref|| with d = final - initial, whether every update is within tolerance)."""
    if sorted(ours["weights"]) != sorted(ref["weights"]):
        raise RuntimeError("the backends train different parameters")
    largest = worst = 0.0
    within = True
    for name, final in ref["weights"].items():
        mine = ours["weights"][name].double()
        largest = max(largest, (mine - final.double()).abs().max().item())
        d_ref, d_ours = final.double() - ref["initial"][name].double(), mine - ours["initial"][name].double()
        error, scale = (d_ours - d_ref).norm().item(), d_ref.norm().item()
        worst = max(worst, error / scale if scale else error)
        within = within and error <= ref["update_rtol"] * scale + 1e-7 * final.numel() ** 0.5
    return largest, worst, within


def identical(a, b):
    """Whether two runs of ours have bit-equal losses and adapters."""
    return ([r["loss"] for r in a["records"]] == [r["loss"] for r in b["records"]]
            and all(torch.equal(a["weights"][n], b["weights"][n]) for n in a["weights"]))


def measure(dtype, zero3, ours, unbounded):
    """The row of one dtype from the children's results."""
    tol = TOLERANCE[dtype]
    loss_diff, losses_ok = loss_difference([r["loss"] for r in ours["records"]],
                                           [r["loss"] for r in zero3["records"]], tol["loss"])
    weight_diff, update_error, updates_ok = adapter_differences(ours, dict(zero3, update_rtol=tol["update_rtol"]))
    later = [r["counters"] for r in ours["records"][1:]] or [ours["records"][0]["counters"]]
    step = {b: steady_summary([r["seconds"] for r in res["records"][:1]],
                              [r["seconds"] for r in res["records"][1:] or res["records"]])["step_s"]
            for b, res in (("zero3", zero3), ("patrickstar", ours), ("unbounded", unbounded))}
    return {"dtype": dtype, "frozen_params": ours["frozen_params"], "trainable_params": ours["trainable_params"],
            "frozen_bytes": ours["frozen_bytes"], "budget": ours["budget"],
            "peak_device_bytes": max(r["counters"]["peak_device_bytes"] for r in ours["records"]),
            "peak_model_bytes_device": max(r["counters"]["peak_model_bytes_device"] for r in ours["records"]),
            "peak_non_model_bytes_device": max(r["counters"]["peak_non_model_bytes_device"]
                                               for r in ours["records"]),
            "bytes_to_device_per_step": statistics.median(c["bytes_to_device"] for c in later),
            "bytes_to_host_per_step": statistics.median(c["bytes_to_host"] for c in later),
            "step_s_zero3": step["zero3"], "step_s_ours": step["patrickstar"], "step_s_unbounded": step["unbounded"],
            "host_peak_zero3": zero3["host_peak_rss_bytes"], "host_peak_ours": ours["host_peak_rss_bytes"],
            "max_loss_diff": loss_diff, "max_adapter_diff": weight_diff, "max_update_error": update_error,
            "within_tolerance": losses_ok and updates_ok, "equal_to_unbounded": identical(ours, unbounded),
            "losses_zero3": [r["loss"] for r in zero3["records"]],
            "losses_ours": [r["loss"] for r in ours["records"]]}


def mib(b):
    return f"{b / 2**20:.2f}"


def format_table(rows):
    header = ["dtype", "frozen base (MiB)", "budget (MiB)", "peak device (MiB)", "peak / budget",
              "model / non-model at peaks (MiB)", "to device / to host per step (MiB)", "step ZeRO-3 / ours (s)",
              "ours / ZeRO-3", "max loss diff", "max adapter diff", "max update error", "within tolerance",
              "bit-equal to no budget"]
    body = []
    for r in rows:
        if "error" in r:
            body.append([r["dtype"], f"FAILED: {r['error']}"])
            continue
        body.append([
            r["dtype"], mib(r["frozen_bytes"]), mib(r["budget"]), mib(r["peak_device_bytes"]),
            f"{r['peak_device_bytes'] / r['budget']:.2f}",
            f"{mib(r['peak_model_bytes_device'])} / {mib(r['peak_non_model_bytes_device'])}",
            f"{mib(r['bytes_to_device_per_step'])} / {mib(r['bytes_to_host_per_step'])}",
            f"{r['step_s_zero3']:.3f} / {r['step_s_ours']:.3f}", f"{r['step_s_ours'] / r['step_s_zero3']:.2f}x",
            f"{r['max_loss_diff']:.2e}", f"{r['max_adapter_diff']:.2e}", f"{r['max_update_error']:.2e}",
            "yes" if r["within_tolerance"] else "NO", "yes" if r["equal_to_unbounded"] else "no"])
    return "\n".join(markdown_table(header, body))


def describe(args):
    load = os.getloadavg()[0]
    checkpointing = "activation checkpointing" if args.checkpointing else "no activation checkpointing"
    return (f"lora_budget: GPT width {args.width} x {args.layers} layers (vocab 256), rank-{args.rank} adapters on "
            f"every linear layer of the blocks, {checkpointing}, batch {args.batch} x {args.seq_len} tokens, "
            f"{args.steps} steps "
            f"(step times: median after the first), AdamW lr {args.lr}, seed {args.seed}; ours: strict twin, "
            f"device_budget = frozen base / {args.ratio:g}, chunk_size {args.chunk_size}; "
            f"{os.cpu_count()} cores, load {load:.2f}")


def main(argv=None):
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args = parse_args(argv)
    if args.child:
        run_child(args)
        return 0
    rows = []
    with tempfile.TemporaryDirectory(prefix="lora_budget_") as workdir:
        for dtype in [d.strip() for d in args.dtypes.split(",") if d.strip()]:
            results = {}
            for backend in BACKENDS:
                logger.info("%s %s", backend, dtype)
                results[backend] = run_backend(args, backend, dtype, workdir)
            failed = [f"{b}: {r['error']}" for b, r in results.items() if "error" in r]
            rows.append({"dtype": dtype, "error": "; ".join(failed)} if failed
                        else measure(dtype, results["zero3"], results["patrickstar"],
                                     results["patrickstar-unbounded"]))
    print(describe(args))
    print(format_table(rows), flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    return 0 if all("error" not in r and r["within_tolerance"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
