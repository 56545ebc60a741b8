#!/usr/bin/env python
"""Benchmark: the longest sequence a fixed GPT trains at a fixed device budget, by activation policy.

What it measures
    A GPT of many thin layers (``--width`` 128, ``--layers`` 16, batch 1), where what activation
    checkpointing keeps (each layer's input) is most of the tide, trained with stage "patrickstar"
    on the strict emulated accelerator (``emulate_accelerator: true``) at ``--budget`` bytes. For each
    row, the longest sequence length that trains two steps (the traced iteration and the first planned
    one, timed) is found by doubling from ``--min-seq`` and bisecting to ``--granularity``; then
    the step time and the bytes moved per step at that length (chunks host <-> device plus
    activations offloaded and restored, from the engine's counters, last step), and the same at the
    length checkpointing alone fits (a common point). Rows:

    * nothing: no checkpointing;
    * checkpointing: ``torch.utils.checkpoint.checkpoint(use_reentrant=True)`` around every layer
      (its input is a saved tensor, which the emulated accelerator's meter counts and offload moves);
    * checkpointing (DeepSpeed's): ``deepspeed.checkpointing.checkpoint`` around every layer (it
      holds its inputs on its autograd context, outside saved tensors: the meter counts them all the
      same and offload moves them, see [Note: held inputs] in activations/storages.py);
    * checkpointing + DeepSpeed ``cpu_checkpointing`` (``deepspeed.checkpointing.checkpoint``, stock
      ZeRO-3 and ours): DeepSpeed 0.19.8's ``cpu_checkpointing`` breaks on a CPU-only machine by
      itself; the row then says "fails on CPU";
    * ours with ``offload_activations: "auto"`` and ``"all"`` (torch's checkpointing), and "auto"
      with DeepSpeed's checkpointing.

    On the emulated accelerator the fits and the bytes are what a GPU would see; step times are CPU
    times of the emulation (copies are memcpy), not GPU figures.

Targets (issue 20)
    "auto" fits >= 1.5x the sequence checkpointing alone fits, and moves fewer bytes per step than
    "all" at the same length.

    python benchmarks/bench_activations.py [--budget 5000000] [--width 128] [--layers 16]
        [--min-seq 64] [--max-seq 2048] [--granularity 128] [--json out.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import platform
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_utils import add_repo_to_path, setup_single_process_env

VOCAB = 256


class Layer(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width, bias=False)
        self.proj = nn.Linear(width, width)
        self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, t, c = h.shape
        q, k, v = self.qkv(self.ln1(h)).view(b, t, 3, self.heads, c // self.heads).transpose(1, 3).unbind(2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        h = h + self.proj(a)
        return h + self.fc2(F.gelu(self.fc1(self.ln2(h))))


class GPT(nn.Module):
    def __init__(self, width: int, layers: int, checkpointed: str | None) -> None:
        super().__init__()
        self.checkpointed = checkpointed  # None, "torch" or "deepspeed"
        self.wte = nn.Embedding(VOCAB, width)
        self.layers = nn.ModuleList([Layer(width, 4) for _ in range(layers)])
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, VOCAB, bias=False)

    def forward(self, tok: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        import deepspeed
        from torch.utils.checkpoint import checkpoint

        h = self.wte(tok)
        for layer in self.layers:
            if not self.checkpointed:
                h = layer(h)
            elif self.checkpointed == "deepspeed":
                h = deepspeed.checkpointing.checkpoint(layer, h)
            else:
                h = checkpoint(layer, h, use_reentrant=True)
        return F.cross_entropy(self.head(self.ln(h)).flatten(0, 1), y.flatten())


ROWS = [
    # name, stage, checkpointing (None, "torch", "deepspeed"), cpu_checkpointing, offload_activations
    ("nothing", "patrickstar", None, False, "none"),
    ("checkpointing", "patrickstar", "torch", False, "none"),
    ("checkpointing (DeepSpeed's)", "patrickstar", "deepspeed", False, "none"),
    ("ckpt + cpu_checkpointing (stock ZeRO-3)", 3, "deepspeed", True, "none"),
    ("ckpt + cpu_checkpointing (ours)", "patrickstar", "deepspeed", True, "none"),
    ('ckpt + offload_activations "auto"', "patrickstar", "torch", False, "auto"),
    ('ckpt + offload_activations "all"', "patrickstar", "torch", False, "all"),
    ('DeepSpeed\'s ckpt + offload_activations "auto"', "patrickstar", "deepspeed", False, "auto"),
]


def _config(args, stage, cpu_ckpt: bool, mode: str) -> dict:
    zero: dict = {"stage": stage}
    if stage == "patrickstar":
        zero.update(
            chunk_size=args.chunk_size,
            emulate_accelerator=True,
            device_budget=args.budget,
            offload_activations=mode,
        )
    else:
        zero["stage3_param_persistence_threshold"] = 0
    return {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": zero,
        "activation_checkpointing": {"cpu_checkpointing": cpu_ckpt},
        "steps_per_print": 10**9,
    }


def trial(args, row, seq: int, steps: int = 2) -> dict | None:
    """Train ``steps`` steps at ``seq``; the last step's time and bytes moved, or None when it fails
    for lack of device memory. Other errors propagate."""
    import deepspeed

    from ds_patrickstar.memory.ledger import DeviceBudgetExceeded

    _, stage, ckpt, cpu_ckpt, mode = row
    config = _config(args, stage, cpu_ckpt, mode)
    torch.manual_seed(0)
    model = GPT(args.width, args.layers, ckpt)
    deepspeed.checkpointing.configure(None, deepspeed_config=config)
    engine = None
    try:
        engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
        gen = torch.Generator().manual_seed(1)
        seconds = 0.0
        for _ in range(steps):
            tok = torch.randint(0, VOCAB, (1, seq), generator=gen)
            start = time.perf_counter()
            engine.backward(engine(tok, torch.roll(tok, -1, 1)))
            engine.step()
            seconds = time.perf_counter() - start
        out = {"seq": seq, "step_s": seconds}
        logging.getLogger("bench_activations").info("%s: seq %d trains, %.2f s/step", row[0], seq, seconds)
        if stage == "patrickstar":
            c = engine.get_patrickstar_counters()
            out["moved"] = (
                c["bytes_to_device"]
                + c["bytes_to_host"]
                + c["activation_bytes_offloaded"]
                + c["activation_bytes_restored"]
            )
            out["activation_moved"] = c["activation_bytes_offloaded"] + c["activation_bytes_restored"]
        return out
    except DeviceBudgetExceeded:
        logging.getLogger("bench_activations").info("%s: seq %d does not fit", row[0], seq)
        return None
    finally:
        if engine is not None:
            engine.destroy()
        deepspeed.checkpointing.reset()
        deepspeed.checkpointing.configure(None)
        engine = model = None
        gc.collect()


def longest(args, row) -> dict | None:
    """Doubling then bisection on the sequence length; the last fitting trial."""
    best, seq = None, args.min_seq
    while seq <= args.max_seq:
        got = trial(args, row, seq)
        if got is None:
            break
        best, seq = got, seq * 2
    if best is None:
        return None
    low, high = best["seq"], min(seq, args.max_seq * 2)
    while high - low > args.granularity:
        mid = (low + high) // 2 // args.granularity * args.granularity
        if mid in (low, high):
            break
        got = trial(args, row, mid)
        if got is None:
            high = mid
        else:
            best, low = got, mid
    return best


def fails_on_cpu(args, row) -> str | None:
    """DeepSpeed's cpu_checkpointing on a CPU-only machine: the error, if it fails by itself."""
    try:
        trial(args, row, args.min_seq, steps=1)
    except Exception as err:  # reported in the row
        return f"{type(err).__name__}: {str(err).splitlines()[0][:80]}"
    return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget", type=int, default=5_000_000, help="emulated device budget, bytes")
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--chunk-size", type=int, default=1 << 18, help="elements per chunk")
    p.add_argument("--min-seq", type=int, default=64)
    p.add_argument("--max-seq", type=int, default=2048)
    p.add_argument("--granularity", type=int, default=128)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    add_repo_to_path()
    setup_single_process_env()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("ds_patrickstar").setLevel(logging.WARNING)
    logging.getLogger("bench_activations").setLevel(logging.INFO)
    import deepspeed

    import ds_patrickstar  # noqa: F401

    deepspeed.init_distributed(dist_backend="gloo")
    results = {}
    for row in ROWS:
        name = row[0]
        error = fails_on_cpu(args, row) if row[3] else None
        results[name] = {"error": error} if error else {"best": longest(args, row) if row[1] == "patrickstar" else None}
        print(f"{name}: {results[name]}", flush=True)
    ckpt = results["checkpointing"]["best"]
    common = ckpt["seq"] if ckpt else args.min_seq
    for row in ROWS:
        if "best" in results[row[0]] and row[1] == "patrickstar":
            results[row[0]]["common"] = trial(args, row, common)
    print()
    print(
        f"GPT width {args.width}, {args.layers} layers, batch 1, fp32, chunk {args.chunk_size} elements; emulated "
        f"device budget {args.budget:,} B; {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"load average {os.getloadavg()[0]:.1f} (shared); torch {torch.__version__}, DeepSpeed {deepspeed.__version__}"
    )
    print()
    print(
        f"| row | longest seq | x checkpointing | step s (at longest) | MB moved/step (at longest) "
        f"| step s at seq {common} | MB moved/step at seq {common} |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, _, _, _, _ in ROWS:
        r = results[name]
        if r.get("error"):
            print(f"| {name} | fails on CPU ({r['error']}) | | | | | |")
            continue
        best, at = r.get("best"), r.get("common")
        if best is None:
            why = (
                "no device budget on CPU without placement"
                if "best" not in r or name.endswith("(stock ZeRO-3)")
                else ""
            )
            print(f"| {name} | {why or f'does not fit at seq {args.min_seq}'} | | | | | |")
            continue
        ratio = best["seq"] / ckpt["seq"] if ckpt else float("nan")
        cells = [f"{best['seq']}", f"{ratio:.2f}x", f"{best['step_s']:.2f}", f"{best['moved'] / 1e6:.1f}"]
        cells += [f"{at['step_s']:.2f}", f"{at['moved'] / 1e6:.1f}"] if at else ["does not fit", ""]
        print(f"| {name} | " + " | ".join(cells) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
