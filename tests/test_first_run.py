"""Issue 43: a first run on any CPU. The main job's dtype choice, this environment's JIT-build folder, and a
build lock no build will release reported with the fix (see [Note: JIT build folder]). No engine."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _benchmarks_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))


@pytest.fixture
def train_gpt():
    import train_gpt

    return train_gpt


@pytest.mark.parametrize("flags,native", [
    ("fpu avx2 avx512f avx512_vnni", False),  # this machine's kind: AMD EPYC, no avx512_bf16
    ("fpu avx2 avx512f avx512_bf16", True),
    ("fpu avx2 amx_bf16 amx_tile", True),
])
def test_native_bf16_from_cpu_flags(tmp_path, flags, native):
    import bench_utils

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
    has, why = bench_utils.cpu_native_bf16(str(cpuinfo))
    assert has is native and "CPU flags" in why


def test_native_bf16_measured_without_flags(tmp_path, monkeypatch):
    import bench_utils

    monkeypatch.setattr(bench_utils, "_bf16_matmul_ratio", lambda: 11.5)
    assert bench_utils.cpu_native_bf16(str(tmp_path / "missing")) == (False, "measured: a bf16 matmul takes 11.5x "
                                                                              "fp32's time")


def test_main_job_picks_fp32_on_a_cpu_without_native_bf16_and_says_so(train_gpt, caplog):
    bf16 = {"bf16": {"enabled": True}}
    with caplog.at_level(logging.INFO, logger="train_gpt"):
        assert train_gpt.pick_dtype(bf16, on_cuda=False, native=(False, "CPU flags have no avx512_bf16")) == "fp32"
    assert "fp32 instead of the config's bf16: this CPU has no native bf16 (CPU flags have no" in caplog.text
    assert train_gpt.pick_dtype(bf16, on_cuda=False, native=(True, "CPU flags list avx512_bf16")) is None
    assert train_gpt.pick_dtype(bf16, on_cuda=True) is None
    assert train_gpt.pick_dtype({"fp16": {"enabled": True}}, on_cuda=False, native=(False, "")) is None
    args = train_gpt.parse_args([])
    assert args.steps == (train_gpt.GPU_STEPS if train_gpt.torch.cuda.is_available() else train_gpt.CPU_STEPS)
    assert train_gpt.prepare_config(train_gpt.parse_args(["--dtype", "bf16"]))["bf16"]["enabled"]


def test_each_environment_gets_its_own_build_folder_unless_one_is_set():
    code = "import os, ds_patrickstar; print(os.environ['TORCH_EXTENSIONS_DIR'])"
    env = {k: v for k, v in os.environ.items() if k != "TORCH_EXTENSIONS_DIR"}
    env.update(PYTHONPATH=str(ROOT), DS_PATRICKSTAR_AUTOLOAD="0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    expected = os.path.join(sys.prefix, "torch_extensions") if os.access(sys.prefix, os.W_OK) else None
    if expected is None:
        pytest.skip(f"{sys.prefix} is not writable: torch's default folder is kept")
    assert out.stdout.strip().splitlines()[-1] == expected, out.stderr[-2000:]
    env["TORCH_EXTENSIONS_DIR"] = "/somewhere/else"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip().splitlines()[-1] == "/somewhere/else", out.stderr[-2000:]


def test_a_stale_build_lock_is_reported_with_the_file_and_the_fix(tmp_path, caplog):
    from ds_patrickstar.integration import jit_builds

    old = time.time() - 2 * jit_builds.STALE_AFTER_S
    stale = tmp_path / "cpu_adam" / "lock"
    fresh = tmp_path / "py311_cpu" / "fused_adam" / "lock"
    for lock, when in ((stale, old), (fresh, time.time())):
        lock.parent.mkdir(parents=True)
        lock.touch()
        os.utime(lock, (when, when))
    with caplog.at_level(logging.WARNING, logger="ds_patrickstar.integration.jit_builds"):
        assert jit_builds.report_stale_locks(str(tmp_path)) == [stale]
    assert f"JIT build lock {stale} is 20 minutes old" in caplog.text and f"(rm {stale})" in caplog.text
    os.utime(fresh, (old, old))  # old, but a process builds in its folder: not stale
    busy = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], cwd=fresh.parent)
    try:
        deadline = time.time() + 10
        while not any(p == fresh.parent for p in jit_builds._busy_folders()) and time.time() < deadline:
            time.sleep(0.1)
        assert jit_builds.stale_locks(str(tmp_path)) == [stale]
    finally:
        busy.kill()
        busy.wait()
