"""Tiny models, each exercising one quirk a ZeRO-3 style parameter-hook backend
must get right. Every entry of :data:`QUIRK_MODELS` is a function
``build(seed) -> (model, batch_fn)``:

* the model is built deterministically from ``seed`` (fp32, on CPU);
* ``batch_fn(micro_step)`` returns a deterministic tuple of positional inputs
  (depends only on seed and micro_step); floating inputs are cast to the
  training dtype by the harness;
* ``model(*inputs)`` returns a scalar loss, or a tuple / dict / dataclass whose
  ``[0]`` / ``["loss"]`` / ``.loss`` is the scalar loss (see ``harness.extract_loss``).

Losses are computed in fp32 (``logits.float()``) so bf16/fp16 runs differ only
in the model's own arithmetic. All models are < 10k parameters and run a step
in milliseconds on CPU. No dropout or other randomness inside forward.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

BATCH = 8  # must match harness.MICRO_BATCH (only for the DeepSpeed batch-size bookkeeping)
D_IN = 16
HID = 32
N_CLASSES = 8
VOCAB = 48
SEQ = 6


# --------------------------------------------------------------------------------------
# batch functions
# --------------------------------------------------------------------------------------
def _gen(seed: int, step: int) -> torch.Generator:
    return torch.Generator().manual_seed(1_000_003 * (seed + 1) + step)


def classification_batches(seed: int, d_in: int = D_IN, n_classes: int = N_CLASSES):
    def batch_fn(step: int):
        g = _gen(seed, step)
        x = torch.randn(BATCH, d_in, generator=g)
        y = torch.randint(0, n_classes, (BATCH,), generator=g)
        return (x, y)

    return batch_fn


def token_batches(seed: int, vocab: int = VOCAB, seq: int = SEQ):
    def batch_fn(step: int):
        g = _gen(seed, step)
        tok = torch.randint(0, vocab, (BATCH, seq + 1), generator=g)
        return (tok[:, :-1].contiguous(), tok[:, 1:].contiguous())

    return batch_fn


def _ce(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))


# --------------------------------------------------------------------------------------
# (a) plain MLP
# --------------------------------------------------------------------------------------
class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(D_IN, HID)
        self.fc2 = nn.Linear(HID, HID)
        self.fc3 = nn.Linear(HID, N_CLASSES)

    def forward(self, x, y):
        h = F.gelu(self.fc1(x))
        h = F.gelu(self.fc2(h))
        return _ce(self.fc3(h), y)


def build_mlp(seed: int):
    torch.manual_seed(seed)
    return MLP(), classification_batches(seed)


# --------------------------------------------------------------------------------------
# (b) tied weights: embedding and LM head share one Parameter (HF style)
# --------------------------------------------------------------------------------------
class TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HID)
        self.block = nn.Linear(HID, HID)
        self.norm = nn.LayerNorm(HID)
        self.lm_head = nn.Linear(HID, VOCAB, bias=False)
        self.lm_head.weight = self.embed.weight  # one Parameter, owned by two modules
        nn.init.normal_(self.embed.weight, std=HID**-0.5)  # keep tied logits O(1)

    def forward(self, tok, y):
        h = self.embed(tok)
        h = h + F.gelu(self.block(h))
        return _ce(self.lm_head(self.norm(h)), y)


def build_tied(seed: int):
    torch.manual_seed(seed)
    return TiedLM(), token_batches(seed)


# --------------------------------------------------------------------------------------
# (c) one module called several times per forward
# --------------------------------------------------------------------------------------
class ReusedModule(nn.Module):
    def __init__(self, n_calls: int = 3):
        super().__init__()
        self.n_calls = n_calls
        self.inp = nn.Linear(D_IN, HID)
        self.shared = nn.Linear(HID, HID)  # called n_calls times
        self.out = nn.Linear(HID, N_CLASSES)

    def forward(self, x, y):
        h = self.inp(x)
        for _ in range(self.n_calls):
            h = h + torch.tanh(self.shared(h))
        # and once more on a different branch, merged back
        h = h + 0.5 * self.shared(h * 0.5)
        return _ce(self.out(h), y)


def build_reused(seed: int):
    torch.manual_seed(seed)
    return ReusedModule(), classification_batches(seed)


# --------------------------------------------------------------------------------------
# (d) frozen parameters mixed with trainable ones
# --------------------------------------------------------------------------------------
class FrozenMix(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(D_IN, HID)  # trainable; its grad flows *through* frozen `mid`
        self.mid = nn.Linear(HID, HID)  # entirely frozen
        self.out = nn.Linear(HID, N_CLASSES)  # weight trainable, bias frozen (mixed in one module)
        self.frozen_head = nn.Linear(D_IN, HID)  # frozen, fed by the (non-grad) input
        for p in self.mid.parameters():
            p.requires_grad_(False)
        self.out.bias.requires_grad_(False)
        for p in self.frozen_head.parameters():
            p.requires_grad_(False)

    def forward(self, x, y):
        h = F.gelu(self.inp(x)) + self.frozen_head(x)
        h = F.gelu(self.mid(h))
        return _ce(self.out(h), y)


def build_frozen(seed: int):
    torch.manual_seed(seed)
    return FrozenMix(), classification_batches(seed)


# --------------------------------------------------------------------------------------
# (e) parameters owned by the top module, used directly in its forward beside children
# --------------------------------------------------------------------------------------
class ParentParam(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(D_IN, HID)
        self.w_top = nn.Parameter(torch.randn(HID, HID) * HID**-0.5)  # used via F.linear
        self.b_top = nn.Parameter(torch.zeros(HID))  # used via an add
        # Used via a broadcast mul. Shape (1,), not (): stock DeepSpeed 0.19.8 cannot hold a
        # 0-dim parameter at all (engine._broadcast_model does p.data.view(torch.uint8),
        # which raises for 0-dim tensors, in every ZeRO stage), so there is no reference.
        self.gain = nn.Parameter(torch.ones(1))
        self.out = nn.Linear(HID, N_CLASSES)

    def forward(self, x, y):
        h = self.inp(x)
        h = F.gelu(F.linear(h, self.w_top) + self.b_top)
        return _ce(self.out(h) * self.gain, y)


def build_parent_param(seed: int):
    torch.manual_seed(seed)
    return ParentParam(), classification_batches(seed)


# --------------------------------------------------------------------------------------
# (f) a parameter and a whole submodule never used in forward
# --------------------------------------------------------------------------------------
class UnusedParams(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(D_IN, HID)
        self.unused_layer = nn.Linear(HID, HID)  # whole submodule never called
        self.out = nn.Linear(HID, N_CLASSES)
        self.unused_param = nn.Parameter(torch.randn(HID) * 0.1)  # never read

    def forward(self, x, y):
        return _ce(self.out(F.gelu(self.inp(x))), y)


def build_unused(seed: int):
    torch.manual_seed(seed)
    return UnusedParams(), classification_batches(seed)


# --------------------------------------------------------------------------------------
# (g) submodules returning a tuple, a dict and a dataclass; top returns each kind
# --------------------------------------------------------------------------------------
@dataclass
class BlockOutput:
    hidden: torch.Tensor
    extra: torch.Tensor


@dataclass
class ModelOutput:
    loss: torch.Tensor
    logits: torch.Tensor


class TupleBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(HID, HID)
        self.aux = nn.Linear(HID, 1)

    def forward(self, h):
        z = self.fc(h)
        return F.gelu(z), self.aux(z)  # (hidden, aux scalar per row)


class DictBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(HID, HID)
        self.gate = nn.Linear(HID, HID)

    def forward(self, h):
        return {"hidden": F.gelu(self.fc(h)), "gate": torch.sigmoid(self.gate(h))}


class DataclassBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(HID, HID)
        self.extra = nn.Linear(HID, 2)

    def forward(self, h):
        z = self.fc(h)
        return BlockOutput(hidden=F.gelu(z), extra=self.extra(z))


class StructuredOutputs(nn.Module):
    def __init__(self, top_kind: str):
        super().__init__()
        assert top_kind in ("tuple", "dict", "dataclass")
        self.top_kind = top_kind
        self.inp = nn.Linear(D_IN, HID)
        self.tblock = TupleBlock()
        self.dblock = DictBlock()
        self.cblock = DataclassBlock()
        self.out = nn.Linear(HID, N_CLASSES)

    def forward(self, x, y):
        h = self.inp(x)
        h, aux = self.tblock(h)
        d = self.dblock(h)
        h = d["hidden"] * d["gate"]
        c = self.cblock(h)
        logits = self.out(c.hidden)
        loss = _ce(logits, y) + 0.01 * aux.float().pow(2).mean() + 0.01 * c.extra.float().pow(2).mean()
        if self.top_kind == "tuple":
            return (loss, logits)
        if self.top_kind == "dict":
            return {"loss": loss, "logits": logits}
        return ModelOutput(loss=loss, logits=logits)


def _build_outputs(kind: str):
    def build(seed: int):
        torch.manual_seed(seed)
        return StructuredOutputs(kind), classification_batches(seed)

    build.__name__ = f"build_outputs_{kind}"
    return build


# --------------------------------------------------------------------------------------
# (h)/(i) activation checkpointing, reentrant and non-reentrant
# --------------------------------------------------------------------------------------
class CkptBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(HID, HID)
        self.fc2 = nn.Linear(HID, HID)

    def forward(self, h):
        return h + self.fc2(F.gelu(self.fc1(h)))


class Checkpointed(nn.Module):
    def __init__(self, use_reentrant: bool, n_blocks: int = 2):
        super().__init__()
        self.use_reentrant = use_reentrant
        self.inp = nn.Linear(D_IN, HID)  # so the checkpointed blocks' input requires grad
        self.blocks = nn.ModuleList([CkptBlock() for _ in range(n_blocks)])
        self.out = nn.Linear(HID, N_CLASSES)

    def forward(self, x, y):
        h = self.inp(x)
        for blk in self.blocks:
            h = checkpoint(blk, h, use_reentrant=self.use_reentrant)
        return _ce(self.out(h), y)


def _build_ckpt(use_reentrant: bool):
    def build(seed: int):
        torch.manual_seed(seed)
        return Checkpointed(use_reentrant), classification_batches(seed)

    build.__name__ = f"build_ckpt_{'reentrant' if use_reentrant else 'nonreentrant'}"
    return build


# --------------------------------------------------------------------------------------
# (j) biases + LayerNorm, for two param groups (no weight decay on biases and norms)
# --------------------------------------------------------------------------------------
class NormBiasNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(D_IN, HID)
        self.ln1 = nn.LayerNorm(HID)
        self.fc = nn.Linear(HID, HID)
        self.ln2 = nn.LayerNorm(HID)
        self.out = nn.Linear(HID, N_CLASSES)

    def forward(self, x, y):
        h = self.ln1(F.gelu(self.inp(x)))
        h = self.ln2(h + F.gelu(self.fc(h)))
        return _ce(self.out(h), y)


def build_groups(seed: int):
    torch.manual_seed(seed)
    return NormBiasNet(), classification_batches(seed)


def two_param_groups(model: nn.Module, weight_decay: float = 0.1, no_decay_lr=None):
    """HF-style groups: weight decay on >=2-D weights; none on biases and norm weights.

    ``no_decay_lr`` (if given) also gives the second group its own LR, so a backend
    that ignored per-group hyper-parameters would be caught by the LR as well.
    """
    decay, no_decay = [], []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    if no_decay_lr is not None:
        groups[1]["lr"] = no_decay_lr
    return groups


# --------------------------------------------------------------------------------------
QUIRK_MODELS: dict[str, Callable[[int], tuple[nn.Module, Callable]]] = {
    "mlp": build_mlp,  # (a)
    "tied": build_tied,  # (b)
    "reused": build_reused,  # (c)
    "frozen": build_frozen,  # (d)
    "parent_param": build_parent_param,  # (e)
    "unused": build_unused,  # (f)
    "outputs_tuple": _build_outputs("tuple"),  # (g)
    "outputs_dict": _build_outputs("dict"),  # (g)
    "outputs_dataclass": _build_outputs("dataclass"),  # (g)
    "ckpt_reentrant": _build_ckpt(True),  # (h)
    "ckpt_nonreentrant": _build_ckpt(False),  # (i)
    "groups": build_groups,  # (j)
}
