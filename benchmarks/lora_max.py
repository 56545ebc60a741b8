"""The largest LoRA base this machine fine-tunes, per backend, and the step time at one size side by side.

    python benchmarks/lora_max.py --disk DIR                               # the search, every backend
    python benchmarks/lora_max.py --disk DIR --fixed-depth 2               # every backend at depth 2, side by side

The model is ``gpt_model.GPT`` of width ``--width`` (2048) with ``lora_rank`` ``--rank`` (16): a trainable
rank-16 adapter beside every linear layer of the blocks, everything else frozen (the base), bf16. Each try
builds it as its users would, in a process of its own, and trains ``--steps`` steps of ``--batch`` x
``--seq-len`` (1 x 16) random tokens: the compute stays small, the point is memory. Backends:

* ``patrickstar``: ``ds_patrickstar.Init`` + stage "patrickstar", the frozen chunks in RAM;
* ``patrickstar-disk``: the same with the frozen chunks on disk (``"offload_param": {"device": "nvme",
  "nvme_path": DIR}`` and ``"host_budget"`` ``--host-budget-gib``);
* ``zero3-cpu``: stock ZeRO-3 with ``deepspeed.zero.Init`` and ``offload_param`` ``cpu``;
* ``zero3-nvme``: the same with ``offload_param`` ``nvme`` under ``DIR``, ``--nvme-buffers`` parameter buffers
  and ZeRO-3's memory knobs turned down (``bench_utils.ZERO3_MEMORY_TUNED``): DeepSpeed's defaults run out of
  buffers at small depths (skipped, with the reason, where DeepSpeed's async_io op does not load: it needs
  ``libaio-dev``);
* ``torch``: plain PyTorch, the base built in bf16, the adapters in fp32 under bf16 autocast,
  ``torch.optim.AdamW`` over the adapters.

``max_model.py`` runs each try (``launch_ranks``: the resident memory of the try's processes polled every
``--poll`` s and capped at ``--host-mem-gib``) and searches the depth (``search``: a walk by ``--grow``,
then a bisection). With ``--disk`` the run first measures the disk's sequential read bandwidth with
``O_DIRECT`` reads (``bench_disk.raw_bandwidth``: ``--probe-gib`` file, 16 threads of 8 MiB requests; the
page cache plays no part), the bound each try's achieved read rate is compared with. A try's bytes read
per step are its process's ``read_bytes`` (``/proc/self/io``: what it fetched from storage, page-cache
hits excluded) over that step; achieved GB/s is that over the step's time.
"""
import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]
import max_model
from bench_harness import build_under_init, error_line, markdown_table, steady_summary

GIB = 1024**3
BACKENDS = ("patrickstar", "patrickstar-disk", "zero3-cpu", "zero3-nvme", "torch")
DISK_BACKENDS = ("patrickstar-disk", "zero3-nvme")
OURS_VS_ZERO3 = {"patrickstar": "zero3-cpu", "patrickstar-disk": "zero3-nvme"}
# host bytes per base parameter, for the search's first depth only: about 2 (bf16) in RAM; the disk backends
# start near a base of 1.3x the machine's memory
GUESS_BYTES_PER_PARAM = {"patrickstar": 2.6, "patrickstar-disk": 1.3, "zero3-cpu": 2.8, "zero3-nvme": 1.3,
                         "torch": 2.6}
PROBE_THREADS, PROBE_BLOCK = 16, 8 << 20


# ---------------------------------------------------------------- one try (its own process)
def ds_config(args) -> dict:
    """The DeepSpeed config of a ``patrickstar*`` or ``zero3-*`` backend."""
    cfg = {"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1,
           "steps_per_print": 10**9, "bf16": {"enabled": True},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0}}}
    swap = os.path.join(args.disk, "swap") if args.disk else None
    if args.backend == "patrickstar":
        cfg["zero_optimization"] = {"stage": "patrickstar"}
    elif args.backend == "patrickstar-disk":
        cfg["zero_optimization"] = {"stage": "patrickstar", "offload_param": {"device": "nvme", "nvme_path": swap},
                                    "host_budget": int(args.host_budget_gib * GIB)}
    elif args.backend == "zero3-cpu":
        cfg["zero_optimization"] = {"stage": 3, "offload_param": {"device": "cpu"}}
    else:  # zero3-nvme: each swapped-in parameter takes one buffer, which must hold the largest (the embedding)
        room = max(10**8, args.vocab * args.width)
        from bench_utils import ZERO3_MEMORY_TUNED  # fewer parameters live and prefetched: fewer buffers taken

        cfg["zero_optimization"] = {"stage": 3, **ZERO3_MEMORY_TUNED,
                                    "offload_param": {"device": "nvme", "nvme_path": swap, "buffer_size": room,
                                                      "buffer_count": args.nvme_buffers}}
        cfg["aio"] = {"block_size": 1 << 20, "queue_depth": 8, "intra_op_parallelism": 1, "single_submit": False,
                      "overlap_events": True}
    return cfg


