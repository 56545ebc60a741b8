"""The benchmarks' one harness: what every measurement needs, so that a new one is a function, not a script.

* **models**: :func:`gpt_overrides_for_params` (a GPT of about N parameters), :func:`changing_lengths` (a
  sequence length per step, as dynamic padding gives), :func:`build_under_init` (a model built as the backend's
  users build it: under ``ds_patrickstar.Init`` or ``deepspeed.zero.Init``);
* **backends**: :func:`backend_config` (the config file of ``configs/`` a user starts from) and
  :func:`ds_config` (a config built in code, per backend name);
* **steps**: :func:`lm_steps` (a GPT trained on given token batches: losses and counters), :func:`timed_steps`
  (warm-up until the step time settles, or a fixed count, then the timed steps)
  and :func:`steady_summary` (median, spread, and the first steps' extra time);
* **trials**: a command in a process (and session) of its own with a deadline (:func:`run_process`,
  :func:`run_logged`), its JSON result or its status (:func:`json_trial`: ``measured``, ``failed`` with its
  error's last line, ``cut`` by its deadline), and the error line of a log (:func:`error_line`);
* **tables**: :func:`markdown_table`.

Nothing here imports torch or DeepSpeed at module level: a parent process that only starts trials stays light.
"""
from __future__ import annotations

import json
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

# ZeRO-3 "tuned" for memory: the knobs DeepSpeed documents for running out of memory, turned down
# from their defaults (live params 1e9, reuse distance 1e9, prefetch 5e7, sub-group 1e9, reduce
# bucket 5e8, persistence threshold 1e5). Benchmarks compare against the best ZeRO-3 a user would
# configure, not only against the defaults.
ZERO3_MEMORY_TUNED = {
    "stage3_max_live_parameters": int(1e8),
    "stage3_max_reuse_distance": int(1e8),
    "stage3_prefetch_bucket_size": int(2e7),
    "stage3_param_persistence_threshold": int(1e4),
    "sub_group_size": int(1e8),
    "reduce_bucket_size": int(2e7),
}

CONFIG_DIR = REPO_ROOT / "configs"
GIB = 1024**3

# ------------------------------------------------------------------ models


def gpt_params(width: int, depth: int, vocab: int, seq_len: int) -> int:
    """Parameters of ``gpt_model.GPT`` (tied LM head) without building it."""
    return vocab * width + seq_len * width + depth * (12 * width**2 + 13 * width) + 2 * width


def gpt_overrides_for_params(params: float, vocab: int, seq_len: int, shapes: list[tuple[float, int, int]]) -> dict:
    """``GPTConfig`` fields of a GPT of about ``params`` parameters: the first of ``shapes`` (up to how many
    parameters, width, heads; e.g. GPT-3's 2048 wide up to 2B, 4096 up to 10B) that takes it, at the depth that
    comes closest (at least 1)."""
    _, width, heads = next((s for s in shapes if params <= s[0]), shapes[-1])
    depth = max(1, round((params - gpt_params(width, 0, vocab, seq_len)) / (12 * width**2 + 13 * width)))
    return {"n_layer": depth, "n_embd": width, "n_head": heads, "block_size": seq_len, "vocab_size": vocab}


