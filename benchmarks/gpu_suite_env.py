"""``gpu_suite.py``'s clock, children and record of the machine: the wall-clock budget shared by its parts, the
child processes (each in a session of its own, killed with all it started when its time is up) and what a figure
needs beside it (GPU, driver, torch, CUDA and DeepSpeed versions, the date, the command)."""
from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

import psutil


class Budget:
    """Wall-clock seconds for the whole run; each part's deadline is its share of what is left, so what a part
    leaves unused goes to the parts after it."""

    def __init__(self, seconds: float):
        self.begin = time.monotonic()
        self.end = self.begin + seconds

    def left(self) -> float:
        return max(0.0, self.end - time.monotonic())

    def used(self) -> float:
        return time.monotonic() - self.begin

    def deadline(self, shares: dict[str, float], part: str, fixed: dict[str, float] | None = None) -> float:
        """``part``'s deadline: its ``fixed`` seconds where it has them, else its share of what is left after
        the fixed seconds of the parts after it."""
        fixed, names = fixed or {}, list(shares)
        later = names[names.index(part):]
        if part in fixed:
            return time.monotonic() + min(fixed[part], self.left())
        left = max(0.0, self.left() - sum(fixed[n] for n in later if n in fixed))
        rest = sum(shares[n] for n in later if n not in fixed)
        return time.monotonic() + (left * shares[part] / rest if rest else left)


def skipped(reason: str) -> dict:
    return {"status": "skipped", "reason": reason}


def lock_cleaner(env: dict, sole_builder: bool):
    """What to run when a child is killed at its deadline: where the suite's processes are the machine's only
    builders (a lent GPU), remove the JIT build locks it may have left (:func:`remove_build_locks`)."""
    return (lambda: remove_build_locks(env)) if sole_builder else None


def remove_build_locks(env: dict) -> list[str]:
    """torch's JIT build lock (``<build dir>/lock``) is a plain file that a killed build leaves behind, and every
    later load of that op would wait on it. Only where the suite's processes are the machine's only builders (not
    on a machine shared with other jobs, whose builds would lose their locks)."""
    from torch.utils import cpp_extension

    root = Path(env.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root())
    locks = [*root.glob("*/lock"), *root.glob("*/*/lock")]
    for lock in locks:
        lock.unlink(missing_ok=True)
    return [str(lock) for lock in locks]


def child_env(repo: Path, dry_run: bool, cuda: bool) -> dict:
    """The environment of every child: no launcher variables (each picks its own port), the repository on
    ``PYTHONPATH``, CUDA hidden in a dry run, and on a GPU ``TORCH_CUDA_ARCH_LIST`` set to the GPU's own
    architecture where it is unset (DeepSpeed's JIT builds fail on H100's default ``9.0a``)."""
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")]))
    if dry_run:
        env["CUDA_VISIBLE_DEVICES"] = ""
    elif cuda and not env.get("TORCH_CUDA_ARCH_LIST"):
        import torch

        env["TORCH_CUDA_ARCH_LIST"] = "{}.{}".format(*torch.cuda.get_device_capability(0))
    return env


def _quiet(cmd: list[str]) -> str | None:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    return done.stdout.strip() or None


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine(args, cuda: bool, env: dict) -> dict:
    """What the figures were measured on, and how."""
    import torch

    gpu = torch.cuda.get_device_name(0) if cuda else None
    driver = _quiet(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]) if cuda else None
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join([os.path.basename(sys.executable), "benchmarks/gpu_suite.py", *sys.argv[1:]]),
        "dry_run": args.dry_run,
        "budget_s": args.budget_s,
        "gpu": gpu or "none (dry run: strict emulated accelerator on the CPU)",
        "gpu_memory_bytes": torch.cuda.get_device_properties(0).total_memory if cuda else None,
        "driver": driver.splitlines()[0] if driver else None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "deepspeed": _version("deepspeed"),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "host_memory_bytes": psutil.virtual_memory().total,
        "cpu": platform.processor() or platform.machine(),
        "git_commit": _quiet(["git", "rev-parse", "--short", "HEAD"]),
        "env": {k: env.get(k) for k in ("TORCH_CUDA_ARCH_LIST", "TORCH_EXTENSIONS_DIR", "OMP_NUM_THREADS")},
    }
