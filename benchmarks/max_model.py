"""The largest model that trains: bisection over GPT depth at a fixed width, per backend.

    python benchmarks/max_model.py                                   # every backend, world sizes 1 and 2
    python benchmarks/max_model.py --backends patrickstar,zero3 --world-sizes 1 --host-mem-gib 20

A *try* builds a GPT (``--width``, depth ``L``), initializes the backend and trains ``--steps``
optimizer steps on random tokens, each rank in its own process. The search process polls the
resident memory (RSS) of every process of the try every ``--poll`` seconds; a try whose total
exceeds ``--host-mem-gib``, that times out, crashes, or runs out of GPU memory is a failure.
The search starts from an estimate (``--host-mem-gib`` / a guess of the backend's bytes/param),
walks up or down by ``--grow`` until it brackets the largest depth that trains, then bisects
down to one layer.

Backends (each as its users would run it): ``patrickstar`` (``ds_patrickstar.Init`` + stage
"patrickstar"), ``patrickstar-disk`` (the same with the disk tier, swap files under ``--disk DIR``,
whose free space bounds the depth searched; host_budget 60% of the cap), ``zero3`` (stock ZeRO-3 with
``deepspeed.zero.Init``), ``zero3-tuned`` (the same with DeepSpeed's memory knobs turned down,
``bench_utils.ZERO3_MEMORY_TUNED``), ``zero3-offload`` (ZeRO-3 + ``offload_param`` +
``offload_optimizer`` to the CPU, CUDA only), ``zero3-infinity`` (stock ZeRO-Infinity: ZeRO-3 with
``offload_optimizer`` and ``offload_param`` on ``"device": "nvme"`` under ``--disk DIR``, DeepSpeed's
async_io op with its default ``aio`` block; added with ``--disk`` where that op loads, skipped with a
message where it does not) and ``torch`` (plain PyTorch AdamW on an fp32 model under bf16 autocast;
world size 1 only). On CUDA the device's memory is a limit too (an out-of-memory error fails the try).

The table: the largest parameter count per backend and world size, the peak host memory of
that try over its parameter count (bytes/param all-in: every process of the try, baseline
included), the median step time, and the ratios to ZeRO-3 at the same world size.
"""
import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_harness import build_under_init, ds_config, free_port, gpt_params, markdown_table

GIB = 1024 ** 3
# bytes/param guesses for the first try only (the search corrects them)
GUESS_BYTES_PER_PARAM = {"patrickstar": 15.0, "patrickstar-disk": 4.0, "zero3": 25.0, "zero3-tuned": 24.0,
                         "zero3-offload": 22.0, "zero3-infinity": 8.0, "torch": 17.0}
DISK_BACKENDS = ("patrickstar-disk", "zero3-infinity")
BASELINE = "zero3"
DISK_HOST_SHARE = 0.6  # patrickstar-disk: host_budget per rank = this share of the cap / world size


# ---------------------------------------------------------------- one try (a rank process)
class ResidentPeaks:
    """This process's resident memory by phase: a thread reads it every ``interval`` seconds and
    :meth:`phase` records the peak since the last call and the memory now, under that name."""

    def __init__(self, interval=0.005):
        self._process, self._interval = psutil.Process(), interval
        self._peak = self._process.memory_info().rss
        self.phases = {}  # name -> {"peak": bytes, "end": bytes}
        threading.Thread(target=self._sample, daemon=True).start()

    def _sample(self):
        while True:
            self._peak = max(self._peak, self._process.memory_info().rss)
            time.sleep(self._interval)

    def phase(self, name):
        now = self._process.memory_info().rss
        self.phases[name] = {"peak": max(self._peak, now), "end": now}
        self._peak = now


