"""A Hugging Face Trainer script in the shape of ``examples/pytorch/language-modeling/run_clm.py``,
for tests/test_drop_in.py. It does NOT import ds_patrickstar: it is run as users run such
scripts, ``python -m ds_patrickstar tests/scripts/hf_clm.py --deepspeed cfg.json ...`` (or
``torchrun -m ds_patrickstar ...``), and without ``--deepspeed`` as the plain PyTorch reference.

A tiny GPT-2 (tied embedding and LM head) built from a config, synthetic token data, no dropout.
Takes TrainingArguments' flags (``--do_train``, ``--do_eval``, ``--max_steps``, ``--save_steps``,
``--resume_from_checkpoint``, ``--use_cpu``, ...). Rank 0 writes ``OUTPUT_DIR/run.json``: the
logged training losses and learning rates per step, and the eval loss.
"""
import json
import os
import sys
from dataclasses import dataclass, field

import torch
import transformers
from transformers import GPT2Config, GPT2LMHeadModel, HfArgumentParser, Trainer, TrainingArguments


@dataclass
class ModelArguments:
    n_layer: int = field(default=2)
    n_embd: int = field(default=32)
    seq_len: int = field(default=16)
    vocab: int = field(default=64)


class Tokens(torch.utils.data.Dataset):
    """Sequences that follow ``t[i+1] = (t[i] * 5 + 3) % vocab`` from a random start: learnable."""

    def __init__(self, n, seq_len, vocab, seed):
        start = torch.randint(0, vocab, (n, 1), generator=torch.Generator().manual_seed(seed))
        rows = [start]
        for _ in range(seq_len - 1):
            rows.append((rows[-1] * 5 + 3) % vocab)
        self.ids = torch.cat(rows, dim=1)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main():
    model_args, args = HfArgumentParser((ModelArguments, TrainingArguments)).parse_args_into_dataclasses()
    transformers.set_seed(args.seed)
    config = GPT2Config(vocab_size=model_args.vocab, n_positions=model_args.seq_len, n_embd=model_args.n_embd,
                        n_layer=model_args.n_layer, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(config)
    train = Tokens(64, model_args.seq_len, model_args.vocab, seed=1)
    val = Tokens(16, model_args.seq_len, model_args.vocab, seed=2)
    trainer = Trainer(model=model, args=args, train_dataset=train if args.do_train else None,
                      eval_dataset=val if args.do_eval else None)
    result = {"world_size": args.world_size}
    if args.do_train:
        trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
        trainer.save_model()
        logs = [e for e in trainer.state.log_history if "loss" in e and "step" in e]
        result["losses"] = {str(e["step"]): e["loss"] for e in logs}
        result["lrs"] = {str(e["step"]): e["learning_rate"] for e in logs}
    if args.do_eval:
        result["eval_loss"] = trainer.evaluate()["eval_loss"]
    if trainer.is_world_process_zero():
        with open(os.path.join(args.output_dir, "run.json"), "w") as f:
            json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
