"""Rank jobs for tests/test_moe_generate.py: a tiny Hugging Face Mixtral whose experts are modules of
their own (as transformers 4.x builds them: each rank's tokens run different expert modules), trained
on 2 ranks; and Hugging Face ``generate`` on 2 ranks with a different length on each.

transformers 5 keeps a Mixtral's experts as one module of 3-D weights, so every rank runs the same
modules whatever the routing; :class:`ExpertList` puts them back into one module per expert, with
the same forward arguments, so that routing decides which modules run.
"""
from __future__ import annotations

import torch

VOCAB, SEQ, BATCH, STEPS = 64, 12, 4, 3
EXPERTS = 4


class Expert(torch.nn.Module):
    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.gate_up = torch.nn.Linear(hidden, 2 * inner, bias=False)
        self.down = torch.nn.Linear(inner, hidden, bias=False)

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(torch.nn.functional.silu(gate) * up)


class ExpertList(torch.nn.Module):
    """A Mixtral block's experts, one module each, called only for the tokens routed to them."""

    def __init__(self, hidden: int, inner: int, count: int):
        super().__init__()
        self.experts = torch.nn.ModuleList(Expert(hidden, inner) for _ in range(count))

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for index, expert in enumerate(self.experts):
            token, slot = torch.where(top_k_index == index)
            if token.numel():
                out.index_add_(0, token, expert(hidden_states[token]) * top_k_weights[token, slot, None])
        return out


def moe_model():
    import transformers

    torch.manual_seed(0)
    config = transformers.MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=2, num_local_experts=EXPERTS,
                                        num_experts_per_tok=1, max_position_embeddings=64, tie_word_embeddings=False,
                                        router_jitter_noise=0.0)
    model = transformers.MixtralForCausalLM(config)
    with torch.no_grad():  # feature 0 of a token's embedding says which half of the vocabulary it is from
        model.model.embed_tokens.weight[:, 0] = torch.where(torch.arange(VOCAB) < VOCAB // 2, 4.0, -4.0)
    for layer in model.model.layers:
        layer.mlp.experts = ExpertList(32, 32, EXPERTS)
        with torch.no_grad():  # which the router reads: experts 0 and 1 for the first half, 2 and 3 for the other
            layer.mlp.gate.weight[:, 0] = torch.tensor([4.0, 4.0, -4.0, -4.0])
    return model


def _batch(rank: int, step: int) -> torch.Tensor:
    """Rank 0's tokens and rank 1's differ, so the router sends them to different experts."""
    gen = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randint(rank * VOCAB // 2, (rank + 1) * VOCAB // 2, (BATCH, SEQ), generator=gen)


def moe_config(stage, gas=1, leaf_classes=None, budget=None) -> dict:
    """``leaf_classes``: ``zero_optimization.leaf_module.classes`` (``[]``: none, not even DeepSpeed's
    default Mixtral block); None: the key is left out."""
    zero = {"stage": stage}
    if stage == "patrickstar":
        zero["chunk_size"] = 2048
        if budget is not None:  # the strict emulated accelerator, small enough to evict every step
            zero.update(emulate_accelerator=True, device_budget=budget)
    else:
        zero["stage3_param_persistence_threshold"] = 0
    if leaf_classes is not None:
        zero["leaf_module"] = {"classes": leaf_classes}
    return {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": gas, "zero_optimization": zero,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}}, "gradient_clipping": 1.0}


def train_moe(rank, world_size, stage, gas=1, leaf_classes=None, set_leaf=False, budget=None):
    """Losses, routing and the fp32 weights after STEPS steps of ``gas`` micro-steps."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, set_z3_leaf_modules

    import ds_patrickstar  # noqa: F401

    model = moe_model()
    if set_leaf:
        set_z3_leaf_modules(model, [ExpertList])
    engine, *_ = deepspeed.initialize(model=model, config=moe_config(stage, gas, leaf_classes, budget),
                                      model_parameters=model.parameters())
    losses, experts_run, evictions = [], set(), 0
    hooks = [e.register_forward_hook(lambda m, a, o, i=i: experts_run.add(i))
             for i, e in enumerate(model.model.layers[0].mlp.experts.experts)]
    for step in range(STEPS * gas):
        ids = _batch(rank, step)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if stage == "patrickstar" and (step + 1) % gas == 0:  # the step just taken
            evictions += engine.get_patrickstar_counters()["evictions"]
    for hook in hooks:
        hook.remove()
    if stage == "patrickstar":
        weights = engine.get_fp32_state_dict()
    else:
        weights = {n: safe_get_full_fp32_param(p) for n, p in engine.module.named_parameters()}
    return {"losses": losses, "weights": weights, "experts_run": sorted(experts_run), "evictions": evictions}


def generate_after_step(rank, world_size, stage, budget=None):
    """One training step, then ``generate`` with 3 new tokens on rank 0 and 7 on rank 1; the tokens, and
    whether the model carries the mark that turns ``synced_gpus`` on, before and after ``destroy``."""
    import deepspeed
    import transformers
    from transformers.integrations import HfDeepSpeedConfig

    import ds_patrickstar  # noqa: F401

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                     eos_token_id=VOCAB - 1)
    ds_config = moe_config(stage, budget=budget)
    keep = HfDeepSpeedConfig(ds_config)  # noqa: F841  (as the Trainer and accelerate set it; held by reference)
    model = transformers.GPT2LMHeadModel(config)
    engine, *_ = deepspeed.initialize(model=model, config=ds_config, model_parameters=model.parameters())
    ids = _batch(rank, 0)
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    engine.eval()
    prompt = _batch(rank, 1)[:2, :4]
    new = 3 if rank == 0 else 7
    with torch.no_grad():
        out = engine.module.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                     pad_token_id=0)
    marked = getattr(model, "_is_fsdp_managed_module", False)
    engine.destroy()
    return {"tokens": out, "marked": marked, "marked_after_destroy": getattr(model, "_is_fsdp_managed_module", False)}