class PhaseClock:
    """Seconds of forward, backward and optimizer step of one training step (synchronized on CUDA),
    with the disk tier's I/O figures from the counters (``disk_wait_seconds``: the I/O not hidden)."""

    DISK = ("disk_bytes_read", "disk_bytes_written", "disk_io_seconds", "disk_wait_seconds")

    def __init__(self, cuda, resident=None):
        self.cuda, self.seconds, self.resident = cuda, {}, resident

    @contextlib.contextmanager
    def timed(self, phase):
        start = time.perf_counter()
        yield
        if self.cuda:
            import torch

            torch.cuda.synchronize()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start
        if self.resident is not None:
            self.resident.phase(phase)

    def take(self, engine):
        out, self.seconds = self.seconds, {}
        if engine is not None:
            counters = engine.get_patrickstar_counters()
            out.update({k: counters[k] for k in self.DISK if k in counters})
        return out


def run_try(args):
    """Build, initialize and train; rank 0 writes a JSON result to ``args.result``."""
    sys.path[:0] = [str(HERE), str(HERE.parent)]
    import torch
    from gpt_model import GPT, GPTConfig

    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=args.depth, n_head=args.heads, n_embd=args.width, block_size=args.seq_len,
                    vocab_size=args.vocab)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    model_data = None
    resident = ResidentPeaks()
    phases = PhaseClock(cuda, resident)
    if args.backend == "torch":
        model = GPT(cfg).to(device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, foreach=False)

        def train_step(x):
            for micro in x.chunk(args.grad_accum):
                with torch.autocast(device.type, dtype=torch.bfloat16):
                    _, loss = model(micro, micro)
                loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss
    else:
        import deepspeed

        ds_cfg = ds_config(args.backend, args.batch, args.keep_gathered, args.grad_accum, args.disk,
                           args.host_budget, args.vocab * args.width, args.device_budget, emulate=not cuda,
                           chunk_size=args.chunk_size)
        model = build_under_init(args.backend, ds_cfg, lambda: GPT(cfg))
        resident.phase("build")
        engine, *_ = deepspeed.initialize(model=model, config=ds_cfg, model_parameters=model.parameters())
        resident.phase("initialize")

        def train_step(x):
            for micro in x.chunk(args.grad_accum):  # micro-batches of one optimizer step
                with phases.timed("forward"):
                    _, loss = engine(micro, micro)
                with phases.timed("backward"):
                    engine.backward(loss)
                with phases.timed("step"):
                    engine.step()
            return loss
    gen = torch.Generator().manual_seed(int(os.environ.get("RANK", 0)))
    times, breakdown = [], []
    for _ in range(args.steps):
        x = torch.randint(0, args.vocab, (args.batch * args.grad_accum, args.seq_len), generator=gen).to(device)
        start = time.perf_counter()
        loss = train_step(x)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        breakdown.append(phases.take(engine if args.backend.startswith("patrickstar") else None))
        if not torch.isfinite(loss).item():
            raise RuntimeError(f"non-finite loss {loss.item()}")
    if args.backend == "patrickstar":
        model_data = engine.get_patrickstar_counters()["model_data_bytes"]

    if int(os.environ.get("RANK", 0)) == 0:
        result = {"step_times": times, "breakdown": breakdown, "model_data_bytes_rank0": model_data,
                  "resident_rank0": resident.phases,
                  "gpu_max_allocated": torch.cuda.max_memory_allocated() if cuda else None}
        Path(args.result).write_text(json.dumps(result))


# ---------------------------------------------------------------- the search (no torch here)
def _tree_memory(procs):
    """Resident memory (RSS) of every rank of a try and of their children. A child that has not
    exec'd yet (same command line as its rank: a fork on its way to running a tool) shares its
    rank's pages and is not counted, or a 20 GiB rank would count twice. (PSS would be exact but
    reading it walks a 20 GiB process's page tables under its memory lock and stalls it.)"""
    total = 0
    for proc in procs:
        try:
            rank = psutil.Process(proc.pid)
            total += rank.memory_info().rss
            command = rank.cmdline()
            for child in rank.children(recursive=True):
                try:
                    if child.cmdline() != command:
                        total += child.memory_info().rss
                except psutil.Error:
                    pass
        except psutil.Error:
            pass
    return total


