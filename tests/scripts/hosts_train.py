"""A tiny training script for the two-host test (tests/test_two_hosts.py): data parallel, disk tier on.

    torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint HOST:PORT \
        tests/scripts/hosts_train.py --out DIR --nvme-path SWAP_DIR_OF_THIS_HOST

Each rank trains a small MLP on its own data (drawn from the step and the global rank, so a
resumed run draws the same) and writes ``DIR/rank<r>.json``: its losses, the host it ran on, what
the defaults that read the host decided (kept groups, which optimizer states went to disk), the
folder of its swap files and the host its manifest names, and a digest of the trained fp32
weights. ``--save-step K --ckpt DIR`` saves a checkpoint after K steps (and goes on);
``--load DIR`` resumes from it. ``--host-memory TOTAL,AVAILABLE`` makes ``psutil`` report a host of
that memory, so the defaults decide the same on any machine and any run.
"""

import argparse
import hashlib
import json
import logging
import socket
import sys
from pathlib import Path

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the working tree's ds_patrickstar

import deepspeed

import ds_patrickstar  # noqa: F401
from ds_patrickstar.disk.swap_files import MANIFEST
from ds_patrickstar.memory.preflight import local_world_size


class HostBudget(logging.Handler):
    """Takes the default host budget from the disk tier's log record (its first argument, in GiB)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.budget = None

    def emit(self, record):
        if record.getMessage().startswith("ds_patrickstar: disk tier: host budget"):
            self.budget = round(record.args[0] * 2**30)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True)
    p.add_argument("--nvme-path", required=True)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--save-step", type=int, default=None)
    p.add_argument("--ckpt", default=None)
    p.add_argument("--load", default=None)
    p.add_argument("--host-memory", default=None)
    return p.parse_args()


def fake_host_memory(spec):
    total, available = (int(v) for v in spec.split(","))
    real = psutil.virtual_memory

    def virtual_memory():
        return real()._replace(total=total, available=available)

    psutil.virtual_memory = virtual_memory


def config(args):
    return {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0, "seed": 0,
            "zero_optimization": {"stage": "patrickstar", "chunk_size": 1024,
                                  "offload_optimizer": {"device": "nvme", "nvme_path": args.nvme_path,
                                                        "io_backend": "threads", "buffer_size": 1024}},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}}


def batch(step, rank):
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, 16, generator=gen), torch.randn(4, 4, generator=gen)


def decisions(engine, budget):
    """What this rank's defaults decided, and where its swap files are."""
    parts = engine.optimizer.parts
    record = {"local_world_size": local_world_size(engine.world_size),
              "keep_gathered": engine.optimizer.manager.residency.policy.limit, "host_budget": budget.budget,
              "spilled": [], "swap_folder": None, "manifest_host": None}
    if parts.disk is not None:
        folder = parts.disk.files.folder
        manifest = json.loads((Path(folder) / MANIFEST).read_text())
        record.update(spilled=sorted(parts.disk.capacities), swap_folder=folder, manifest_host=manifest["host"])
    return record


def main():
    args = parse_args()
    torch.set_num_threads(1)
    if args.host_memory:
        fake_host_memory(args.host_memory)
    budget = HostBudget()
    tier_logger = logging.getLogger("ds_patrickstar.disk.tier")
    tier_logger.addHandler(budget)
    tier_logger.setLevel(logging.INFO)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 32), torch.nn.GELU(),
                                torch.nn.Linear(32, 4))
    engine, *_ = deepspeed.initialize(model=model, config=config(args), model_parameters=model.parameters())
    rank = engine.global_rank
    record = {"rank": rank, "world_size": engine.world_size, "host": socket.gethostname(), **decisions(engine, budget)}
    first = 0
    if args.load:
        _, client = engine.load_checkpoint(args.load)
        first = client["step"]
    losses = []
    for step in range(first, args.steps):
        x, y = batch(step, rank)
        loss = ((engine(x) - y) ** 2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if step + 1 == args.save_step:
            engine.save_checkpoint(args.ckpt, tag="mid", client_state={"step": step + 1})
    weights = engine.get_fp32_state_dict()
    digest = hashlib.sha256()
    for name in sorted(weights):
        digest.update(name.encode() + weights[name].numpy().tobytes())
    record.update(losses=losses, weights=digest.hexdigest())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps(record))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
