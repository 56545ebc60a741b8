"""Loader and backend selection for the fused chunk Adam kernels.

The C++/CUDA sources live in ``ops/`` (installed as ``ds_patrickstar.csrc``) and
are JIT-compiled with :func:`torch.utils.cpp_extension.load` (ninja) on first
use, into torch's extension cache (``TORCH_EXTENSIONS_DIR`` or
``~/.cache/torch_extensions``); later processes reuse the build.

* :func:`get_adam_backend` returns a function with the signature of
  :func:`ds_patrickstar.optim.adam_math.adam_step_reference`: the fused CPU kernel for
  ``cpu``, the CUDA kernel for ``cuda``, else the reference.  If a kernel cannot
  be built, it logs one warning (why, and how to fix it) and returns the
  reference.  ``DS_PATRICKSTAR_FORCE_TORCH_ADAM=1`` forces the reference.

The CPU build's SIMD flags are chosen by inspecting the build machine
(``/proc/cpuinfo``, else ``torch.backends.cpu.get_cpu_capability()``); the
chosen ISA is part of the extension name, so a shared cache never mixes them.
``DS_PATRICKSTAR_CPU_ISA=avx512|avx2|scalar`` overrides the detection.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import platform
import shutil
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from .adam_math import (
    AdamHyper,
    AdamStep,
    AdamStepFrom,
    adam_step_from_reference,
    adam_step_reference,
    bias_corrections,
)

logger = logging.getLogger(__name__)

FORCE_TORCH_ENV = "DS_PATRICKSTAR_FORCE_TORCH_ADAM"
CPU_ISA_ENV = "DS_PATRICKSTAR_CPU_ISA"

_ISA_CFLAGS = {
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c"],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "scalar": [],
}

_lock = threading.RLock()
_extensions: dict[str, Any] = {}  # device type -> loaded module, or None after a failed build
_backends: dict[str, tuple[str, AdamStep]] = {}  # device type -> (name, step function)


def _force_torch() -> bool:
    return os.environ.get(FORCE_TORCH_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def source_dir() -> Path:
    """Directory of the installed C++/CUDA sources (the ``ds_patrickstar.csrc`` package)."""
    try:
        from importlib.resources import files

        path = Path(str(files("ds_patrickstar.csrc")))
        if (path / "adam_cpu.cpp").is_file():
            return path.resolve()
    except (ImportError, ModuleNotFoundError, TypeError):
        pass
    # Running from a source checkout where ds_patrickstar.csrc is not mapped.
    return (Path(__file__).resolve().parents[2] / "ops").resolve()


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def detect_cpu_isa() -> str:
    """The widest SIMD path the build machine supports: ``avx512``, ``avx2`` or ``scalar``."""
    forced = os.environ.get(CPU_ISA_ENV, "").strip().lower()
    if forced:
        if forced not in _ISA_CFLAGS:
            raise ValueError(f"{CPU_ISA_ENV}={forced!r}: expected one of {sorted(_ISA_CFLAGS)}")
        return forced
    if platform.machine().lower() not in ("x86_64", "amd64", "i686", "x86"):
        return "scalar"
    flags = _cpu_flags()
    if flags:
        if {"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma", "f16c"} <= flags:
            return "avx512"
        if {"avx2", "fma", "f16c"} <= flags:
            return "avx2"
        return "scalar"
    cap = torch.backends.cpu.get_cpu_capability().upper()  # "AVX512", "AVX2", "DEFAULT", ...
    return "avx512" if cap.startswith("AVX512") else "avx2" if cap.startswith("AVX2") else "scalar"


@contextlib.contextmanager
def _build_guard(name: str) -> Iterator[None]:
    """Hold an OS lock on ``name``'s build directory while torch builds or loads it.

    torch's own lock (``<build dir>/lock``) is a plain file: a process killed while holding it
    (Ctrl-C, a test timeout, an out-of-memory kill during a load) leaves it, and every later process
    waits on it forever. ``fcntl.flock`` locks are dropped by the kernel when their holder dies, and
    every ds_patrickstar process builds and loads under one; so a torch lock found while we hold it
    was left by a dead process and goes, with a warning."""
    from torch.utils import cpp_extension

    build_dir = Path(cpp_extension._get_build_directory(name, False))
    with open(build_dir / "ds_patrickstar.flock", "a") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        try:
            lock = build_dir / "lock"
            if lock.exists():
                logger.warning(
                    "ds_patrickstar: removing %s, left by a build or load of %s whose process died", lock, name
                )
                lock.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(guard, fcntl.LOCK_UN)


def _build_extension(device_type: str) -> Any:
    """Compile (or load from the cache) the extension for ``device_type``; raises on failure."""
    from torch.utils import cpp_extension

    src = source_dir()
    common = [f"-I{src}"]
    if device_type == "cpu":
        cxx = os.environ.get("CXX", "c++")
        if shutil.which(cxx) is None:
            raise RuntimeError(f"no C++ compiler found ({cxx!r} is not on PATH)")
        isa = detect_cpu_isa()
        with _build_guard(f"ds_patrickstar_adam_cpu_{isa}"):
            return cpp_extension.load(
                name=f"ds_patrickstar_adam_cpu_{isa}",
                sources=[str(src / "adam_cpu.cpp")],
                extra_cflags=["-O3", "-fopenmp", *_ISA_CFLAGS[isa], *common],
                extra_ldflags=["-fopenmp"],
                extra_include_paths=[str(src)],
                verbose=False,
            )
    if device_type == "cuda":
        if torch.version.cuda is None:
            raise RuntimeError(f"this torch build ({torch.__version__}) has no CUDA support")
        if cpp_extension.CUDA_HOME is None:
            raise RuntimeError("nvcc / the CUDA toolkit was not found (set CUDA_HOME)")
        with _build_guard("ds_patrickstar_adam_cuda"):
            return cpp_extension.load(
                name="ds_patrickstar_adam_cuda",
                sources=[str(src / "adam_cuda_binding.cpp"), str(src / "adam_cuda.cu")],
                extra_cflags=["-O3", *common],
                extra_cuda_cflags=["-O3", "-lineinfo", *common],
                extra_include_paths=[str(src)],
                verbose=False,
            )
    raise RuntimeError(f"no fused Adam kernel for device type {device_type!r}")


def _load_extension(device_type: str) -> Any | None:
    """The compiled extension for ``device_type`` or None (one warning on the first failure)."""
    with _lock:
        if device_type in _extensions:
            return _extensions[device_type]
        try:
            ext = _build_extension(device_type)
        except Exception as exc:  # compiler missing, build error, import error, ...
            reason = " ".join(str(exc).split())
            if len(reason) > 1500:
                reason = reason[:700] + " ... " + reason[-700:]
            fix = (
                "install a C++17 compiler with OpenMP (g++ >= 9) and ninja (`pip install ninja`)"
                if device_type == "cpu"
                else "install a CUDA toolkit whose nvcc matches torch.version.cuda and set CUDA_HOME"
            )
            logger.warning(
                "ds_patrickstar: could not build the fused %s Adam kernel, falling back to the pure-torch "
                "reference Adam (correct but several times slower). Reason: %s. To fix: %s; the build is "
                "cached under TORCH_EXTENSIONS_DIR (default ~/.cache/torch_extensions). Set %s=1 to use the "
                "reference deliberately.",
                device_type.upper(),
                reason,
                fix,
                FORCE_TORCH_ENV,
            )
            ext = None
        _extensions[device_type] = ext
        return ext


def _scalars(step: int, hyper: AdamHyper, grad_scale: float) -> tuple:
    """The kernels' arguments after the tensors."""
    if step < 1:
        raise ValueError(f"Adam step count must be >= 1, got {step}")
    bc1, bc2_sqrt = bias_corrections(hyper, step)
    return (hyper.lr, hyper.beta1, hyper.beta2, hyper.eps, hyper.weight_decay, hyper.adamw, bc1, bc2_sqrt,
            float(grad_scale))  # fmt: skip


