"""One trial of ``gpu_suite.py``: one backend at one model size, in a process of its own.

    python benchmarks/gpu_suite_trial.py --backend ours --model gpt2-medium --batch 4 --seq-len 512 --json OUT.json

Builds the GPT (``gpt_model.py`` preset, ``--overrides`` a JSON dict of ``GPTConfig`` fields; ``--init``: under
the backend's own Init, as a model larger than host memory in fp32 must be), initializes the backend with the
config a user would take from ``configs/`` (``bench_harness.backend_config``), trains untimed warm-up steps
(``--warmup``: a count, or ``auto``: until the step time settles, at most ``--max-warmup``) then ``--steps``
timed steps on random tokens (``bench_harness.timed_steps``) and writes one JSON: the steady-state summary
(median, spread, the warm-up steps' extra seconds), per step the wall
time (synchronized) and the forward / backward / ``engine.step()`` times (CUDA events on the current stream on
CUDA, ``time.perf_counter`` on the CPU), ours' counters of the step (bytes moved, Adam chunks on host/device,
host bytes), the host's RSS (now and peak), ``torch.cuda.host_memory_stats()`` where torch has it, the GPU's
peak allocation and, on CUDA, the pinned copy bandwidth both ways (to turn ours' bytes moved into seconds), after
the run (``pinned``) and right after initialize (``pinned_at_start``: no step's host Adam can be running beside it).

Backends: ``ours`` (stage "patrickstar"; ``--emulate-budget B`` runs it on the strict emulated accelerator with
``device_budget`` B, the dry run), ``zero3-offload`` (stock ZeRO-3, ``offload_param`` + ``offload_optimizer``
to the CPU; on a machine without CUDA plain ZeRO-3 on the CPU stands in for it; ``--memory-fraction F`` holds
it to that share of the GPU, ``torch.cuda.set_per_process_memory_fraction``) and ``zero3`` (no offload).
``predicted_step_s`` and ``planned_step_s`` are the engine's counters of those names where it has them (else None).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_utils as bu
import gpt_model
from bench_harness import backend_config, build_under_init, changing_lengths, steady_summary, timed_steps

BACKENDS = ("ours", "zero3-offload", "zero3")
PHASES = ("forward", "backward", "step")
COUNTER_KEYS = ("predicted_step_s", "planned_step_s", "prefetches", "retraces_shape", "tide_replans",
                "bytes_to_device", "bytes_to_host", "evictions", "adam_chunks_host", "adam_chunks_device",
                "host_bytes_allocated", "model_bytes_host", "model_bytes_device", "peak_device_bytes",
                "frozen_bytes_device", "frozen_bytes_host", "prefetch_hits", "grads_released_in_backward",
                "activation_bytes_offloaded", "activation_bytes_restored", "peak_activation_bytes_device",
                "peak_non_model_bytes_device", "predicted_bytes_to_device", "predicted_bytes_to_host",
                "prefetch_distance", "prefetches_beyond_next", "stranded_bytes_released", "states_gave_way",
                "activations_gave_way", "planned_tide_set_aside",
                "eviction_order", "clean_evictions", "bytes_floor", "host_pinnings", "plan_seconds",
                "host_updates_in_backward", "host_updates_redone", "spare_bytes_host")
PINNED_PROBE_BYTES = 256 * 2**20


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=BACKENDS, required=True)
    p.add_argument("--model", default="tiny", choices=sorted(gpt_model.PRESETS))
    p.add_argument("--overrides", default="{}", help="JSON dict of GPTConfig fields over the preset")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--warmup", default="auto", help="untimed steps: a count, or auto (until the step time settles)")
    p.add_argument("--max-warmup", type=int, default=6, help="--warmup auto: at most this many")
    p.add_argument("--steps", type=int, default=5, help="timed steps (the median reported)")
    p.add_argument("--init", action="store_true", help="build the model under the backend's Init")
    p.add_argument("--memory-fraction", type=float, default=None,
                   help="CUDA: torch.cuda.set_per_process_memory_fraction(F) before anything is allocated")
    p.add_argument("--dynamic-padding", action="store_true",
                   help="each step's sequences padded to their own longest: a length per step in [seq-len/4, "
                        "seq-len] (bench_harness.changing_lengths), the first at seq-len; tokens/s counts the "
                        "tokens each step ran")
    p.add_argument("--paddings", action="store_true",
                   help="one engine, two runs: a fixed length, then --dynamic-padding; the JSON's 'paddings' holds "
                        "each one's figures")
    p.add_argument("--device-budget", type=int, default=None, help="ours on CUDA: zero_optimization.device_budget")
    p.add_argument("--emulate-budget", type=int, default=None,
                   help="ours on the strict emulated accelerator with this device_budget (no CUDA)")
    p.add_argument("--lora", type=int, default=0, help="LoRA adapters of this rank on every linear layer of the "
                   "blocks, the rest frozen (0: train everything)")
    p.add_argument("--chunk-size", type=int, default=None, help="ours: chunk_size (elements) over the config's")
    p.add_argument("--clip", type=float, default=None, help="gradient_clipping over the config's (1.0); 0: none, so "
                   "that ours' host updates begin in backward (see [Note: host updates in backward])")
    p.add_argument("--optimizer-placement", choices=("time", "fill"), default=None,
                   help="ours: zero_optimization.optimizer_placement (left out: the default, time)")
    p.add_argument("--profile-step", action="store_true", help="one more step under cProfile: the host's "
                   "time per function (host_profile in the JSON)")
    p.add_argument("--planner-snapshot", default=None, help="ours: write the placement planner's last thorough "
                   "plan here (engine.planner_snapshot; plan it again with benchmarks/replan.py)")
    p.add_argument("--json", required=True)
    args = p.parse_args(argv)
    args.warmup = args.warmup if args.warmup == "auto" else int(args.warmup)
    return args


def trial_config(args, cuda: bool) -> dict:
    """The backend's config from ``configs/``, with this trial's batch."""
    backend = "patrickstar" if args.backend == "ours" else "zero3"
    config = bu.load_config(backend_config(backend, offload=args.backend == "zero3-offload"))
    config["train_micro_batch_size_per_gpu"] = args.batch
    config["gradient_accumulation_steps"] = 1
    if args.backend == "ours" and args.emulate_budget is not None:
        if cuda:
            raise SystemExit("--emulate-budget is for a machine without CUDA")
        config["zero_optimization"].update(emulate_accelerator=True, device_budget=args.emulate_budget)
    elif args.backend == "ours" and args.device_budget is not None:
        config["zero_optimization"]["device_budget"] = args.device_budget
    if args.clip is not None:
        config["gradient_clipping"] = args.clip
    if args.backend == "ours" and args.chunk_size is not None:
        config["zero_optimization"]["chunk_size"] = args.chunk_size
    if args.backend == "ours" and args.optimizer_placement is not None:
        config["zero_optimization"]["optimizer_placement"] = args.optimizer_placement
    return config


class PhaseTimer:
    """Seconds of each phase of a step: CUDA events on the current stream where CUDA is, else the wall clock
    (the CPU runs every phase synchronously, so the clock after a phase is its end)."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.marks: list[tuple[str, object, object]] = []

    def _mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def phase(self, name: str, fn, *args):
        start = self._mark()
        out = fn(*args)
        self.marks.append((name, start, self._mark()))
        return out

    def take(self) -> dict[str, float]:
        if self.cuda:
            torch.cuda.synchronize()
        out = {}
        for name, start, end in self.marks:
            out[name] = start.elapsed_time(end) / 1e3 if self.cuda else end - start
        self.marks = []
        return out