def _read_bytes() -> int:
    """Bytes this process (all its threads) fetched from storage so far."""
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("read_bytes:")).split()[1])


def _adapters(model, cfg):
    """The trainable parameters, checked to be the adapters and nothing else (``ds_numel``: a ZeRO-3 partition's
    whole size; under ``ds_patrickstar.Init`` a parameter's shape is there before its values)."""
    from gpt_model import count_adapter_params

    trainable = [p for p in model.parameters() if p.requires_grad]
    count = sum(getattr(p, "ds_numel", p.numel()) for p in trainable)
    if count != count_adapter_params(cfg):
        raise RuntimeError(f"{count} trainable parameters, not the {count_adapter_params(cfg)} of the adapters")
    return trainable


def _build(args, cfg):
    """``(engine, step)``: the LoRA GPT built as the backend's users build it, initialized (engine None for plain
    PyTorch), and one training step."""
    import torch
    from gpt_model import GPT

    if args.backend == "torch":
        default = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)  # the base built in bf16 directly: no fp32 copy of it
        try:
            model = GPT(cfg)
        finally:
            torch.set_default_dtype(default)
        adapters = _adapters(model, cfg)
        for p in adapters:
            p.data = p.data.float()
        optimizer = torch.optim.AdamW(adapters, lr=1e-4, weight_decay=0.0)

        def torch_step(x):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                _, loss = model(x, x)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss

        return None, torch_step
    import deepspeed

    config = ds_config(args)
    model = build_under_init(args.backend, config, lambda: GPT(cfg))
    adapters = _adapters(model, cfg)
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=adapters)

    def engine_step(x):
        _, loss = engine(x, x)
        engine.backward(loss)
        engine.step()
        return loss

    return engine, engine_step


def run_try(args):
    """Build, initialize and train ``args.steps`` steps; write step times, bytes read and counters to
    ``args.result``."""
    import torch
    from gpt_model import GPTConfig

    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=args.depth, n_head=args.heads, n_embd=args.width, block_size=args.seq_len,
                    vocab_size=args.vocab, lora_rank=args.rank, activation_checkpointing=args.checkpointing)
    engine, step = _build(args, cfg)
    gen = torch.Generator().manual_seed(0)
    times, reads, counters = [], [], []
    for _ in range(args.steps):
        x = torch.randint(0, args.vocab, (args.batch, args.seq_len), generator=gen)
        before, start = _read_bytes(), time.perf_counter()
        loss = step(x)
        times.append(time.perf_counter() - start)
        reads.append(_read_bytes() - before)
        if engine is not None and hasattr(engine, "get_patrickstar_counters"):
            got = engine.get_patrickstar_counters()
            counters.append({k: v for k, v in got.items() if k.startswith(("disk_", "frozen_", "model_data"))})
        if not torch.isfinite(loss).item():
            raise RuntimeError(f"non-finite loss {loss.item()}")
    Path(args.result).write_text(json.dumps({"step_times": times, "read_bytes": reads, "counters": counters}))


# ---------------------------------------------------------------- the tries and the table (no torch here)
def sizes(args, depth) -> dict:
    """Parameters of the base and of the adapters at ``depth``, without building the model."""
    from gpt_model import GPTConfig, count_adapter_params, count_params_for_config

    cfg = GPTConfig(n_layer=depth, n_head=args.heads, n_embd=args.width, block_size=args.seq_len,
                    vocab_size=args.vocab, lora_rank=args.rank)
    adapters = count_adapter_params(cfg)
    return {"base": count_params_for_config(cfg) - adapters, "adapters": adapters}


