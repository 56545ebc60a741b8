"""A tiny DeepSpeed + ds_patrickstar training script for the launcher tests (tests/test_launchers.py).

    torchrun --nproc_per_node 2 tests/scripts/tiny_train.py --out DIR
    deepspeed --num_gpus 2 --master_port PORT tests/scripts/tiny_train.py --out DIR

Trains a small MLP for --steps steps on the same data on every rank and writes
``DIR/rank<r>.json`` with that rank's losses. ``--fail-rank R --fail-step S`` makes rank R
raise at step S (the error message names both). ``--unmodified-end`` ends as scripts users do not
edit often end (benchmarks/exit_abort.py): the last loss averaged over the ranks, and no
``destroy_process_group``; ``--no-exit-wait`` leaves out the engine's wait at exit
(see [Note: gloo workers idle at exit]), to measure what it prevents.
"""
import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the working tree's ds_patrickstar

import deepspeed

import ds_patrickstar  # noqa: F401


def parse_args():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--fail-rank", type=int, default=None)
    p.add_argument("--fail-step", type=int, default=None)
    p.add_argument("--unmodified-end", action="store_true")
    p.add_argument("--no-exit-wait", action="store_true")
    p.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", -1)))
    p = deepspeed.add_config_arguments(p)
    return p.parse_args()


def config(args):
    if args.deepspeed_config:
        with open(args.deepspeed_config) as f:
            return json.load(f)
    return {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0,
            "zero_optimization": {"stage": "patrickstar", "chunk_size": 1024},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}}


def main():
    args = parse_args()
    if args.no_exit_wait:
        from ds_patrickstar.integration import registration

        registration.register_wait_at_exit = lambda: None
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 32), torch.nn.GELU(),
                                torch.nn.Linear(32, 4))
    engine, *_ = deepspeed.initialize(model=model, config=config(args), model_parameters=model.parameters())
    rank = engine.global_rank
    gen = torch.Generator().manual_seed(100)  # the same data on every rank
    losses = []
    for step in range(args.steps):
        if rank == args.fail_rank and step == args.fail_step:
            raise RuntimeError(f"tiny_train: injected failure on rank {rank} at step {step}")
        x, y = torch.randn(4, 16, generator=gen), torch.randn(4, 4, generator=gen)
        loss = ((engine(x) - y) ** 2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "world_size": engine.world_size,
                                                      "losses": losses}))
    if args.unmodified_end:  # as Hugging Face's evaluate ends: a loss averaged over the ranks
        torch.distributed.all_reduce(torch.tensor([losses[-1]]))
        return
    # An orderly end, as torch recommends. Without it a gloo worker thread can let go of the last
    # collective's tensors after the interpreter began to finalize and abort the process ("terminate
    # called without an active exception"; torch on gloo alone, stock ZeRO-3 as well): a "patrickstar"
    # engine waits for gloo's workers at exit (see [Note: gloo workers idle at exit]); measured in
    # docs/benchmarks.md ("Exit abort").
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
