"""The fp32 master, momentum and variance of one owned chunk (or of a piece of it): what the optimizer
updates, wherever the states live (accelerator, host, or a disk tier's buffer; see
[Note: optimizer-state placement] in optim/states.py and [Note: disk tier] in disk/states.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(eq=False)
class OptimizerChunk:
    """fp32 master, momentum and variance aligned with one owned param chunk."""

    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.master, self.exp_avg, self.exp_avg_sq

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def sliced(self, start: int, stop: int) -> OptimizerChunk:
        return OptimizerChunk(*(t[start:stop] for t in self.tensors()))
