"""Run a function on N real processes (gloo, file store) with a deadline; re-raise worker errors."""
from __future__ import annotations

import io
import os
import queue
import socket
import tempfile
import traceback

import torch
import torch.multiprocessing as mp


class WorkerError(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn, rank, world_size, store, port, results, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    import faulthandler
    faulthandler.dump_traceback_later(60, exit=False)
    try:
        import torch
        import torch.distributed as dist
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
        buffer = io.BytesIO()
        torch.save(fn(rank, world_size, *args), buffer)  # plain bytes: no shared-memory handles to outlive us
        results.put((rank, True, buffer.getvalue()))
    except BaseException:  # noqa: BLE001 - the traceback travels to the parent
        results.put((rank, False, traceback.format_exc()))


def run_ranks(fn, world_size: int, *args, timeout: float = 240.0) -> list:
    """``fn(rank, world_size, *args)`` on every rank; returns the per-rank results in rank order.

    A worker exception ends the run at once: the other workers are terminated (they may be
    blocked in a collective) and the first failing rank's traceback is raised.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    store = tempfile.mktemp(prefix="ds_ps_store_")
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world_size, store, port, results, args), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    out: dict[int, object] = {}
    try:
        while len(out) < world_size:
            try:
                rank, ok, value = results.get(timeout=timeout)
            except queue.Empty:
                raise WorkerError(f"ranks {sorted(set(range(world_size)) - set(out))} did not finish "
                                  f"within {timeout} s") from None
            if not ok:
                raise WorkerError(f"rank {rank} failed:\n{value}")
            out[rank] = torch.load(io.BytesIO(value), weights_only=False)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()
        if os.path.exists(store):
            os.remove(store)
    return [out[r] for r in range(world_size)]
