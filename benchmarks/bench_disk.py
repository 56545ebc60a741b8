"""The disk tier's bandwidth against the disk's own, measured in the same run.

    python benchmarks/bench_disk.py                       # 2 GiB raw test, 1.5 GiB of states, 3 steps
    python benchmarks/bench_disk.py --dir /nvme/tmp --raw-gib 8 --states-gib 6

1. The disk: a preallocated file of ``--raw-gib`` is rewritten in place (O_DIRECT, requests of
   ``--block-mib`` from ``--raw-threads`` threads, a deep queue: the tier's own I/O code,
   ThreadDiskIO), then read,
   then read and rewritten at once (two halves, the mixed load of an optimizer step).
2. The tier: ``--states-gib`` of optimizer states in swap files (chunks of ``--chunk-elements``),
   streamed in pieces of ``--piece-elements`` through ``--buffers`` aligned buffers while the fused CPU
   Adam updates each piece
   (the optimizer step of ``offload_optimizer: {"device": "nvme"}``, DiskStates.stream); the same
   Adam on the same chunks with states in RAM gives the compute-only time.

The table: GB/s of each, the tier's achieved (bytes read + written) / step time, its ratio to
the mixed bandwidth, and the seconds the step waited on I/O, one row per I/O backend of
``--backends`` (``threads``: ThreadDiskIO; ``aio``: DeepSpeed's aio_handle, AioDiskIO, with
``--threads`` as its intra_op_parallelism and ``--queue-depth``; skipped with a message where the
async_io op cannot load). Every file is deleted at the end.
"""
import argparse
import os
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ds_patrickstar.disk.aio import AioDiskIO, load_async_io
from ds_patrickstar.disk.budget import record_bytes
from ds_patrickstar.disk.io import ThreadDiskIO, aligned_empty
from ds_patrickstar.disk.states import DiskStates
from ds_patrickstar.disk.swap_files import SwapFiles
from ds_patrickstar.disk.swap_layout import PIECE_ELEMENTS
from ds_patrickstar.optim.adam_math import AdamHyper
from ds_patrickstar.optim.kernels import get_adam_backend

GB = 1e9


def raw_bandwidth(folder, size, block, threads, modes=("write", "read", "mixed")):
    """GB/s of in-place sequential write, read and mixed (half read, half written at once), those of ``modes``."""
    path = os.path.join(folder, "raw.bin")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    os.posix_fallocate(fd, 0, size)
    io = ThreadDiskIO(threads, block)
    bufs = [aligned_empty(block) for _ in range(threads * 4)]
    try:
        for offset in range(0, size, block):  # write every block once (not timed): then in-place rewrites
            io.write(fd, offset, bufs[0]).wait()
        results = {}
        for name in tuple(modes) * 2:  # each twice, the better one counts
            start = time.perf_counter()
            pending = []
            for i, offset in enumerate(range(0, size, block)):
                buf = bufs[i % len(bufs)]
                if len(pending) >= len(bufs):
                    pending.pop(0).wait()
                write = name == "write" or (name == "mixed" and i % 2 == 0)
                pending.append(io.write(fd, offset, buf) if write else io.read(fd, offset, buf))
            for p in pending:
                p.wait()
            results[name] = max(results.get(name, 0.0), size / (time.perf_counter() - start) / GB)
        return results
    finally:
        io.close()
        os.close(fd)
        os.unlink(path)