def attempt(args, backend, depth) -> dict:
    """One try of ``backend`` at ``depth``: what it measured, or ``ok: False`` and why."""
    result = tempfile.mktemp(prefix="lora_max_", suffix=".json")
    log = Path(args.logs) / f"{backend}_L{depth}.log"
    swap = os.path.join(args.disk, "swap") if args.disk else None
    if swap:  # every try starts on an empty swap folder, and leaves none behind
        shutil.rmtree(swap, ignore_errors=True)
        os.makedirs(swap)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--try", "--backend", backend, "--depth", str(depth),
           "--result", result, *_shared_flags(args)]
    run = max_model.launch_ranks(cmd, 1, args, log)
    out = {"backend": backend, "depth": depth, "params": sum(sizes(args, depth).values()), **sizes(args, depth),
           "peak_host_bytes": run["peak_host_bytes"], "seconds": run["seconds"], "log": str(log)}
    if run["why"] is None and os.path.exists(result):
        out.update(json.loads(Path(result).read_text()), ok=True)
    else:
        crashed = run["why"] is None or run["why"].startswith("exit codes")  # else killed: over the cap, timed out
        said = error_line(log.read_text(errors="replace")) if crashed and log.exists() else None
        out.update(ok=False, why=said or run["why"] or f"no result (see {log})")
    for path in (result, swap):
        if path and os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        elif path and os.path.exists(path):
            os.remove(path)
    return out


def _shared_flags(args) -> list[str]:
    flags = ["--width", args.width, "--heads", args.heads, "--vocab", args.vocab, "--rank", args.rank,
             "--seq-len", args.seq_len, "--batch", args.batch, "--steps", args.steps,
             "--host-budget-gib", args.host_budget_gib, "--nvme-buffers", args.nvme_buffers]
    return [str(f) for f in flags] + (["--disk", args.disk] if args.disk else []) + \
        (["--checkpointing"] if args.checkpointing else [])


def measured(r) -> dict:
    """Over the timed steps (all but the first): the median step time (``bench_harness.steady_summary``) and
    bytes read, tokens/s, and the bytes read over the seconds those steps took (read GB/s)."""
    first = 1 if len(r["step_times"]) > 1 else 0
    times, reads = r["step_times"][first:], r["read_bytes"][first:]
    step = steady_summary(r["step_times"][:first], times)["step_s"]
    return {"step": step, "tokens": r.get("tokens", 0) / step, "read": statistics.median(reads),
            "read_gbs": sum(reads) / sum(times) / 1e9}


def table(rows, args, disk_gbs) -> str:
    """One row per try; ratios of ours' step time to ZeRO-3's where both trained at the same depth."""
    ram = psutil.virtual_memory().total
    header = ["backend", "depth", "base params", "adapters", "base bf16", "base / RAM", "result", "step time",
              "tokens/s", "peak RSS", "read / step", "read GB/s", "/ disk read", "step vs ZeRO-3"]
    by_key = {(r["backend"], r["depth"]): r for r in rows}
    body = []
    for r in rows:
        cells = [r["backend"], r["depth"], f"{r['base'] / 1e9:.3f}B", f"{r['adapters'] / 1e6:.1f}M",
                 f"{2 * r['base'] / GIB:.2f} GiB", f"{2 * r['base'] / ram:.2f}"]
        if not r["ok"]:
            body.append(cells + [f"FAILED: {r['why']}"] + [""] * 7)
            continue
        m = measured({**r, "tokens": args.batch * args.seq_len})
        ratio = f"{m['read_gbs'] / disk_gbs:.0%}" if disk_gbs else "n/a"
        other = by_key.get((OURS_VS_ZERO3.get(r["backend"]), r["depth"]))
        vs = f"{m['step'] / measured(other)['step']:.2f}x" if other and other["ok"] else ""
        body.append(cells + ["trained", f"{m['step']:.2f} s", f"{m['tokens']:.1f}",
                             f"{r['peak_host_bytes'] / GIB:.2f} GiB", f"{m['read'] / GIB:.2f} GiB",
                             f"{m['read_gbs']:.2f}", ratio, vs])
    return "\n".join(markdown_table(header, body))


