"""benchmarks/gpu_suite.py cannot rot between GPU runs: its dry run (the same code on the strict emulated
accelerator, tiny sizes, one run shared by these tests) gives every part a row or a stated reason; two partial
runs merge into the table of one; a part cut by its deadline reads "cut" and a failing trial "failed" with its
error; the sizes follow the GPU's memory and a size the host cannot hold is a stated failure."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
import bench_harness
import gpu_suite
import gpu_suite_env
import gpu_suite_max_model
import gpu_suite_merge
import gpu_suite_parts as parts
import gpu_suite_report

PARTS = ("builds", "lora", "dynamic_padding", "throughput", "sweep", "gpu_tests", "max_model", "breakdown",
         "host_memory")
STATUSES = ("measured", "cut", "failed", "skipped")
DIST_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    # the dry run's trials load DeepSpeed's CPU Adam and shared-memory comm op and ours' CPU Adam: build them here
    # (a no-op when cached), so that no JIT build is timed against, or killed at, the dry run's deadlines
    from deepspeed.accelerator import get_accelerator
    from deepspeed.ops.op_builder import CPUAdamBuilder

    from ds_patrickstar.optim.kernels import adam_backend_name

    CPUAdamBuilder().load(verbose=False)
    shm = get_accelerator().create_op_builder("ShareMemCommBuilder")  # None where the accelerator is CUDA
    if shm is not None:
        shm.load(verbose=False)
    assert adam_backend_name("cpu") == "cpu_fused"
    out = tmp_path_factory.mktemp("gpu_suite")
    env = {k: v for k, v in os.environ.items() if k not in DIST_ENV}
    env["OMP_NUM_THREADS"] = "1"
    # 20 s of trials (the dry run's default is 70): every part still gets its row, a trial or so is measured
    cmd = [sys.executable, str(REPO / "benchmarks" / "gpu_suite.py"), "--dry-run", "--budget-s", "20",
           "--out", str(out)]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=150,
                          start_new_session=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out, json.loads((out / "gpu_suite.json").read_text())


def fake_suite(tmp_path, *argv) -> SimpleNamespace:
    """What the parts need of a ``gpu_suite.Suite``, without starting one."""
    args = gpu_suite.parse_args(["--dry-run", "--out", str(tmp_path), *argv])
    return SimpleNamespace(args=args, repo=REPO, cuda=False, device_bytes=parts.DRY_DEVICE_BYTES,
                           child_env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, part_progress=lambda *_: None)


def test_dry_run_gives_every_part_a_row_or_a_stated_reason(dry_run):
    out, result = dry_run
    for name in PARTS:
        part = result["parts"][name]
        assert part["status"] in STATUSES, (name, part)
        assert part["status"] == "measured" or part.get("reason") or part.get("error"), (name, part)
        for trial in part.get("trials", []):
            assert trial["status"] in STATUSES, (name, trial)
            if trial["status"] == "measured":
                assert trial["tokens_per_s"] > 0 and trial["timed_steps"] >= 5, (name, trial)
            else:
                assert trial.get("reason") or trial.get("error"), (name, trial)
    assert "no CUDA" in result["parts"]["gpu_tests"]["reason"]
    sizes = {(t["size"], t["backend"]) for t in result["parts"]["throughput"]["trials"]}
    assert {("0.5x", "ours"), ("1.5x", "ours"), ("3x", "ours"), ("0.5x", "zero3-offload")} <= sizes
    assert {t["point"] for t in result["parts"]["sweep"]["trials"]} == {"12 GiB", "16 GiB"}
    assert {(t["backend"], t["padding"]) for t in result["parts"]["dynamic_padding"]["trials"]} == {
        (b, p) for b in parts.OFFLOADED for p in ("fixed", "dynamic")}
    meta = result["meta"]
    assert all(key in meta for key in ("gpu", "driver", "torch", "deepspeed", "date", "command"))
    assert meta["dry_run"] and "--dry-run" in meta["command"]
    table = (out / "gpu_suite.md").read_text()
    assert "| model | params | layers x width | backend | status | step (ms) | spread | tokens/s |" in table
    assert "| point | backend | B (GiB) | status | tokens/s | ours / ZeRO-3 offload |" in table
    assert "6 * N" in table


def test_dry_run_numbers_are_sane_and_ratios_as_computed(dry_run):
    _, result = dry_run
    swept = [t for t in result["parts"]["sweep"]["trials"] if t["status"] == "measured" and t["backend"] == "ours"]
    for t in swept:  # where the host's time goes, one step under cProfile
        profile = t["host_profile"]
        assert profile["rows"] and 0 < profile["ds_patrickstar_own_s"] < profile["wall_s"]
    assert not swept or "**Host time of one step**" in gpu_suite_report.render(result)
    trials = result["parts"]["throughput"]["trials"]
    got = {(t["size"], t["backend"]): t for t in trials if t["status"] == "measured"}
    for t in got.values():
        assert math.isclose(t["tokens_per_s"], t["batch"] * t["seq_len"] / t["step_s"])
        assert t["step_min_s"] <= t["step_s"] <= t["step_max_s"] and t["spread"] >= 0
        assert t["warmup_steps"] >= 2 and len(t["records"]) == t["timed_steps"]
        assert t["overrides"]["activation_checkpointing"] and (t["predicted_step_s"] or 0) >= 0
    if ("0.5x", "ours") in got:
        assert got[("0.5x", "ours")]["emulated"] and got[("0.5x", "ours")]["records"][-1]["counters"]
    skipped = [t for t in trials if t["backend"] == "zero3" and t["size"] != "0.5x"]
    assert skipped and all("does not fit" in t["reason"] for t in skipped), skipped
    for row in result["parts"]["throughput"]["ratios"]:
        ours, stock = got.get((row["size"], "ours")), got.get((row["size"], "zero3-offload"))
        if ours and stock:
            assert math.isclose(row["ours_over_zero3_offload"], ours["tokens_per_s"] / stock["tokens_per_s"])
    for row in result["parts"].get("breakdown", {}).get("rows", []):
        assert row["adam_s"] > 0  # the Adam clock found each engine's Adam


def test_dry_run_keeps_each_trials_planner_snapshot_to_plan_again(dry_run):
    """Each measured sweep trial of ours wrote its placement planner's last thorough plan under ``<out>/planner/``
    (see [Note: planner snapshot]), so a GPU run's traces and times come back to be planned again on a CPU: planned
    again here from the file, the choice the trial made."""
    from ds_patrickstar.placement.snapshot import PlannerSnapshot, chosen, replan

    out, result = dry_run
    swept = [t for t in result["parts"]["sweep"]["trials"] if t["status"] == "measured" and t["backend"] == "ours"]
    written = [t["planner_snapshot"] for t in swept if not str(t["planner_snapshot"]).startswith("none")]
    assert written or not swept, swept
    for path in written:
        assert Path(path).parent == out / "planner", path
        snapshot = PlannerSnapshot.read(path)
        assert chosen(replan(snapshot)) == snapshot.chosen, path


def test_sizes_follow_the_gpu_memory_and_the_host_says_what_it_cannot_hold(tmp_path, monkeypatch):
    monkeypatch.setattr(parts.psutil, "virtual_memory", lambda: SimpleNamespace(available=500 * 2**30))
    ctx = fake_suite(tmp_path)
    ctx.args.dry_run, ctx.device_bytes = False, 85_000_000_000  # an H100's 79 GiB
    sizes = parts.model_sizes(ctx, ctx.args)
    for fraction, (name, preset, overrides) in zip((0.5, 1.5, 3.0), sizes):
        data = parts.OURS_BYTES_PER_PARAM * parts.params_of(preset, overrides)
        assert name == f"{fraction:g}x" and abs(data / ctx.device_bytes - fraction) < 0.1 * fraction, (name, data)
    huge = parts.host_shortfall(ctx, "zero3-offload", 30 * 10**9)  # 540 GB on the host
    assert huge.startswith("failed: host memory") and "before launching" in huge
    assert parts.host_shortfall(ctx, "ours", 10**6) is None
    gib = bench_harness.GIB
    assert parts.sweep_size(ctx, ctx.args)[0] == "0.5x"  # 42 GB of model data past the largest point's 16 GiB
    plan = parts.sweep_plan(ctx, ctx.args)
    stock = next(argv for head, argv in plan if head["backend"] == "zero3-offload" and head["point"] == "12 GiB")
    assert math.isclose(float(stock[stock.index("--memory-fraction") + 1]), 12 * gib / ctx.device_bytes, rel_tol=1e-5)
    ours = {head["rule"]: argv for head, argv in plan if head["backend"] == "ours" and head["point"] == "12 GiB"}
    assert {rule: argv[argv.index("--optimizer-placement") + 1] for rule, argv in ours.items()} == {
        "time": "time", "fill": "fill"}  # a row per optimizer_placement rule, the step-time model's beside fill's


def test_a_preset_sweep_at_absolute_budgets_and_parts_with_fixed_seconds(tmp_path, monkeypatch):
    ctx = fake_suite(tmp_path, "--sweep-model", "gpt-1.3b", "--sweep-absolute", "--sweep-points", "12/off",
                     "--part-seconds", "sweep=50")
    ctx.args.dry_run, ctx.device_bytes = False, 150_000_000_000  # an H200: the 12 GiB stay 12 GiB
    # and its host (126 GiB), not this machine's available memory, which decides whether a trial launches
    monkeypatch.setattr(parts.psutil, "virtual_memory", lambda: SimpleNamespace(available=126 * bench_harness.GIB))
    head, argv = next((h, a) for h, a in parts.sweep_plan(ctx, ctx.args) if h["backend"] == "ours")
    assert head["size"] == "gpt-1.3b" and head["budget_bytes"] == 12 * bench_harness.GIB
    assert argv[argv.index("--model") + 1] == "gpt-1.3b" and '{"activation_checkpointing": false}' in argv
    budget = gpu_suite_env.Budget(100.0)
    shares = {"builds": 1.0, "sweep": 1.0, "gpu_tests": 1.0}
    fixed = {"builds": 20.0, "gpu_tests": 30.0}
    assert 19 < budget.deadline(shares, "builds", fixed) - time.monotonic() <= 20  # its own seconds
    assert 69 < budget.deadline(shares, "sweep", fixed) - time.monotonic() <= 70  # what gpu_tests' 30 s leave
    with pytest.raises(SystemExit):
        gpu_suite.parse_args(["--out", str(tmp_path), "--parts", "sweep", "--part-seconds", "builds=5"])


def test_warm_up_runs_until_the_step_time_settles():
    times = iter([3.0, 2.0, 1.0, 1.05, 1.0, 1.2, 0.9, 1.0, 1.1])
    warm, timed = bench_harness.timed_steps(lambda i: {"wall_s": next(times)}, "auto", 5, max_warmup=6)
    assert [r["wall_s"] for r in warm] == [3.0, 2.0, 1.0, 1.05] and len(timed) == 5
    summary = bench_harness.steady_summary([r["wall_s"] for r in warm], [r["wall_s"] for r in timed])
    assert summary["step_s"] == 1.0 and math.isclose(summary["first_steps_extra_s"], 7.05 - 4.0)
    assert math.isclose(summary["spread"], 0.3)
    warm, _ = bench_harness.timed_steps(lambda i: {"wall_s": 1.0}, 3, 5)
    assert len(warm) == 3


def test_two_partial_runs_merge_into_the_table_of_one_run(dry_run, tmp_path):
    _, full = dry_run
    first = {"lora", "dynamic_padding", "throughput"}
    halves = []
    for mine in (first, set(gpu_suite.SHARES) - first):
        half = json.loads(json.dumps(full))
        for name in gpu_suite.SHARES:
            if name not in mine:
                half["parts"][name] = {"status": "skipped", "reason": gpu_suite_merge.NOT_AMONG}
        path = tmp_path / f"half{len(halves)}.json"
        path.write_text(json.dumps(half))
        halves.append(path)
    gpu_suite.main(["--merge", *map(str, halves), "--out", str(tmp_path / "merged")])
    merged = json.loads((tmp_path / "merged" / "gpu_suite.json").read_text())
    assert len(merged["meta"]["merged_from"]) == 2

    def tables(result):
        return gpu_suite_report.render(result).split("**Parts.**")[1]

    assert tables(merged) == tables(full)


def test_a_merge_keeps_each_rule_of_a_sweep_point():
    def trial(rule, status, tokens=None):
        return {"size": "m", "point": "12 GiB", "backend": "ours", "rule": rule, "status": status,
                **({"tokens_per_s": tokens} if tokens else {"reason": "r"})}

    old = {"status": "measured", "trials": [trial("time", "measured", 2.0), trial("fill", "failed")]}
    new = {"status": "measured", "trials": [trial("time", "measured", 3.0)]}
    merged = gpu_suite_merge.merge_part("sweep", old, new)
    assert {(t["rule"], t["status"], t.get("tokens_per_s")) for t in merged["trials"]} == {
        ("time", "measured", 3.0), ("fill", "failed", None)}


def test_a_part_cut_by_its_deadline_reads_cut(tmp_path):
    ctx = fake_suite(tmp_path)
    part = parts.run_sweep(ctx, ctx.args, time.monotonic() - 1)
    assert part["status"] == "cut" and "deadline" in part["reason"]
    assert {t["status"] for t in part["trials"]} == {"cut", "skipped"}
    text = gpu_suite_report.render({"meta": fake_meta(), "flops": "", "parts": {"sweep": part}})
    assert "| equal memory | cut |" in text and "| 12 GiB | ours |" in text and "| cut | deadline" in text
    ctx = fake_suite(tmp_path, "--backends", "zero3-offload")  # a call of other backends: ours' rows say so
    part = parts.run_sweep(ctx, ctx.args, time.monotonic() - 1)
    assert all("not among --backends" in t["reason"] for t in part["trials"] if t["backend"] == "ours")


def test_a_failing_trial_reads_failed_with_its_error(tmp_path, monkeypatch):
    script = tmp_path / "trial.py"
    script.write_text("raise RuntimeError('DeviceBudgetExceeded: 12.3 GiB past the budget')\n")
    monkeypatch.setattr(parts, "TRIAL", script)
    ctx = fake_suite(tmp_path)
    head = {"size": "0.5x", "point": "12 GiB", "backend": "ours", "budget_bytes": 2**30, "params": 10**6}
    part = parts.run_plan(ctx, "sweep", [(head, [])], time.monotonic() + 60)
    trial = part["trials"][0]
    assert part["status"] == "failed" and trial["status"] == "failed"
    assert trial["error"].endswith("RuntimeError: DeviceBudgetExceeded: 12.3 GiB past the budget"), trial
    text = gpu_suite_report.render({"meta": fake_meta(), "flops": "", "parts": {"sweep": part}})
    assert "| 12 GiB | ours | 1 | failed | exit 1: RuntimeError: DeviceBudgetExceeded" in text


def fake_meta() -> dict:
    return {"gpu": "g", "torch": "t", "python": "p", "cpus": 1, "host_memory_bytes": 2**30, "date": "d",
            "budget_s": 1.0, "command": "c", "dry_run": True}


def test_ratios_are_ours_over_stock_and_offloaded_over_no_offload():
    def trial(backend, tokens_per_s, status="measured"):
        return {"size": "m", "backend": backend, "status": status, "tokens_per_s": tokens_per_s}

    rows = parts.ratios([trial("ours", 300.0), trial("zero3-offload", 100.0), trial("zero3", 400.0)])
    assert rows == [{"size": "m", "ours_over_zero3_offload": 3.0,
                     "practicality": {"ours": 0.75, "zero3-offload": 0.25}}]
    rows = parts.ratios([trial("ours", 300.0), trial("zero3-offload", 0.0, "failed")])
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
    result["parts"]["gpu_tests"] = {"status": "cut", "outcome": "timed out after 97 s", "passed": 226,
                                    "failures": 0, "errors": 0, "skipped": 0, "seconds_used": 97.0,
                                    "deadline_s": 97.0}
    ours = next((t for t in result["parts"]["throughput"]["trials"] if t["status"] == "measured"), None)
    if ours is None:
        pytest.skip("no throughput trial was measured in the dry run's time here")
    ours["pinned"] = {"h2d_bytes_per_s": 2e10, "d2h_bytes_per_s": 1e10}
    ours["host"]["cuda_host_memory_stats"] = {"allocated_bytes.current": 2**30, "allocated_bytes.peak": 2**31}
    ours["records"][-1]["counters"].update(bytes_to_device=4 * 10**9, bytes_to_host=10**9)
    result["parts"].update(gpu_suite_report.derived_parts(result["parts"]))
    text = gpu_suite_report.render(result)
    assert "NVIDIA H100 80GB HBM3 (80 GiB), driver 580.1" in text
    assert "| GPU tests (`pytest -m gpu`) | cut | 97 (97) | timed out after 97 s: 226 passed" in text
    assert "| 300.0 |" in text  # 4 GB at 20 GB/s + 1 GB at 10 GB/s, in ms
    assert "| 1.000 | 2.000 |" in text and "Dry run" not in text


def test_the_builds_name_what_exists():
    """The GPU-only builds part imports by name: a module moved or renamed fails here, not on a lent GPU."""
    import importlib
    import re

    for op, code in gpu_suite.BUILDS.items():
        module, name = re.match(r"from (\S+) import (\w+)", code).groups()
        assert hasattr(importlib.import_module(module), name), op


def test_the_builds_are_those_the_run_loads():
    """A run of ours alone does not build DeepSpeed's ops (on an H200 their build took the deadline of ours'),
    one of ZeRO-3 offload alone not ours'; ``pytest -m gpu`` loads both."""
    assert gpu_suite.needed_builds(["ours"], ["builds", "sweep"]) == ["ours cuda", "ours cpu"]
    assert gpu_suite.needed_builds(["zero3-offload"], ["builds", "sweep"]) == ["deepspeed cpu_adam",
                                                                             "deepspeed fused_adam"]
    assert gpu_suite.needed_builds(["ours"], ["builds", "gpu_tests"]) == list(gpu_suite.BUILDS)


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
    ours, stock = (next(t for t in result["parts"]["lora"]["trials"] if t["backend"] == b) for b in parts.OFFLOADED)
    assert stock["status"] == "skipped" and stock["reason"]
    if ours["status"] == "cut":  # the dry run's share of a busy machine
        pytest.skip(f"the LoRA trial ran out of the dry run's time here: {ours}")
    assert ours["status"] == "measured", ours
    assert ours["lora"] == 4 and ours["trainable_params"] < ours["params"] / 5
    counters = ours["records"][-1]["counters"]
    assert counters["frozen_bytes_device"] + counters["frozen_bytes_host"] > parts.DRY_LORA["budget"]
    assert ours["losses"] and all(math.isfinite(x) for x in ours["losses"])


def test_clip_reaches_every_trials_config(tmp_path):
    """``--clip 0`` (no clipping, so that ours' host updates begin in backward) reaches both backends' configs."""
    import gpu_suite_trial

    args = fake_suite(tmp_path, "--clip", "0").args
    for backend in ("ours", "zero3-offload"):
        argv = parts.trial_argv(args, backend, "tiny", {})
        assert argv[argv.index("--clip") + 1] == "0.0"
        trial = gpu_suite_trial.parse_args([*argv, "--json", str(tmp_path / "t.json")])
        assert gpu_suite_trial.trial_config(trial, cuda=False)["gradient_clipping"] == 0.0
    assert "--clip" not in parts.trial_argv(fake_suite(tmp_path).args, "ours", "tiny", {})
