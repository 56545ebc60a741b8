"""Train a small GPT on the embedded byte-level corpus with DeepSpeed + ds_patrickstar.

    python benchmarks/train_gpt.py                      # tiny GPT, configs/patrickstar_cpu.json
                                                        # (fp32 on a CPU without native bf16: see pick_dtype)
    python benchmarks/train_gpt.py --config configs/zero3_cpu.json --steps 50
    deepspeed benchmarks/train_gpt.py --deepspeed_config configs/patrickstar_gpu.json

Without a launcher it runs as a single process (RANK/WORLD_SIZE/MASTER_* get defaults).
"""
import argparse
import json
import logging
import math
import os
import random
import statistics
import time
from pathlib import Path

import bench_utils as bu
import data
import deepspeed
import gpt_model
import torch
import torch.nn.functional as F
from deepspeed.accelerator import get_accelerator
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

logger = logging.getLogger("train_gpt")
GPU_STEPS, CPU_STEPS = 800, 500


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None, help="DeepSpeed JSON config (default: "
                   "configs/patrickstar_gpu.json on CUDA, else configs/patrickstar_cpu.json)")
    p.add_argument("--model", default="tiny", choices=sorted(gpt_model.PRESETS))
    p.add_argument("--steps", type=int, default=None,
                   help=f"optimizer steps (default: {GPU_STEPS} on CUDA, {CPU_STEPS} on the CPU: a few minutes)")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=None, help="override train_micro_batch_size_per_gpu")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None, help="override the config")
    p.add_argument("--grad-accum", type=int, default=None,
                   help="override gradient_accumulation_steps: micro-batches per optimizer step")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--log-every", type=int, default=100)
    p.add_argument("--eval-batches", type=int, default=8, help="held-out batches scored at the end")
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--corpus", default=None, help="text file or folder of *.txt (default: benchmarks/data)")
    p.add_argument("--plot", action="store_true", help="save tide.png if the engine has tide_plot()")
    p.add_argument("--out", default=str(bu.REPO_ROOT / "runs" / "train_gpt"), help="output folder")
    p.add_argument("--json", default=None, help="write the summary and per-step records here")
    p.add_argument("--no-progress", action="store_true", help="no tqdm bar")
    p.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", -1)))
    p = deepspeed.add_config_arguments(p)
    args = p.parse_args(argv)
    if args.steps is None:
        args.steps = GPU_STEPS if torch.cuda.is_available() else CPU_STEPS
    return args


def config_path(args):
    if args.deepspeed_config:
        return args.deepspeed_config
    if args.config:
        return args.config
    name = "patrickstar_gpu.json" if torch.cuda.is_available() else "patrickstar_cpu.json"
    return str(bu.CONFIG_DIR / name)


def prepare_config(args):
    """Load the JSON config and apply the command-line overrides."""
    config = bu.load_config(config_path(args))
    if args.batch:
        config["train_micro_batch_size_per_gpu"] = args.batch
        config.pop("train_batch_size", None)
    dtype = args.dtype or pick_dtype(config)
    if dtype:
        bu.set_dtype(config, dtype)
    if args.grad_accum:
        config["gradient_accumulation_steps"] = args.grad_accum
        config.pop("train_batch_size", None)
    sched = config.get("scheduler", {})
    params = sched.get("params", {})
    if sched.get("type") == "WarmupDecayLR":
        params["total_num_steps"] = max(args.steps, 1)
        params["warmup_num_steps"] = min(params.get("warmup_num_steps", 0), max(args.steps // 5, 1))
    return config


def pick_dtype(config, on_cuda=None, native=None):
    """The dtype to force when ``--dtype`` is not given: fp32 for a bf16 config on a CPU without native
    bf16 (its bf16 matmuls are emulated, ~10x slower than fp32), else None (the config's)."""
    on_cuda = torch.cuda.is_available() if on_cuda is None else on_cuda
    if on_cuda or not config.get("bf16", {}).get("enabled", False):
        return None
    has_bf16, why = bu.cpu_native_bf16() if native is None else native
    if has_bf16:
        logger.info("bf16 as the config says: this CPU has native bf16 (%s)", why)
        return None
    logger.info("fp32 instead of the config's bf16: this CPU has no native bf16 (%s), where bf16 matmuls "
                "run ~10x slower than fp32; --dtype bf16 forces bf16", why)
    return "fp32"


def import_backend(config):
    """``import ds_patrickstar`` (registers the backend); only fatal when the config needs it."""
    bu.add_repo_to_path()
    try:
        import ds_patrickstar  # noqa: F401
    except ImportError:
        if bu.zero_stage(config) == "patrickstar":
            raise
        logger.warning("ds_patrickstar is not importable; continuing with stock DeepSpeed")


def seed_everything(seed):
    random.seed(seed)
    torch.manual_seed(seed)


def build_engine(args, config):
    model, cfg = gpt_model.build_model(args.model, activation_checkpointing=args.activation_checkpointing)
    if args.seq_len > cfg.block_size:
        raise ValueError(f"--seq-len {args.seq_len} > block_size {cfg.block_size} of {args.model}")
    counts = {"params": gpt_model.count_params(model),
              "flops_per_token": gpt_model.flops_per_token(
                  cfg, gpt_model.count_params(model, exclude_position_embedding=True), args.seq_len)}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine, cfg, counts


def lm_loss(engine, x, y):
    logits = engine(x)
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))


