#!/usr/bin/env python
"""What the host Adam running beside the compute does to the rest of the step: copy bandwidth and the driving
thread.

Why: on an H200 (docs/benchmarks.md, "Equal memory") ours' budget trials read 37-41 GB/s of pinned host-to-device
bandwidth where ZeRO-3 offload's and ours' everything-resident trial read 55, and at 24 GiB the forward took 75 ms
against 55 while 13 chunks' host Adam (39 ms of kernel time) ran beside it. Two suspects, measured apart here:

* **copies beside the host Adam**: host-to-device and device-to-host GB/s of a pinned buffer, from torch's pinned
  allocator (``pin_memory=True``) and from ds_patrickstar's host pool (``cudaHostRegister``, see [Note: pinned host
  memory]), alone and while the host Adam kernel (the one the step runs, on a worker thread as the overlapped step
  runs it) updates ``--adam-elements`` elements over and over;
* **the driving thread beside the host Adam**: the seconds of ``--launches`` small operations issued from the main
  thread (kernel launches on CUDA, small tensor operations on the CPU: a launch-bound forward's host side), alone
  and beside the host Adam with all the intra-op threads and with one fewer, and the Adam's elements/s in each.

Each figure is the median of ``--repeats`` runs. On a machine without CUDA only the second part runs (its CPU
figures say what two threads on these cores do, not what a GPU's host would).

    python benchmarks/bench_host_contention.py [--json out.json] [--adam-elements 67108864] [--launches 2000]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_utils as bu

bu.add_repo_to_path()
from ds_patrickstar.optim.adam_math import AdamHyper
from ds_patrickstar.optim.chunk_adam import adam_backend

HYPER = AdamHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, adamw=True)
PROBE_BYTES = 256 * 2**20


class HostAdam:
    """The host Adam kernel over ``elements`` elements, run again and again on a worker thread with ``threads``
    intra-op threads until stopped; counts the elements it updated."""

    def __init__(self, elements: int, threads: int) -> None:
        self.step = adam_backend(torch.device("cpu"))
        self.slot = torch.full((elements,), 1e-3, dtype=torch.bfloat16)
        self.states = [torch.zeros(elements) for _ in range(3)]
        self.threads, self.updated, self.seconds = threads, 0, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        torch.set_num_threads(self.threads)  # this thread's intra-op threads (the kernel asks for them)
        start = time.perf_counter()
        while not self._stop.is_set():
            self.step(self.slot, *self.states, step=1, hyper=HYPER, grad_scale=1.0)
            self.updated += self.slot.numel()
        self.seconds = time.perf_counter() - start

    def __enter__(self) -> HostAdam:
        self._thread.start()
        time.sleep(0.05)  # running before the timed work starts
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def rate(self) -> float:
        return self.updated / self.seconds if self.seconds else 0.0


def median_of(repeats: int, work) -> float:
    return statistics.median(work() for _ in range(repeats))


def copy_seconds(dst: torch.Tensor, src: torch.Tensor) -> float:
    """Seconds of one non-blocking copy, by CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    dst.copy_(src, non_blocking=True)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def bandwidth(host: torch.Tensor, device: torch.Tensor, repeats: int) -> dict[str, float]:
    copy_seconds(device, host)  # warm
    return {"h2d_GBps": host.numel() / median_of(repeats, lambda: copy_seconds(device, host)) / 1e9,
            "d2h_GBps": host.numel() / median_of(repeats, lambda: copy_seconds(host, device)) / 1e9}


def copies(args) -> dict:
    """GB/s both ways from torch's pinned memory and from the host pool, alone and beside the host Adam."""
    from ds_patrickstar.memory.cuda import CudaAccelerator

    accel = CudaAccelerator(torch.device("cuda"), budget=2**40)
    device = torch.empty(PROBE_BYTES, dtype=torch.uint8, device="cuda")
    buffers = {"torch pinned": torch.empty(PROBE_BYTES, dtype=torch.uint8, pin_memory=True),
               "host pool": accel.host_empty(PROBE_BYTES, torch.uint8)}
    rows = []
    for name, host in buffers.items():
        alone = bandwidth(host, device, args.repeats)
        with HostAdam(args.adam_elements, torch.get_num_threads()) as adam:
            beside = bandwidth(host, device, args.repeats)
        rows.append({"buffer": name, "alone": alone, "beside_host_adam": beside, "adam_elements_per_s": adam.rate})
    accel.host_free(buffers["host pool"])
    return {"probe_bytes": PROBE_BYTES, "rows": rows}


def launches_seconds(count: int, device: str) -> float:
    """Seconds for ``count`` small operations issued from this thread (synchronized at the end)."""
    x = torch.ones(256, device=device)
    start = time.perf_counter()
    for _ in range(count):
        x = x * 1.0001 + 1e-6
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def driving_thread(args, device: str) -> dict:
    """The main thread's small operations alone and beside the host Adam with all intra-op threads and one fewer."""
    launches_seconds(args.launches, device)  # warm
    alone = median_of(args.repeats, lambda: launches_seconds(args.launches, device))
    rows = [{"host_adam_threads": 0, "launch_s": alone, "adam_elements_per_s": 0.0, "slowdown": 1.0}]
    everyone = torch.get_num_threads()
    for threads in sorted({everyone, max(1, everyone - 1)}, reverse=True):
        with HostAdam(args.adam_elements, threads) as adam:
            beside = median_of(args.repeats, lambda: launches_seconds(args.launches, device))
        torch.set_num_threads(everyone)  # as it was, whatever the worker's setting did to this thread's
        rows.append({"host_adam_threads": threads, "launch_s": beside, "adam_elements_per_s": adam.rate,
                     "slowdown": beside / alone})
    return {"device": device, "launches": args.launches, "intra_op_threads": everyone, "rows": rows}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--adam-elements", type=int, default=1 << 26, help="elements the host Adam updates per call")
    parser.add_argument("--launches", type=int, default=2000, help="small operations the main thread issues")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    result = {"machine": torch.cuda.get_device_name() if cuda else "no CUDA", "cpu": bu.describe_cpu(),
              "torch": torch.__version__, "copies": copies(args) if cuda else None,
              "driving_thread": driving_thread(args, "cuda" if cuda else "cpu")}
    print(result["machine"], "|", result["cpu"])
    for row in (result["copies"] or {}).get("rows", []):
        print(f"{row['buffer']:>12}: H2D {row['alone']['h2d_GBps']:.1f} GB/s alone, "
              f"{row['beside_host_adam']['h2d_GBps']:.1f} beside the host Adam; D2H {row['alone']['d2h_GBps']:.1f}, "
              f"{row['beside_host_adam']['d2h_GBps']:.1f} (host Adam {row['adam_elements_per_s'] / 1e9:.2f}e9 el/s)")
    for row in result["driving_thread"]["rows"]:
        print(f"{args.launches} small ops on {result['driving_thread']['device']}, host Adam threads "
              f"{row['host_adam_threads']}: {row['launch_s'] * 1e3:.1f} ms ({row['slowdown']:.2f}x alone), host Adam "
              f"{row['adam_elements_per_s'] / 1e9:.2f}e9 el/s")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
