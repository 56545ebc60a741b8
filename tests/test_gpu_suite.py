"""benchmarks/gpu_suite.py cannot rot between GPU runs: its dry run (the same code on the strict emulated
accelerator, tiny sizes) writes a JSON where every part is measured or skipped with a reason, a Markdown table,
sane numbers and ratios as computed; its search stops at its deadline; --to-docs rewrites the docs section."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
import gpu_suite
import gpu_suite_max_model
import gpu_suite_report

PARTS = ("builds", "gpu_tests", "throughput", "max_model", "breakdown", "host_memory", "dynamic_padding", "lora")
DIST_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    # stock ZeRO-3 offload's trial loads DeepSpeed's CPU Adam: build it here (a no-op when cached) so that a
    # fresh TORCH_EXTENSIONS_DIR's JIT build is not timed against the dry run's deadline
    from deepspeed.ops.op_builder import CPUAdamBuilder

    CPUAdamBuilder().load(verbose=False)
    out = tmp_path_factory.mktemp("gpu_suite")
    env = {k: v for k, v in os.environ.items() if k not in DIST_ENV}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, str(REPO / "benchmarks" / "gpu_suite.py"), "--dry-run", "--budget-s", "90", "--out",
           str(out)]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=150,
                          start_new_session=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out, json.loads((out / "gpu_suite.json").read_text())


def test_dry_run_measures_or_skips_every_part_with_a_reason(dry_run):
    out, result = dry_run
    for name in PARTS:
        part = result["parts"][name]
        assert part["status"] in ("measured", "skipped"), (name, part)
        if part["status"] == "skipped":
            assert part["reason"], name
    assert "no CUDA" in result["parts"]["gpu_tests"]["reason"]
    assert result["not_run"] == []
    padding = {(t["backend"], t["padding"]): t for t in result["parts"]["dynamic_padding"]["trials"]}
    for trial in padding.values():  # measured, or not with the reason (the deadline on a busy machine)
        assert trial["tokens_per_s"] > 0 if trial["status"] == "measured" else trial.get("reason") or trial["error"]
    assert padding[("zero3-offload", "dynamic")]["status"] == "skipped"
    assert all(r["reason"] == "not run: feature not built" for r in result["not_run"])
    meta = result["meta"]
    for key in ("gpu", "driver", "torch", "deepspeed", "date", "command"):
        assert key in meta, key
    assert meta["dry_run"] and "--dry-run" in meta["command"]
    table = (out / "gpu_suite.md").read_text()
    assert "| model | params | backend | step (ms) | tokens/s | TFLOPS |" in table
    assert "6 * N" in table


def test_dry_run_numbers_are_sane_and_ratios_as_computed(dry_run):
    _, result = dry_run
    trials = result["parts"]["throughput"]["trials"]
    for t in trials:
        assert t["status"] in ("measured", "skipped", "failed"), t
        assert t["status"] == "measured" or t.get("reason") or t.get("error"), t
    got = {(t["size"], t["backend"]): t for t in trials if t["status"] == "measured"}
    assert ("dry-s", "ours") in got and ("dry-s", "zero3-offload") in got, [
        (t["size"], t["backend"], t["status"], t.get("reason") or t.get("error")) for t in trials]
    for t in got.values():
        assert t["tokens_per_s"] > 0 and t["step_s"] > 0 and t["tflops"] > 0
        assert math.isclose(t["tokens_per_s"], t["batch"] * t["seq_len"] / t["step_s"])
    assert got[("dry-s", "ours")]["emulated"] and got[("dry-s", "ours")]["records"][-1]["counters"]
    # ZeRO-3 without offload fits the dry run's pretend GPU (1 MB) at the smallest size only
    skipped = [t for t in trials if t["backend"] == "zero3" and t["size"] != "dry-s"]
    assert skipped and all("does not fit" in t["reason"] for t in skipped), skipped
    for row in result["parts"]["throughput"]["ratios"]:
        ours, stock = got.get((row["size"], "ours")), got.get((row["size"], "zero3-offload"))
        if ours and stock:
            assert math.isclose(row["ours_over_zero3_offload"], ours["tokens_per_s"] / stock["tokens_per_s"])
        for backend, ratio in row["practicality"].items():
            base = got[(row["size"], "zero3")]["tokens_per_s"]
            assert math.isclose(ratio, got[(row["size"], backend)]["tokens_per_s"] / base)
    breakdown = result["parts"]["breakdown"]["rows"]
    assert any(r["backend"] == "ours" and r["adam_chunks_host"] + r["adam_chunks_device"] > 0 for r in breakdown)
    assert all(r["adam_s"] > 0 for r in breakdown), breakdown  # the Adam clock found each engine's Adam
    host = result["parts"]["host_memory"]["rows"]
    assert all(r["rss_bytes"] > 0 for r in host)


def test_ratios_are_ours_over_stock_and_offloaded_over_no_offload():
    def trial(backend, tokens_per_s, status="measured"):
        return {"size": "m", "backend": backend, "status": status, "tokens_per_s": tokens_per_s}

    rows = gpu_suite.ratios([trial("ours", 300.0), trial("zero3-offload", 100.0), trial("zero3", 400.0)])
    assert rows == [{"size": "m", "ours_over_zero3_offload": 3.0,
                     "practicality": {"ours": 0.75, "zero3-offload": 0.25}}]
    rows = gpu_suite.ratios([trial("ours", 300.0), trial("zero3-offload", 0.0, "failed")])
    assert rows[0]["ours_over_zero3_offload"] is None and rows[0]["practicality"] == {}


def test_to_docs_rewrites_only_the_marked_section(dry_run, tmp_path):
    out, _ = dry_run
    docs = tmp_path / "benchmarks.md"
    docs.write_text(f"# head\n\n{gpu_suite_report.BEGIN}\nOLD-TABLE\n{gpu_suite_report.END}\n\n## after\n")
    gpu_suite.main(["--to-docs", str(out / "gpu_suite.json"), "--docs", str(docs)])
    text = docs.read_text()
    assert text.startswith("# head\n") and text.endswith("\n## after\n") and "OLD-TABLE" not in text
    assert (out / "gpu_suite.md").read_text() in text
    assert gpu_suite_report.BEGIN in (REPO / "docs" / "benchmarks.md").read_text()


def test_the_tables_render_what_only_a_gpu_fills_in(dry_run):
    """The fields a dry run leaves empty (GPU, driver, pinned bandwidth, the CUDA host allocator, GPU tests)."""
    _, result = dry_run
    result = json.loads(json.dumps(result))
    result["meta"].update(gpu="NVIDIA H100 80GB HBM3", gpu_memory_bytes=80 * 2**30, driver="580.1", dry_run=False)
    result["parts"]["gpu_tests"] = {"status": "measured", "outcome": "exit 1", "passed": 3, "failures": 1,
                                    "errors": 0, "skipped": 0, "seconds_used": 50.0, "deadline_s": 100.0}
    ours = next(t for t in result["parts"]["throughput"]["trials"] if t["status"] == "measured")
    ours["pinned"] = {"h2d_bytes_per_s": 2e10, "d2h_bytes_per_s": 1e10}
    ours["host"]["cuda_host_memory_stats"] = {"allocated_bytes.current": 2**30, "allocated_bytes.peak": 2**31}
    ours["records"][-1]["counters"].update(bytes_to_device=4 * 10**9, bytes_to_host=10**9)
    result["parts"].update(gpu_suite_report.derived_parts(result["parts"]))
    text = gpu_suite_report.render(result)
    assert "NVIDIA H100 80GB HBM3 (80 GiB), driver 580.1" in text and "exit 1: 3 passed, 1 failures" in text
    assert "| 300.0 |" in text  # 4 GB at 20 GB/s + 1 GB at 10 GB/s, in ms
    assert "| 1.000 | 2.000 |" in text and "Dry run" not in text


def test_the_builds_name_what_exists():
    """The GPU-only builds part imports by name: a module moved or renamed fails here, not on a lent GPU."""
    import importlib
    import re

    for op, code in gpu_suite.BUILDS.items():
        module, name = re.match(r"from (\S+) import (\w+)", code).groups()
        assert hasattr(importlib.import_module(module), name), op


def test_search_brackets_the_largest_depth_and_stops_at_its_deadline():
    def fits_seven(depth, timeout):
        return {"depth": depth, "ok": depth <= 7}

    found = gpu_suite_max_model.deadline_search(fits_seven, 3, 96, 1.5, time.monotonic() + 60, 0.0)
    assert (found["largest_depth"], found["smallest_failed_depth"], found["exact"]) == (7, 8, True)
    found = gpu_suite_max_model.deadline_search(fits_seven, 20, 96, 1.5, time.monotonic() + 60, 0.0)
    assert (found["largest_depth"], found["exact"]) == (7, True)

    def slow(depth, timeout):
        time.sleep(0.05)
        return {"depth": depth, "ok": True}

    found = gpu_suite_max_model.deadline_search(slow, 1, 96, 2.0, time.monotonic() + 0.12, 0.01)
    assert 1 <= len(found["tries"]) <= 3 and not found["exact"] and found["stopped"].startswith("deadline")


def test_dry_run_trains_lora_on_a_base_larger_than_the_device(dry_run):
    """The LoRA part: ours trains adapters beside a frozen base whose chunks exceed the (emulated) device
    budget; stock ZeRO-3's trial is skipped in the dry run with its reason."""
    _, result = dry_run
    part = result["parts"]["lora"]
    ours, stock = (next(t for t in part["trials"] if t["backend"] == b) for b in ("ours", "zero3-offload"))
    assert stock["status"] == "skipped" and stock["reason"]
    out_of_time = ours.get("reason", "").startswith("deadline") or "timed out" in ours.get("error", "")
    if ours["status"] != "measured" and out_of_time:  # the last part gets what the others left
        pytest.skip(f"the LoRA trial ran out of the dry run's time here: {ours}")
    assert part["status"] == "measured", part
    assert ours["status"] == "measured" and ours["lora"] == 4 and ours["trainable_params"] < ours["params"] / 5
    counters = ours["records"][-1]["counters"]
    assert counters["frozen_bytes_device"] + counters["frozen_bytes_host"] > gpu_suite.DRY_LORA["budget"]
    assert ours["losses"] and all(math.isfinite(x) for x in ours["losses"])
