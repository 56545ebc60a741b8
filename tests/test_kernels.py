"""Fused chunk Adam kernels (CPU) vs the reference math, plus the fallback paths.

The CPU kernel is JIT-built once per session (~45 s on 2 cores, then cached on
disk). Every kernel result is compared with ``adam_step_reference`` evaluated in
float64 on the same inputs; tolerances are stated next to each check.

Set ``DS_PATRICKSTAR_TEST_ALL_ISAS=1`` to also build and check the AVX2 and the
scalar variants of the CPU kernel (two more builds, ~90 s).
"""
from __future__ import annotations

import fcntl
import logging
import os
import shutil
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

from ds_patrickstar.optim import kernels
from ds_patrickstar.optim.adam_math import AdamHyper, adam_step_reference

# Master/exp_avg/exp_avg_sq of the fp32 kernel vs the float64 reference, one step:
# |kernel - ref| <= ATOL + RTOL * |ref|. fp32 has a 6e-8 unit roundoff; the update
# term adds a few roundings of lr*m/denom on top of it.
RTOL, ATOL = 2e-6, 1e-7
# 20 steps vs torch.optim.AdamW/Adam in fp32 (both fp32, different op order).
STEPS_RTOL, STEPS_ATOL = 1e-5, 2e-6


@pytest.fixture(scope="module", autouse=True)
def two_threads():
    """The kernel's tests run on two threads (the session runs on one, tests/harness.py), so its
    parallel split is what they check."""
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(saved)


@pytest.fixture(scope="module")
def cpu_step():
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler on PATH: the fused CPU kernel cannot be built")
    os.environ.pop(kernels.FORCE_TORCH_ENV, None)
    step = kernels.get_adam_backend(torch.device("cpu"))
    assert kernels.adam_backend_name("cpu") == "cpu_fused", "the CPU kernel failed to build (see the warning)"
    return step


def make_inputs(n, lp_dtype, seed, *, grad_mult=1.0, device="cpu", offset=0):
    """Fresh random (param_lp holding the grad, master, exp_avg, exp_avg_sq); ``offset`` shifts
    every buffer by that many elements inside a larger allocation (an unaligned chunk slice)."""
    gen = torch.Generator().manual_seed(seed)

    def buf(values, dtype):
        big = torch.zeros(n + offset + 3, dtype=dtype, device=device)
        view = big[offset:offset + n]
        view.copy_(values)
        return view

    grad = torch.randn(n, generator=gen) * grad_mult
    master = torch.randn(n, generator=gen)
    exp_avg = torch.randn(n, generator=gen) * 0.1
    exp_avg_sq = torch.rand(n, generator=gen) * 0.01
    return (buf(grad, lp_dtype), buf(master, torch.float32), buf(exp_avg, torch.float32),
            buf(exp_avg_sq, torch.float32))


def check_against_reference(step_fn, n, lp_dtype, hyper, *, step, grad_scale, grad_mult=1.0, seed=0,
                            device="cpu", offset=0):
    bufs = make_inputs(n, lp_dtype, seed, grad_mult=grad_mult, device=device, offset=offset)
    ref = [t.detach().to("cpu", torch.float64).clone() for t in bufs]
    step_fn(*bufs, step=step, hyper=hyper, grad_scale=grad_scale)
    adam_step_reference(*ref, step=step, hyper=hyper, grad_scale=grad_scale)
    lp, master, exp_avg, exp_avg_sq = (t.cpu() for t in bufs)
    for name, got, want in (("master", master, ref[1]), ("exp_avg", exp_avg, ref[2]),
                            ("exp_avg_sq", exp_avg_sq, ref[3])):
        torch.testing.assert_close(got.double(), want, rtol=RTOL, atol=ATOL, msg=lambda m, name=name: f"{name}: {m}")
    # The low-precision param is exactly the new master rounded to nearest even.
    assert torch.equal(lp, master.to(lp_dtype))
    return bufs


HYPERS = [
    AdamHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=wd, adamw=adamw, bias_correction=bc)
    for adamw in (True, False) for wd in (0.0, 0.1) for bc in (True, False)
]


