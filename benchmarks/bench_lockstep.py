"""What the ranks' agreement before each collective costs (see [Note: ranks in lockstep]): step time of a
2-rank GPT with ``zero_optimization.lockstep`` "off", "on" and "first_steps", alternating in one run,
per chunk size.

    python benchmarks/bench_lockstep.py                       # chunk sizes 8192 (keep_gathered 0) and 65536
    python benchmarks/bench_lockstep.py --chunks 65536 --steps 10 --repeats 3

CPU and gloo, two processes on this machine; per trial the median step after two warm-up steps, per
side the best trial.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks")]

import bench_utils as bu


def _rank(rank: int, world: int, store: str, mode: str, chunk: int, keep: int | None, steps: int, out) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=store.rsplit("_", 1)[-1])
    torch.set_num_threads(1)
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    import deepspeed
    from gpt_model import GPT, GPTConfig

    import ds_patrickstar  # noqa: F401

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=4, n_head=4, n_embd=128, block_size=64, vocab_size=256))
    zero = {"stage": "patrickstar", "chunk_size": chunk, "lockstep": mode,
            **({} if keep is None else {"keep_gathered": keep})}
    cfg = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": zero,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    engine, *_ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
    gen = torch.Generator().manual_seed(rank)
    times = []
    for _ in range(steps):
        tokens = torch.randint(0, 256, (4, 65), generator=gen)
        start = time.perf_counter()
        logits = engine(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 256).float(), tokens[:, 1:].reshape(-1))
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - start)
    counters = engine.get_patrickstar_counters()
    if rank == 0:
        kept = sorted(times[2:])
        out.put((kept[len(kept) // 2], counters["lockstep_checks"], counters["all_gathers"],
                 counters["reduce_scatters"], counters["agreement_seconds"]))
    engine.destroy()
    dist.destroy_process_group()


def _trial(mode: str, chunk: int, keep: int | None, steps: int) -> tuple:
    return bu.spawn_ranks(_rank, 2, (mode, chunk, keep, steps), 1, "bench_lockstep_", timeout=600)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunks", default="8192,65536", help="chunk sizes (elements), comma-separated")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2, help="off/on/first_steps trials per chunk size")
    args = parser.parse_args()
    print("| chunk_size | keep_gathered | checks per step | agreement ms per step | all-gathers | reduce-scatters | "
          "step off (ms) | step on (ms) | on / off | step first_steps (ms) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for chunk in (int(c) for c in args.chunks.split(",")):
        keep = 0 if chunk <= 8192 else None  # small chunks, nothing kept: the most collectives per step
        runs: dict[str, list[tuple]] = {"off": [], "on": [], "first_steps": []}
        for _ in range(args.repeats):
            for mode, trials in runs.items():
                trials.append(_trial(mode, chunk, keep, args.steps))
        best = {mode: min(r[0] for r in trials) * 1e3 for mode, trials in runs.items()}  # the best of the repeats
        checks, gathers, scatters, seconds = runs["on"][0][1:]
        print(f"| {chunk} | {'default' if keep is None else keep} | {checks} | {seconds * 1e3:.1f} | {gathers} | "
              f"{scatters} | {best['off']:.1f} | {best['on']:.1f} | {best['on'] / best['off']:.2f}x | "
              f"{best['first_steps']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
