"""Placement when the batch's shape changes every step, side by side with the same run at a fixed shape.

    python benchmarks/dynamic_shapes.py                 # the twin target: GPT, changing vs fixed length
    python benchmarks/dynamic_shapes.py --hf            # also a Hugging Face GPT-2 with dynamic padding
    python benchmarks/dynamic_shapes.py --json out.json

The twin target (issue 31): on the strict emulated accelerator (``emulate_accelerator``) with a device
budget below what the model and its optimizer states take, a GPT whose sequence length changes every
step (as ``DataCollatorWithPadding`` makes it) against the same run at the longest length: prefetches
and device-side Adam chunks per step after warm-up, re-traces, and the losses against stock ZeRO-3
with the same batches. The Hugging Face run trains a GPT-2 from a config on batches padded to their
own longest sequence (dynamic padding) and on batches padded to the longest length (fixed), and
reports tokens/s (real tokens: padding excluded) beside each other. All in this process; ZeRO-3 and
ours on the same batches and seed.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_utils as bu
from bench_harness import changing_lengths, lm_steps

bu.add_repo_to_path()
logger = logging.getLogger("dynamic_shapes")

VOCAB = 256
TWIN = dict(n_layer=4, n_head=2, n_embd=64, block_size=32, vocab_size=VOCAB)
TWIN_BUDGET = 1_700_000  # B: below the model's 2.1 MB of fp32 parameters and optimizer states
TWIN_BATCH = 2
HF_BUDGET = 16_000_000  # B: the HF GPT-2 (3.5 MB of fp32 parameters and optimizer states) and its activations


def gpt_config(stage, budget: int | None = None, chunk: int = 8192, **zero) -> dict:
    z: dict = {"stage": stage}
    if stage == "patrickstar":
        z.update(chunk_size=chunk, emulate_accelerator=True, **({"device_budget": budget} if budget else {}), **zero)
    else:
        z["stage3_param_persistence_threshold"] = 0
    return {"train_micro_batch_size_per_gpu": TWIN_BATCH, "zero_optimization": z, "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}}}


def gpt_run(config: dict, lengths: list[int], seed: int = 0, between=None) -> dict:
    """Train the twin GPT one step per length; losses, counters per step (ours) and seconds.
    ``between(engine, step, tokens)``, when given, runs after each step (an evaluation, say); what it
    returns is listed under ``"between"``."""
    import deepspeed
    from gpt_model import GPT, GPTConfig

    torch.manual_seed(seed)
    model = GPT(GPTConfig(**TWIN))
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    gen = torch.Generator().manual_seed(seed + 1)
    batches = (torch.randint(0, VOCAB, (TWIN_BATCH, length + 1), generator=gen) for length in lengths)
    started = time.perf_counter()
    losses, counters, extra = lm_steps(engine, batches, VOCAB, between)
    return {"losses": losses, "counters": counters, "seconds": time.perf_counter() - started, "between": extra}


def _after(counters: list[dict], key: str, warmup: int) -> float:
    return statistics.mean(c[key] for c in counters[warmup:])


def twin_target(steps: int, warmup: int, budget: int) -> dict:
    """Ours at changing and at fixed length, ZeRO-3 at the changing length (the same batches)."""
    changing = changing_lengths(steps, TWIN["block_size"])
    fixed = [TWIN["block_size"]] * steps
    zero3 = gpt_run(gpt_config(3), changing)
    # optimizer_placement "fill": the device-side Adam plan is what changing shapes must keep; "time" (the default)
    # keeps no state on the accelerator at this budget (fewer bytes moved), leaving nothing to compare
    ours_changing = gpt_run(gpt_config("patrickstar", budget, optimizer_placement="fill"), changing)
    ours_fixed = gpt_run(gpt_config("patrickstar", budget, optimizer_placement="fill"), fixed)
    rows = {}
    for name, run in (("changing", ours_changing), ("fixed", ours_fixed)):
        rows[name] = {key: _after(run["counters"], key, warmup)
                      for key in ("prefetches", "adam_chunks_device", "adam_chunks_host")}
        rows[name]["retraces"] = sum(c["retraces_shape"] + c["retraces_order"] for c in run["counters"])
    worst = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(ours_changing["losses"], zero3["losses"]))
    return {"lengths": changing, "budget": budget, "warmup": warmup, "rows": rows,
            "prefetch_ratio": rows["changing"]["prefetches"] / max(rows["fixed"]["prefetches"], 1e-12),
            "adam_device_ratio": rows["changing"]["adam_chunks_device"] / max(rows["fixed"]["adam_chunks_device"],
                                                                             1e-12),
            "loss_rel_vs_zero3": worst}


def hf_padding_run(stage, dynamic: bool, steps: int, longest: int, batch: int, budget: int | None) -> dict:
    """A Hugging Face GPT-2 (from a config) on batches padded to their own longest sequence (``dynamic``)
    or to ``longest``; real tokens/s (padding excluded) after the first two steps."""
    import deepspeed
    import transformers

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=longest, n_embd=64, n_layer=4, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    config = gpt_config(stage, budget)
    config["train_micro_batch_size_per_gpu"] = batch
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    rng, gen = random.Random(0), torch.Generator().manual_seed(0)
    tokens = seconds = 0.0
    losses = []
    try:
        for step in range(steps):
            lengths = [rng.randint(longest // 4, longest) for _ in range(batch)]
            width = max(lengths) if dynamic else longest
            ids = torch.randint(0, VOCAB, (batch, width), generator=gen)
            mask = (torch.arange(width) < torch.tensor(lengths)[:, None]).long()
            labels = ids.masked_fill(mask == 0, -100)
            started = time.perf_counter()
            loss = engine(input_ids=ids, attention_mask=mask, labels=labels).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            if step >= 2:
                seconds += time.perf_counter() - started
                tokens += sum(lengths)
    finally:
        engine.destroy()
    return {"tokens_per_s": tokens / seconds if seconds else 0.0, "losses": losses}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the per-step means")
    parser.add_argument("--budget", type=int, default=TWIN_BUDGET, help="device budget of the twin target, B")
    parser.add_argument("--hf", action="store_true", help="also the Hugging Face dynamic-padding run")
    parser.add_argument("--hf-steps", type=int, default=10)
    parser.add_argument("--hf-budget", type=int, default=HF_BUDGET, help="ours' device budget in the HF run, B")
    parser.add_argument("--no-twin", action="store_true", help="skip the twin target (with --hf)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    bu.setup_single_process_env()
    result: dict = {}
    if not args.no_twin:
        result["twin"] = twin_target(args.steps, args.warmup, args.budget)
        print_twin(result["twin"], args.warmup)
    if args.hf:
        hf = {}
        for stage in ("patrickstar", 3):
            for dynamic in (True, False):
                key = f"{'ours' if stage == 'patrickstar' else 'zero3'} {'dynamic' if dynamic else 'fixed'}"
                hf[key] = hf_padding_run(stage, dynamic, args.hf_steps, 64, 4, args.hf_budget)
                print(f"hf {key:<14} {hf[key]['tokens_per_s']:>9.0f} real tokens/s")
        result["hf"] = hf
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


def print_twin(twin: dict, warmup: int) -> None:
    print(f"twin target, lengths {twin['lengths']}, budget {twin['budget']:,} B, means over steps {warmup}+")
    print(f"{'run':<10}{'prefetches':>12}{'adam dev':>10}{'adam host':>11}{'re-traces':>11}")
    for name, row in twin["rows"].items():
        print(f"{name:<10}{row['prefetches']:>12.1f}{row['adam_chunks_device']:>10.1f}"
              f"{row['adam_chunks_host']:>11.1f}{row['retraces']:>11d}")
    print(f"changing/fixed: prefetches {twin['prefetch_ratio']:.2f}x, device Adam chunks "
          f"{twin['adam_device_ratio']:.2f}x; losses vs ZeRO-3 (changing length): max rel "
          f"{twin['loss_rel_vs_zero3']:.1e}")


if __name__ == "__main__":
    sys.exit(main())