class AdamClock:
    """Host wall seconds per step in the optimizer's Adam, by wrapping bound methods of this process's engine (ours
    and DeepSpeed expose no such timer): ours' ``adam.apply`` (every owned chunk's update, with the copies it waits
    for) and its ``adam._update`` calls on host tensors (the CPU Adam kernel, synchronous); stock ZeRO-3's inner
    ``optimizer.step`` (its CPU Adam with offload; on the GPU without offload only the launches). Where the engine
    has none of these it reports nothing."""

    def __init__(self, engine, backend: str):
        self.seconds: dict[str, float] = {}
        self.keys: list[str] = []
        opt = getattr(engine, "optimizer", None)
        if backend == "ours":
            adam = getattr(opt, "adam", None)
            self._wrap(adam, "apply", "adam_s")
            self._wrap(adam, "_update", "adam_host_s", lambda _chunk, data, *rest, **kw: data.device.type == "cpu")
        else:
            self._wrap(getattr(opt, "optimizer", None), "step", "adam_s")

    def _wrap(self, owner, name: str, key: str, when=None) -> None:
        inner = getattr(owner, name, None)
        if not callable(inner):
            return

        def timed(*args, **kwargs):
            if when is not None and not when(*args, **kwargs):
                return inner(*args, **kwargs)
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds[key] = self.seconds.get(key, 0.0) + time.perf_counter() - start

        setattr(owner, name, timed)
        self.keys.append(key)

    def take(self) -> dict[str, float]:
        out = {key: self.seconds.get(key, 0.0) for key in self.keys}
        self.seconds = {}
        return out


