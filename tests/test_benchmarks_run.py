"""Benchmarks still run, at tiny sizes: the placement-overhead benchmark builds the chunk manager,
placement and the run state by hand (as no user does), so a change of their signatures breaks it
without any other test noticing; the LoRA benchmark drives ``max_model.py``'s tries and search
helpers with a model of its own; and every script at least imports."""
from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_placement_overhead_benchmark_runs_at_a_tiny_size(tmp_path):
    out = tmp_path / "overhead.json"
    done = subprocess.run(
        [sys.executable, "benchmarks/bench_placement_overhead.py", "--chunks", "64", "--fraction-chunks", "64",
         "--iters", "1", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "us/moment" in done.stdout and "evict/it" in done.stdout, done.stdout[-2000:]
    rows = [row for table in json.loads(out.read_text())["tables"] for row in table["results"]]
    assert rows and all(row["us_choose_per_moment"] > 0 for row in rows)  # the victims chosen are timed


def test_host_contention_benchmark_runs_at_a_tiny_size():
    """``bench_host_contention.py`` (its CUDA half needs a GPU): the host Adam beside the main thread's operations."""
    done = subprocess.run(
        [sys.executable, "benchmarks/bench_host_contention.py", "--adam-elements", "65536", "--launches", "50",
         "--repeats", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("small ops on") >= 2, done.stdout[-2000:]  # alone, beside (all threads, one fewer)


def test_lora_max_benchmark_trains_a_tiny_lora_gpt(tmp_path):
    """``lora_max.py`` at a tiny size: one try of ours in its own process, one row with the step time and the
    bytes read (the disk backends and the search are left to the large runs)."""
    done = subprocess.run(
        [sys.executable, "benchmarks/lora_max.py", "--backends", "patrickstar", "--fixed-depth", "1", "--width", "64",
         "--heads", "2", "--vocab", "256", "--rank", "4", "--seq-len", "8", "--steps", "2", "--logs", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    row = next(line for line in done.stdout.splitlines() if line.startswith("| patrickstar | 1 |"))
    assert "| trained |" in row, done.stdout[-2000:]


def test_every_benchmark_script_imports():
    """Each script's module-level imports resolve (one process: torch and DeepSpeed are imported once)."""
    script = (
        "import importlib.util, pathlib, sys\n"
        "sys.path[:0] = ['benchmarks', '.']\n"
        "for path in sorted(pathlib.Path('benchmarks').glob('*.py')):\n"
        "    spec = importlib.util.spec_from_file_location('benchmark_' + path.stem, path)\n"
        "    spec.loader.exec_module(importlib.util.module_from_spec(spec))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