def device_name():
    return get_accelerator().current_device_name()


def memory_postfix():
    text = f"{bu.host_rss_bytes() / bu.GIB:.2f}G"
    gpu = bu.gpu_max_allocated_bytes()
    return text if gpu is None else f"{text} gpu {gpu / bu.GIB:.2f}G"


def make_progress(args, rank):
    if rank != 0 or args.no_progress:
        return None
    return tqdm(total=args.steps, desc="train", dynamic_ncols=True)


def train_step(engine, sampler, device):
    """One optimizer step: ``gradient_accumulation_steps`` micro-batches (DeepSpeed steps the
    optimizer at the boundary); returns the mean micro-batch loss and the wall time."""
    micro = engine.gradient_accumulation_steps()
    batches = [sampler.next(device) for _ in range(micro)]
    start = time.perf_counter()
    losses = []
    for x, y in batches:
        loss = lm_loss(engine, x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach())
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return torch.stack(losses).mean().item(), time.perf_counter() - start


def current_lr(engine):
    lrs = engine.get_lr()
    return lrs[0] if lrs else float("nan")


def comms_logger_enabled():
    from deepspeed.comm import comm as ds_comm
    return ds_comm.comms_logger.enabled


def reset_comms_logger():
    from deepspeed.comm import comm as ds_comm
    ds_comm.comms_logger.reset_data()


def comms_logger_volume():
    """Bytes this rank moved in all-gathers and reduce-scatters since the last reset, from
    DeepSpeed's comms logger (``"comms_logger": {"enabled": true}``). The logger's message size
    is the collective's ``tensor`` argument: the rank's own input of an all-gather (it receives
    (W-1) such pieces) and the whole input of a reduce-scatter (it sends (W-1)/W of it), the same
    conventions as ds_patrickstar's counters (ds_patrickstar/groups/comm.py)."""
    from deepspeed.comm import comm as ds_comm
    world = ds_comm.get_world_size()
    gathered = scattered = 0
    for name, sizes in ds_comm.comms_logger.comms_dict.items():
        for msg_size, record in sizes.items():
            if name.startswith("all_gather"):
                gathered += record[0] * msg_size * (world - 1)
            elif name.startswith("reduce_scatter"):
                scattered += record[0] * msg_size * (world - 1) // world
    return {"bytes_all_gathered": gathered, "bytes_reduce_scattered": scattered, "source": "comms logger"}


def patrickstar_volume(engine):
    if not hasattr(engine, "get_patrickstar_counters"):
        return None
    counters = engine.get_patrickstar_counters()
    return {"bytes_all_gathered": counters["bytes_all_gathered"],
            "bytes_reduce_scattered": counters["bytes_reduce_scattered"], "source": "counters"}


class TrainLoop:
    """Runs the optimizer steps, shows progress on rank 0 and keeps per-step records."""

    def __init__(self, args, engine, sampler, rank):
        self.args, self.engine, self.sampler, self.rank = args, engine, sampler, rank
        self.device = device_name()
        self.tokens = (sampler.batch_size * sampler.seq_len * engine.gradient_accumulation_steps()
                       * int(os.environ.get("WORLD_SIZE", 1)))
        self.bar = make_progress(args, rank)

    def run(self):
        self.engine.train()
        self.comm_volume = None
        with logging_redirect_tqdm():
            records = []
            for i in range(1, self.args.steps + 1):
                if i == self.args.steps and comms_logger_enabled():
                    reset_comms_logger()  # comm_volume: the last step only
                records.append(self.step(i))
            if comms_logger_enabled():
                self.comm_volume = comms_logger_volume()
        if self.bar is not None:
            self.bar.close()
        return records

    def step(self, step):
        loss, seconds = train_step(self.engine, self.sampler, self.device)
        tok_s = self.tokens / seconds
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tok_s:.0f}", mem=memory_postfix())
        if self.rank == 0 and (step % self.args.log_every == 0 or step == self.args.steps):
            logger.info("step %d loss %.4f lr %.2e tokens/s %.0f mem %s", step, loss,
                        current_lr(self.engine), tok_s, memory_postfix())
        return {"step": step, "loss": loss, "seconds": seconds, "tokens": self.tokens}


@torch.no_grad()
def evaluate(engine, sampler, batches):
    if batches <= 0:
        return None
    device = device_name()
    engine.eval()
    losses = [lm_loss(engine, *sampler.next(device)).item() for _ in range(batches)]
    engine.train()
    return sum(losses) / len(losses)


def window_mean(values, window):
    chunk = values[:window]
    return sum(chunk) / len(chunk)