def _kill(procs):
    for proc in procs:
        try:
            for child in psutil.Process(proc.pid).children(recursive=True):
                child.kill()
        except psutil.Error:
            pass
        if proc.poll() is None:
            proc.kill()
    for proc in procs:
        proc.wait()


def attempt(args, backend, world_size, depth, log_dir):
    """One try in its own processes; returns a dict with ``ok`` and what was measured."""
    params = gpt_params(args.width, depth, args.vocab, args.seq_len)
    cap = int(args.host_mem_gib * GIB)
    result_path = tempfile.mktemp(prefix="max_model_", suffix=".json")
    log_path = Path(log_dir) / f"{backend}_ws{world_size}_L{depth}.log"
    swap = os.path.join(args.disk, "zero_infinity") if backend == "zero3-infinity" else None
    if swap:  # a killed try leaves its swap files behind: every try starts on an empty folder
        shutil.rmtree(swap, ignore_errors=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--try", "--backend", backend, "--depth", str(depth),
           "--width", str(args.width), "--heads", str(args.heads), "--vocab", str(args.vocab),
           "--seq-len", str(args.seq_len), "--batch", str(args.batch), "--steps", str(args.steps),
           "--grad-accum", str(args.grad_accum),
           *(["--keep-gathered", str(args.keep_gathered)] if args.keep_gathered is not None else []),
           *(["--device-budget", str(args.device_budget)] if args.device_budget is not None else []),
           *(["--chunk-size", str(args.chunk_size)] if args.chunk_size is not None else []),
           *(["--disk", args.disk, "--host-budget", str(int(cap * DISK_HOST_SHARE / world_size))]
             if backend in DISK_BACKENDS else []),
           "--result", result_path]
    run = launch_ranks(cmd, world_size, args, log_path)
    out = {"backend": backend, "world_size": world_size, "depth": depth, "params": params,
           "peak_host_bytes": run["peak_host_bytes"], "seconds": run["seconds"], "log": str(log_path)}
    if run["why"] is None and os.path.exists(result_path):
        out.update(json.loads(Path(result_path).read_text()), ok=True)
    else:
        out.update(ok=False, why=run["why"] or f"no result (see {log_path})")
    if os.path.exists(result_path):
        os.remove(result_path)
    if swap:
        shutil.rmtree(swap, ignore_errors=True)
    return out


