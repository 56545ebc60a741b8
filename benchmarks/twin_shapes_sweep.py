#!/usr/bin/env python
"""Activation offload under changing batch shapes, on the strict twin: does a run train where the memory allows?

    python benchmarks/twin_shapes_sweep.py                       # 60 configurations, gradient accumulation 2-3
    python benchmarks/twin_shapes_sweep.py --ga 1 --seeds 40     # one micro-batch a step
    python benchmarks/twin_shapes_sweep.py --tight            # budgets below the activations, "auto" against "all"
    python benchmarks/twin_shapes_sweep.py --json out.json

Each configuration (from its seed: micro-batches per step, dtype, chunk size, a margin) trains a GPT of
``gpt_model.py`` for eight steps on batches padded to their own length (8-32 tokens, drawn per micro-batch) on the
strict emulated accelerator, twice: once keeping every activation (a budget far above the model; its peak
non-model memory is measured), then with ``offload_activations: "auto"`` at that peak plus ``margin`` chunk groups
(the largest chunk, three times with gradient accumulation: payload and fp32 accumulator), a budget at which the
activations and a working set of chunks fit, as ZeRO-3 offload's would. Reported: how many trained, whether their
losses equal the first run's bit for bit (offloading moves bytes, never values), and each refusal's moment. The
activation offload's handling of changing shapes is [Note: a risen tide] in ds_patrickstar/activations/plan.py.

``--tight``: the budget is a share of that peak (0.4-0.85, from the seed) plus the margin, below what keeping every
activation needs, so activations must move; where "auto" refuses, the same run with ``offload_activations: "all"``
(every block offloaded, every iteration) says whether the memory allowed it ([Note: activations give way] in
ds_patrickstar/activations/give_way.py, [Note: a forecast set aside] in ds_patrickstar/placement/last_resort.py).
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_utils as bu

bu.add_repo_to_path()

MODEL = dict(n_layer=4, n_head=2, n_embd=64, block_size=32, vocab_size=128)
LARGEST = 16384  # elements of the model's largest parameter (its MLP weights get chunks of their own)


def train(config: dict, lengths: list[int], seed: int) -> tuple[list[float], int]:
    """The losses of one run and its peak non-model memory on the accelerator."""
    import deepspeed
    from gpt_model import GPT, GPTConfig

    torch.manual_seed(seed)
    model = GPT(GPTConfig(**MODEL))
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    gen = torch.Generator().manual_seed(seed)
    losses, peak = [], 0
    try:
        for length in lengths:
            tokens = torch.randint(0, MODEL["vocab_size"], (2, length + 1), generator=gen)
            logits = engine(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, MODEL["vocab_size"]),
                                                     tokens[:, 1:].reshape(-1))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            peak = max(peak, engine.get_patrickstar_counters()["peak_non_model_bytes_device"])
    finally:
        engine.destroy()
    return losses, peak


def config(ga: int, dtype: str, chunk: int, budget: int, offload: str) -> dict:
    zero = {"stage": "patrickstar", "chunk_size": chunk, "emulate_accelerator": True, "device_budget": budget,
            "offload_activations": offload}
    out = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": ga, "zero_optimization": zero,
           "gradient_clipping": 1.0, "steps_per_print": 10**9,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}}}
    if dtype == "bf16":
        out["bf16"] = {"enabled": True}
    return out


def one(seed: int, gas: list[int], tight: bool = False) -> dict:
    rng = random.Random(seed * 13 + 5)
    ga, dtype = rng.choice(gas), rng.choice(["bf16", "fp32"])
    chunk, margin = rng.choice([2048, 4096, 8192]), rng.choice([1.5, 2, 3, 4, 6])
    share = random.Random(seed * 7 + 3).choice([0.4, 0.55, 0.7, 0.85]) if tight else 1.0
    lengths = [random.Random(seed * 1000 + i).randint(8, 32) for i in range(8 * ga)]
    resident, peak = train(config(ga, dtype, chunk, 10**9, "none"), lengths, seed)
    group = max(chunk, LARGEST) * (2 if dtype == "bf16" else 4) * (3 if ga > 1 else 1)
    budget = int(share * peak + margin * group)
    row = {"seed": seed, "ga": ga, "dtype": dtype, "chunk": chunk, "margin": margin, "share": share, "peak": peak,
           "budget": budget}
    try:
        losses, _ = train(config(ga, dtype, chunk, budget, "auto"), lengths, seed)
        row.update(trained=True, same_losses=losses == resident)
    except Exception as err:  # a budget refusal: its message names the moment and the remedies
        row.update(trained=False, error=f"{type(err).__name__}: {str(err)[:160]}")
        if tight:
            row["all_trained"] = _trains(config(ga, dtype, chunk, budget, "all"), lengths, seed)
    return row


def _trains(config: dict, lengths: list[int], seed: int) -> bool:
    try:
        train(config, lengths, seed)
    except Exception:  # a budget refusal
        return False
    return True


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=60)
    parser.add_argument("--start", type=int, default=0)
    parser.add_argument("--ga", default="2,3", help="micro-batches per step to draw from, comma-separated")
    parser.add_argument("--tight", action="store_true", help="budgets below the activations; refusals tried with "
                        '"all"')
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    logging.disable(logging.WARNING)
    print(f"{bu.describe_cpu()}; ds_patrickstar from {bu.repo_commit()}")
    gas = [int(g) for g in args.ga.split(",")]
    rows = [one(seed, gas, args.tight) for seed in range(args.start, args.start + args.seeds)]
    for row in rows:
        if not row["trained"]:
            also = {True: '; "all" trains', False: '; "all" refused too'}.get(row.get("all_trained"), "")
            print(f"  seed {row['seed']}: GA {row['ga']}, {row['dtype']}, chunk {row['chunk']}, budget "
                  f"{row['budget']:,} B ({row['share']} x peak {row['peak']:,} + {row['margin']} groups): "
                  f"{row['error']}{also}")
    trained = [r for r in rows if r["trained"]]
    print(f"{len(trained)} of {len(rows)} trained, {sum(r['same_losses'] for r in trained)} of them with the "
          f"losses of the run keeping every activation bit for bit")
    if args.tight:
        print(f'{sum(bool(r.get("all_trained")) for r in rows)} refused where "all" trains')
    if args.json:
        found = {"cpu": bu.describe_cpu(), "code": bu.repo_commit(), "rows": rows}
        Path(args.json).write_text(json.dumps(found, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
