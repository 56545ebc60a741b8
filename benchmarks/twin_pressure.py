"""Placement where the model data does not fit the accelerator, on the strict twin, mirroring the H100 sweep.

    python benchmarks/twin_pressure.py                  # budgets mirroring 8 / 12 / 16 / 24 GiB, both rules
    python benchmarks/twin_pressure.py --json out.json
    python benchmarks/twin_pressure.py --ga 2            # two micro-batches a step (gradient accumulation)

Issue 42's GPU sweep (gpt-1.3b, batch 8 x 512, bf16: 18.4 GB of model data, 6.4 GB of activations at their
peak, 100 chunks, one H100) in miniature on the strict emulated accelerator (``emulate_accelerator``): a GPT
whose chunks, optimizer states and traced activations stand in the same proportions, at device budgets that
are the same fractions of its model data as 8, 12, 16 and 24 GiB are of 18.4 GB. Per budget, two runs on the
same batches: ``optimizer_placement: "fill"`` (the optimizer states of every chunk that fits on the
accelerator, the rule before the step-time model) and ``"time"`` (as many as the step-time model predicts
fastest, see [Note: optimizer states by step time]). Reported per run, as means over the steps after the
warm-up: bytes to the accelerator and back (measured by the emulated accelerator's copies), the move model's
prediction of them, evictions, chunks updated by Adam on the accelerator and the host, and the predicted step
(the twin's CPU moment times with transfers and Adam priced by the H100 profile: a model figure, not a GPU
time), the fewest bytes any placement of the trace could move (see [Note: the bytes floor]); the losses of both
rules against each other and against stock ZeRO-3's.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_utils as bu
from bench_harness import lm_steps

bu.add_repo_to_path()
from ds_patrickstar.placement.eviction_queue import EvictionOrder

VOCAB = 256
MODEL = dict(n_layer=8, n_head=4, n_embd=128, block_size=64, vocab_size=VOCAB)
CHUNK = 16384  # about 100 chunks, as the H100 run's
BATCH = 4
H100_MODEL_DATA = 18.4e9  # B, gpt-1.3b's chunks and optimizer states in the H100 sweep
GIB = 2**30
MIRRORED_GIB = (8, 12, 16, 24)


def config(stage, budget: int | None = None, rule: str = "time", ga: int = 1) -> dict:
    zero: dict = {"stage": stage}
    if stage == "patrickstar":
        zero.update(chunk_size=CHUNK, emulate_accelerator=True, device_budget=budget, optimizer_placement=rule)
    else:
        zero["stage3_param_persistence_threshold"] = 0
    return {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": ga,
            "zero_optimization": zero, "gradient_clipping": 1.0,
            "bf16": {"enabled": True}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}}}


def run(cfg: dict, steps: int) -> dict:
    """``steps`` optimizer steps of ``cfg`` (each of its ``gradient_accumulation_steps`` micro-batches); the
    losses and counters of each step's boundary micro-batch."""
    import deepspeed
    from gpt_model import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(**MODEL))
    engine, *_ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
    ga = cfg.get("gradient_accumulation_steps", 1)
    gen = torch.Generator().manual_seed(1)
    batches = (torch.randint(0, VOCAB, (BATCH, MODEL["block_size"] + 1), generator=gen) for _ in range(steps * ga))
    losses, counters, _ = lm_steps(engine, batches, VOCAB)
    boundary = slice(ga - 1, None, ga)
    return {"losses": losses[boundary], "counters": counters[boundary] if counters else counters}


KEYS = ("bytes_to_device", "bytes_to_host", "predicted_bytes_to_device", "predicted_bytes_to_host", "evictions",
        "adam_chunks_device", "adam_chunks_host", "predicted_step_s", "peak_activation_bytes_device",
        "prefetch_distance", "prefetches_beyond_next", "eviction_order", "accumulator_bytes_to_device",
        "accumulator_bytes_to_host", "predicted_accumulator_bytes_to_device", "predicted_accumulator_bytes_to_host",
        "bytes_floor")
