"""A GPT in pure torch (nanoGPT-like), sized by named presets, for the benchmarks.

Token + learned position embedding, pre-LN transformer blocks (causal self-attention through
``F.scaled_dot_product_attention``, GELU MLP), a final LayerNorm and an LM head whose weight is
TIED to the token embedding (one ``nn.Parameter`` owned by both ``wte`` and ``lm_head``, the same
way Hugging Face GPT-2 ties them, so ZeRO-3 style per-module parameter gathering sees it in each
module that uses it). Nothing here imports DeepSpeed.
"""
import math
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


@dataclass(frozen=True)
class GPTConfig:
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 192
    block_size: int = 256
    vocab_size: int = 256
    dropout: float = 0.0
    activation_checkpointing: bool = False
    # How each block is checkpointed when activation_checkpointing is on: torch's non-reentrant
    # ("torch", the default), torch's reentrant ("torch-reentrant", what Hugging Face's
    # gradient_checkpointing_enable() uses) or DeepSpeed's (deepspeed.checkpointing.checkpoint).
    checkpoint_impl: str = "torch"
    # Tokens per piece of a sequence-chunked loss (0: one piece): the LM head and cross-entropy of
    # each piece run under a checkpoint, so that at long sequences only one piece's logits live,
    # as long-sequence trainers do (the logits of 8k tokens x 50k vocab in fp32 are 1.6 GB).
    loss_chunk: int = 0
    # LoRA: every linear layer of the blocks gets a trainable rank-``lora_rank`` adapter beside it
    # (``LoraLinear``) and every other parameter is frozen (0: train everything).
    lora_rank: int = 0


PRESETS = {
    # ~1.9M parameters: the default of benchmarks/train_gpt.py, trains in minutes on 2 CPU cores.
    "tiny": GPTConfig(n_layer=4, n_head=4, n_embd=192, block_size=256, vocab_size=256),
    # ~10.8M parameters.
    "small": GPTConfig(n_layer=6, n_head=6, n_embd=384, block_size=512, vocab_size=256),
    # ~114M parameters (GPT-2 small width, 16 layers, byte vocabulary): the data-parallel volume check
    # at more than 100M parameters that still fits a few CPU ranks.
    "gpt-114m": GPTConfig(n_layer=16, n_head=12, n_embd=768, block_size=512, vocab_size=256),
    # GPT-2 medium shape, ~355M parameters (vocab padded to a multiple of 64).
    "gpt2-medium": GPTConfig(n_layer=24, n_head=16, n_embd=1024, block_size=1024, vocab_size=50304),
    # GPT-3 XL shape, ~1.3B parameters.
    "gpt-1.3b": GPTConfig(n_layer=24, n_head=16, n_embd=2048, block_size=2048, vocab_size=50304),
}

CHECKPOINT_IMPLS = ("torch", "torch-reentrant", "deepspeed")


def get_config(preset, **overrides):
    """The named preset with keyword ``overrides`` (e.g. ``activation_checkpointing=True``)."""
    if preset not in PRESETS:
        raise KeyError(f"unknown model preset {preset!r}; choose from {sorted(PRESETS)}")
    return replace(PRESETS[preset], **overrides)


class LoraB(nn.Linear):
    """The adapter's up-projection: it starts at zero (as in PEFT), so the model starts as its base."""

    def reset_parameters(self):
        nn.init.zeros_(self.weight)


class LoraLinear(nn.Module):
    """A frozen ``nn.Linear`` (``base``) and a trainable rank-``rank`` adapter beside it:
    ``base(x) + lora_B(lora_A(x))``, the structure and names of PEFT's LoRA layer. Each sub-module
    holds one kind of parameter (frozen or trainable); the adapter's values come from its modules'
    own ``reset_parameters`` (``lora_B``: zero) and ``GPT._init_weights`` (``lora_A``), which
    ``ds_patrickstar.Init`` runs too, and ``lora_B`` is zero before ``deepspeed.zero.Init``
    partitions it."""

    def __init__(self, in_features, out_features, rank, base=None):
        super().__init__()
        self.base = nn.Linear(in_features, out_features) if base is None else base
        self.base.requires_grad_(False)
        self.lora_A = nn.Linear(in_features, rank, bias=False)
        self.lora_B = LoraB(rank, out_features, bias=False)

    def forward(self, x):
        return self.base(x) + self.lora_B(self.lora_A(x))


def _linear(cfg, in_features, out_features):
    """A linear layer of a block: plain, or frozen with an adapter when ``cfg.lora_rank`` is set."""
    if cfg.lora_rank:
        return LoraLinear(in_features, out_features, cfg.lora_rank)
    return nn.Linear(in_features, out_features)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        if cfg.n_embd % cfg.n_head:
            raise ValueError("n_embd must be divisible by n_head")
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.c_attn = _linear(cfg, cfg.n_embd, 3 * cfg.n_embd)
        self.c_proj = _linear(cfg, cfg.n_embd, cfg.n_embd)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        drop = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=drop, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.c_fc = _linear(cfg, cfg.n_embd, 4 * cfg.n_embd)
        self.c_proj = _linear(cfg, 4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x):
        x = x + self.drop(self.attn(self.ln_1(x)))
        return x + self.drop(self.mlp(self.ln_2(x)))


