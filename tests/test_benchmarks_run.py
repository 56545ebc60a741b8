"""Benchmarks that drive the package's internals directly still run: the placement-overhead
benchmark builds the chunk manager, placement and the run state by hand (as no user does), so a
change of their signatures breaks it without any other test noticing. Tiny sizes, one process."""
from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_placement_overhead_benchmark_runs_at_a_tiny_size():
    done = subprocess.run(
        [sys.executable, "benchmarks/bench_placement_overhead.py", "--chunks", "64", "--fraction-chunks", "64",
         "--iters", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "us/moment" in done.stdout and "evict/it" in done.stdout, done.stdout[-2000:]