def launch_ranks(cmd, world_size, args, log_path):
    """Run ``cmd`` once per rank (rank, port and ``OMP_NUM_THREADS`` in each one's environment, output
    to ``log_path``), polling the resident memory of them all every ``args.poll`` seconds: above
    ``args.host_mem_gib``, past ``args.timeout`` or when a rank fails, every rank is killed. Returns
    the peak, the seconds, and ``why`` it failed (None when every rank exited 0)."""
    cap, port, procs = int(args.host_mem_gib * GIB), free_port(), []
    with open(log_path, "w") as log:
        for rank in range(world_size):
            env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                       LOCAL_WORLD_SIZE=str(world_size), LOCAL_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(port), OMP_NUM_THREADS=str(max(1, args.threads // world_size)))
            procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
        start, peak, why = time.time(), 0, None
        while any(p.poll() is None for p in procs):
            peak = max(peak, _tree_memory(procs))
            if peak > cap:
                why = f"host memory {peak / GIB:.2f} GiB > cap {args.host_mem_gib:.2f} GiB"
            elif time.time() - start > args.timeout:
                why = f"timeout after {args.timeout:.0f} s"
            elif any(p.poll() not in (None, 0) for p in procs):
                why = "a rank failed"
            if why:
                _kill(procs)
                break
            time.sleep(args.poll)
    codes = [p.returncode for p in procs]
    if why in (None, "a rank failed") and any(codes):
        why = f"exit codes {codes} (see {log_path})"
    remove_shm_buffers(port)
    return {"peak_host_bytes": peak, "seconds": round(time.time() - start, 1), "why": why}


def remove_shm_buffers(port):
    """DeepSpeed's shm comm op (CPU) leaves ``/dev/shm/deepspeed_allreduce_buffer_*_<port>_<rank>`` (69 MB each)
    behind, also when its ranks end normally: many tries would fill /dev/shm."""
    for path in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"):
        path.unlink(missing_ok=True)


def search(args, backend, world_size, log_dir, try_depth=None, guess_bytes_per_param=None):
    """The largest depth that trains (and its try), by walking from an estimate then bisecting.
    ``try_depth(depth)`` runs one try (default: :func:`attempt`); ``guess_bytes_per_param`` sets the
    first depth (default: ``GUESS_BYTES_PER_PARAM[backend]``) unless ``args.start_depth`` does."""
    per_layer = 12 * args.width ** 2
    guess = args.host_mem_gib * GIB / (guess_bytes_per_param or GUESS_BYTES_PER_PARAM[backend])
    depth = int(min(args.max_depth, max(1, (guess - args.vocab * args.width) // per_layer)))
    if args.start_depth is not None:
        depth = min(args.max_depth, args.start_depth)
    try_depth = try_depth or (lambda d: attempt(args, backend, world_size, d, log_dir))
    tries = {}

    def ok(d):
        if d not in tries:
            r = try_depth(d)
            tries[d] = r
            status = "ok  " if r["ok"] else "FAIL"
            detail = (f"step {statistics.median(r['step_times']):.1f} s" if r["ok"] else r["why"])
            print(f"  [{backend} ws={world_size}] L={d:3d} {r['params'] / 1e9:6.3f}B params: {status} "
                  f"peak host {r['peak_host_bytes'] / GIB:6.2f} GiB ({r['seconds']:.0f} s; {detail})", flush=True)
        return tries[d]["ok"]

    lo, hi = 0, args.max_depth + 1  # lo trains, hi does not
    if ok(depth):
        lo = depth
        while lo < args.max_depth:
            step = min(args.max_depth, max(lo + 1, int(lo * args.grow)))
            if not ok(step):
                hi = step
                break
            lo = step
    else:
        hi = depth
        while hi > 1:
            step = max(1, min(hi - 1, int(hi / args.grow)))
            if ok(step):
                lo = step
                break
            hi = step
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return tries.get(lo), list(tries.values())


def table(best, args):
    """One row per backend and world size; the ratio is against the larger of ZeRO-3 with its
    defaults and ZeRO-3 tuned for memory at the same world size (the best ZeRO-3 a user gets)."""
    rows = []
    for (backend, ws), r in best.items():
        if r is None:
            rows.append([backend, ws, "nothing trains", "", "", "", "", ""])
            continue
        stock = [best.get((b, ws)) for b in (BASELINE, "zero3-tuned")]
        base = max((b for b in stock if b), key=lambda b: b["params"], default=None)
        ratio = f"{r['params'] / base['params']:.2f}x" if base else "n/a"
        rows.append([backend, ws, f"{r['params'] / 1e9:.3f}B", r["depth"], f"{r['peak_host_bytes'] / GIB:.2f} GiB",
                     f"{r['peak_host_bytes'] / r['params']:.1f}", f"{statistics.median(r['step_times']):.1f} s", ratio])
    return "\n".join(markdown_table(["backend", "world size", "largest model", "depth", "peak host",
                                     "bytes/param all-in", "step time", "params vs best ZeRO-3"], rows))


def breakdown_table(best):
    """Per backend's largest model: the last step's forward, backward and optimizer step seconds
    (rank 0), and for the disk tier the I/O it moved, its busy seconds and the seconds the step
    waited on it; hidden I/O is the I/O threads' busy time the step did not wait for."""
    rows = []
    for (backend, ws), r in best.items():
        if not r or not r.get("breakdown"):
            continue
        last = r["breakdown"][-1]
        disk = "disk_io_seconds" in last and last["disk_bytes_read"] + last["disk_bytes_written"] > 0
        io = ([f"{(last['disk_bytes_read'] + last['disk_bytes_written']) / GIB:.1f} GiB",
               f"{last['disk_io_seconds']:.1f} s", f"{last['disk_wait_seconds']:.1f} s",
               f"{max(0.0, 1 - last['disk_wait_seconds'] / max(last['disk_io_seconds'], 1e-9)):.0%}"]
              if disk else ["-"] * 4)
        rows.append([backend, ws, f"{r['params'] / 1e9:.3f}B", f"{last.get('forward', 0):.1f} s",
                     f"{last.get('backward', 0):.1f} s", f"{last.get('step', 0):.1f} s", *io])
    return "\n".join(markdown_table(["backend", "world size", "largest model", "forward", "backward",
                                     "step (Adam, I/O)", "disk read+written", "I/O busy", "I/O waited",
                                     "I/O hidden"], rows))


def resident_table(best):
    """Per backend's largest model, rank 0's resident memory (GiB) by phase of its last step: at the
    end of the build and of initialize, then the peak during forward, backward and optimizer step,
    and the model data the backend counts (ds_patrickstar: its counters)."""
    rows = []
    for (backend, ws), r in best.items():
        phases = (r or {}).get("resident_rank0")
        if not phases or "step" not in phases:
            continue
        data = r.get("model_data_bytes_rank0")
        cells = [phases[p][k] / GIB for p, k in (("build", "end"), ("initialize", "end"), ("forward", "peak"),
                                                   ("backward", "peak"), ("step", "peak"), ("step", "end"))]
        rows.append([backend, ws, f"{r['params'] / 1e9:.3f}B", *(f"{c:.2f}" for c in cells),
                     f"{data / GIB:.2f}" if data else "-"])
    return "\n".join(markdown_table(["backend", "world size", "largest model", "built", "initialized",
                                     "forward peak", "backward peak", "step peak", "after the step", "model data"],
                                    rows))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    total = psutil.virtual_memory().total / GIB
    p.add_argument("--host-mem-gib", type=float, default=round(total - 2.0, 1),
                   help=f"host memory cap per try, all processes together (default: this machine's "
                        f"{total:.1f} GiB minus 2 GiB)")
    p.add_argument("--backends", default=None,
                   help="comma-separated, of patrickstar, patrickstar-disk, zero3, zero3-tuned, zero3-offload (CUDA "
                        "only), zero3-infinity (--disk), torch "
                        "(default: all that apply here)")
    p.add_argument("--world-sizes", default="1,2")
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step (every backend)")
    p.add_argument("--keep-gathered", type=int, default=None,
                   help="patrickstar: zero_optimization.keep_gathered in bytes (default: the config's default, "
                        "every group kept gathered from forward to backward as ZeRO-3 does; 0 releases each group "
                        "after its forward use: the least memory with several ranks on one host)")
    p.add_argument("--device-budget", type=int, default=None,
                   help="patrickstar backends: zero_optimization.device_budget in bytes; on a machine without CUDA "
                        "it runs them on the strict emulated accelerator (a check of the search, not a GPU figure)")
    p.add_argument("--chunk-size", type=int, default=None,
                   help="patrickstar backends: zero_optimization.chunk_size in elements (default: the config's)")
    p.add_argument("--steps", type=int, default=2, help="optimizer steps per try")
    p.add_argument("--max-depth", type=int, default=96)
    p.add_argument("--start-depth", type=int, default=None,
                   help="depth of the first try (default: an estimate from --host-mem-gib)")
    p.add_argument("--grow", type=float, default=1.15, help="factor of the walk before the bisection")
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds per try")
    p.add_argument("--poll", type=float, default=0.1, help="seconds between memory readings")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="CPU threads per try, split over ranks")
    p.add_argument("--logs", default=str(HERE.parent / "runs" / "max_model"))
    p.add_argument("--json", default=None, help="write every try and the table here")
    p.add_argument("--disk", default=None, metavar="DIR",
                   help="the folder of the disk backends' swap files (its free space is checked first and bounds "
                        "--max-depth); without --backends, adds patrickstar-disk (the disk tier) and zero3-infinity "
                        "(stock ZeRO-Infinity, where DeepSpeed's async_io op loads)")
    p.add_argument("--host-budget", type=int, default=None, help=argparse.SUPPRESS)
    # one try (internal)
    p.add_argument("--try", dest="is_try", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--backend", help=argparse.SUPPRESS)
    p.add_argument("--depth", type=int, help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _bound_depth_by_disk(args):
    """The disk tier needs 12 bytes per parameter (plus padding) under --disk: check before starting."""
    Path(args.disk).mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(args.disk).free
    depth = args.max_depth
    while depth > 1 and 12.2 * gpt_params(args.width, depth, args.vocab, args.seq_len) > free:
        depth -= 1
    need = 12.2 * gpt_params(args.width, depth, args.vocab, args.seq_len)
    if need > free:
        raise SystemExit(f"--disk {args.disk}: {free / GIB:.1f} GiB free, too little for one layer of optimizer states")
    if depth < args.max_depth:
        print(f"--disk {args.disk}: {free / GIB:.1f} GiB free holds the optimizer states of depth {depth} at most; "
              f"--max-depth lowered from {args.max_depth}", flush=True)
        args.max_depth = depth


def _async_io_missing():
    """Why DeepSpeed's async_io op (ZeRO-Infinity's NVMe engine) cannot load here, or ``""``."""
    sys.path.insert(0, str(HERE.parent))
    from ds_patrickstar.disk.aio import load_async_io

    return load_async_io()[1]


def main(argv=None):
    args = parse_args(argv)
    if args.is_try:
        run_try(args)
        return
    import torch

    cuda = torch.cuda.is_available()
    backends = (args.backends.split(",") if args.backends else
                ["patrickstar", "zero3"] + (["zero3-offload"] if cuda else []) + ["torch"])
    for backend in backends:
        if backend not in GUESS_BYTES_PER_PARAM:
            raise SystemExit(f"--backends: unknown backend {backend!r}; choose from {sorted(GUESS_BYTES_PER_PARAM)}")
        if backend == "zero3-offload" and not cuda:
            raise SystemExit("--backends: zero3-offload needs CUDA (offload is what moves data off the GPU)")
    if not args.disk and any(b in DISK_BACKENDS for b in backends):
        raise SystemExit(f"--backends {','.join(b for b in backends if b in DISK_BACKENDS)} needs --disk DIR "
                         "(the folder of the swap files)")
    if args.disk:
        if not args.backends:  # the default set gains the disk backends; an explicit --backends is kept as given
            backends = [*backends, *DISK_BACKENDS]
        _bound_depth_by_disk(args)
    if "zero3-infinity" in backends:
        why = _async_io_missing()
        if why:
            print(f"skipping zero3-infinity: {why}", flush=True)
            backends.remove("zero3-infinity")
        elif not args.disk:
            raise SystemExit("--backends zero3-infinity needs --disk DIR (the folder of its swap files)")
    Path(args.logs).mkdir(parents=True, exist_ok=True)
    print(f"max_model: width {args.width}, seq {args.seq_len}, batch {args.batch} x GA {args.grad_accum}, "
          f"{args.steps} steps per try, "
          f"patrickstar keep_gathered {args.keep_gathered if args.keep_gathered is not None else 'default'}, "
          f"host cap {args.host_mem_gib:.1f} GiB{', CUDA' if cuda else ', CPU'}", flush=True)
    best, everything = {}, []
    for world_size in [int(w) for w in args.world_sizes.split(",")]:
        for backend in backends:
            if backend == "torch" and world_size > 1:
                continue
            print(f"searching {backend} at world size {world_size}", flush=True)
            best[(backend, world_size)], tries = search(args, backend, world_size, args.logs)
            everything += tries
    text = (table(best, args) + "\n\nStep-time breakdown (last step, rank 0):\n\n" + breakdown_table(best)
            + "\n\nResident memory by phase (GiB, rank 0, last step):\n\n" + resident_table(best))
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "tries": everything, "table": text}, indent=1))


if __name__ == "__main__":
    main()
