#!/usr/bin/env python
"""The planner's host time at the first steps, at the GPU sweep's trace size, on the strict twin.

Issue 42's GPU sweep trains gpt-1.3b: 24 blocks, 100 chunks. The planner's work grows with the trace (moments x
chunks per replay of an iteration) and the candidates it prices, not with the tensors' sizes, so a GPT of the same
depth and chunk count on the strict emulated accelerator (``emulate_accelerator``) plans as much as the GPU run
does; this measures that host time (counter ``plan_seconds``: the traced step's plan, then the next step's check,
see [Note: the planner's cost] in ds_patrickstar/placement/state_choice.py) at device budgets that are the same
fractions of its model data as 8 / 12 / 16 / 24 GiB are of gpt-1.3b's 18.4 GB (as ``twin_pressure.py`` does),
and the wall time of the first steps beyond the steady step's. Host time on this machine's CPU, not a GPU's;
the steps themselves are the twin's CPU compute. Beside it, what the traced first step offloads of the
activations and the host buffers it pins (see [Note: the traced iteration's offload] in
ds_patrickstar/activations/traced_keep.py), and what a steady step offloads.

    python benchmarks/bench_planning.py [--steps 5] [--layers 24] [--chunks 100] [--json out.json] [--snapshots DIR]

Run it from another checkout (``PYTHONPATH=<checkout> python <checkout>/benchmarks/bench_planning.py``) to
compare commits; the line "ds_patrickstar from" names the code measured.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_utils as bu
import twin_pressure as tp


def run(layers: int, chunks: int, gib: int, steps: int, snapshot: str | None = None) -> dict:
    """``steps`` steps of the twin's GPT of ``layers`` blocks in about ``chunks`` chunks at the budget mirroring
    ``gib`` GiB: per step the wall time and the counters that show the planning; ``snapshot``: a path to write
    the planner's last thorough plan to (see [Note: planner snapshot])."""
    import deepspeed
    import torch
    from gpt_model import GPT, GPTConfig

    model_config = dict(tp.MODEL, n_layer=layers)
    data = 14 * sum(p.numel() for p in GPT(GPTConfig(**model_config)).parameters())
    config = tp.config("patrickstar", int(data * gib * tp.GIB / tp.H100_MODEL_DATA))
    config["zero_optimization"]["chunk_size"] = max(1024, data // 14 // chunks)
    torch.manual_seed(0)
    model = GPT(GPTConfig(**model_config))
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    gen = torch.Generator().manual_seed(1)
    rows = []
    for _ in range(steps):
        tokens = torch.randint(0, tp.VOCAB, (tp.BATCH, model_config["block_size"] + 1), generator=gen)
        started = time.perf_counter()
        logits = engine(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, tp.VOCAB), tokens[:, 1:].reshape(-1))
        engine.backward(loss)
        engine.step()
        wall = time.perf_counter() - started
        counters = engine.get_patrickstar_counters()
        rows.append({"wall_s": wall, **{k: counters[k] for k in ("plan_seconds", "adam_chunks_device",
                                                                 "adam_chunks_host", "prefetch_distance",
                                                                 "activation_bytes_offloaded", "host_pinnings")}})
    steady = statistics.median(r["wall_s"] for r in rows[2:]) if steps > 2 else float("nan")
    owned = rows[-1]["adam_chunks_device"] + rows[-1]["adam_chunks_host"]
    if snapshot is not None:
        engine.planner_snapshot(snapshot)
    engine.destroy()
    return {"mirrors_gib": gib, "chunks": owned, "steady_s": steady,
            "first_two_extra_s": sum(r["wall_s"] for r in rows[:2]) - 2 * steady, "steps": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--chunks", type=int, default=100)
    parser.add_argument("--json")
    parser.add_argument("--snapshots", default=None, help="a folder: each mirror's planner snapshot, mirror_<GiB>.json "
                        "(plan them again with replan.py)")
    args = parser.parse_args()
    bu.setup_single_process_env()
    print(f"{bu.describe_cpu()}; ds_patrickstar from {bu.repo_commit()}")
    results = []
    for gib in tp.MIRRORED_GIB:
        snapshot = None
        if args.snapshots:
            Path(args.snapshots).mkdir(parents=True, exist_ok=True)
            snapshot = str(Path(args.snapshots) / f"mirror_{gib}.json")
        r = run(args.layers, args.chunks, gib, args.steps, snapshot)
        plans = " / ".join(f"{s['plan_seconds']:.3f}" for s in r["steps"][:2])
        states = " / ".join(str(s["adam_chunks_device"]) for s in r["steps"][:3])
        print(f"mirrors {gib:>2} GiB: {r['chunks']} chunks, plan_seconds step 1 / 2 {plans} s, first two steps "
              f"{r['first_two_extra_s']:.3f} s over two steady steps ({r['steady_s']:.3f} s), states on the "
              f"accelerator at steps 1 / 2 / 3: {states}")
        first, last = r["steps"][0], r["steps"][-1]
        print(f"  activations offloaded at step 1: {first['activation_bytes_offloaded']:,} B "
              f"({first['host_pinnings']} host buffers pinned), at step {len(r['steps'])}: "
              f"{last['activation_bytes_offloaded']:,} B")
        results.append(r)
    if args.json:
        found = {"cpu": bu.describe_cpu(), "code": bu.repo_commit(), "layers": args.layers, "results": results}
        Path(args.json).write_text(json.dumps(found, indent=1))


if __name__ == "__main__":
    main()
