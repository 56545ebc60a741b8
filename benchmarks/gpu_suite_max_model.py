"""``gpu_suite.py``'s part 3: the largest GPT that trains at a capped host memory, ours against ZeRO-3 offload, by
a search over ``max_model.py``'s tries (each a process of its own, its host memory polled and capped) that stops
at its deadline: what it found is a lower bound unless a failed try one layer deeper brackets it."""
from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import max_model
from gpu_suite_env import skipped


def next_depth(lo: int, hi: int | None, grow: float, max_depth: int) -> int | None:
    """The next depth of the search (``lo`` trained, 0: none yet; ``hi`` failed, None: none yet), None when done."""
    if hi is None:  # nothing failed yet: walk up
        return None if lo >= max_depth else min(max_depth, max(lo + 1, int(lo * grow)))
    if lo == 0:  # nothing trained yet: walk down
        return None if hi <= 1 else max(1, min(hi - 1, int(hi / grow)))
    return None if hi - lo <= 1 else (lo + hi) // 2


def deadline_search(try_depth, start: int, max_depth: int, grow: float, deadline: float, min_try_s: float) -> dict:
    """The largest depth for which ``try_depth(depth, timeout)`` trains (it returns a dict with ``ok``): a walk
    from ``start`` by ``grow`` (up while tries train, down while they fail), then a bisection, until
    ``deadline``. ``exact``: the largest that trained is one layer below one that failed."""
    tries: dict[int, dict] = {}
    lo, hi, stopped = 0, None, None
    depth: int | None = max(1, min(start, max_depth))
    while depth is not None:
        left = deadline - time.monotonic()
        if left < min_try_s:
            stopped = f"deadline: {left:.0f} s left before depth {depth}"
            break
        tries[depth] = try_depth(depth, left)
        if tries[depth].get("timed_out"):  # says nothing about whether it fits
            stopped = f"deadline: the try at depth {depth} timed out"
            break
        lo, hi = (depth, hi) if tries[depth]["ok"] else (lo, depth)
        depth = next_depth(lo, hi, grow, max_depth)
    exact = lo > 0 and hi is not None and hi - lo == 1
    if stopped is None and lo == max_depth:
        stopped = f"reached the deepest try ({max_depth})"
    return {"largest_depth": lo or None, "smallest_failed_depth": hi, "exact": exact, "stopped": stopped,
            "tries": [tries[d] for d in sorted(tries)]}


LONG_SEARCH_S = 240.0  # seconds of a backend's search from which ours starts near the GPU's limit


def start_depth(margs: argparse.Namespace, backend: str, device_bytes: int) -> int:
    """The first try: ``max_model``'s guess of the backend's host bytes/param under the cap or, given the GPU's
    ``device_bytes``, for ours near its expected limit (its 16 bytes/param on the GPU first, most of the GPU, the
    rest for activations, then on the host): the larger a try, the longer it takes, and a GPU's take a minute."""
    if backend == "patrickstar" and device_bytes:
        params = (0.8 * device_bytes + 0.5 * margs.host_mem_gib * 2**30) / 16
    else:
        params = margs.host_mem_gib * 2**30 / max_model.GUESS_BYTES_PER_PARAM[backend]
    return max(1, int((params - margs.vocab * margs.width) // (12 * margs.width ** 2)))


def max_model_args(args, dry_device_bytes: int, logs: str) -> argparse.Namespace:
    dry = args.dry_run
    argv = ["--host-mem-gib", str(args.host_cap_gib if not dry else 4.0), "--width", str(args.max_width),
            "--heads", "16" if not dry else "2", "--vocab", "50304" if not dry else "256",
            "--seq-len", "64" if not dry else "16", "--steps", "2", "--max-depth", str(args.max_depth),
            "--logs", logs]
    if dry:
        argv += ["--device-budget", str(dry_device_bytes)]
    return max_model.parse_args(argv)


def run_max_model(ctx, args, deadline: float, dry_device_bytes: int, dry_stock_skip: str) -> dict:
    """Ours' search, then ZeRO-3 offload's (in a dry run: ours only, on the emulated accelerator), each with half
    of what is left; the tries' logs live as long as the part (a failed try keeps its tail)."""
    with tempfile.TemporaryDirectory(prefix="gpu_suite_") as logs:
        return _run_max_model(ctx, args, deadline, max_model_args(args, dry_device_bytes, logs), dry_stock_skip)


def _run_max_model(ctx, args, deadline: float, margs: argparse.Namespace, dry_stock_skip: str) -> dict:
    os.environ.update(ctx.child_env)  # max_model.attempt starts its tries with this process's environment
    out = {"status": "measured", "host_cap_gib": margs.host_mem_gib, "width": margs.width, "seq_len": margs.seq_len,
           "backends": {}}
    pairs = [("ours", "patrickstar")] + ([] if args.dry_run else [("zero3-offload", "zero3-offload")])
    for i, (name, backend) in enumerate(pairs):
        share = (deadline - time.monotonic()) / (len(pairs) - i)
        near_limit = ctx.cuda and share >= LONG_SEARCH_S  # a short search starts where a try surely ends in time
        start = start_depth(margs, backend, ctx.device_bytes if near_limit else 0)

        def try_depth(depth, timeout, backend=backend):
            margs.timeout = timeout
            got = max_model.attempt(margs, backend, 1, depth, margs.logs)
            kept = {k: got.get(k) for k in ("depth", "params", "ok", "why", "peak_host_bytes", "seconds",
                                            "step_times", "gpu_max_allocated")}
            if not got["ok"] and Path(got["log"]).exists():
                lines = [ln for ln in Path(got["log"]).read_text(errors="replace").splitlines() if ln.strip()]
                kept["log_tail"] = "\n".join(lines[-5:])[-1500:]
            return {**kept, "timed_out": (got.get("why") or "").startswith("timeout")}

        found = deadline_search(try_depth, start, margs.max_depth,
                                args.max_grow, time.monotonic() + share, args.min_trial_s)
        out["backends"][name] = found
        ctx.part_progress("max_model", out)
    if args.dry_run:
        out["backends"]["zero3-offload"] = {**skipped(dry_stock_skip), "tries": []}
    if not any(b["tries"] for b in out["backends"].values()):
        return {**out, **skipped("deadline: no try started")}
    return out
