#!/usr/bin/env python
"""Benchmark of the fused chunk Adam step against the best existing ways to do the same job.

The job: a chunk holds bf16 gradients (in the low-precision param slot) and fp32
master/exp_avg/exp_avg_sq; one Adam step must leave updated fp32 state and the
new bf16 params. Paths, all on the same master/exp_avg/exp_avg_sq buffers:

  ours            fused kernel: bf16 grad -> fp32 state -> bf16 param, one pass
  ds_cpu_adam     DeepSpeedCPUAdam (CPU) incl. bf16->fp32 grad copy and fp32->bf16 param copy
  torch_fused_e2e torch AdamW(fused=True) incl. the same two copies
  torch_fused_fp32 torch AdamW(fused=True) alone (grads already fp32, no copies)
  reference       ds_patrickstar.optim.adam_math.adam_step_reference (pure torch)
  ours_from       CPU: the fused kernel from (grad, master, exp_avg, exp_avg_sq) into other buffers
                  (adam_step_from: a host update begun in backward, see [Note: host updates in backward])
  copy_then_ours  CPU: the same job by copying the four into the other buffers, then ours in place
  bandwidth       CPU: triad a = b + s*c (STREAM convention, 12 B/elem counted; a separate
                  output array also costs a write-allocate read, so real traffic is 16 B) and the
                  in-place update a += s*c (12 B/elem, read-modify-write like every buffer of
                  ours); the bound uses the faster of the two. CUDA: device-to-device copy.

Bytes moved per param (counting each read and each write once, no write-allocate):
  ours 28 = 2 (bf16 grad) + 2 (bf16 param) + 3 * 8 (fp32 master, exp_avg, exp_avg_sq, read + write)
  *_e2e 40 = 6 (bf16 grad -> fp32 grad) + 28 (fp32 Adam: grad 4, p/m/v 24) + 6 (fp32 -> bf16 param)
  torch_fused_fp32 28; reference 28 (its minimum; it really moves more, through temporaries).
Timing: warm-up, then rounds that run every path once each (interleaved, so background load
hits all alike); the median per path is reported.

    python benchmarks/bench_adam.py [--size 16777216] [--repeats 10] [--threads 1,all] [--device cpu|cuda]
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from ds_patrickstar.optim import kernels
from ds_patrickstar.optim.adam_math import AdamHyper, adam_step_reference

HYPER = AdamHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, adamw=True)
BYTES = {"ours": 28, "ds_cpu_adam": 40, "ds_fused_adam": 40, "torch_fused_e2e": 40, "torch_fused_fp32": 28,
         "reference": 28, "ours_from": 28, "copy_then_ours": 56}
SIMD_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_bf16",
              "avx512_fp16", "amx_bf16", "asimd", "sve")


def describe_cpu() -> str:
    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in open("/proc/cpuinfo", encoding="ascii", errors="replace"):
            if line.startswith("model name") and model in (platform.processor(), platform.machine(), ""):
                model = line.split(":", 1)[1].strip()
            elif line.startswith(("flags", "Features")) and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    simd = " ".join(f for f in SIMD_FLAGS if f in flags) or "unknown"
    return (f"CPU: {model}; {os.cpu_count()} logical cores; SIMD flags: {simd}; "
            f"torch {torch.__version__} cpu capability {torch.backends.cpu.get_cpu_capability()}")


def torch_adamw(param: torch.nn.Parameter, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor):
    opt = torch.optim.AdamW([param], lr=HYPER.lr, betas=(HYPER.beta1, HYPER.beta2), eps=HYPER.eps,
                            weight_decay=HYPER.weight_decay, fused=True)
    # Share our state buffers (as load_state_dict would).
    opt.state[param] = {"step": torch.zeros((), dtype=torch.float32, device=param.device),
                        "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    return opt


def build_paths(n: int, device: str, skip_ds: bool
                ) -> tuple[dict[str, Callable[[], None]], dict[str, tuple[Callable[[], None], int]]]:
    """Steps to time, and the bandwidth probes with their bytes per call."""
    dev = torch.device(device)
    gen = torch.Generator().manual_seed(0)
    grad_lp = torch.randn(n, generator=gen).to(device=dev, dtype=torch.bfloat16)  # grad in, bf16 param out
    master = torch.randn(n, generator=gen).to(dev)
    exp_avg, exp_avg_sq = torch.zeros(n, device=dev), torch.zeros(n, device=dev)
    grad32 = torch.empty(n, device=dev)
    param = torch.nn.Parameter(master)  # shares master's storage
    param.grad = grad32
    count = {"t": 0}

    fused = kernels.get_adam_backend(dev)
    name = kernels.adam_backend_name(dev)
    if name == "torch_reference":
        print(f"WARNING: no fused kernel for {device}; 'ours' is the reference", file=sys.stderr)

    def ours():
        count["t"] += 1
        fused(grad_lp, master, exp_avg, exp_avg_sq, step=count["t"], hyper=HYPER, grad_scale=1.0)

    def reference():
        count["t"] += 1
        adam_step_reference(grad_lp, master, exp_avg, exp_avg_sq, step=count["t"], hyper=HYPER, grad_scale=1.0)

    paths: dict[str, Callable[[], None]] = {"ours": ours}
    if not skip_ds:
        try:
            if device == "cpu":
                from deepspeed.ops.adam import DeepSpeedCPUAdam as DSAdam
                ds_name = "ds_cpu_adam"
            else:
                from deepspeed.ops.adam import FusedAdam as DSAdam
                ds_name = "ds_fused_adam"
            t0 = time.perf_counter()
            ds_opt = DSAdam([param], lr=HYPER.lr, betas=(HYPER.beta1, HYPER.beta2), eps=HYPER.eps,
                            weight_decay=HYPER.weight_decay, adamw_mode=True)
            if device == "cpu":  # share our state buffers; FusedAdam (CUDA) allocates its own
                ds_opt.state[param] = {"step": 0, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
            print(f"{type(ds_opt).__name__} ready in {time.perf_counter() - t0:.1f} s (JIT build on first use)")

            def ds_e2e():
                grad32.copy_(grad_lp)
                ds_opt.step()
                grad_lp.copy_(master)

            ds_e2e()  # fail here, not in the middle of the timing
            paths[ds_name] = ds_e2e
        except Exception as exc:  # report and go on without it
            print(f"DeepSpeed Adam unavailable: {type(exc).__name__}: {str(exc)[:300]}", file=sys.stderr)
    topt = torch_adamw(param, exp_avg, exp_avg_sq)

    def torch_e2e():
        grad32.copy_(grad_lp)
        topt.step()
        grad_lp.copy_(master)

    paths["torch_fused_e2e"] = torch_e2e
    paths["torch_fused_fp32"] = topt.step
    paths["reference"] = reference

    if device == "cpu":
        step_from = kernels.get_adam_from_backend(dev)
        spare = (torch.empty_like(grad_lp), *(torch.empty_like(master) for _ in range(3)))
        sources = (grad_lp, master, exp_avg, exp_avg_sq)

        def ours_from():
            step_from(*sources, *spare, step=count["t"] + 1, hyper=HYPER, grad_scale=1.0)

        def copy_then_ours():
            for out, source in zip(spare, sources):
                out.copy_(source)
            fused(*spare, step=count["t"] + 1, hyper=HYPER, grad_scale=1.0)

        paths.update(ours_from=ours_from, copy_then_ours=copy_then_ours)
        m = max(n, 32 * 2**20)  # 3 x >= 128 MB: far beyond any L3
        a, b, c = torch.empty(m), torch.rand(m), torch.rand(m)

        a.zero_()
        return paths, {"triad a=b+s*c": (lambda: torch.add(b, c, alpha=1.5, out=a), 12 * m),
                       "in-place a+=s*c": (lambda: a.add_(c, alpha=1.5), 12 * m)}
    src, dst = torch.zeros(4 * n, device=dev), torch.empty(4 * n, device=dev)
    return paths, {"d2d copy": (lambda: dst.copy_(src), 2 * 4 * 4 * n)}


def measure(paths: dict[str, Callable[[], None]], probes: dict[str, tuple[Callable[[], None], int]], warmup: int,
            repeats: int, device: str) -> tuple[dict[str, float], dict[str, float]]:
    """Median seconds per path, and GB/s per bandwidth probe."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    jobs = dict(paths, **{k: fn for k, (fn, _) in probes.items()})
    for fn in jobs.values():
        for _ in range(warmup):
            fn()
    sync()
    times: dict[str, list[float]] = {k: [] for k in jobs}
    for _ in range(repeats):
        for k, fn in jobs.items():
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            times[k].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    return ({k: med[k] for k in paths}, {k: nbytes / med[k] / 1e9 for k, (_, nbytes) in probes.items()})


