"""``twin_pressure.py``'s mirrors of the H100 sweep at several ranks: per budget, the fill rule and the step-time
model's choice of the optimizer states, each rank's bytes moved per steady step (accumulators included) and the bytes
predicted.

    python benchmarks/twin_pressure_ranks.py                 # two ranks, the 8 / 12 / 16 / 24 GiB mirrors
    python benchmarks/twin_pressure_ranks.py --ranks 2 --steps 6 --json out.json
    python benchmarks/twin_pressure_ranks.py --mirrors 6,7,9,10,11,13,14    # other GiB of the sweep

Each rank gets the budget ``twin_pressure.py`` gives one at that mirror (the fraction of the whole model's data
that 8 / 12 / 16 / 24 GiB are of gpt-1.3b's 18.4 GB) and owns a share of the chunks; the ranks are processes on
this machine (gloo on the CPU), every one on the same batches. The move model at several ranks reads the model
data it does not move (gathered groups, gradient and collective buffers) as measured at each moment (see [Note:
predicted moves] in ds_patrickstar/placement/move_model.py). Means over the steps after ``--warmup``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks")]

import bench_utils as bu
import twin_pressure as tp

KEYS = (
    "bytes_to_device",
    "bytes_to_host",
    "predicted_bytes_to_device",
    "predicted_bytes_to_host",
    "accumulator_bytes_to_device",
    "accumulator_bytes_to_host",
    "predicted_accumulator_bytes_to_device",
    "predicted_accumulator_bytes_to_host",
    "adam_chunks_device",
    "adam_chunks_host",
    "prefetch_distance",
    "eviction_order",
)


def _rank(rank: int, world: int, store: str, budget: int, rule: str, steps: int, ga: int, out) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=store.rsplit("_", 1)[-1],
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    import ds_patrickstar  # noqa: F401

    result = tp.run(tp.config("patrickstar", budget, rule, ga), steps)
    out.put((rank, result["losses"], [{k: c[k] for k in KEYS} for c in result["counters"]]))
    dist.destroy_process_group()


def trial(world: int, budget: int, rule: str, steps: int, ga: int = 1) -> list[tuple[list[float], list[dict]]]:
    """Per rank, the losses and counters of ``steps`` steps at ``budget`` under ``rule``."""
    results = sorted(bu.spawn_ranks(_rank, world, (budget, rule, steps, ga), world, "twin_pressure_ranks_"))
    return [(losses, counters) for _, losses, counters in results]


def _accumulators(r: dict) -> str:
    """With gradient accumulation, the accumulators' bytes each way, predicted and measured."""
    if not r["accumulator_bytes_to_device"] and not r["accumulator_bytes_to_host"]:
        return ""
    return (
        f"; accumulators predicted {r['predicted_accumulator_bytes_to_device']:,.0f} / "
        f"{r['predicted_accumulator_bytes_to_host']:,.0f} B against {r['accumulator_bytes_to_device']:,.0f} / "
        f"{r['accumulator_bytes_to_host']:,.0f}"
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the means")
    parser.add_argument("--ga", type=int, default=1, help="gradient_accumulation_steps (micro-batches per step)")
    parser.add_argument("--mirrors", default=",".join(str(g) for g in tp.MIRRORED_GIB), help="GiB, comma-separated")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    print(f"{bu.describe_cpu()}; {args.ranks} ranks, GA {args.ga}")
    data, rows = tp.model_data_bytes(), []
    for gib in (float(g) for g in args.mirrors.split(",")):
        budget = int(data * gib * tp.GIB / tp.H100_MODEL_DATA)
        row: dict = {"mirrors_gib": gib, "budget": budget}
        for rule in ("fill", "time"):
            ranks = trial(args.ranks, budget, rule, args.steps, args.ga)
            row[rule] = [
                {k: statistics.mean(c[k] for c in counters[args.warmup :]) for k in KEYS} | {"losses": losses}
                for losses, counters in ranks
            ]
        rows.append(row)
        same = all(t["losses"] == f["losses"] for t, f in zip(row["time"], row["fill"]))
        print(f"mirrors {gib:g} GiB (budget {budget:,} B per rank), losses of the two rules equal: {same}")
        for rank, (fill, time) in enumerate(zip(row["fill"], row["time"])):
            moved = {name: sum(r[k] for k in tp.MOVED) for name, r in (("fill", fill), ("time", time))}
            ratio = moved["time"] / moved["fill"] if moved["fill"] else 1.0
            print(
                f"  rank {rank}: fill {fill['adam_chunks_device']:.0f} states on the accelerator, "
                f"{moved['fill']:,.0f} B moved; time {time['adam_chunks_device']:.0f} states, "
                f"{moved['time']:,.0f} B ({ratio:.2f}x), "
                f"predicted {time['predicted_bytes_to_device']:,.0f} / {time['predicted_bytes_to_host']:,.0f} B "
                f"against {time['bytes_to_device']:,.0f} / {time['bytes_to_host']:,.0f} measured, prefetch "
                f"distance {time['prefetch_distance']:.0f}, eviction order {time['eviction_order']:.0f}"
                + _accumulators(time)
            )
    if args.json:
        record = {"cpu": bu.describe_cpu(), "ranks": args.ranks, "ga": args.ga, "rows": rows}
        Path(args.json).write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