def tier_bandwidth(folder, states_bytes, chunk_elements, buffers, io, steps, piece):
    """The optimizer step over spilled chunks: achieved GB/s, step seconds, I/O wait, Adam-only seconds."""
    count = max(1, states_bytes // (12 * chunk_elements))
    capacities = {c: chunk_elements for c in range(count)}
    files = SwapFiles(folder, 0, {c: record_bytes(n) for c, n in capacities.items()})
    tier = DiskStates(files, io, capacities, buffers, piece)
    adam = get_adam_backend("cpu")
    hyper = AdamHyper(lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, adamw=True)
    params = {c: torch.randn(chunk_elements).to(torch.bfloat16) for c in capacities}
    try:
        for c in capacities:
            tier.initialize(c, params[c].float())
        times, waits, moved = [], [], []
        for step in range(1, steps + 1):
            tier.take_counts()
            start = time.perf_counter()
            for cid, first, state in tier.stream(capacities):
                data = params[cid][first : first + state.master.numel()]
                adam(data, state.master, state.exp_avg, state.exp_avg_sq, step=step, hyper=hyper, grad_scale=1.0)
            times.append(time.perf_counter() - start)
            counts = tier.take_counts()
            waits.append(counts.wait_seconds)
            moved.append(counts.bytes_read + counts.bytes_written)
        ram = [torch.zeros(chunk_elements) for _ in range(3)]
        start = time.perf_counter()
        for cid in capacities:
            adam(params[cid], *ram, step=1, hyper=hyper, grad_scale=1.0)
        adam_only = time.perf_counter() - start
        best = min(range(steps), key=lambda i: times[i])
        return {"achieved": moved[best] / times[best] / GB, "step_s": times[best], "wait_s": waits[best],
                "adam_s": adam_only, "chunks": count, "bytes": moved[best], "buffer_bytes": tier.buffer_bytes,
                "piece": tier.piece}
    finally:
        tier.close()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default="/tmp/ds_ps_bench_disk", help="a folder on the disk to measure")
    parser.add_argument("--raw-gib", type=float, default=2.0)
    parser.add_argument("--states-gib", type=float, default=1.5)
    parser.add_argument("--chunk-elements", type=int, default=16 * 2**20)
    parser.add_argument("--buffers", type=int, default=4)
    parser.add_argument("--piece-elements", type=int, default=PIECE_ELEMENTS,
                        help="elements of the piece each buffer holds (offload_optimizer.buffer_size)")
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--block-mib", type=int, default=8)
    parser.add_argument("--raw-threads", type=int, default=16, help="threads of the disk's own test (a deep queue)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--backends", default="threads,aio", help="I/O backends of the tier, one row each")
    parser.add_argument("--queue-depth", type=int, default=8, help="aio: requests in flight per thread")
    args = parser.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    need = int((args.raw_gib + args.states_gib) * 2**30 * 1.1)
    free = shutil.disk_usage(args.dir).free
    if free < need:
        sys.exit(f"{args.dir}: {need:,} bytes needed, {free:,} free; lower --raw-gib / --states-gib")
    block = args.block_mib * 2**20
    backends = args.backends.split(",")
    if "aio" in backends and load_async_io()[1]:
        print(f"skipping backend aio: {load_async_io()[1]}")
        backends.remove("aio")
    makers = {"threads": lambda: ThreadDiskIO(args.threads, block),
              "aio": lambda: AioDiskIO(block, args.queue_depth, False, True, args.threads)}
    try:
        raw = raw_bandwidth(args.dir, int(args.raw_gib * 2**30) // block * block, block, args.raw_threads)
        tiers = {name: tier_bandwidth(args.dir, int(args.states_gib * 2**30), args.chunk_elements, args.buffers,
                                      makers[name](), args.steps, args.piece_elements) for name in backends}
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
    print("| backend | disk write (GB/s) | disk read | disk mixed | tier achieved | achieved / mixed | step (s) "
          "| I/O wait (s) | Adam only (s) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, tier in tiers.items():
        ratio = tier["achieved"] / raw["mixed"]
        print(f"| {name} | {raw['write']:.2f} | {raw['read']:.2f} | {raw['mixed']:.2f} | {tier['achieved']:.2f} | "
              f"{ratio:.0%} | {tier['step_s']:.2f} | {tier['wait_s']:.2f} | {tier['adam_s']:.2f} |")
    tier = next(iter(tiers.values()))
    print(f"({tier['chunks']} chunks of {args.chunk_elements:,} elements, {tier['bytes'] / GB:.2f} GB moved per step, "
          f"{args.buffers} + 1 buffers of {tier['piece']:,}-element pieces ({tier['buffer_bytes'] / 2**20:.0f} MiB), "
          f"{args.threads} tier threads, {args.raw_threads} raw threads, {args.block_mib} MiB requests, "
          f"aio queue depth {args.queue_depth})")


if __name__ == "__main__":
    main()
