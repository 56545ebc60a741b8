"""``deepspeed.initialize`` as a transaction: a failed one leaves the user's model and optimizer as they were.

[Note: initialize as a transaction]
Before the engine is built, :class:`ModelState` takes references (never copies) to what initialize
changes on the user's objects: every submodule's parameter and buffer entries, every parameter's and
buffer's tensor (``.data``) and gradient, and a client optimizer's param groups. Everything that can
be decided without touching the model is decided first (see
:func:`~ds_patrickstar.integration.planning.plan_run`); the steps after it allocate and bind the
parameters to their chunks. When any step of initialize fails, :func:`roll_back` tears the half-built
engine down with the teardown of a finished one (``engine.destroy()``, see [Note: engine teardown]),
except that nothing is read back from the chunks (no collective runs on a failing rank): our hooks and
DeepSpeed's leave the model, the disk tier's I/O threads stop and its files go, the accelerator gives
back its memory; then every entry and tensor gets its reference back and the error that failed
initialize propagates unchanged. So the model holds the same tensors, with the same values, on the
same devices, and initialize can run again on it. An error while rolling back is logged, never raised
over that error. The references live until initialize returns: the model's own tensors stay in memory
beside its chunks until then (the pre-flight check measures free memory with them held).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from .zero_optimizer import PatrickStarOptimizer

logger = logging.getLogger(__name__)


@dataclass
class ModelState:
    """References to the model's and a client optimizer's state as initialize found it."""

    entries: list[tuple[dict[str, Any], str, Any]]  # (a submodule's _parameters or _buffers, key, value)
    tensors: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]  # (tensor, its .data, its .grad)
    groups: list[tuple[dict[str, Any], dict[str, Any]]]  # (a param group, its entries)
    group_list: list[dict[str, Any]] | None  # the client optimizer's list of param groups

    @classmethod
    def of(cls, module: torch.nn.Module, optimizer: object = None) -> ModelState:
        """The state of ``module`` and of ``optimizer`` when it is a torch optimizer (a client's)."""
        entries: list[tuple[dict[str, Any], str, Any]] = []
        tensors: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = {}
        for sub in module.modules():
            for table in (sub._parameters, sub._buffers):
                for key, value in table.items():
                    entries.append((table, key, value))
                    if value is not None and id(value) not in tensors:
                        grad = value.grad if isinstance(value, torch.nn.Parameter) else None
                        tensors[id(value)] = (value, value.data, grad)
        group_list = optimizer.param_groups if isinstance(optimizer, torch.optim.Optimizer) else None
        groups = [(group, dict(group)) for group in group_list or []]
        return cls(entries, list(tensors.values()), groups, group_list)

    def restore(self) -> None:
        """Every entry, tensor, gradient and param group as :meth:`of` found it."""
        for table, key, value in self.entries:
            table[key] = value
        for tensor, data, grad in self.tensors:
            tensor.data = data
            if isinstance(tensor, torch.nn.Parameter):
                tensor.grad = grad
        if self.group_list is not None:
            self.group_list[:] = [group for group, _ in self.groups]
        for group, saved in self.groups:
            group.clear()
            group.update(saved)


def roll_back(engine: Any, saved: ModelState) -> None:
    """A failed initialize: ``engine`` (as far as it was built) goes, the model gets ``saved`` back; see
    [Note: initialize as a transaction]. Raises nothing: a step that fails is logged and the next runs."""
    optimizer = getattr(engine, "optimizer", None)
    steps = [engine.destroy, saved.restore]
    if isinstance(optimizer, PatrickStarOptimizer):
        steps.insert(0, optimizer.abandon)  # before destroy, which would read the values back
    for step in steps:
        try:
            step()
        except Exception:
            logger.exception("ds_patrickstar: rolling back a failed initialize: %s failed", step.__qualname__)
