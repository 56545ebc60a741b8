"""Helpers shared by the benchmark scripts: process setup, memory readings, model-data bytes."""
import json
import os
import platform
import resource
import subprocess
import sys
from pathlib import Path

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_harness import (  # noqa: F401  (re-exported: the scripts use them here)
    CONFIG_DIR,
    GIB,
    REPO_ROOT,
    ZERO3_MEMORY_TUNED,
    free_port,
)


def add_repo_to_path():
    """Make ``import ds_patrickstar`` work from a checkout that is not pip-installed."""
    if str(REPO_ROOT) not in sys.path:
        sys.path.append(str(REPO_ROOT))


def repo_commit():
    """Where ds_patrickstar is imported from and its commit, for every figure."""
    import ds_patrickstar

    root = Path(ds_patrickstar.__file__).resolve().parents[1]
    out = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return f"{root} ({out.stdout.strip() or 'not a checkout'})"


def setup_single_process_env():
    """Env defaults for ``torch.distributed`` when the script was not started by a launcher."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))


def load_config(path):
    with open(path) as f:
        return json.load(f)


def zero_stage(config):
    return config.get("zero_optimization", {}).get("stage", 0)


def set_dtype(config, dtype):
    """Force the mixed-precision mode of a DeepSpeed config dict: bf16, fp16 or fp32."""
    if dtype not in ("bf16", "fp16", "fp32"):
        raise ValueError(f"unknown dtype {dtype!r}")
    config["bf16"] = {"enabled": dtype == "bf16"}
    fp16 = dict(config.get("fp16", {}))
    fp16["enabled"] = dtype == "fp16"
    config["fp16"] = fp16
    return config


def _cpu_flags(cpuinfo="/proc/cpuinfo"):
    """The CPU's feature flags from ``/proc/cpuinfo`` (x86 ``flags``, Arm ``Features``), or None."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return set(value.split())
    except OSError:
        return None
    return None


def describe_cpu(cpuinfo="/proc/cpuinfo"):
    """The CPU's model, logical cores, load and the flags CPU figures depend on (avx2, avx512f, avx512_bf16,
    amx_bf16), for every CPU figure."""
    model = platform.processor() or platform.machine()
    try:
        with open(cpuinfo, encoding="ascii", errors="replace") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    flags = sorted((_cpu_flags(cpuinfo) or set()) & {"avx2", "avx512f", "avx512_bf16", "amx_bf16"})
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return f"{model}, {os.cpu_count()} logical cores, flags {' '.join(flags) or 'none of avx2/avx512'}, load {load:.1f}"


def _bf16_matmul_ratio(n=256, repeats=3):
    """bf16 matmul time over fp32's on the CPU (best of ``repeats``): a measured check."""
    import time

    def best(dtype):
        a = torch.randn(n, n).to(dtype)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            a @ a
            times.append(time.perf_counter() - start)
        return min(times)

    return best(torch.bfloat16) / max(best(torch.float32), 1e-9)


def cpu_native_bf16(cpuinfo="/proc/cpuinfo"):
    """(has native bf16, why): the ``avx512_bf16``/``amx_bf16`` (x86) or ``bf16`` (Arm) flag where
    ``/proc/cpuinfo`` lists flags, else a measured check (bf16 matmul at most 2x fp32's time)."""
    flags = _cpu_flags(cpuinfo)
    if flags is not None:
        found = sorted(flags & {"avx512_bf16", "amx_bf16", "bf16"})
        return bool(found), f"CPU flags {'list ' + ', '.join(found) if found else 'have no avx512_bf16/amx_bf16/bf16'}"
    ratio = _bf16_matmul_ratio()
    return ratio <= 2.0, f"measured: a bf16 matmul takes {ratio:.1f}x fp32's time"


def host_rss_bytes():
    return psutil.Process().memory_info().rss


def host_peak_rss_bytes():
    """Peak resident set size of this process so far (``ru_maxrss`` is KiB on Linux, B on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def gpu_max_allocated_bytes():
    return torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None


def _storage_key_and_bytes(t):
    storage = t.untyped_storage()
    return (t.device.type, t.device.index, storage.data_ptr()), storage.nbytes()


def unique_storage_bytes(tensors):
    """Bytes of the distinct storages behind ``tensors`` (views of one buffer count once)."""
    seen = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.numel() > 0:
            key, nbytes = _storage_key_and_bytes(t)
            seen[key] = nbytes
    return sum(seen.values())


def _zero3_tensors(engine):
    """Every tensor that stock ZeRO-3 (stage3.py of DeepSpeed 0.19) keeps as model data."""
    opt = engine.optimizer
    for p in engine.module.parameters():
        yield getattr(p, "ds_tensor", None)
        yield p.data
    yield from getattr(opt, "fp16_partitioned_groups_flat", [])
    for flat in getattr(opt, "fp32_partitioned_groups_flat", []):
        yield flat
        yield flat.grad
    for state in getattr(opt.optimizer, "state", {}).values():
        yield from (v for v in state.values() if isinstance(v, torch.Tensor))
    yield getattr(opt, "grad_partitions_flat_buffer", None)
    yield from getattr(opt, "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition", {}).values()
    for grads in getattr(opt, "averaged_gradients", {}).values():
        yield from (grads or [])


def zero3_model_data_bytes(engine):
    """Model-data bytes held by a stock ZeRO-3 engine, counting each storage once.

    Counted: parameter partitions (``p.ds_tensor``) and any gathered/persistent full
    parameters (``p.data``), the low-precision flats, the fp32 master partitions
    (``fp32_partitioned_groups_flat``) and their ``.grad``, the optimizer state tensors
    (``exp_avg``/``exp_avg_sq``... in ``optimizer.optimizer.state``), the gradient partition
    buffer (``grad_partitions_flat_buffer``, plus its per-parameter views) and
    ``averaged_gradients``. NOT counted: the IPG reduce bucket (a fixed-size communication
    buffer) and the parameter-swap buffers of NVMe offload.
    """
    return unique_storage_bytes(_zero3_tensors(engine))


def model_data_bytes(engine, stage):
    """Model-data bytes of the engine, or None when the backend cannot say.

    Uses ``engine.optimizer.model_data_bytes()`` where the optimizer has it (ds_patrickstar),
    else the ZeRO-3 count above for ``stage == 3``.
    """
    opt = getattr(engine, "optimizer", None)
    if hasattr(opt, "model_data_bytes"):
        return int(opt.model_data_bytes())
    if stage == 3 and hasattr(opt, "fp32_partitioned_groups_flat"):
        return zero3_model_data_bytes(engine)
    return None


def spawn_ranks(target, world, args, replies, prefix="bench_ranks_", timeout=900.0):
    """``target(rank, world, store, *args, out)`` in ``world`` spawned processes, which join gloo through the file
    ``store`` (its name ends in a free port: DeepSpeed names its shared-memory buffers after MASTER_PORT); returns
    the first ``replies`` items the processes put on the queue ``out``."""
    import tempfile

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    store = tempfile.mktemp(prefix=prefix, suffix=f"_{free_port()}")
    procs = [ctx.Process(target=target, args=(rank, world, store, *args, out)) for rank in range(world)]
    for p in procs:
        p.start()
    results = [out.get(timeout=timeout) for _ in range(replies)]
    for p in procs:
        p.join(timeout=60)
    if os.path.exists(store):
        os.remove(store)
    return results