def report(n: int, med: dict[str, float], bws: dict[str, float], label: str) -> None:
    bw = max(bws.values())
    probes = ", ".join(f"{k} {v:.1f} GB/s" for k, v in bws.items())
    print(f"\n== {label}: {n / 1e6:.1f} M params; bandwidth: {probes}")
    print(f"{'path':<18}{'bytes/param':>12}{'median ms':>11}{'Mparams/s':>11}{'eff GB/s':>10}{'ours/path':>11}")
    rate = {k: n / t for k, t in med.items()}
    for k, t in med.items():
        print(f"{k:<18}{BYTES[k]:>12}{t * 1e3:>11.2f}{rate[k] / 1e6:>11.1f}{rate[k] * BYTES[k] / 1e9:>10.1f}"
              f"{rate['ours'] / rate[k]:>10.2f}x")
    existing = [k for k in ("ds_cpu_adam", "ds_fused_adam", "torch_fused_e2e") if k in rate]
    best = max(existing, key=rate.get)
    bound = bw * 1e9 / BYTES["ours"]
    print(f"ours / best existing end-to-end ({best}): {rate['ours'] / rate[best]:.2f}x")
    print(f"ours / torch fused fp32 AdamW alone:       {rate['ours'] / rate['torch_fused_fp32']:.2f}x")
    print(f"ours achieved / bandwidth bound ({bound / 1e6:.0f} Mparams/s = {bw:.1f} GB/s / 28 B): "
          f"{rate['ours'] / bound:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=int, default=16 * 2**20, help="params per step (default 16M)")
    ap.add_argument("--repeats", type=int, default=10, help="timed rounds (median reported)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", default="1,all", help="comma list of CPU thread counts; 'all' = os.cpu_count()")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--skip-deepspeed", action="store_true", help="leave out DeepSpeed's optimizer")
    args = ap.parse_args()

    print(describe_cpu())
    if args.device == "cuda":
        if not torch.cuda.is_available():
            sys.exit("--device cuda: no CUDA device")
        print(f"GPU: {torch.cuda.get_device_name()}")
    print(f"Adam backend: {kernels.adam_backend_name(args.device)}"
          + (f" (SIMD {kernels.cpu_simd_name()})" if args.device == "cpu" else ""))
    paths, probes = build_paths(args.size, args.device, args.skip_deepspeed)
    saved = torch.get_num_threads()
    thread_counts = [os.cpu_count() if t.strip() == "all" else int(t) for t in args.threads.split(",")]
    if args.device == "cuda":
        thread_counts = [saved]
    for threads in dict.fromkeys(thread_counts):
        torch.set_num_threads(threads)
        med, bws = measure(paths, probes, args.warmup, args.repeats, args.device)
        label = f"{args.device}, {threads} thread{'s' if threads > 1 else ''}" if args.device == "cpu" else "cuda"
        report(args.size, med, bws, label)
    torch.set_num_threads(saved)


if __name__ == "__main__":
    main()
