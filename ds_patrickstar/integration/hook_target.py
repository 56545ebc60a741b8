"""The hook target: what happens to chunks at every forward, backward and state-dict moment.

The hooks (:mod:`~ds_patrickstar.integration.hooks`) call :class:`TrainingFlow`; it moves the run
from phase to phase (see [Note: run state]), turns module entries and exits into chunk-manager
moments, tells placement where an iteration starts (see [Note: moments and the trace]), hands
gradients to the manager, and routes
``state_dict``/``load_state_dict`` to :class:`~ds_patrickstar.io.export.ChunkExport`
(see [Note: state_dict]).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import Any

import torch

from ..autograd_state import iter_tensors
from ..chunks.chunk import TensorInfo
from ..groups.manager import ChunkManager
from ..io.export import ChunkExport
from ..optim.frozen_steps import check_still_frozen
from ..optim.states import OptimizerStates
from ..placement.interface import Placement
from ..run_state import RunState
from .backward_end import BackwardEnd


def _backward_reads_no_weights(module: torch.nn.Module) -> bool:
    """A dense ``nn.Embedding``: its backward needs the indices and the weight's shape, not its values."""
    return type(module) is torch.nn.Embedding and not module.sparse


class TrainingFlow:
    """Implements :class:`~ds_patrickstar.integration.hooks.HookTarget` for one model."""

    def __init__(
        self,
        module: torch.nn.Module,
        manager: ChunkManager,
        placement: Placement,
        export: ChunkExport,
        optim_states: OptimizerStates,
        is_boundary: Callable[[], bool],
        run: RunState,
        leaves: Mapping[torch.nn.Module, list[TensorInfo]] | None = None,
    ) -> None:
        self.module = module
        self.manager = manager
        self.optim_states = optim_states
        self.placement = placement
        self.run = run
        self.export = export
        self.is_boundary = is_boundary
        self._module_names = {m: n for n, m in module.named_modules()}
        # see [Note: leaf modules]
        self._leaves = {m: manager.leaves.add(self._module_names[m], infos) for m, infos in (leaves or {}).items()}
        self._meter_ctx: AbstractContextManager[Any] | None = None
        self.backward = BackwardEnd(self.end_backward)  # see [Note: end of backward]
        self._frozen = [info for info in manager.map.infos() if not info.trainable]

    # ---- iterations -------------------------------------------------------------------
    def root_forward_start(self, inputs: Any) -> None:
        if self.backward.running:  # the whole model checkpointed: its recomputation
            return
        self.end_saved_tensor_hooks()  # a training forward that raised left its hooks on
        if self.run.backward_raised():
            self.abort_iteration()
        training = torch.is_grad_enabled()  # else an evaluation forward: placed, not traced
        if training:
            check_still_frozen(self._frozen)  # see [Note: requires_grad after initialize]
        if training and self.run.forward_without_backward():
            self.placement.drop_forward()  # see [Note: moments and the trace]
        first = self.run.start_forward(training)
        if first and self.placement.start_iteration(inputs):
            self.optim_states.all_to_host()  # a (re-)trace measures the tide without them
        if not training:
            self.placement.evaluation_begins()  # see [Note: evaluation moments]
            return
        beyond = self.placement.forward_begins(None if first else inputs)
        offloader, meter = self.placement.activations, self.placement.meter
        if offloader is not None:  # its hooks count what stays, as the meter's would
            offloader.start_forward(every_block=beyond)
            self._meter_ctx = offloader.hooks()
        elif meter is not None:
            self._meter_ctx = meter.hooks()
        if self._meter_ctx is not None:
            self._meter_ctx.__enter__()

    def abort_iteration(self) -> None:
        """The last backward raised: its iteration is abandoned (see [Note: a backward that raised])."""
        self.manager.abort_iteration()
        self.optim_states.cancel_read_ahead()  # the reads started in backward (see [Note: disk tier])
        self.optim_states.master_to_params()
        self.manager.finish_step()
        self.placement.abort_iteration()
        self.run.abort_iteration()

    def root_forward_end(self) -> None:
        if self.backward.running:
            return
        self.run.end_forward()
        self.manager.end_forward()  # see [Note: ranks in lockstep]
        offloader = self.placement.activations
        if self._meter_ctx is not None and offloader is not None:
            offloader.end_forward()
        self.end_saved_tensor_hooks()

    def end_saved_tensor_hooks(self) -> None:
        """The saved-tensor hooks of the training forward (the meter's or activation offload's) come off;
        torch keeps them for the whole process otherwise, also after a forward that raised, and after
        ``engine.destroy()`` (they would count, or move, the next model's activations)."""
        ctx, self._meter_ctx = self._meter_ctx, None
        if ctx is not None:
            ctx.__exit__(None, None, None)

    # ---- module moments -------------------------------------------------------------------
    def pre_forward(self, module: torch.nn.Module, infos: list[TensorInfo]) -> None:
        kind = "fwd:"
        if self.backward.running:  # a forward inside backward: a recomputation
            self.run.recompute()
            kind = "rec:"
        self.manager.access(infos, kind + self._module_names.get(module, "?"))

    def block_forward(self, index: int, inputs: Any) -> None:
        """A block's training forward begins (not a recomputation): its inputs are counted for as long
        as they are held (see [Note: held inputs]), its saved tensors begin (see [Note: activation offload])."""
        if self._meter_ctx is None or self.backward.running:
            return
        tensors = list(iter_tensors(inputs))
        offloader, meter = self.placement.activations, self.placement.meter
        if offloader is not None:
            offloader.enter_block(index, tensors)
        elif meter is not None:
            for tensor in tensors:
                meter.hold(tensor)

    def post_forward(self, module: torch.nn.Module, infos: list[TensorInfo]) -> None:
        if self.run.recomputing():
            return  # an activation-checkpoint recomputation: the tensors stay in COMPUTE for backward
        self.manager.after_forward(infos)

    def in_backward(self) -> bool:
        """A backward pass of ours is running (see [Note: end of backward])."""
        return self.backward.running

    def backward_begins(self, where: str = "the model's output") -> None:
        """Autograd runs one of our backward hooks (for ``where``): the run is in its backward, whose end is
        queued; inside a training forward it raises (see [Note: run state])."""
        self.run.backward_hook(where)
        self.backward.arm()

    def end_backward(self) -> None:
        """The backward pass is over (its final callback; see [Note: end of backward]): the epilogue."""
        self.manager.end_backward(self.is_boundary())
        self.run.end_backward()  # see [Note: run state]

    def pre_backward(self, module: torch.nn.Module, infos: list[TensorInfo]) -> None:
        self.backward_begins(self._module(module))
        self.manager.reap_reductions()
        if self.is_boundary():  # the step's disk reads need no gradient: start them now (see [Note: disk tier])
            self.optim_states.read_ahead()
        if _backward_reads_no_weights(module) and self.is_boundary() and self.manager.grads_only(infos):
            return  # its gradient gets slots when it arrives (see [Note: tied weights between backward uses])
        self.manager.access(infos, "bwd:" + self._module_names.get(module, "?"))

    def post_backward(self, module: torch.nn.Module, infos: list[TensorInfo]) -> None:
        self.backward_begins(self._module(module))
        self.manager.backward_use_over(infos)

    def _module(self, module: torch.nn.Module) -> str:
        name = self._module_names.get(module)
        return f"module {name!r} ({type(module).__name__})" if name else f"the root module ({type(module).__name__})"

    def leaf_called(self, module: torch.nn.Module, marked: bool) -> None:
        self.manager.leaves.called(self._leaves[module], marked)

    def leaf_backward_over(self, module: torch.nn.Module) -> None:
        """One forward call's backward of a leaf module is over (see [Note: leaf modules])."""
        self.backward_begins(self._module(module))
        self.manager.leaves.backward_over(self._leaves[module], self.is_boundary())

    def grad_ready(self, info: TensorInfo, grad: torch.Tensor) -> None:
        self.backward_begins(f"parameter {info.name}")
        self.manager.take_grad(info, grad, self.is_boundary())

    # ---- state dicts (see [Note: state_dict]) ------------------------------------------
    def after_state_dict(self, state_dict: dict[str, Any], prefix: str) -> None:
        self.export.fill_state_dict(self.module, state_dict, prefix)

    def before_load_state_dict(self, state_dict: dict[str, Any], prefix: str, error_msgs: list[str]) -> None:
        self.export.load_from_state_dict(self.module, state_dict, prefix, error_msgs)

    def after_load_state_dict(self, incompatible_keys: Any) -> None:
        self.export.finish_load(incompatible_keys)