MOVED = ("bytes_to_device", "bytes_to_host", "accumulator_bytes_to_device", "accumulator_bytes_to_host")


def steady(counters: list[dict], warmup: int) -> dict:
    return {key: statistics.mean(c[key] for c in counters[warmup:]) for key in KEYS}


def model_data_bytes() -> int:
    from gpt_model import GPT, GPTConfig

    params = sum(p.numel() for p in GPT(GPTConfig(**MODEL)).parameters())
    return 14 * params


def sweep(steps: int, warmup: int, ga: int = 1) -> dict:
    data = model_data_bytes()
    zero3 = run(config(3, ga=ga), steps)["losses"]
    rows = []
    for gib in MIRRORED_GIB:
        budget = int(data * gib * GIB / H100_MODEL_DATA)
        row: dict = {"mirrors_gib": gib, "budget": budget}
        for rule in ("fill", "time"):
            result = run(config("patrickstar", budget, rule, ga), steps)
            row[rule] = steady(result["counters"], warmup)
            row[rule]["losses"] = result["losses"]
        moved = {r: sum(row[r][way] for way in MOVED) for r in ("fill", "time")}
        row["moved_ratio"] = moved["time"] / moved["fill"] if moved["fill"] else 1.0
        row["floor"] = row["time"]["bytes_floor"]  # the same trace under either rule (see [Note: the bytes floor])
        row["floor_ratio"] = row["floor"] / moved["fill"] if moved["fill"] else None
        row["loss_rel_vs_zero3"] = max(abs(a - b) / abs(b) for a, b in zip(row["time"]["losses"], zero3))
        row["loss_rel_time_vs_fill"] = max(abs(a - b) / abs(b) for a, b in zip(row["time"]["losses"],
                                                                               row["fill"]["losses"]))
        rows.append(row)
        print_row(row)
    return {"model_data_bytes": data, "steps": steps, "warmup": warmup, "ga": ga, "rows": rows,
            "cpu": bu.describe_cpu()}


def print_row(row: dict) -> None:
    floor = f"{row['floor_ratio']:.2f}" if row.get("floor_ratio") is not None else "-"
    print(f"budget {row['budget']:,} B (mirrors {row['mirrors_gib']} GiB): time/fill bytes moved "
          f"{row['moved_ratio']:.2f} (the floor of any placement: {row['floor']:,.0f} B, {floor} of fill); "
          f"losses: time vs fill max rel {row['loss_rel_time_vs_fill']:.1e}, "
          f"vs ZeRO-3 {row['loss_rel_vs_zero3']:.1e}")
    for rule in ("fill", "time"):
        r = row[rule]
        print(f"  {rule:<5} to device {r['bytes_to_device']:>11,.0f}"
              f" (predicted {r['predicted_bytes_to_device']:>11,.0f})"
              f"  to host {r['bytes_to_host']:>11,.0f} (predicted {r['predicted_bytes_to_host']:>11,.0f})"
              f"  evictions {r['evictions']:>6.1f}  Adam device/host {r['adam_chunks_device']:.0f}/"
              f"{r['adam_chunks_host']:.0f}  predicted step {r['predicted_step_s']:.4f} s"
              f"  activations {r['peak_activation_bytes_device']:,.0f} B"
              f"  prefetch distance {r['prefetch_distance']:.0f} ({r['prefetches_beyond_next']:.1f} beyond the next)"
              f"  eviction order {EvictionOrder(round(r['eviction_order'])).label}"
              f"  accumulators to device {r['accumulator_bytes_to_device']:,.0f}"
              f" (predicted {r['predicted_accumulator_bytes_to_device']:,.0f})"
              f" to host {r['accumulator_bytes_to_host']:,.0f}"
              f" (predicted {r['predicted_accumulator_bytes_to_host']:,.0f})")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--ga", type=int, default=1, help="gradient_accumulation_steps (micro-batches per step)")
    parser.add_argument("--warmup", type=int, default=3, help="steps left out of the means")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    bu.setup_single_process_env()
    print(bu.describe_cpu())
    result = sweep(args.steps, args.warmup, args.ga)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
