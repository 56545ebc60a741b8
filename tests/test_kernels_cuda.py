"""CUDA Adam kernel: a compile-only check that runs without a GPU, and runtime checks on a GPU.

``test_cuda_kernel_compiles_with_nvcc`` compiles ops/adam_cuda.cu (plain CUDA,
no torch headers) for sm_80 and sm_90 so a broken kernel fails CI on CPU-only
machines; ``test_cuda_binding_compiles`` syntax-checks the torch binding. The
runtime tests are marked ``gpu`` and skipped without CUDA.
"""
from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

from ds_patrickstar.optim import kernels
from ds_patrickstar.optim.adam_math import AdamHyper

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_kernels import HYPERS, check_against_reference, hyper_id, make_inputs

NVCC = shutil.which("nvcc") or (shutil.which(os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc"))
                                 if os.environ.get("CUDA_HOME") else None)
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not found (PATH or CUDA_HOME): cannot compile-check")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@needs_nvcc
def test_cuda_kernel_compiles_with_nvcc(tmp_path):
    src = kernels.source_dir()
    cmd = [NVCC, "-c", str(src / "adam_cuda.cu"), "-o", str(tmp_path / "adam_cuda.o"), f"-I{src}", "-std=c++17",
           "-O3", "-Xcompiler", "-fPIC", "-Werror", "all-warnings",
           "-gencode", "arch=compute_80,code=sm_80", "-gencode", "arch=compute_90,code=sm_90"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"{' '.join(cmd)}\n{out.stdout}\n{out.stderr}"
    assert (tmp_path / "adam_cuda.o").stat().st_size > 0


@needs_nvcc
def test_cuda_binding_compiles(tmp_path):
    """g++ -fsyntax-only on the binding with torch's and the toolkit's headers.

    CPU-only torch wheels lack the generated ``c10/cuda/impl/cuda_cmake_macros.h``;
    an empty stand-in is provided then (it only carries build-config macros).
    """
    from torch.utils import cpp_extension

    cxx = shutil.which(os.environ.get("CXX", "c++"))
    if cxx is None:
        pytest.skip("no C++ compiler on PATH")
    src = kernels.source_dir()
    includes = [f"-I{p}" for p in cpp_extension.include_paths("cpu")]
    if not any(Path(p, "c10/cuda/impl/cuda_cmake_macros.h").is_file() for p in cpp_extension.include_paths("cpu")):
        stub = tmp_path / "c10" / "cuda" / "impl"
        stub.mkdir(parents=True)
        (stub / "cuda_cmake_macros.h").write_text("#pragma once\n")
        includes.append(f"-I{tmp_path}")
    cmd = [cxx, "-std=c++17", "-fsyntax-only", "-w", f"-I{src}", *includes, *_nvcc_includes(),
           f"-I{sysconfig.get_paths()['include']}", "-DTORCH_EXTENSION_NAME=ds_patrickstar_adam_cuda",
           str(src / "adam_cuda_binding.cpp")]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"{' '.join(cmd)}\n{out.stderr[-5000:]}"


def _nvcc_includes() -> list[str]:
    """The toolkit include flags nvcc itself uses (nvcc may be a wrapper script)."""
    dry = subprocess.run([NVCC, "--dryrun", "-x", "cu", "-c", os.devnull, "-o", os.devnull], capture_output=True,
                         text=True, timeout=60)
    for line in (dry.stdout + dry.stderr).splitlines():
        if "INCLUDES=" in line and "SYSTEM" not in line:
            return shlex.split(line.split("INCLUDES=", 1)[1])
    return [f"-I{Path(os.environ.get('CUDA_HOME', '/usr/local/cuda')) / 'include'}"]


@pytest.fixture(scope="module")
def cuda_step():
    os.environ.pop(kernels.FORCE_TORCH_ENV, None)
    step = kernels.get_adam_backend(torch.device("cuda"))
    assert kernels.adam_backend_name("cuda") == "cuda_fused", "the CUDA kernel failed to build (see the warning)"
    return step


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("hyper", HYPERS, ids=hyper_id)
@pytest.mark.parametrize("n", [1, 7, 1000003])
@pytest.mark.parametrize("lp_dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("offset", [0, 1, 3])
def test_cuda_kernel_matches_reference(cuda_step, lp_dtype, n, hyper, offset):
    check_against_reference(cuda_step, n, lp_dtype, hyper, step=3, grad_scale=0.5, seed=n, device="cuda",
                            offset=offset)


@pytest.mark.gpu
@needs_cuda
def test_cuda_kernel_unaligned_lp_only(cuda_step):
    # master/exp_avg/exp_avg_sq aligned but param_lp shifted: must take the scalar path, still correct.
    n = 4099
    lp = torch.randn(n + 1, device="cuda").bfloat16()[1:]
    master, exp_avg, exp_avg_sq = torch.randn(n, device="cuda"), torch.zeros(n, device="cuda"), torch.zeros(
        n, device="cuda")
    ref = [t.double().cpu().clone() for t in (lp, master, exp_avg, exp_avg_sq)]
    cuda_step(lp, master, exp_avg, exp_avg_sq, step=1, hyper=HYPERS[0], grad_scale=1.0)
    from ds_patrickstar.optim.adam_math import adam_step_reference
    adam_step_reference(*ref, step=1, hyper=HYPERS[0], grad_scale=1.0)
    torch.testing.assert_close(master.cpu().double(), ref[1], rtol=2e-6, atol=1e-7)
    assert torch.equal(lp, master.bfloat16())


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("adamw", [True, False], ids=["AdamW", "Adam"])
def test_cuda_kernel_20_steps_vs_torch_optim(cuda_step, adamw):
    n, steps = 10007, 20
    gen = torch.Generator().manual_seed(3)
    init = torch.randn(n, generator=gen).cuda()
    grads = [torch.randn(n, generator=gen).cuda() for _ in range(steps)]
    lr, betas, eps, wd = 1e-2, (0.9, 0.999), 1e-8, 0.05
    ref_param = torch.nn.Parameter(init.clone())
    opt = (torch.optim.AdamW if adamw else torch.optim.Adam)([ref_param], lr=lr, betas=betas, eps=eps,
                                                              weight_decay=wd, foreach=False)
    hyper = AdamHyper(lr=lr, beta1=betas[0], beta2=betas[1], eps=eps, weight_decay=wd, adamw=adamw)
    master = init.clone()
    exp_avg, exp_avg_sq, lp = (torch.zeros_like(init) for _ in range(3))
    for t, g in enumerate(grads, start=1):
        ref_param.grad = g.clone()
        opt.step()
        lp.copy_(g)
        cuda_step(lp, master, exp_avg, exp_avg_sq, step=t, hyper=hyper, grad_scale=1.0)
    torch.testing.assert_close(master, ref_param.detach(), rtol=1e-5, atol=2e-6)


@pytest.mark.gpu
@needs_cuda
def test_cuda_kernel_rejects_cpu_tensors(cuda_step):
    lp, master, exp_avg, exp_avg_sq = make_inputs(64, torch.bfloat16, seed=0, device="cuda")
    with pytest.raises(RuntimeError, match="must be on"):
        cuda_step(lp, master.cpu(), exp_avg, exp_avg_sq, step=1, hyper=HYPERS[0], grad_scale=1.0)
