"""``deepspeed.initialize`` as a transaction: a failed one leaves the user's model and optimizer as they were.

[Note: initialize as a transaction]
Before the engine is built, :class:`ModelState` records what initialize changes on the user's objects,
holding no parameter's values (they would stay in memory beside the chunks, and initialize never
doubles model memory: see store/binding.py): every submodule's parameter and buffer entries, every
parameter's device, dtype and gradient, every buffer's tensor (buffers are small and never chunked),
and a client optimizer's param groups. What needs no parameter's values is decided first (see
:func:`~ds_patrickstar.integration.planning.plan_run` and ``assembly.py``: a run refused there changes
no parameter); the steps after it bind the parameters to their chunks, one at a time. When any step of
initialize fails, the half-built engine goes with the teardown of a finished one (``engine.destroy()``,
see [Note: engine teardown]): our hooks and DeepSpeed's leave the model, the disk tier's I/O threads
stop and its files go, the accelerator gives back its memory. Before that, each parameter already
bound gets its values back as a host tensor of its own, with destroy's read-back but from this rank's
own chunks and without a collective (the other ranks may never join one): the values its chunk
received when it was bound. Then every entry, gradient and param group gets its reference back and
every parameter its device and dtype, and the error that failed initialize propagates unchanged. So
the model holds the same ``nn.Parameter`` objects with the values they had when bound, on the same
devices in the same dtypes, and initialize can run again on it. With bf16 or fp16, DeepSpeed casts the
parameters before binding: an fp32 parameter comes back fp32 holding its values rounded to the
training dtype (the rounding DeepSpeed's cast made), bound or not. With data parallelism a rank holds
the values of its own chunks only: a bound parameter with values in another rank's chunk (one that
straddles the ranks' chunks among them) is left as destroy leaves an interrupted run's (empty, marked,
one warning saying how many and why), and a new initialize refuses it by name before any collective:
load its values (a checkpoint) into the model first. An error while rolling back is logged, never
raised over the error that failed initialize.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from .planning import VALUES_LOST
from .zero_optimizer import PatrickStarOptimizer

logger = logging.getLogger(__name__)

ParamState = tuple[torch.nn.Parameter, torch.device, torch.dtype, torch.Tensor | None]  # (param, device, dtype, grad)


@dataclass
class ModelState:
    """What initialize found of the model and a client optimizer; no parameter's values."""

    entries: list[tuple[dict[str, Any], str, Any]]  # (a submodule's _parameters or _buffers, key, value)
    params: list[ParamState]
    buffers: list[tuple[torch.Tensor, torch.Tensor]]  # (buffer, its .data)
    groups: list[tuple[dict[str, Any], dict[str, Any]]]  # (a param group, its entries)
    group_list: list[dict[str, Any]] | None  # the client optimizer's list of param groups

    @classmethod
    def of(cls, module: torch.nn.Module, optimizer: object = None) -> ModelState:
        """The state of ``module`` and of ``optimizer`` when it is a torch optimizer (a client's)."""
        entries: list[tuple[dict[str, Any], str, Any]] = []
        params: dict[int, ParamState] = {}
        buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for sub in module.modules():
            for key, param in sub._parameters.items():
                entries.append((sub._parameters, key, param))
                if param is not None:
                    params.setdefault(id(param), (param, param.device, param.dtype, param.grad))
            for key, buffer in sub._buffers.items():
                entries.append((sub._buffers, key, buffer))
                if buffer is not None:
                    buffers.setdefault(id(buffer), (buffer, buffer.data))
        group_list = optimizer.param_groups if isinstance(optimizer, torch.optim.Optimizer) else None
        groups = [(group, dict(group)) for group in group_list or []]
        return cls(entries, list(params.values()), list(buffers.values()), groups, group_list)

    @torch.no_grad()
    def restore(self) -> None:
        """Every entry, buffer tensor, gradient and param group as :meth:`of` found it; every parameter
        with values on its device in its dtype (a bound one got its values back first: see
        [Note: initialize as a transaction])."""
        for table, key, value in self.entries:
            table[key] = value
        for buffer, data in self.buffers:
            buffer.data = data
        for param, device, dtype, grad in self.params:
            if not getattr(param, VALUES_LOST, False):  # an empty one takes no gradient of its old shape
                param.data = param.data.to(device, dtype)
                param.grad = grad
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
        steps.insert(0, optimizer.abandon)  # before destroy, which would read the values back with a collective
    for step in steps:
        try:
            step()
        except Exception:
            logger.exception("ds_patrickstar: rolling back a failed initialize: %s failed", step.__qualname__)
