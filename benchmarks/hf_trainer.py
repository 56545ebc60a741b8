"""Fine-tune a small GPT-2 (built from a config) on the embedded corpus with the Hugging Face
Trainer and DeepSpeed stage "patrickstar".

    python benchmarks/hf_trainer.py                                   # one process, configs/hf_patrickstar.json
    deepspeed --num_gpus 2 benchmarks/hf_trainer.py --steps 100       # 2 ranks (CPU-only: 2 processes on gloo)
    python benchmarks/hf_trainer.py --deepspeed my_ds_config.json     # any DeepSpeed config Trainer accepts

Needs the ``hf`` extra (``pip install -e ".[hf]"``). Tokens are raw bytes (vocabulary 256): a
uniform guess scores ln 256 = 5.55. Prints the Trainer's progress bar and loss logs, then its
train and eval summaries (loss, perplexity, runtime, samples/s) and where the model was saved.
"""
import argparse
import logging
import math
import os
from pathlib import Path

import bench_utils as bu
import data
import torch

bu.add_repo_to_path()

import ds_patrickstar  # noqa: F401  (registers stage "patrickstar" before the Trainer initializes DeepSpeed)

logger = logging.getLogger("hf_trainer")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--deepspeed", default=str(bu.CONFIG_DIR / "hf_patrickstar.json"), help="DeepSpeed JSON config")
    p.add_argument("--steps", type=int, default=200, help="optimizer steps (max_steps)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=8, help="per_device_train_batch_size")
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--dtype", choices=["bf16", "fp32"], default=None,
                   help="default: bf16 on CUDA, fp32 on the CPU (where bf16 matmuls are slow)")
    p.add_argument("--eval-windows", type=int, default=64, help="held-out windows scored at the end")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", default=str(bu.REPO_ROOT / "runs" / "hf_trainer"), help="output_dir")
    p.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", -1)))  # set by deepspeed
    return p.parse_args(argv)


class Windows(torch.utils.data.Dataset):
    """Non-overlapping windows of ``seq_len`` bytes; the model shifts labels itself."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, limit: int | None = None):
        n = len(tokens) // seq_len if limit is None else min(limit, len(tokens) // seq_len)
        self.windows = tokens[: n * seq_len].to(torch.int64).view(n, seq_len)

    def __len__(self):
        return len(self.windows)

    def __getitem__(self, i):
        return {"input_ids": self.windows[i], "labels": self.windows[i]}


def main(argv=None):
    args = parse_args(argv)
    bu.setup_single_process_env()
    import transformers

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    transformers.set_seed(args.seed)
    train_tokens, val_tokens = data.split_corpus(data.load_corpus())
    config = transformers.GPT2Config(vocab_size=data.VOCAB_SIZE, n_positions=args.seq_len, n_embd=args.n_embd,
                                     n_layer=args.n_layer, n_head=max(1, args.n_embd // 32))
    model = transformers.GPT2LMHeadModel(config)
    on_cpu = not torch.cuda.is_available()
    dtype = args.dtype or ("fp32" if on_cpu else "bf16")
    training_args = transformers.TrainingArguments(
        output_dir=args.out, deepspeed=args.deepspeed,
        use_cpu=on_cpu,  # CPU-only: without it accelerate sees one process per launch (docs/hugging-face.md)
        bf16=dtype == "bf16", per_device_train_batch_size=args.batch, per_device_eval_batch_size=args.batch,
        gradient_accumulation_steps=args.grad_accum, max_steps=args.steps, learning_rate=args.lr,
        adam_beta2=0.95, weight_decay=0.1, warmup_steps=max(1, args.steps // 10), max_grad_norm=1.0,
        logging_steps=max(1, args.steps // 20), save_strategy="no", report_to=[], seed=args.seed,
        dataloader_num_workers=0)
    trainer = transformers.Trainer(model=model, args=training_args,
                                   train_dataset=Windows(train_tokens, args.seq_len),
                                   eval_dataset=Windows(val_tokens, args.seq_len, args.eval_windows))
    if trainer.is_world_process_zero():
        logger.info("GPT-2 with %.2f M parameters, %d training windows of %d bytes, DeepSpeed config %s",
                    sum(p.numel() for p in model.parameters()) / 1e6, len(trainer.train_dataset), args.seq_len,
                    args.deepspeed)
    result = trainer.train()
    trainer.log_metrics("train", result.metrics)
    metrics = trainer.evaluate()
    metrics["perplexity"] = math.exp(metrics["eval_loss"])
    trainer.log_metrics("eval", metrics)
    final = Path(args.out) / "final"
    trainer.save_model(str(final))  # a collective: every rank calls it
    if trainer.is_world_process_zero():
        logger.info("model saved to %s (load it with GPT2LMHeadModel.from_pretrained)", final)
    return metrics


if __name__ == "__main__":
    main()
