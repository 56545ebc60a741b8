"""Parameters used outside the module that holds them: DeepSpeed's external parameters, on chunks.

[Note: external parameters]
A module may use a parameter it does not hold: one another module returned from its forward (a layer
handing its bias to the caller for a fused bias-add, as Megatron's ``skip_bias_add`` does), or one registered
with DeepSpeed's public ``deepspeed.zero.register_external_parameter(module, param)``. Both live in stock's
registry, ``module._external_params`` (id -> parameter; every module gets one at initialize, as stock's
modules do), and are honoured as stock does: every module's
forward is tracked on a stack (a pre- and a post-hook on every module, registered before the module's own
hooks so that its post-hook runs first); a module's forward uses its registered external parameters (a moment,
as for its own: the chunks are present and the tensors ``COMPUTE`` until its forward ends, and its backward
uses them again once backward reaches its outputs); a parameter found in a module's output that no module on
the stack has registered is registered on the calling module (and moved out of the finished module's
registry, where it was external to that one), and its use is handed to the caller before the finished
module's own use ends, so the chunk never goes in between. The registry persists, so from the next forward
on the caller brings the parameter at its own start, as stock does. Without this a returned parameter was
let go at the end of the module that holds it: with data parallelism or placement its chunk could be
released while the caller still read it. Stock also registers a parameter that a module's forward reads by
attribute from another module (its ``_parameters`` are a dict that registers on read); ours does not wrap
modules' dicts, so such a parameter must be registered, or returned, to be safe where chunks move.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from deepspeed.runtime.zero.partition_parameters import (
    _init_external_params,
    register_external_parameter,
    unregister_external_parameter,
)

from ..autograd_state import iter_tensors
from ..chunks.chunk import TensorInfo


class UseTarget(Protocol):
    """The module moments of the training flow (integration/hook_target.py) that external uses drive."""

    def pre_forward(self, module: torch.nn.Module, infos: list[TensorInfo]) -> None: ...

    def post_forward(self, module: torch.nn.Module, infos: list[TensorInfo]) -> None: ...

    def pre_backward(self, module: torch.nn.Module, infos: list[TensorInfo]) -> None: ...


def _registry(module: torch.nn.Module) -> dict[int, torch.nn.Parameter]:
    return getattr(module, "_external_params", None) or {}


class ExternalUses:
    """The forward's module stack and the uses of external parameters; see [Note: external parameters]."""

    def __init__(self, info_of: Callable[[torch.Tensor], TensorInfo | None], target: UseTarget) -> None:
        self._info_of, self._target = info_of, target
        self._stack: list[tuple[torch.nn.Module, list[TensorInfo]]] = []  # per open forward: its external uses

    @staticmethod
    def track(module: torch.nn.Module) -> None:
        """``module`` gets stock's registry (and its ``ds_external_parameters``), as under stock's stage 3."""
        _init_external_params(module)

    def _infos(self, module: torch.nn.Module) -> list[TensorInfo]:
        return [info for p in _registry(module).values() if (info := self._info_of(p)) is not None]

    def enter(self, module: torch.nn.Module) -> None:
        infos = self._infos(module)
        if infos:
            self._target.pre_forward(module, infos)
        self._stack.append((module, infos))

    def leave(self, module: torch.nn.Module, output: Any) -> None:
        if not self._stack or self._stack[-1][0] is not module:  # a forward that raised left entries behind
            self._stack = [entry for entry in self._stack if entry[0] is not module]
            return
        _, infos = self._stack.pop()
        for tensor in iter_tensors(output):  # a parameter first: activations need no lookup
            if isinstance(tensor, torch.nn.Parameter) and (info := self._info_of(tensor)) is not None:
                self._returned(module, tensor, info)
        if not infos:
            return
        self._target.post_forward(module, infos)
        outputs = [t for t in iter_tensors(output) if t.requires_grad]
        if outputs and torch.is_grad_enabled():
            torch.autograd.graph.register_multi_grad_hook(
                outputs, lambda grads: self._target.pre_backward(module, infos), mode="any"
            )

    def _returned(self, module: torch.nn.Module, param: torch.nn.Parameter, info: TensorInfo) -> None:
        """``module``'s forward returned ``param``: the caller uses it from now on."""
        if not self._stack or any(id(param) in _registry(m) for m, _ in self._stack):
            return
        caller, uses = self._stack[-1]
        register_external_parameter(caller, param)
        self._target.pre_forward(caller, [info])  # ended by the caller's post-forward
        uses.append(info)
        if id(param) in _registry(module):
            unregister_external_parameter(module, param)

    def clear(self) -> None:
        """A new training forward begins."""
        self._stack.clear()
