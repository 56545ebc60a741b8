"""Which update the step applies: the client's optimizer read once at initialize, refused if unsupported.

Adam and AdamW run on the fused kernels (see [Note: one Adam, several backends]); torch's SGD on its
pure-torch math (see [Note: SGD on chunks]). Every other optimizer is refused before anything is built.
"""

from __future__ import annotations

import enum
from typing import Any

import torch

from .adam_math import AdamHyper
from .sgd_math import SgdHyper

_UNSUPPORTED_FLAGS = ("amsgrad", "maximize", "capturable", "differentiable")


class UpdateRule(enum.Enum):
    """The optimizer's update (its value is what a checkpoint records); its hyper-parameters are read from a
    param group at every step."""

    ADAM = "Adam"
    ADAMW = "AdamW"
    SGD = "SGD"

    @property
    def adamw(self) -> bool:
        """Decoupled weight decay (AdamW)."""
        return self is UpdateRule.ADAMW

    @property
    def sgd(self) -> bool:
        return self is UpdateRule.SGD

    def hyper(self, group: dict[str, Any]) -> AdamHyper | SgdHyper:
        """The hyper-parameters of ``group`` as they are now (an LR scheduler edits them)."""
        return SgdHyper.from_group(group) if self.sgd else AdamHyper.from_group(group, self.adamw)


def update_rule(optimizer: torch.optim.Optimizer) -> UpdateRule:
    """The update ``optimizer`` asks for; raise ``ValueError`` for one stage 'patrickstar' cannot apply."""
    if isinstance(optimizer, torch.optim.SGD):
        if any(g.get("differentiable") for g in optimizer.param_groups):
            raise ValueError(
                "SGD(differentiable=True) is not supported by stage 'patrickstar'; set differentiable=False"
            )
        return UpdateRule.SGD
    return UpdateRule.ADAMW if adamw_mode(optimizer) else UpdateRule.ADAM


def adamw_mode(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` decouples weight decay (AdamW); raise if it is not an Adam."""
    name = type(optimizer).__name__
    if hasattr(optimizer, "adam_w_mode"):  # DeepSpeed FusedAdam / DeepSpeedCPUAdam
        return bool(optimizer.adam_w_mode)
    if isinstance(optimizer, torch.optim.Adam):  # torch AdamW subclasses Adam
        group = optimizer.param_groups[0] if optimizer.param_groups else {}
        for flag in _UNSUPPORTED_FLAGS:
            if any(g.get(flag) for g in optimizer.param_groups):
                raise ValueError(f"{name}({flag}=True) is not supported by stage 'patrickstar'; set {flag}=False")
        return bool(group.get("decoupled_weight_decay", isinstance(optimizer, torch.optim.AdamW)))
    raise ValueError(
        f"stage 'patrickstar' updates parameters on its chunks itself and supports Adam, AdamW and SGD only, "
        f'got optimizer {name}. Use "type": "Adam" or "AdamW" in the optimizer block, or pass '
        f"torch.optim.Adam, torch.optim.AdamW or torch.optim.SGD."
    )