def pinned_bandwidth() -> dict | None:
    """Bytes/s of a pinned host -> device and device -> host copy (CUDA only)."""
    if not torch.cuda.is_available():
        return None
    host = torch.empty(PINNED_PROBE_BYTES, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(PINNED_PROBE_BYTES, dtype=torch.uint8, device="cuda")
    out = {}
    for name, (dst, src) in {"h2d": (dev, host), "d2h": (host, dev)}.items():
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(3):
            dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        out[f"{name}_bytes_per_s"] = 3 * PINNED_PROBE_BYTES / (time.perf_counter() - start)
    return out


def host_memory(cuda: bool) -> dict:
    """The host's RSS now and at its peak, and the CUDA caching host allocator's statistics where present."""
    out = {"rss_bytes": bu.host_rss_bytes(), "peak_rss_bytes": bu.host_peak_rss_bytes(),
           "cuda_host_memory_stats": None}
    stats_fn = getattr(torch.cuda, "host_memory_stats", None)
    if not cuda:
        out["cuda_host_memory_stats_note"] = "no CUDA"
    elif stats_fn is None:
        out["cuda_host_memory_stats_note"] = f"torch {torch.__version__} has no torch.cuda.host_memory_stats"
    else:
        stats = stats_fn()
        out["cuda_host_memory_stats"] = {k: v for k, v in stats.items() if k.endswith(".current") or
                                         k.endswith(".peak")}
    return out


def train(args, engine, device, timer: PhaseTimer, adam: AdamClock, vocab: int) -> tuple[list[dict], list[dict]]:
    """(warm-up records, timed records) of training steps on random tokens."""
    gen = torch.Generator().manual_seed(0)
    most_warmup = max(args.max_warmup, 0 if args.warmup == "auto" else args.warmup)
    lengths = changing_lengths(most_warmup + args.steps + 1, args.seq_len)

    def step(i: int) -> dict:
        length = lengths[i] if args.dynamic_padding and i else args.seq_len
        tokens = torch.randint(0, vocab, (args.batch, length + 1), generator=gen).to(device)
        if timer.cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        _, loss = timer.phase("forward", engine, tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
        timer.phase("backward", engine.backward, loss)
        timer.phase("step", engine.step)
        if timer.cuda:
            torch.cuda.synchronize()
        record = {"wall_s": time.perf_counter() - start, "loss": loss.item(), "tokens": args.batch * length,
                  **timer.take()}
        record["other"] = record["wall_s"] - sum(record[k] for k in PHASES)
        record.update(adam.take())
        if hasattr(engine, "get_patrickstar_counters"):
            counters = engine.get_patrickstar_counters()
            record["counters"] = {k: counters[k] for k in COUNTER_KEYS if k in counters}
        return record

    return timed_steps(step, args.warmup, args.steps, args.max_warmup)


def profile_step(args, engine, device, vocab: int, top: int = 30) -> dict:
    """One more step under cProfile: where the host's time goes (the functions with the most time of their
    own), to tell a step bound by the host's time per moment from one bound by the GPU or the copies."""
    import cProfile
    import pstats

    tokens = torch.randint(0, vocab, (args.batch, args.seq_len + 1), generator=torch.Generator().manual_seed(1))
    tokens = tokens.to(device)
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    loss = engine(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())[1]
    engine.backward(loss)
    engine.step()
    profiler.disable()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    stats = pstats.Stats(profiler).stats  # (file, line, name) -> (calls, primitive calls, own s, cumulative s, _)
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    ours = sum(c[2] for (f, _, _), c in stats.items() if "ds_patrickstar" in f)
    return {"wall_s": time.perf_counter() - start, "ds_patrickstar_own_s": ours, "rows": [
        {"function": f"{Path(f).name}:{line}({name})", "calls": c[1], "own_s": c[2], "cumulative_s": c[3]}
        for (f, line, name), c in rows]}


def summarize(args, cfg, n_params: int, warm: list[dict], records: list[dict]) -> dict:
    steady = steady_summary([r["wall_s"] for r in warm], [r["wall_s"] for r in records])
    step_s, tokens = steady["step_s"], args.batch * args.seq_len
    if args.dynamic_padding:  # steps of different lengths: the tokens they ran over the seconds they took
        step_s = sum(r["wall_s"] for r in records) / len(records)
        tokens = sum(r["tokens"] for r in records) / len(records)
    flops = gpt_model.flops_per_token(cfg, n_params, args.seq_len) * tokens
    predicted = (records[-1].get("counters") or {}).get("predicted_step_s")
    planned = (records[-1].get("counters") or {}).get("planned_step_s")
    return {**steady, "step_s": step_s, "tokens_per_step": tokens, "tokens_per_s": tokens / step_s,
            "tflops": flops / step_s / 1e12, "tflops_6n": 6 * n_params * tokens / step_s / 1e12,
            "phases_s": {k: statistics.median(r[k] for r in records) for k in (*PHASES, "other")},
            "adam_s": {k: statistics.median(r[k] for r in records) for k in ("adam_s", "adam_host_s")
                       if k in records[0]},
            "predicted_step_s": predicted, "planned_step_s": planned, "final_loss": records[-1]["loss"]}


def planner_snapshot(engine, args) -> str | None:
    """The path the planner's last thorough plan went to, or why there is none (see [Note: planner snapshot])."""
    if args.planner_snapshot is None:
        return None
    try:
        return engine.planner_snapshot(args.planner_snapshot)
    except RuntimeError as err:
        return f"none: {err}"


def run(args) -> dict:
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    import ds_patrickstar  # noqa: F401  (registers stage "patrickstar")

    cuda = torch.cuda.is_available()
    if args.memory_fraction is not None and cuda:
        torch.cuda.set_per_process_memory_fraction(args.memory_fraction)
    config = trial_config(args, cuda)
    torch.manual_seed(0)
    cfg = gpt_model.get_config(args.model, **json.loads(args.overrides))
    params = gpt_model.count_params_for_config(cfg)
    n_params = params - cfg.block_size * cfg.n_embd  # in matmuls: without the position table
    model = (build_under_init(args.backend, config, lambda: gpt_model.GPT(cfg)) if args.init
             else gpt_model.GPT(cfg))
    if args.lora:
        gpt_model.add_lora(model, args.lora)
    trainable = [p for p in model.parameters() if p.requires_grad]
    start = time.perf_counter()
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=trainable)
    init_s = time.perf_counter() - start
    pinned_at_start = pinned_bandwidth()  # before any step: no host Adam beside the probe (see "pinned" below)
    device, timer, adam = get_accelerator().current_device_name(), PhaseTimer(cuda), AdamClock(engine, args.backend)
    if args.paddings:  # the fixed length first, then dynamic padding on the same engine
        runs = {}
        for padding in ("fixed", "dynamic"):
            args.dynamic_padding = padding == "dynamic"
            warm, records = train(args, engine, device, timer, adam, cfg.vocab_size)
            runs[padding] = {**summarize(args, cfg, n_params, warm, records), "records": records,
                             "warmup_records": warm}
        figures = {"paddings": runs, "records": records}
    else:
        warm, records = train(args, engine, device, timer, adam, cfg.vocab_size)
        figures = {**summarize(args, cfg, n_params, warm, records), "records": records, "warmup_records": warm}
        if args.profile_step:
            figures["host_profile"] = profile_step(args, engine, device, cfg.vocab_size)
    figures["planner_snapshot"] = planner_snapshot(engine, args) if args.backend == "ours" else None
    host, gpu_max = host_memory(cuda), bu.gpu_max_allocated_bytes()  # before the bandwidth probe allocates
    host["model_data_bytes"] = bu.model_data_bytes(engine, "patrickstar" if args.backend == "ours" else 3)
    return {"backend": args.backend, "model": args.model, "overrides": json.loads(args.overrides),
            "params": params, "params_matmul": n_params, "batch": args.batch, "seq_len": args.seq_len,
            "init_s": init_s, "timing": "cuda events" if cuda else "perf_counter",
            "emulated": args.backend == "ours" and args.emulate_budget is not None, "lora": args.lora,
            "device_budget": config["zero_optimization"].get("device_budget"),
            "memory_fraction": args.memory_fraction if cuda else None,
            "activation_checkpointing": cfg.activation_checkpointing,
            "trainable_params": sum(getattr(p, "ds_numel", p.numel()) for p in trainable),
            "losses": [r["loss"] for r in records], **figures, "host": host, "gpu_max_allocated_bytes": gpu_max,
            "pinned": pinned_bandwidth(), "pinned_at_start": pinned_at_start}


def main(argv=None):
    args = parse_args(argv)
    bu.add_repo_to_path()
    bu.setup_single_process_env()
    result = run(args)
    Path(args.json).write_text(json.dumps(result, indent=1))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
