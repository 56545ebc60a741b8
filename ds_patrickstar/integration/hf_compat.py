"""Hugging Face accelerate: the ZeRO stage it copies out of the config, and its process count.

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
"""

from __future__ import annotations

import sys
from numbers import Real

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
