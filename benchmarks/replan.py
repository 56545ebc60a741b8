#!/usr/bin/env python
"""Plan again from a placement planner snapshot (``engine.planner_snapshot(path)``; the GPU suite writes one per
trial of ours under ``<out>/planner/``), on any machine: the run's choice beside the one its inputs give now, at
the snapshot's budget and profile or at others (see [Note: planner snapshot] in ds_patrickstar/placement/snapshot.py).

    python benchmarks/replan.py SNAPSHOT.json [SNAPSHOT.json ...]
    python benchmarks/replan.py SNAPSHOT.json --budget 0.75,1.5        # budgets as fractions of the snapshot's
    python benchmarks/replan.py SNAPSHOT.json --to-device-gbs 25 --host-adam-scale 0.5
    python benchmarks/replan.py SNAPSHOT.json --compute-scale 1,0.01,0.001   # the moments' compute times x each
    python benchmarks/replan.py SNAPSHOT.json --host-overlap step,backward   # the host Adam from the step, or begun
                                                                             # in backward (the snapshot's: run)

Each line: the states on the accelerator (of the candidates), the prefetch distance, the eviction order, the
predicted step and its parts (compute, transfers not hidden, optimizer), the bytes moved both ways. Host time
planning is printed too: the planner's own cost at that trace size on this machine.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import replace
from itertools import product

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ds_patrickstar.placement.eviction_queue import EvictionOrder
from ds_patrickstar.placement.snapshot import PlannerSnapshot, replan
from ds_patrickstar.placement.step_time import HostOverlap

OVERLAPS = {"run": None, "off": HostOverlap.OFF, "step": HostOverlap.FROM_STEP, "backward": HostOverlap.FROM_BACKWARD}


def describe(label: str, states: list[int], of: int, distance: int, order: int, step_s: float, moved: int) -> str:
    return (
        f"  {label:<40} {len(states):>4} of {of} states on the accelerator, {distance} ahead, "
        f"{EvictionOrder(order).label} order: predicted step {step_s * 1e3:.2f} ms, {moved:,} B moved"
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("snapshots", nargs="+")
    parser.add_argument("--budget", default="1", help="device budgets as fractions of the snapshot's, comma-separated")
    parser.add_argument("--to-device-gbs", type=float, default=None, help="host to device GB/s (and back)")
    parser.add_argument("--host-adam-scale", type=float, default=1.0, help="the host Adam's rate times this")
    parser.add_argument("--compute-scale", default="1", help="the moments' compute times times each of these, "
                        "comma-separated (a faster device: the copies and the host Adam hide less)")
    parser.add_argument("--host-overlap", default="run", help="when the host Adam runs, comma-separated: run (the "
                        "snapshot's), off (before step() returns), step (from the step), backward (begun in backward "
                        "where gradients leave, see [Note: host updates in backward])")
    args = parser.parse_args(argv)
    overlaps = [x for x in args.host_overlap.split(",") if x]
    if not overlaps or set(overlaps) - set(OVERLAPS):
        parser.error(f"--host-overlap {args.host_overlap!r}: comma-separated, of {', '.join(OVERLAPS)}")
    for path in args.snapshots:
        snapshot = PlannerSnapshot.read(path)
        profile = replace(
            snapshot.profile,
            host_adam_elements_per_s=snapshot.profile.host_adam_elements_per_s * args.host_adam_scale,
        )
        if args.to_device_gbs is not None:
            profile = replace(profile, to_device_bytes_per_s=args.to_device_gbs * 1e9,
                              to_host_bytes_per_s=args.to_device_gbs * 1e9)
        of, ran = len(snapshot.fill), snapshot.chosen
        print(f"{path}: {len(snapshot.moments)} moments, {len(snapshot.costs.sizes)} chunks, budget "
              f"{snapshot.budget:,} B, {of} candidates; measured compute {sum(snapshot.compute_s) * 1e3:.1f} ms")
        print(describe("the run chose", ran["on_device"], of, ran["distance"], ran["order"], ran["step_s"],
                       ran["moved"]))
        for fraction, scale, overlap in product((float(f) for f in args.budget.split(",")),
                                                (float(s) for s in args.compute_scale.split(",")), overlaps):
            budget = int(snapshot.budget * fraction)
            scaled = replace(snapshot, compute_s=tuple(t * scale for t in snapshot.compute_s))
            if OVERLAPS[overlap] is not None:
                scaled = replace(scaled, overlap=OVERLAPS[overlap])
            started = time.perf_counter()
            choice = replan(scaled, budget=budget, profile=profile)
            planned = time.perf_counter() - started
            step = choice.step
            label = f"planned at {budget:,} B" + (f", compute x{scale:g}" if scale != 1 else "")
            label += f", host Adam {overlap}" if overlap != "run" else ""
            print(describe(label, sorted(choice.on_device), of, choice.distance, int(choice.order), step.total_s,
                           choice.moved)
                  + f" (compute {step.compute_s * 1e3:.2f}, exposed {step.exposed_transfers_s * 1e3:.2f}, optimizer "
                    f"{step.optimizer_s * 1e3:.2f} ms; planned in {planned:.2f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