def changing_lengths(steps: int, longest: int, seed: int = 0) -> list[int]:
    """A length per step, as dynamic padding gives: random in [longest/4, longest), the longest at step 1."""
    rng = random.Random(seed)
    lengths = [rng.randint(max(1, longest // 4), max(1, longest - 1)) for _ in range(steps)]
    if steps > 1:
        lengths[1] = longest
    return lengths


def build_under_init(backend: str, config: dict, make_model):
    """``make_model()`` built as the backend's users build it: under ``ds_patrickstar.Init`` for ours (names
    starting ``patrickstar`` or ``ours``), ``deepspeed.zero.Init`` for stock ZeRO-3 (its process group first),
    plainly otherwise."""
    if backend.startswith(("patrickstar", "ours")):
        import ds_patrickstar

        with ds_patrickstar.Init(config=config):
            return make_model()
    if backend.startswith("zero3"):
        import deepspeed
        import torch

        deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
        with deepspeed.zero.Init(config_dict_or_path=config):
            return make_model()
    return make_model()


# ------------------------------------------------------------------ backends


def lm_steps(engine, batches, vocab: int, after=None) -> tuple[list[float], list[dict], list]:
    """Train ``engine`` (a GPT of ``gpt_model``) one step per token batch (``[batch, length + 1]``: inputs and
    next-token targets); the losses, ours' counters per step (none for stock) and what ``after(engine, step,
    tokens)`` returned after each step, when given. The engine is destroyed at the end."""
    import torch

    losses, counters, extra = [], [], []
    try:
        for tokens in batches:
            logits = engine(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, vocab), tokens[:, 1:].reshape(-1))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            if hasattr(engine, "get_patrickstar_counters"):
                counters.append(engine.get_patrickstar_counters())
            if after is not None:
                extra.append(after(engine, len(losses) - 1, tokens))
    finally:
        engine.destroy()
    return losses, counters, extra


def backend_config(backend: str, offload: bool, cuda: bool | None = None) -> Path:
    """The config file of ``configs/`` that a user of ``backend`` starts from (on CUDA or not)."""
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
    if backend in ("patrickstar", "patrickstar-static", "ours"):
        return CONFIG_DIR / ("patrickstar_gpu.json" if cuda else "patrickstar_cpu.json")
    if backend in ("zero3", "zero3-tuned", "zero3-offload"):
        return CONFIG_DIR / ("zero3_offload_gpu.json" if offload else "zero3_cpu.json")
    raise ValueError(f"unknown backend {backend!r}")


def ds_config(backend, batch, keep_gathered=None, grad_accum=1, disk=None, host_budget=None, largest_param=0,
              device_budget=None, emulate=False, chunk_size=None) -> dict:
    """A bf16 AdamW config built in code for ``backend``: ``patrickstar`` (``patrickstar-disk``: optimizer states
    past ``host_budget`` on disk under ``disk``), ``zero3``, ``zero3-tuned`` (``ZERO3_MEMORY_TUNED``),
    ``zero3-offload`` (params and optimizer on the CPU) or ``zero3-infinity`` (both on NVMe under ``disk``)."""
    cfg = {"train_micro_batch_size_per_gpu": batch, "gradient_accumulation_steps": grad_accum,
           "steps_per_print": 10**9, "bf16": {"enabled": True}, "gradient_clipping": 1.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.1}}}
    if backend in ("patrickstar", "patrickstar-disk"):
        zero = cfg["zero_optimization"] = {"stage": "patrickstar"}
        if backend == "patrickstar-disk":
            zero.update(offload_optimizer={"device": "nvme", "nvme_path": disk}, host_budget=host_budget)
        if keep_gathered is not None:
            zero["keep_gathered"] = keep_gathered
        if chunk_size is not None:
            zero["chunk_size"] = chunk_size
        if device_budget is not None:  # on a machine without CUDA: the strict emulated accelerator
            zero.update(device_budget=device_budget, emulate_accelerator=emulate)
    elif backend == "zero3":
        cfg["zero_optimization"] = {"stage": 3}
    elif backend == "zero3-tuned":
        cfg["zero_optimization"] = {"stage": 3, **ZERO3_MEMORY_TUNED}
    elif backend == "zero3-offload":
        cfg["zero_optimization"] = {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": True},
                                    "offload_optimizer": {"device": "cpu", "pin_memory": True}}
    elif backend == "zero3-infinity":  # as DeepSpeed's ZeRO-Infinity tutorial sets it up, swap files under DIR
        nvme = {"device": "nvme", "nvme_path": os.path.join(disk, "zero_infinity")}
        # offload_param's buffers must hold the largest parameter (GPT-2048's embedding is above DeepSpeed's
        # default 1e8 elements) and the optimizer swapper keeps fp32 buffers of sub_group_size elements
        room = max(10**8, largest_param)
        cfg["zero_optimization"] = {"stage": 3, "offload_param": {**nvme, "buffer_size": room},
                                    "offload_optimizer": dict(nvme), "sub_group_size": room}
        cfg["aio"] = {"block_size": 1 << 20, "queue_depth": 8, "intra_op_parallelism": 1, "single_submit": False,
                      "overlap_events": True}
    return cfg


# ------------------------------------------------------------------ steps


def settled(times: list[float], tolerance: float) -> bool:
    """Whether the last two step times are within ``tolerance`` of each other (relative)."""
    return len(times) >= 2 and abs(times[-1] - times[-2]) <= tolerance * min(times[-2:])


def timed_steps(step, warmup: int | str, steps: int, max_warmup: int = 8, tolerance: float = 0.1):
    """``(warm-up records, timed records)``: ``step(i)`` returns a record with its ``wall_s``. ``warmup`` is a
    count, or ``"auto"``: until two steps in a row are within ``tolerance`` (at most ``max_warmup`` steps, at
    least 2)."""
    warm, i = [], 0
    while (len(warm) < warmup) if warmup != "auto" else (
            len(warm) < max_warmup and not settled([r["wall_s"] for r in warm], tolerance)):
        warm.append(step(i))
        i += 1
    return warm, [step(i + k) for k in range(steps)]