def probe_disk(args) -> float | None:
    """The disk's sequential read GB/s under ``--disk`` (O_DIRECT), or None without ``--disk``."""
    if not args.disk:
        return None
    from bench_disk import raw_bandwidth

    folder = os.path.join(args.disk, "probe")
    os.makedirs(folder, exist_ok=True)
    try:
        size = int(args.probe_gib * GIB) // PROBE_BLOCK * PROBE_BLOCK
        return raw_bandwidth(folder, size, PROBE_BLOCK, PROBE_THREADS, modes=("read",))["read"]
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    total = psutil.virtual_memory().total / GIB
    p.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated, of " + ", ".join(BACKENDS))
    p.add_argument("--disk", default=None, metavar="DIR", help="the disk backends' swap folder and the disk probed "
                   "(without it the disk backends are left out)")
    p.add_argument("--fixed-depth", type=int, default=None, help="one try per backend at this depth, no search")
    p.add_argument("--host-mem-gib", type=float, default=round(total - 2.0, 1),
                   help=f"the cap on a try's resident memory (default: this machine's {total:.1f} GiB minus 2)")
    p.add_argument("--host-budget-gib", type=float, default=None,
                   help="patrickstar-disk's host_budget (default: 60%% of --host-mem-gib)")
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--rank", type=int, default=16, help="LoRA rank of the adapters")
    p.add_argument("--checkpointing", action="store_true", help="checkpoint every block (torch's non-reentrant)")
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=3, help="steps per try (the first is not timed)")
    p.add_argument("--max-depth", type=int, default=1024)
    p.add_argument("--start-depth", type=int, default=None, help="the search's first depth")
    p.add_argument("--grow", type=float, default=1.15)
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per try")
    p.add_argument("--poll", type=float, default=0.1)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--nvme-buffers", type=int, default=8,
                   help="zero3-nvme: offload_param.buffer_count (DeepSpeed's default 5 runs out at depth 2: "
                        "'Not enough buffers 0 for swapping 1')")
    p.add_argument("--probe-gib", type=float, default=4.0, help="size of the disk probe's file")
    p.add_argument("--logs", default=str(HERE.parent / "runs" / "lora_max"))
    p.add_argument("--json", default=None, help="write every try and the table here")
    p.add_argument("--try", dest="is_try", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--backend", help=argparse.SUPPRESS)
    p.add_argument("--depth", type=int, help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.host_budget_gib is None:
        args.host_budget_gib = round(max_model.DISK_HOST_SHARE * args.host_mem_gib, 2)
    return args


def choose_backends(args) -> list[str]:
    """The backends of ``--backends`` that can run here; each one left out is said why."""
    chosen = []
    for backend in args.backends.split(","):
        if backend not in BACKENDS:
            raise SystemExit(f"--backends: unknown backend {backend!r}; choose from {', '.join(BACKENDS)}")
        why = "needs --disk DIR" if backend in DISK_BACKENDS and not args.disk else ""
        if backend == "zero3-nvme" and not why:
            why = max_model._async_io_missing()
        if why:
            print(f"skipping {backend}: {why}", flush=True)
        else:
            chosen.append(backend)
    return chosen


def _bound_disk_depth(args):
    """The disk backends write the bf16 base (2 bytes per parameter) under ``--disk``: bound the depth by it."""
    free = shutil.disk_usage(args.disk).free
    while args.max_depth > 1 and 2.2 * sizes(args, args.max_depth)["base"] > free:
        args.max_depth -= 1
    print(f"--disk {args.disk}: {free / GIB:.1f} GiB free; the disk backends' depth at most {args.max_depth}",
          flush=True)


def main(argv=None):
    args = parse_args(argv)
    if args.is_try:
        run_try(args)
        return
    backends = choose_backends(args)
    Path(args.logs).mkdir(parents=True, exist_ok=True)
    if args.disk:
        os.makedirs(args.disk, exist_ok=True)
        _bound_disk_depth(args)
    disk_gbs = probe_disk(args)
    ram = psutil.virtual_memory().total
    print(f"lora_max: width {args.width}, rank-{args.rank} adapters, bf16, {args.batch} x {args.seq_len} tokens, "
          f"{args.steps} steps per try, host cap {args.host_mem_gib:.1f} GiB, machine RAM {ram / GIB:.1f} GiB; "
          + (f"disk sequential read {disk_gbs:.2f} GB/s (O_DIRECT, {PROBE_THREADS} threads x "
             f"{PROBE_BLOCK >> 20} MiB, {args.probe_gib:g} GiB file under {args.disk})" if disk_gbs else "no --disk"),
          flush=True)
    rows = []
    for backend in backends:
        if args.fixed_depth is not None:
            rows.append(attempt(args, backend, args.fixed_depth))
            r = rows[-1]
            print(f"  [{backend}] L={r['depth']}: " + ("ok" if r["ok"] else f"FAILED: {r['why']}"), flush=True)
            continue
        guess = GUESS_BYTES_PER_PARAM[backend]
        best, tries = max_model.search(args, backend, 1, args.logs, lambda d, b=backend: attempt(args, b, d), guess)
        rows.append(best or tries[-1])
    text = table(rows, args, disk_gbs)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "disk_read_gbs": disk_gbs, "rows": rows,
                                               "table": text}, indent=1))


if __name__ == "__main__":
    main()