class GPT(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight
        self.apply(self._init_weights)
        residual_std = 0.02 / math.sqrt(2 * cfg.n_layer)
        for name, p in self.named_parameters():
            if name.endswith(("c_proj.weight", "c_proj.base.weight")):
                nn.init.normal_(p, mean=0.0, std=residual_std)
        if cfg.lora_rank:  # the base frozen: embeddings, LayerNorms, the tied LM head, every base layer
            for name, p in self.named_parameters():
                p.requires_grad_(".lora_" in name)

    @staticmethod
    def _init_weights(module):
        if isinstance(module, (nn.Linear, nn.Embedding)) and not isinstance(module, LoraB):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx, targets=None):
        """Logits ``(B, T, vocab)``; with ``targets`` returns ``(logits, cross-entropy loss)``."""
        t = idx.shape[1]
        if t > self.cfg.block_size:
            raise ValueError(f"sequence length {t} exceeds block_size {self.cfg.block_size}")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = self._checkpointed(block, x) if self.cfg.activation_checkpointing and self.training else block(x)
        if targets is not None and self.cfg.loss_chunk:
            return None, self._chunked_loss(self.ln_f(x), targets)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss

    def _checkpointed(self, block, x):
        impl = self.cfg.checkpoint_impl
        if impl == "deepspeed":
            import deepspeed

            return deepspeed.checkpointing.checkpoint(block, x)
        if impl not in CHECKPOINT_IMPLS:
            raise ValueError(f"checkpoint_impl={impl!r}: choose from {CHECKPOINT_IMPLS}")
        return checkpoint(block, x, use_reentrant=impl == "torch-reentrant")

    def _piece_loss(self, h, targets):
        logits = self.lm_head(h).float()
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1), reduction="sum")

    def _chunked_loss(self, h, targets):
        """Mean cross-entropy over pieces of ``loss_chunk`` tokens, each under a checkpoint (its
        logits are recomputed in backward); ``(None, loss)`` is returned: no full logits exist."""
        total = h.new_zeros((), dtype=torch.float32)
        for start in range(0, h.shape[1], self.cfg.loss_chunk):
            piece = slice(start, start + self.cfg.loss_chunk)
            total = total + checkpoint(self._piece_loss, h[:, piece], targets[:, piece], use_reentrant=False)
        return total / targets.numel()


def add_lora(model, rank):
    """Freeze every parameter, then put a LoRA adapter beside every linear layer of the blocks (the LM head is
    the tied embedding, frozen with it)."""
    model.requires_grad_(False)
    for block in model.blocks:
        for owner in list(block.modules()):
            for name, child in list(owner.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(owner, name, LoraLinear(child.in_features, child.out_features, rank, base=child))


def count_params(model, exclude_position_embedding=False):
    """Unique parameters (the tied embedding/LM-head weight counted once).

    Call it before handing the model to DeepSpeed: ZeRO-3 style backends replace the data of
    partitioned parameters by empty tensors, so ``numel()`` then reads 0.
    """
    seen = {}
    for name, p in model.named_parameters():
        seen.setdefault(id(p), (name, p))
    return sum(p.numel() for name, p in seen.values()
               if not (exclude_position_embedding and name.startswith("wpe.")))


def count_params_for_config(cfg):
    """Parameter count of a ``GPTConfig`` without building the model (adapters included)."""
    d, layer = cfg.n_embd, 12 * cfg.n_embd ** 2 + 13 * cfg.n_embd
    return cfg.vocab_size * d + cfg.block_size * d + cfg.n_layer * layer + 2 * d + count_adapter_params(cfg)


def count_adapter_params(cfg):
    """The trainable parameters of ``cfg.lora_rank``'s adapters: ``rank x (in + out)`` per linear layer of
    the blocks (query-key-value, attention output, MLP in and out)."""
    d = cfg.n_embd
    return cfg.n_layer * cfg.lora_rank * ((d + 3 * d) + (d + d) + (d + 4 * d) + (4 * d + d))


def flops_per_token(cfg, n_params, seq_len):
    """Training FLOPs per token: ``6 * N + 12 * L * H * T``.

    ``N`` is the number of parameters that take part in matmuls (pass the count WITHOUT the
    position embedding; the tied embedding is counted once, which accounts for the LM-head
    matmul). ``6 * N`` covers the forward (2 FLOPs per multiply-add) and backward (twice the
    forward) passes through the weights; ``12 * L * H * T`` adds the attention score and
    attention-times-value matmuls (L layers, hidden size H, sequence length T), as in the PaLM
    paper (Chowdhery et al. 2022, appendix B). It ignores the causal mask (full T x T counted),
    activation recomputation, softmax/LayerNorm/GELU and the optimizer.
    """
    return 6 * n_params + 12 * cfg.n_layer * cfg.n_embd * seq_len


def build_model(preset="tiny", **overrides):
    """Return ``(model, cfg)`` for a preset name."""
    cfg = get_config(preset, **overrides)
    return GPT(cfg), cfg