def hyper_id(h):
    return f"{'adamw' if h.adamw else 'adam'}-wd{h.weight_decay}-{'bc' if h.bias_correction else 'nobc'}"


@pytest.mark.parametrize("hyper", HYPERS, ids=hyper_id)
@pytest.mark.parametrize("n", [1, 7, 1000003])
@pytest.mark.parametrize("lp_dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_cpu_kernel_matches_reference(cpu_step, lp_dtype, n, hyper):
    check_against_reference(cpu_step, n, lp_dtype, hyper, step=3, grad_scale=1.0, seed=n)


@pytest.mark.parametrize("lp_dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("loss_scale,clip_coef", [(1.0, 1.0), (1024.0, 1.0), (1024.0, 0.3), (1.0, 0.05)])
def test_cpu_kernel_loss_scale_and_clip(cpu_step, lp_dtype, loss_scale, clip_coef):
    # fp16 grads scaled by 1024 stay finite (|g| < 6e4); the kernel must unscale and clip.
    hyper = AdamHyper(lr=2e-3, beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=0.01, adamw=True)
    check_against_reference(cpu_step, 4099, lp_dtype, hyper, step=1, grad_scale=clip_coef / loss_scale,
                            grad_mult=loss_scale, seed=11)


@pytest.mark.parametrize("backend", ["cpu_fused", "torch_reference"])
@pytest.mark.parametrize("lp_dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_the_update_into_other_buffers_is_the_update_in_place(cpu_step, lp_dtype, backend):
    """[Note: host updates in backward]: ``adam_step_from`` reads the gradient and the states and writes the new
    parameter and states elsewhere, bit for bit what the step in place writes, the sources untouched; the CPU
    kernel's streamed stores from the first aligned element (outputs 4 elements off a vector's alignment), from
    the first (outputs aligned), and none (7 elements)."""
    from ds_patrickstar.optim.adam_math import adam_step_from_reference

    step_from = kernels.get_adam_from_backend("cpu") if backend == "cpu_fused" else adam_step_from_reference
    in_place, step = cpu_step if backend == "cpu_fused" else adam_step_reference, 4
    for n, offset in ((70001, 3), (70001, 15), (7, 1)):
        sources = make_inputs(n, lp_dtype, seed=n, offset=offset)
        kept = [t.clone() for t in sources]
        outputs = make_inputs(n, lp_dtype, seed=n + 1, offset=offset + 1)  # other values, another alignment
        step_from(*sources, *outputs, step=step, hyper=HYPERS[1], grad_scale=0.25)
        in_place(*kept, step=step, hyper=HYPERS[1], grad_scale=0.25)
        for got, want in zip(outputs, kept):
            assert torch.equal(got, want)
        assert all(torch.equal(a, b) for a, b in zip(sources, make_inputs(n, lp_dtype, seed=n, offset=offset)))


@pytest.mark.parametrize("offset", [1, 2, 3, 5])
def test_cpu_kernel_unaligned_slices(cpu_step, offset):
    hyper = HYPERS[1]
    check_against_reference(cpu_step, 70001, torch.bfloat16, hyper, step=2, grad_scale=0.5, offset=offset)


def test_cpu_kernel_same_result_for_any_thread_count(cpu_step):
    hyper = HYPERS[0]
    saved = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            bufs = make_inputs(300007, torch.bfloat16, seed=5)
            cpu_step(*bufs, step=4, hyper=hyper, grad_scale=0.25)
            outs.append(bufs)
    finally:
        torch.set_num_threads(saved)
    for other in outs[1:]:
        for a, b in zip(outs[0], other):
            assert torch.equal(a, b)


@pytest.mark.parametrize("adamw", [True, False], ids=["AdamW", "Adam"])
def test_cpu_kernel_20_steps_vs_torch_optim(cpu_step, adamw):
    n, steps = 10007, 20
    gen = torch.Generator().manual_seed(3)
    init = torch.randn(n, generator=gen)
    grads = [torch.randn(n, generator=gen) for _ in range(steps)]
    lr, betas, eps, wd = 1e-2, (0.9, 0.999), 1e-8, 0.05
    ref_param = torch.nn.Parameter(init.clone())
    opt_cls = torch.optim.AdamW if adamw else torch.optim.Adam
    opt = opt_cls([ref_param], lr=lr, betas=betas, eps=eps, weight_decay=wd, foreach=False)
    hyper = AdamHyper(lr=lr, beta1=betas[0], beta2=betas[1], eps=eps, weight_decay=wd, adamw=adamw)
    master, exp_avg, exp_avg_sq = init.clone(), torch.zeros(n), torch.zeros(n)
    lp = torch.empty(n)
    for t, g in enumerate(grads, start=1):
        ref_param.grad = g.clone()
        opt.step()
        lp.copy_(g)
        cpu_step(lp, master, exp_avg, exp_avg_sq, step=t, hyper=hyper, grad_scale=1.0)
    state = opt.state[ref_param]
    torch.testing.assert_close(master, ref_param.detach(), rtol=STEPS_RTOL, atol=STEPS_ATOL)
    torch.testing.assert_close(exp_avg, state["exp_avg"], rtol=STEPS_RTOL, atol=STEPS_ATOL)
    torch.testing.assert_close(exp_avg_sq, state["exp_avg_sq"], rtol=STEPS_RTOL, atol=1e-9)
    assert torch.equal(lp, master)


def test_cpu_kernel_rejects_bad_inputs(cpu_step):
    hyper = HYPERS[0]
    lp, master, exp_avg, exp_avg_sq = make_inputs(64, torch.bfloat16, seed=0)
    with pytest.raises(RuntimeError, match="master must be float32"):
        cpu_step(lp, master.half(), exp_avg, exp_avg_sq, step=1, hyper=hyper, grad_scale=1.0)
    with pytest.raises(RuntimeError, match="param_lp must be float32, bfloat16 or float16"):
        cpu_step(lp.double(), master, exp_avg, exp_avg_sq, step=1, hyper=hyper, grad_scale=1.0)
    with pytest.raises(RuntimeError, match="must be contiguous"):
        cpu_step(lp, torch.zeros(128)[::2], exp_avg, exp_avg_sq, step=1, hyper=hyper, grad_scale=1.0)
    with pytest.raises(RuntimeError, match="numel mismatch"):
        cpu_step(lp, master, exp_avg[:63], exp_avg_sq, step=1, hyper=hyper, grad_scale=1.0)
    with pytest.raises(ValueError, match="step count"):
        cpu_step(lp, master, exp_avg, exp_avg_sq, step=0, hyper=hyper, grad_scale=1.0)


def test_force_torch_env_var(cpu_step, monkeypatch):
    monkeypatch.setenv(kernels.FORCE_TORCH_ENV, "1")
    assert kernels.adam_backend_name("cpu") == "torch_reference"
    assert kernels.get_adam_backend(torch.device("cpu")) is adam_step_reference
    monkeypatch.delenv(kernels.FORCE_TORCH_ENV)
    assert kernels.adam_backend_name("cpu") == "cpu_fused"


def test_build_failure_falls_back_with_one_warning(monkeypatch, caplog):
    def broken_build(device_type):
        raise RuntimeError("simulated compiler failure: c++: not found")

    monkeypatch.delenv(kernels.FORCE_TORCH_ENV, raising=False)
    monkeypatch.setattr(kernels, "_build_extension", broken_build)
    monkeypatch.setattr(kernels, "_extensions", {})  # restored afterwards: the real build stays cached
    monkeypatch.setattr(kernels, "_backends", {})
    with caplog.at_level(logging.WARNING, logger="ds_patrickstar.optim.kernels"):
        for _ in range(3):
            assert kernels.get_adam_backend("cpu") is adam_step_reference
            assert kernels.adam_backend_name(torch.device("cpu")) == "torch_reference"
    warnings = [r for r in caplog.records if r.name == "ds_patrickstar.optim.kernels" and r.levelno == logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    msg = warnings[0].getMessage()
    assert "simulated compiler failure" in msg and "falling back" in msg and "To fix" in msg
    # The fallback does the job.
    hyper = HYPERS[0]
    check_against_reference(kernels.get_adam_backend("cpu"), 1001, torch.bfloat16, hyper, step=1, grad_scale=1.0)


def test_a_loader_that_cannot_be_imported_falls_back_with_one_warning(monkeypatch, caplog):
    """Where the kernels' loader itself does not import (it needs POSIX file locks), Adam runs on the
    reference and says so once."""
    import sys

    from ds_patrickstar.optim import chunk_adam

    monkeypatch.setitem(sys.modules, "ds_patrickstar.optim.kernels", None)  # its import raises ImportError
    chunk_adam._warn_no_kernels.cache_clear()
    with caplog.at_level(logging.WARNING, logger="ds_patrickstar.optim.chunk_adam"):
        for _ in range(2):
            assert chunk_adam.adam_backend(torch.device("cpu")) is adam_step_reference
    warnings = [r.getMessage() for r in caplog.records if r.name == "ds_patrickstar.optim.chunk_adam"]
    assert len(warnings) == 1 and "pure-torch reference" in warnings[0] and "halted" in warnings[0], warnings
    chunk_adam._warn_no_kernels.cache_clear()


def test_detect_cpu_isa_matches_torch(monkeypatch):
    monkeypatch.delenv(kernels.CPU_ISA_ENV, raising=False)
    isa = kernels.detect_cpu_isa()
    assert isa in ("avx512", "avx2", "scalar")
    cap = torch.backends.cpu.get_cpu_capability().upper()
    if cap.startswith("AVX512"):
        assert isa == "avx512"
    monkeypatch.setenv(kernels.CPU_ISA_ENV, "scalar")
    assert kernels.detect_cpu_isa() == "scalar"
    monkeypatch.setenv(kernels.CPU_ISA_ENV, "sse9")
    with pytest.raises(ValueError):
        kernels.detect_cpu_isa()


def test_compiled_simd_path_is_the_detected_one(cpu_step):
    assert kernels.cpu_simd_name() == kernels.detect_cpu_isa()


@pytest.mark.skipif(os.environ.get("DS_PATRICKSTAR_TEST_ALL_ISAS") != "1",
                    reason="set DS_PATRICKSTAR_TEST_ALL_ISAS=1 to build and test the avx2 and scalar variants")
@pytest.mark.slow
@pytest.mark.parametrize("isa", ["avx2", "scalar"])
def test_other_isa_variants(isa):
    # In a subprocess: the ISA is fixed at build time and cached per process.
    code = textwrap.dedent(f"""
        import torch
        from ds_patrickstar.optim import kernels
        import tests.test_kernels as t
        assert kernels.cpu_simd_name() == {isa!r}, kernels.cpu_simd_name()
        step = kernels.get_adam_backend("cpu")
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            for n in (1, 7, 100003):
                for h in t.HYPERS:
                    t.check_against_reference(step, n, dtype, h, step=2, grad_scale=0.5, offset=n % 3)
        print("ok")
    """)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, DS_PATRICKSTAR_CPU_ISA=isa, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0 and "ok" in out.stdout, out.stdout + out.stderr


def test_a_build_lock_left_by_a_dead_process_is_removed_and_a_live_build_waited_for(tmp_path, monkeypatch,
                                                                                     caplog):
    """A process killed while torch held its build lock leaves the lock file; without the guard every
    later process waits on it forever. A live holder of the guard is waited for."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    from torch.utils import cpp_extension

    build_dir = tmp_path.joinpath(cpp_extension._get_build_directory("probe", False))
    lock = build_dir / "lock"
    lock.touch()
    with caplog.at_level(logging.WARNING, logger="ds_patrickstar.optim.kernels"):
        with kernels._build_guard("probe"):
            assert not lock.exists()
    assert "whose process died" in caplog.text
    entered = threading.Event()
    with open(build_dir / "ds_patrickstar.flock", "a") as held:  # another process building now
        fcntl.flock(held, fcntl.LOCK_EX)

        def load():
            with kernels._build_guard("probe"):
                entered.set()

        waiter = threading.Thread(target=load)
        waiter.start()
        assert not entered.wait(0.5)
        fcntl.flock(held, fcntl.LOCK_UN)
    assert entered.wait(10)
    waiter.join()
