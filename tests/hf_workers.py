"""Hugging Face runs for tests/test_hf.py, each on real rank processes (see multiproc.run_ranks).
Trainer and accelerate keep process-wide state (accelerate's AcceleratorState / PartialState /
GradientState singletons, transformers' reference to the DeepSpeed config, environment
variables): the kept workers of run_ranks reset it before every job, as a new process would have it.

Tiny GPT-2 (tied embedding / LM head) and Llama (untied) models are built from a config,
with synthetic token data: nothing is downloaded.
"""
from __future__ import annotations

import json
import os

import torch

VOCAB, SEQ, SAMPLES = 64, 16, 32


def tiny_model(kind: str):
    """``gpt2``, ``llama``, or ``llama_frozen``: the Llama with its embedding and first layer frozen by hand."""
    import transformers

    torch.manual_seed(0)
    if kind == "llama_frozen":
        model = tiny_model("llama")
        model.model.embed_tokens.requires_grad_(False)
        model.model.layers[0].requires_grad_(False)
        return model
    if kind == "gpt2":
        config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2,
                                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return transformers.GPT2LMHeadModel(config)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=SEQ,
                                      tie_word_embeddings=False)
    return transformers.LlamaForCausalLM(config)


class TokenData(torch.utils.data.Dataset):
    """Sequences with a learnable pattern (each token is the previous one plus a per-row step)."""

    def __init__(self, n: int = SAMPLES, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        start = torch.randint(0, VOCAB, (n, 1), generator=gen)
        step = torch.randint(1, 4, (n, 1), generator=gen)
        self.ids = (start + step * torch.arange(SEQ)) % VOCAB

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


PROBE = torch.arange(SEQ).remainder(VOCAB).unsqueeze(0)


def ds_config(stage, gas: int = 1) -> dict:
    """A Trainer DeepSpeed config with Hugging Face's "auto" values and the templates' no-offload blocks."""
    zero = {"stage": stage, "offload_optimizer": {"device": "none"}, "offload_param": {"device": "none"}}
    if stage == "patrickstar":
        zero["chunk_size"] = 4096
    else:
        zero.update(stage3_param_persistence_threshold=0, stage3_gather_16bit_weights_on_model_save=True)
    return {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto", "gradient_accumulation_steps": gas,
            "gradient_clipping": "auto", "zero_optimization": zero, "bf16": {"enabled": "auto"},
            "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                      "weight_decay": "auto"}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                         "warmup_num_steps": "auto"}}}


def _args(out_dir, stage, steps, gas=1, save_steps=None, **kw):
    import transformers

    return transformers.TrainingArguments(
        output_dir=out_dir, deepspeed=ds_config(stage, gas), use_cpu=True, per_device_train_batch_size=4,
        gradient_accumulation_steps=gas, max_steps=steps, learning_rate=5e-3, weight_decay=0.01, warmup_steps=2,
        max_grad_norm=1.0, logging_steps=1, save_strategy="steps" if save_steps else "no", save_steps=save_steps or 1,
        report_to=[], seed=0, data_seed=0, disable_tqdm=True, dataloader_num_workers=0, **kw)


def _losses(trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def trainer_run(rank, world_size, kind, stage, out_dir, steps=4, save_steps=None):
    """Train, save_model, reload with from_pretrained on every rank."""
    import transformers

    import ds_patrickstar  # noqa: F401

    model = tiny_model(kind)
    trainer = transformers.Trainer(model=model, args=_args(out_dir, stage, steps, save_steps=save_steps),
                                   train_dataset=TokenData())
    trainer.train()
    trainer.save_model(os.path.join(out_dir, "final"))
    trainer.accelerator.wait_for_everyone()
    engine = trainer.model_wrapped
    result = {"losses": _losses(trainer), "basic_optimizer": type(engine.basic_optimizer).__name__,
              "checkpoints": sorted(d for d in os.listdir(out_dir) if d.startswith("checkpoint-"))}
    if stage == "patrickstar":  # (under stage 3 from_pretrained would build a zero.Init model: the test loads it)
        result["trained"] = engine.get_fp32_state_dict()
        result.update(load_saved(os.path.join(out_dir, "final"), kind))
    return result


def load_saved(path, kind):
    """``from_pretrained`` of a saved model: its state dict and its logits on a fixed input."""
    import transformers

    cls = transformers.GPT2LMHeadModel if kind == "gpt2" else transformers.LlamaForCausalLM
    loaded = cls.from_pretrained(path)
    with torch.no_grad():
        logits = loaded(PROBE).logits
    return {"loaded": {k: v.clone() for k, v in loaded.state_dict().items()}, "logits": logits}


def trainer_resume(rank, world_size, kind, stage, out_dir, checkpoint, steps=4):
    import transformers

    import ds_patrickstar  # noqa: F401

    trainer = transformers.Trainer(model=tiny_model(kind), args=_args(out_dir, stage, steps),
                                   train_dataset=TokenData())
    trainer.train(resume_from_checkpoint=checkpoint)
    return {"losses": _losses(trainer)}


def accelerate_run(rank, world_size, stage, out_dir, epochs=2, gas=2, kind="gpt2"):
    """The common accelerate loop: accumulate() with GA 2, save_state / load_state, get_state_dict; of the
    tiny GPT-2, or (``kind="lora"``) of the PEFT LoRA Llama."""
    from accelerate import Accelerator, PartialState
    from accelerate.utils import DeepSpeedPlugin

    import ds_patrickstar  # noqa: F401

    PartialState(cpu=True)
    config = ds_config(stage, gas)
    config.update(train_micro_batch_size_per_gpu=4, gradient_clipping=1.0)
    del config["scheduler"], config["bf16"]
    config["optimizer"]["params"] = {"lr": 5e-3, "weight_decay": 0.01}
    plugin = DeepSpeedPlugin(hf_ds_config=config)
    accelerator = Accelerator(deepspeed_plugin=plugin)
    model = tiny_lora() if kind == "lora" else tiny_model(kind)
    from accelerate.utils import DummyOptim

    # 4 micro-batches (2 optimizer steps) per rank and epoch; whole epochs, so that accelerate's
    # end-of-dataloader synchronisation falls on the same micro-steps in every run
    loader = torch.utils.data.DataLoader(TokenData(16 * world_size), batch_size=4, shuffle=False)
    model, optimizer, loader = accelerator.prepare(model, DummyOptim(model.parameters()), loader)

    def epoch():
        losses = []
        for batch in loader:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            losses.append(loss.item())
        return losses

    first = [loss for _ in range(epochs) for loss in epoch()]
    accelerator.save_state(os.path.join(out_dir, "state"))
    after = epoch()
    accelerator.load_state(os.path.join(out_dir, "state"))
    replay = epoch()
    state_dict = accelerator.get_state_dict(model)
    return {"first": first, "after": after, "replay": replay, "zero_stage": repr(plugin.zero_stage),
            "state_dict": {k: v.clone() for k, v in (state_dict or {}).items()},
            "fp32": model.get_fp32_state_dict() if stage == "patrickstar" else None}


def trainer_checkpointing_run(rank, world_size, kind, stage, out_dir, steps=3):
    """Train with TrainingArguments(gradient_checkpointing=True) (the Trainer calls the model's
    gradient_checkpointing_enable()); losses, and with "patrickstar" the trained fp32 master and the
    recomputation moments of the last step."""
    import transformers

    import ds_patrickstar  # noqa: F401

    trainer = transformers.Trainer(model=tiny_model(kind), train_dataset=TokenData(),
                                   args=_args(out_dir, stage, steps, gradient_checkpointing=True))
    trainer.train()
    engine = trainer.model_wrapped
    result = {"losses": _losses(trainer)}
    if stage == "patrickstar":
        result["recompute_moments"] = engine.get_patrickstar_counters()["recompute_moments"]
    return result


def tiny_lora():
    """The tiny Llama as a PEFT LoRA model: rank-4 adapters on the attention projections, the base frozen."""
    import peft

    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "o_proj"])
    model = peft.get_peft_model(tiny_model("llama"), config)
    torch.manual_seed(1)  # LoRA's B starts at zero: give it values, so every adapter learns from step 1
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.02)
    return model