def summarize(args, engine, records, val_loss, config, counts, comm_volume=None):
    losses = [r["loss"] for r in records]
    window = max(1, min(20, len(losses) // 5))
    timed = records[min(5, len(records) - 1):]
    median_s = statistics.median(r["seconds"] for r in timed)
    md_bytes, n_params = bu.model_data_bytes(engine, bu.zero_stage(config)), counts["params"]
    tokens_per_s = records[0]["tokens"] / median_s
    return {
        "model": args.model, "params": n_params, "zero_stage": bu.zero_stage(config),
        "batch": config["train_micro_batch_size_per_gpu"], "seq_len": args.seq_len, "steps": len(records),
        "grad_accum": engine.gradient_accumulation_steps(),
        "loss_first": window_mean(losses, window), "loss_last": window_mean(losses[::-1], window),
        "loss_window": window, "val_loss": val_loss,
        "step_time_median_s": median_s, "tokens_per_s": tokens_per_s,
        "flops_per_token": counts["flops_per_token"], "model_gflops": tokens_per_s * counts["flops_per_token"] / 1e9,
        "host_peak_rss_bytes": bu.host_peak_rss_bytes(), "gpu_max_allocated_bytes": bu.gpu_max_allocated_bytes(),
        "model_data_bytes": md_bytes, "model_data_bytes_per_param": md_bytes / n_params if md_bytes else None,
        "device": device_name(), "world_size": int(os.environ.get("WORLD_SIZE", 1)),
        # the last step's counters (ds_patrickstar only), and its data-parallel traffic per rank
        "patrickstar_counters": engine.get_patrickstar_counters() if hasattr(engine, "get_patrickstar_counters")
        else None,
        "comm_volume": patrickstar_volume(engine) or comm_volume,
    }


def gib(nbytes):
    return "n/a" if nbytes is None else f"{nbytes / bu.GIB:.3f} GiB"


def format_summary(s):
    rows = [
        ("model / params", f"{s['model']} / {s['params'] / 1e6:.2f} M"),
        ("backend (zero stage)", str(s["zero_stage"])),
        ("device x world size", f"{s['device']} x {s['world_size']}"),
        (f"loss first {s['loss_window']} steps", f"{s['loss_first']:.4f}"),
        (f"loss last {s['loss_window']} steps", f"{s['loss_last']:.4f}"),
        ("held-out loss", "n/a" if s["val_loss"] is None else f"{s['val_loss']:.4f}"),
        ("median step time", f"{s['step_time_median_s'] * 1e3:.1f} ms"),
        ("tokens/s (per step median)", f"{s['tokens_per_s']:.0f}"),
        ("model GFLOP/s (6N + 12LHT)", f"{s['model_gflops']:.1f}"),
        ("peak host RSS", gib(s["host_peak_rss_bytes"])),
        ("GPU max allocated", gib(s["gpu_max_allocated_bytes"])),
        ("model data", gib(s["model_data_bytes"])),
        ("model data bytes/param", "n/a" if s["model_data_bytes_per_param"] is None
         else f"{s['model_data_bytes_per_param']:.2f}"),
    ]
    if s.get("comm_volume"):
        v = s["comm_volume"]
        rows.append((f"all-gathered / reduce-scattered per step ({v['source']})",
                     f"{v['bytes_all_gathered'] / 2**20:.3f} / {v['bytes_reduce_scattered'] / 2**20:.3f} MiB per rank"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def maybe_plot(engine, out_dir):
    for owner in (engine, getattr(engine, "optimizer", None)):
        if hasattr(owner, "tide_plot"):
            path = Path(out_dir) / "tide.png"
            owner.tide_plot(str(path))
            logger.info("saved %s", path)
            return


def write_outputs(args, summary, records):
    payload = {"summary": summary, "records": records, "args": vars(args)}
    paths = [Path(args.out) / "metrics.json"] + ([Path(args.json)] if args.json else [])
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(payload, indent=1, default=str))


def main(argv=None):
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args = parse_args(argv)
    if args.local_rank >= 0:
        os.environ.setdefault("LOCAL_RANK", str(args.local_rank))
    bu.setup_single_process_env()
    config = prepare_config(args)
    import_backend(config)
    seed_everything(args.seed)
    engine, cfg, counts = build_engine(args, config)
    rank = int(os.environ.get("RANK", 0))
    train_tokens, val_tokens = data.split_corpus(data.load_corpus(args.corpus))
    batch = config["train_micro_batch_size_per_gpu"]
    sampler = data.BatchSampler(train_tokens, batch, args.seq_len, seed=args.seed, rank=rank)
    loop = TrainLoop(args, engine, sampler, rank)
    records = loop.run()
    val_sampler = data.BatchSampler(val_tokens, batch, args.seq_len, seed=args.seed + 1, rank=rank)
    val_loss = evaluate(engine, val_sampler, args.eval_batches)
    if rank == 0:
        summary = summarize(args, engine, records, val_loss, config, counts, loop.comm_volume)
        write_outputs(args, summary, records)
        if args.plot:
            maybe_plot(engine, args.out)
        print(format_summary(summary), flush=True)
        logger.info("uniform-guess loss is ln(%d) = %.3f", cfg.vocab_size, math.log(cfg.vocab_size))
    if torch.distributed.is_initialized():  # an orderly end: see tests/scripts/tiny_train.py
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