def steady_summary(warm_s: list[float], timed_s: list[float]) -> dict:
    """The median of the timed steps, their spread ((max - min) / median) and quartiles, and the extra seconds
    the warm-up steps took over as many steady steps."""
    median = statistics.median(timed_s)
    quartiles = statistics.quantiles(timed_s, n=4) if len(timed_s) > 1 else [median] * 3
    return {"step_s": median, "step_min_s": min(timed_s), "step_max_s": max(timed_s),
            "spread": (max(timed_s) - min(timed_s)) / median if median else 0.0,
            "step_q1_s": quartiles[0], "step_q3_s": quartiles[2], "timed_steps": len(timed_s),
            "warmup_steps": len(warm_s), "warmup_s": list(warm_s),
            "first_steps_extra_s": sum(warm_s) - median * len(warm_s)}


# ------------------------------------------------------------------ trials


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_process(cmd: list[str], timeout: float, env: dict | None = None, cwd: Path | None = None,
                on_timeout=None) -> tuple[int | None, str]:
    """Run ``cmd`` in a session of its own; (its exit code, or None when ``timeout`` ran out, and its output).
    On a timeout the whole session goes (a JIT build's compilers too), then ``on_timeout()`` runs."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    return wait_process(proc, timeout, on_timeout)


def wait_process(proc: subprocess.Popen, timeout: float, on_timeout=None) -> tuple[int | None, str]:
    """:func:`run_process` for a process already started (in a session of its own, its output piped)."""
    try:
        out, _ = proc.communicate(timeout=max(timeout, 1))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        if on_timeout is not None:
            on_timeout()
        return None, f"timed out after {timeout:.0f} s\n{out or ''}"
    return proc.returncode, out or ""


def run_logged(cmd: list[str], log_path: Path, timeout: float | None, env: dict | None = None) -> dict:
    """Run ``cmd`` with its output into ``log_path``: ``{}`` when it exited 0, else ``{"error": ...}`` (its exit
    and the log's error line, or that it timed out)."""
    with open(log_path, "w") as log:
        try:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout:.0f} s"}
    if rc != 0:
        return {"error": f"exit {rc}: {error_line(Path(log_path).read_text(errors='replace')) or 'no output'}"}
    return {}


ERROR = re.compile(r"^(\[rank\d+\]: )?[\w.]*(Error|Exception|Exceeded|Interrupt)\b.*")


def error_line(text: str, limit: int = 240) -> str | None:
    """The last exception line of a child's output (``SomeError: ...``), else its last line that says something
    (DeepSpeed's warnings left out), at most ``limit`` characters; None for no output."""
    lines = [ln.strip() for ln in (text or "").splitlines() if ln.strip() and "[WARNING]" not in ln]
    line = next((ln for ln in reversed(lines) if ERROR.match(ln)), lines[-1] if lines else None)
    return line if line is None or len(line) <= limit else line[: limit - 3] + "..."


def tail(out: str, lines: int = 8) -> str:
    """The last ``lines`` lines of a child's output that say something (DeepSpeed's warnings left out)."""
    kept = [ln for ln in (out or "").splitlines() if ln.strip() and "[WARNING]" not in ln]
    return "\n".join(kept[-lines:])[-2000:]


def json_trial(cmd: list[str], json_path: Path, deadline: float, min_s: float, env: dict | None = None,
               cwd: Path | None = None, on_timeout=None) -> dict:
    """One trial in a process of its own that writes its result to ``json_path``: ``status`` ``measured`` (and
    the result), ``failed`` (``error``: its exit and its error's last line, ``tail``: its last lines) or ``cut``
    (``reason``: less than ``min_s`` seconds were left before ``deadline``, or it ran past it)."""
    left = deadline - time.monotonic()
    if left < min_s:
        return {"status": "cut", "reason": f"deadline: {left:.0f} s left, a trial needs {min_s:.0f} s"}
    start = time.monotonic()
    code, output = run_process(cmd, left, env, cwd, on_timeout)
    seconds = time.monotonic() - start
    if code is None:
        return {"status": "cut", "reason": f"deadline: timed out after {seconds:.0f} s", "seconds": seconds,
                "tail": tail(output, 4)}
    if code != 0 or not Path(json_path).exists():
        return {"status": "failed", "error": f"exit {code}: {error_line(output) or 'no output'}",
                "tail": tail(output, 6), "seconds": seconds}
    return {"status": "measured", "seconds": seconds, **json.loads(Path(json_path).read_text())}


# ------------------------------------------------------------------ tables


def markdown_table(header: list[str], rows: list[list]) -> list[str]:
    """A Markdown table's lines (cells as ``str``; a ``|`` in a cell becomes ``/``, a line break a space)."""
    def cell(value) -> str:
        return str(value).replace("|", "/").replace("\n", " ")

    return ["| " + " | ".join(map(cell, header)) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(map(cell, row)) + " |" for row in rows)]