def peft_run(rank, world_size, stage, out_dir, steps=4, save_steps=2, resume=None, gas=1, checkpointing=False):
    """A PEFT LoRA model through the Trainer (``gas``: gradient accumulation steps; ``checkpointing``: the
    Trainer's reentrant gradient checkpointing of each decoder layer): train (or resume), save_model; the
    losses, the files save_model wrote, the adapter config and weights in them, and the trained model's
    logits on a fixed input."""
    import transformers
    from safetensors.torch import load_file

    import ds_patrickstar  # noqa: F401

    kw = {"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"use_reentrant": True}}
    args = _args(out_dir, stage, steps, gas, save_steps, **(kw if checkpointing else {}))
    trainer = transformers.Trainer(model=tiny_lora(), args=args,
                                   train_dataset=TokenData())
    trainer.train(resume_from_checkpoint=resume)
    final = os.path.join(out_dir, "final")
    trainer.save_model(final)
    trainer.accelerator.wait_for_everyone()
    with open(os.path.join(final, "adapter_config.json")) as f:
        adapter_config = json.load(f)
    with torch.no_grad():  # the trained model's outputs, through the engine on every rank
        outputs = trainer.model_wrapped(input_ids=PROBE).logits
    result = {"losses": _losses(trainer), "files": sorted(os.listdir(final)), "adapter_config": adapter_config,
              "adapters": load_file(os.path.join(final, "adapter_model.safetensors")), "outputs": outputs}
    if stage == "patrickstar":  # every frozen base weight in a frozen chunk
        chunk_map = trainer.model_wrapped.optimizer.chunk_map
        frozen = [p for p in trainer.model.parameters() if not p.requires_grad]
        result["base_in_frozen_chunks"] = bool(frozen) and all(
            chunk_map.info(p) is not None and not chunk_map.info(p).trainable for p in frozen)
        result["recompute_moments"] = trainer.model_wrapped.get_patrickstar_counters()["recompute_moments"]
    return result


def peft_reloaded(path):
    """``PeftModel.from_pretrained`` of saved adapters on a fresh tiny Llama base: its logits on a fixed input."""
    import peft

    model = peft.PeftModel.from_pretrained(tiny_model("llama"), path)
    with torch.no_grad():
        return model(input_ids=PROBE).logits


def trainer_eval_before_train(rank, world_size, kind, stage, out_dir):
    """``evaluate()`` and ``predict()`` on a Trainer that has not trained (Hugging Face's ZeRO inference
    path), then ``train()`` is not called: the eval loss and the predictions' loss."""
    import transformers

    import ds_patrickstar  # noqa: F401

    trainer = transformers.Trainer(model=tiny_model(kind), args=_args(out_dir, stage, 1),
                                   eval_dataset=TokenData(n=8, seed=1))
    metrics = trainer.evaluate()
    predicted = trainer.predict(TokenData(n=8, seed=2))
    return {"eval_loss": metrics["eval_loss"], "predict_loss": predicted.metrics["test_loss"],
            "engine": type(trainer.model_wrapped).__name__}


def peft_merge_run(rank, world_size, stage, out_dir, steps=2):
    """A PEFT LoRA model trained by the Trainer, then merged and unmerged as users do under ZeRO-3 (inside
    ``GatheredParameters(..., modifier_rank=0)``): the logits through the engine after each, and the full value
    of a merged base weight."""
    import deepspeed
    import transformers

    import ds_patrickstar  # noqa: F401

    trainer = transformers.Trainer(model=tiny_lora(), args=_args(out_dir, stage, steps), train_dataset=TokenData())
    trainer.train()
    model, engine = trainer.model, trainer.model_wrapped
    base = model.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight
    result = {}
    for name, change in (("merged", model.merge_adapter), ("unmerged", model.unmerge_adapter)):
        with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=0):
            change()
        with deepspeed.zero.GatheredParameters([base]):
            result[f"{name}_base"] = base.detach().clone()
        with torch.no_grad():
            result[name] = engine(input_ids=PROBE).logits
    return result
