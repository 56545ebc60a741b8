#!/usr/bin/env python
"""Micro-benchmark: Python bookkeeping of chunk placement per training iteration vs the number of chunks.

What it measures
    The real ds_patrickstar objects (ChunkManager, ChunkStore, PlacementRuntime with its Placer and
    MemoryTracer, on the strict EmulatedAccelerator) driven without a model and without DeepSpeed.
    Every chunk is tiny (``--chunk-elems`` fp32 elements, default 1024 = 4 KiB) and holds one
    parameter, so the bytes copied per move are negligible and the time measured is the Python
    bookkeeping of placement: moments, tensor-state moves, the ledger, the trace, Belady
    eviction, prefetch, and the emulated accelerator's copy queue. The accelerator budget holds
    only some of the chunks, so nearly every chunk brought in evicts one.

    One simulated iteration, as the hooks would drive it (see ds_patrickstar/integration/hook_target.py):
      * ``tracer.start_iteration(())``;
      * forward: moments ``fwd:m`` over the model in order, each ``manager.access`` of
        ``--per-moment`` consecutive chunks followed by ``manager.after_forward``;
      * backward: moments ``bwd:m`` in reverse order, each ``manager.access`` followed by
        ``manager.take_grad`` of every parameter of the moment (a zero gradient);
      * epilogue: ``manager.end_backward(boundary=True)`` and ``manager.finish_step()``
        (slots hold parameters again), as the optimizer would around its step. The optimizer
        step itself (Adam, optimizer-state placement) is not simulated.
    The first iteration traces (LRU eviction, no prefetch), a second one warms up with the
    trace (Belady eviction and prefetch active); the iterations after that are timed.

Two tables
    * fixed budget (``--chunks``, default 1,000 / 10,000 / 20,000 chunks, ``--budget-chunks``
      resident): the same number of resident chunks at every size, so any per-moment cost that
      grows here grows with *all* chunks (a scan of every chunk at a moment);
    * budget as a fraction of the model (``--fraction-chunks``, ``--budget-fraction``, default
      25%): the resident chunks grow with the model, as when a model twice as large runs on the
      same device with chunks half the size. Eviction picks its victims from a priority queue
      (O(log resident chunks) per victim), so this table should stay flat too.

How to read it
    ``us/moment`` is the bookkeeping per moment (access + after_forward or take_grad), split into
    ``victims``, the time choosing what to evict (``Placer.victims`` and ``Placer.victims_used_after``, the
    eviction queue, timed by wrapping them on the instance), and ``rest``. If a column is
    O(1) per moment it stays flat as the chunk count grows while ``ms/iter`` grows linearly (more
    moments). Under each table the ratio of the largest to the smallest chunk count is printed
    per column: ~1 means flat. ``epilogue ms`` is O(chunks) per iteration by nature (every tensor
    settles once). ``--profile`` prints the functions with the most own time in one more
    iteration at the largest count of each table.

    python benchmarks/bench_placement_overhead.py [--chunks 1000,10000,20000] [--budget-chunks 16]
        [--fraction-chunks 1000,10000] [--budget-fraction 0.25] [--iters 2] [--per-moment 4]
        [--profile] [--json out.json]
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import logging
import os
import platform
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from ds_patrickstar.chunks.chunk_map import ChunkMap
from ds_patrickstar.chunks.layout import plan_chunks
from ds_patrickstar.counters import StepCounters
from ds_patrickstar.groups.comm import ChunkComm
from ds_patrickstar.groups.manager import ChunkManager
from ds_patrickstar.integration.assembly import make_placement
from ds_patrickstar.integration.config import PatrickStarConfig
from ds_patrickstar.memory.emulated import EmulatedAccelerator
from ds_patrickstar.memory.reductions import InFlightReductions
from ds_patrickstar.run_state import RunState
from ds_patrickstar.store.binding import build_chunk_map
from ds_patrickstar.store.chunk_store import ChunkStore


def describe_machine() -> str:
    model = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo", encoding="ascii", errors="replace"):
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (f"CPU: {model}; {os.cpu_count()} logical cores; Python {platform.python_version()}; "
            f"torch {torch.__version__}")


class Setup:
    """The placement objects for ``n`` one-parameter chunks, and the moments of one iteration."""

    def __init__(self, n: int, elems: int, per_moment: int, budget_chunks: int) -> None:
        t0 = time.perf_counter()
        self.params = [torch.nn.Parameter(torch.zeros(elems)) for _ in range(n)]
        # One param group per parameter: the same chunks as one group of n parameters (each chunk is
        # full), but planning one group is first fit over every open chunk, O(n^2) (~1 min at 20,000).
        specs = plan_chunks([[(f"p{i}", p)] for i, p in enumerate(self.params)], elems, world_size=1)
        self.plan_s = time.perf_counter() - t0
        chunk_bytes = elems * 4
        self.budget = budget_chunks * chunk_bytes
        self.counters = StepCounters()
        accel = EmulatedAccelerator(self.budget)
        store = ChunkStore(accel, self.counters, movable=True)
        comm = ChunkComm(None, self.counters)
        chunk_map = build_chunk_map(ChunkMap(1, 0), specs, store, has_values=lambda p: True)
        options = PatrickStarConfig(emulate_accelerator=True, device_budget=self.budget, chunk_size=elems)
        reductions = InFlightReductions()
        self.run = RunState()  # moved here as the hooks and the optimizer move it (see [Note: run state])
        self.runtime = make_placement(options, accel, store, self.counters, chunk_map, reductions, False, self.run)
        self.manager = ChunkManager(chunk_map, comm, store, self.runtime, reductions, self.run, accumulate=False,
                                    keep_gathered=None, prefetch_groups=1)
        self.setup_s = time.perf_counter() - t0
        assert len(self.manager.map.chunks) == n, (len(self.manager.map.chunks), n)
        infos = [self.manager.map.info(p) for p in self.params]  # chunk i holds parameter i
        self.moments = [infos[i:i + per_moment] for i in range(0, n, per_moment)]
        self.grad = torch.zeros(elems)
        # Time spent choosing eviction victims (the eviction queue), by wrapping the two calls on this
        # instance (the library is not modified): for a moment's room, and for a prefetch's (most here).
        self.choose_s = 0.0
        self._time(self.runtime.placer, "victims")
        self._time(self.runtime.placer, "victims_used_after")

    def _time(self, obj, name: str) -> None:
        fn = getattr(obj, name)

        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.choose_s += time.perf_counter() - t0

        setattr(obj, name, timed)

    def iteration(self) -> tuple[float, float, float, dict[str, int]]:
        """One iteration: seconds in moments, of which choosing victims, seconds in the epilogue, and
        the counters of the iteration."""
        manager, grad = self.manager, self.grad
        self.counters.reset()
        self.choose_s = 0.0
        t0 = time.perf_counter()
        self.runtime.tracer.start_iteration(())
        with torch.enable_grad():  # a no-grad moment would not advance the trace
            self.run.start_forward(grad=True)
            for m, infos in enumerate(self.moments):
                manager.access(infos, f"fwd:{m}")
                manager.after_forward(infos)
            self.run.end_forward()
            self.run.backward_hook()
            for m in range(len(self.moments) - 1, -1, -1):
                infos = self.moments[m]
                manager.access(infos, f"bwd:{m}")
                for info in infos:
                    manager.take_grad(info, grad, boundary=True)
        t1 = time.perf_counter()
        choose_s = self.choose_s
        manager.end_backward(boundary=True)
        self.run.end_backward()
        self.run.start_step()
        manager.finish_step()
        self.run.end_step()
        t2 = time.perf_counter()
        return t1 - t0, choose_s, t2 - t1, self.counters.as_dict()


def run_one(n: int, budget_chunks: int, args: argparse.Namespace, profile: bool) -> dict:
    setup = Setup(n, args.chunk_elems, args.per_moment, budget_chunks)
    setup.iteration()  # traces
    assert setup.runtime.tracer.current_trace() is None  # still tracing until the next start_iteration
    gc.collect()
    setup.iteration()  # warm-up with the trace: Belady eviction and prefetch
    assert setup.runtime.tracer.current_trace() is not None, "the trace was not adopted"
    moments_s, choose_s, epilogue_s, totals, counters = [], [], [], [], None
    for _ in range(args.iters):
        gc.collect()
        ms, cs, es, counters = setup.iteration()
        moments_s.append(ms)
        choose_s.append(cs)
        epilogue_s.append(es)
        totals.append(ms + es)
    profile_text = None
    if profile:
        prof = cProfile.Profile()
        prof.enable()
        setup.iteration()
        prof.disable()
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(args.profile_top)
        profile_text = out.getvalue()
    moments = 2 * len(setup.moments)
    med_moments = statistics.median(moments_s)
    return {
        "chunks": n,
        "budget_chunks": budget_chunks,
        "moments": moments,
        "iter_ms": statistics.median(totals) * 1e3,
        "moments_ms": med_moments * 1e3,
        "epilogue_ms": statistics.median(epilogue_s) * 1e3,
        "us_per_moment": med_moments / moments * 1e6,
        "us_choose_per_moment": statistics.median(choose_s) / moments * 1e6,
        "us_rest_per_moment": statistics.median([m - c for m, c in zip(moments_s, choose_s)]) / moments * 1e6,
        "evictions": counters["evictions"],
        "prefetches": counters["prefetches"],
        "prefetch_hits": counters["prefetch_hits"],
        "setup_s": setup.setup_s,
        "plan_chunks_s": setup.plan_s,
        "iter_ms_all": [t * 1e3 for t in totals],
        "profile": profile_text,
    }


HEADER = (f"{'chunks':>7}{'resident':>9}{'moments':>8}{'ms/iter':>10}{'us/moment':>10}{'victims':>9}{'rest':>7}"
          f"{'epilogue ms':>12}"
          f"{'evict/it':>9}{'prefetch/it':>12}{'hits/it':>8}{'setup s':>8}")


def run_table(title: str, counts: list[int], budget_of, args: argparse.Namespace) -> dict:
    print(f"\n== {title}")
    print(HEADER)
    results = []
    for n in counts:
        r = run_one(n, budget_of(n), args, profile=args.profile and n == counts[-1])
        results.append(r)
        print(f"{r['chunks']:>7}{r['budget_chunks']:>9}{r['moments']:>8}{r['iter_ms']:>10.1f}"
              f"{r['us_per_moment']:>10.1f}{r['us_choose_per_moment']:>9.1f}{r['us_rest_per_moment']:>7.1f}"
              f"{r['epilogue_ms']:>12.1f}{r['evictions']:>9}{r['prefetches']:>12}"
              f"{r['prefetch_hits']:>8}{r['setup_s']:>8.1f}", flush=True)
    small, large = results[0], results[-1]
    ratios = {}
    if len(results) > 1:
        for key, what in (("us_per_moment", "us/moment"), ("us_choose_per_moment", "  victims"),
                          ("us_rest_per_moment", "     rest")):
            ratios[key] = growth = large[key] / small[key] if small[key] else float("nan")
            verdict = "flat: O(1) per moment" if growth < 1.5 else "GROWS with the chunk count"
            print(f"{what} at {large['chunks']} chunks / at {small['chunks']} chunks = {growth:5.2f}x  ({verdict})")
        epi = (large["epilogue_ms"] / large["chunks"]) / (small["epilogue_ms"] / small["chunks"])
        print(f"epilogue per chunk at {large['chunks']} / at {small['chunks']} chunks = {epi:.2f}x "
              f"(O(chunks) per iteration is expected there)")
    for r in results:
        text = r.pop("profile")
        if text:
            print(f"\ncProfile of one iteration at {r['chunks']} chunks (by own time):\n{text}", end="")
    return {"title": title, "ratio_largest_to_smallest": ratios, "results": results}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunks", default="1000,10000,20000",
                    help="comma list of chunk counts for the fixed-budget table ('' to skip it)")
    ap.add_argument("--budget-chunks", type=int, default=16,
                    help="fixed-budget table: accelerator budget in chunks, the same at every chunk count")
    ap.add_argument("--fraction-chunks", default="1000,10000",
                    help="comma list of chunk counts for the budget-fraction table ('' to skip it)")
    ap.add_argument("--budget-fraction", type=float, default=0.25,
                    help="budget-fraction table: accelerator budget as a fraction of all chunks")
    ap.add_argument("--iters", type=int, default=2, help="timed iterations per chunk count (median reported)")
    ap.add_argument("--per-moment", type=int, default=4, help="consecutive chunks used at each moment")
    ap.add_argument("--chunk-elems", type=int, default=1024, help="fp32 elements per chunk (= chunk_size)")
    ap.add_argument("--profile", action="store_true",
                    help="cProfile one more iteration at the largest count of each table")
    ap.add_argument("--profile-top", type=int, default=15)
    ap.add_argument("--json", default=None, help="also write the results to this path")
    args = ap.parse_args()

    def parse(text: str) -> list[int]:
        return sorted({int(c) for c in text.split(",") if c.strip()})

    counts, fraction_counts = parse(args.chunks), parse(args.fraction_chunks)
    smallest = min(counts + fraction_counts, default=0)
    if args.per_moment < 1 or args.iters < 1 or smallest < args.per_moment:
        ap.error("need --iters >= 1, --per-moment >= 1 and every chunk count >= --per-moment")
    if args.budget_chunks < 2 * args.per_moment:
        ap.error("--budget-chunks must hold at least two moments (2 * --per-moment chunks)")

    logging.disable(logging.INFO)  # the library logs a line per trace and per setup
    torch.set_num_threads(1)  # copies of 4 KiB: threads would only add noise
    print(describe_machine())
    print(f"chunks of {args.chunk_elems} fp32 elements ({args.chunk_elems * 4} B), one parameter each; "
          f"{args.per_moment} chunks per moment; emulated accelerator, world size 1, no activations")
    print("Data moved per chunk is tiny, so the times below are the Python bookkeeping of placement.")
    print(f"Per chunk count: trace iteration, warm-up iteration, then median of {args.iters} timed iterations.")
    tables = []
    if counts:
        tables.append(run_table(f"fixed budget of {args.budget_chunks} chunks: does per-moment cost grow with "
                                f"all chunks?", counts, lambda n: args.budget_chunks, args))
    if fraction_counts:
        tables.append(run_table(f"budget {args.budget_fraction:.0%} of the chunks: resident chunks grow with the "
                                f"model", fraction_counts,
                                lambda n: max(2 * args.per_moment, int(n * args.budget_fraction)), args))
    print("\nms/iter: forward + backward moments + epilogue (end_backward, finish_step), median; us/moment: the "
          "moments only, per moment, split into victims (choosing what to evict: "
          "Placer.victims and victims_used_after, the O(log resident chunks) eviction queue) and rest; "
          "resident: the budget in chunks; evict/prefetch/hits: StepCounters of one iteration; setup s: "
          "building the objects.")
    if not any(r["prefetches"] for t in tables for r in t["results"]):
        print("No prefetches: prefetch only fills free room (it never evicts), and with no activation tide the "
              "budget stays full once warm.")
    if args.json:
        payload = {"machine": describe_machine(), "args": vars(args), "tables": tables}
        Path(args.json).write_text(json.dumps(payload, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