def _wrap(ext_step: Callable[..., None], name: str, like: Callable[..., None] = adam_step_reference) -> AdamStep:
    """``ext_step`` with the signature (and doc) of ``like``, the reference it stands in for."""

    def fused_adam_step(*tensors: torch.Tensor, step: int, hyper: AdamHyper, grad_scale: float) -> None:
        ext_step(*tensors, *_scalars(step, hyper, grad_scale))

    fused_adam_step.__name__ = fused_adam_step.__qualname__ = f"{name}_adam_step"
    fused_adam_step.__doc__ = like.__doc__
    return fused_adam_step


def _select(device: torch.device | str) -> tuple[str, AdamStep]:
    dtype = torch.device(device).type
    if _force_torch():
        return "torch_reference", adam_step_reference
    with _lock:
        if dtype not in _backends:
            ext = _load_extension(dtype) if dtype in ("cpu", "cuda") else None
            if ext is None:
                _backends[dtype] = ("torch_reference", adam_step_reference)
            else:
                name = f"{dtype}_fused"
                _backends[dtype] = (name, _wrap(ext.adam_step, name))
        return _backends[dtype]


def get_adam_backend(device: torch.device | str) -> AdamStep:
    """Adam step function for tensors on ``device`` (signature of ``adam_step_reference``)."""
    return _select(device)[1]


def get_adam_from_backend(device: torch.device | str) -> AdamStepFrom:
    """The update from one set of buffers into another for tensors on ``device`` (signature of
    ``adam_step_from_reference``): the CPU kernel's ``adam_step_from``, else the reference (copies, then in
    place)."""
    name, _ = _select(device)
    step_from = getattr(_extensions.get("cpu"), "adam_step_from", None) if name == "cpu_fused" else None
    if step_from is None:
        return adam_step_from_reference
    return _wrap(step_from, "cpu_fused_from", adam_step_from_reference)


def adam_backend_name(device: torch.device | str) -> str:
    """``"cpu_fused"``, ``"cuda_fused"`` or ``"torch_reference"``."""
    return _select(device)[0]


def cpu_simd_name() -> str | None:
    """SIMD path compiled into the CPU kernel (``avx512``/``avx2``/``scalar``), None if not built."""
    ext = None if _force_torch() else _load_extension("cpu")
    return None if ext is None else ext.simd()
