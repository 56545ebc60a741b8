"""Hugging Face: the ZeRO stage accelerate copies out of the config, its process count, and ranks kept
together through ``generate``.

[Note: accelerate's zero_stage]
accelerate copies ``zero_optimization.stage`` into ``DeepSpeedPlugin.zero_stage`` and
compares it with numbers: ``Accelerator.no_sync`` (entered by ``accumulate()`` on every
micro-step but the last, with several processes) asks ``zero_stage < 2`` to decide whether
DDP-style ``no_sync`` applies, which raises ``TypeError`` for the string "patrickstar".
Everywhere else Hugging Face asks ``== 3`` / ``is_zero3()`` (to use ``zero.Init`` and
gathered stage-3 saving), which "patrickstar" rightly fails.

So when ``deepspeed.initialize`` runs for a "patrickstar" config (accelerate calls it in
``prepare()``, before any training loop), :func:`adapt_accelerate` replaces each plugin's
``zero_stage`` that reads "patrickstar" by :class:`StageName`: the same string (it prints,
hashes and compares equal as "patrickstar", and ``== 3`` stays false), which orders against
numbers as stage 3 does. Parameters, gradients and optimizer states are partitioned
(gradients are reduce-scattered in backward and accumulated by the engine), so accelerate
takes its ZeRO >= 2 path: no ``no_sync``, the boundary is passed to the engine. Nothing is
changed when accelerate was never imported, nor for plugins of other stages.

[Note: generation in step]
With data parallelism every rank must run every forward (each one gathers chunk groups, see
[Note: chunk groups]), but ``generate`` stops a rank's loop when its own sequences are done: the
other ranks' next forward would wait forever in its all-gather. Hugging Face keeps the ranks
together with ``synced_gpus``: a rank whose sequences are done goes on running forwards (their
tokens dropped) until every rank's are, as it agrees with one all-reduce per token. ``generate``
turns it on by itself when ``is_deepspeed_zero3_enabled()`` or ``is_fsdp_managed_module(model)``
holds and the world has more than one process. The first reads the ``HfDeepSpeedConfig`` and
answers for ZeRO-3 everywhere (``zero.Init`` in ``from_pretrained``, gathered saving, ...), so it
must stay false for "patrickstar"; the second reads an attribute of the model,
``_is_fsdp_managed_module``, and nothing but the ``synced_gpus`` defaults asks it (``generate``,
``Seq2SeqTrainer``, a few speech models; a Trainer's loading by transformers' own distributed
plan does too, which a "patrickstar" run does not use). So :func:`synchronize_generation`, called
by the one registration point for a "patrickstar" initialize with more than one rank, sets that
attribute on every module of the model that has a ``generate`` (the model, and the base model a
PEFT model wraps), and ``destroy`` removes it: ``generate`` then runs as under ZeRO-3, with the same
tokens. The forwards of a rank that is done are evaluation forwards like the others (see
[Note: run state]).
"""

from __future__ import annotations

import sys
from numbers import Real

import torch

from .config import STAGE_NAME

_ORDERS_AS = 3


class StageName(str):
    """``"patrickstar"`` that orders against ZeRO stage numbers as stage 3; see [Note: accelerate's zero_stage]."""

    __slots__ = ()

    @staticmethod
    def _number(other: object) -> bool:
        return isinstance(other, Real) and not isinstance(other, bool)

    def __lt__(self, other):
        return _ORDERS_AS < other if self._number(other) else str.__lt__(self, other)

    def __le__(self, other):
        return _ORDERS_AS <= other if self._number(other) else str.__le__(self, other)

    def __gt__(self, other):
        return _ORDERS_AS > other if self._number(other) else str.__gt__(self, other)

    def __ge__(self, other):
        return _ORDERS_AS >= other if self._number(other) else str.__ge__(self, other)

    __hash__ = str.__hash__


def adapt_accelerate() -> int:
    """Give every accelerate DeepSpeed plugin whose ``zero_stage`` is "patrickstar" a :class:`StageName`;
    return how many were changed."""
    state = sys.modules.get("accelerate.state")
    if state is None:
        return 0
    plugins = state.AcceleratorState._shared_state.get("deepspeed_plugins")
    if plugins is None:
        return 0
    changed = 0
    for plugin in plugins.values() if isinstance(plugins, dict) else [plugins]:
        stage = getattr(plugin, "zero_stage", None)
        if type(stage) is str and stage == STAGE_NAME:
            plugin.zero_stage = StageName(stage)
            changed += 1
    return changed


def accelerate_num_processes() -> int | None:
    """How many processes accelerate set this run up with, or None when it has not (not imported,
    or no ``PartialState`` yet)."""
    state = sys.modules.get("accelerate.state")
    if state is None:
        return None
    return state.PartialState._shared_state.get("num_processes")


SYNCED = "_is_fsdp_managed_module"  # what transformers' is_fsdp_managed_module reads


def synchronize_generation(model: torch.nn.Module, world_size: int) -> list[torch.nn.Module]:
    """Make Hugging Face's ``generate`` keep ``world_size`` > 1 ranks together on ``model``; returns the
    modules marked (see [Note: generation in step])."""
    if world_size <= 1:
        return []
    marked = [
        m for m in model.modules() if callable(getattr(type(m), "generate", None)) and not getattr(m, SYNCED, False)
    ]
    for module in marked:
        setattr(module, SYNCED, True)
    return marked


def unsynchronize_generation(marked: list[torch.nn.Module]) -> None:
    """Undo :func:`synchronize_generation` (``destroy``: the model is a plain one again)."""
    for module in marked:
        if getattr(module, SYNCED, False):
            delattr(module, SYNCED)
