"""The ZeRO optimizer object DeepSpeed's engine drives for stage 'patrickstar'.

A thin adapter: it implements the interface the engine calls on a ZeRO optimizer (backward
prologue/epilogue, ``step``, ``zero_grad``, ``overflow``, ``loss_scale``/``cur_scale``,
``param_groups``, grad norm, ``state_dict``) on top of the parts
:func:`~ds_patrickstar.integration.assembly.assemble` builds. The parameter groups are the basic
optimizer's own group dicts, so an LR scheduler (from the config or the client) that edits them
is read at every step. The step itself is described in [Note: step].
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from deepspeed.runtime.base_optimizer import ZeROOptimizer
from deepspeed.runtime.fp16.loss_scaler import CreateLossScaler
from torch.distributed import ProcessGroup

from ..chunks.chunk import Chunk
from ..io import checkpoint
from ..io.init import DeferredModel
from ..optim.chunk_adam import combined_scale
from ..placement.planner import update_order
from ..run_state import Phase
from .accounts import StepAccounts
from .assembly import ChunkedModel, assemble
from .config import PatrickStarConfig
from .generation_hooks import GenerationHooks
from .parking import StateParking

logger = logging.getLogger(__name__)


class PatrickStarOptimizer(GenerationHooks, ZeROOptimizer):
    """Chunk-based mixed-precision Adam behind DeepSpeed's ZeRO-optimizer interface."""

    def __init__(
        self,
        module: torch.nn.Module,
        basic_optimizer: torch.optim.Optimizer,
        options: PatrickStarConfig,
        *,
        device: torch.device,
        dtype: torch.dtype,
        clip_grad: float,
        gradient_accumulation_steps: int,
        static_loss_scale: float,
        dynamic_loss_scale: bool,
        dynamic_loss_args: dict | None,
        dp_group: ProcessGroup | None = None,
        deferred: DeferredModel | None = None,
        unmanaged: bool = False,
    ) -> None:
        super().__init__()
        self.optimizer = basic_optimizer
        self.param_groups = basic_optimizer.param_groups
        self.options = options
        self.clip_grad = clip_grad
        self.dp_process_group = dp_group
        self.loss_scaler = CreateLossScaler(
            dtype=dtype,
            static_loss_scale=static_loss_scale,
            dynamic_scaling=dynamic_loss_scale,
            dynamic_loss_args=dynamic_loss_args,
        )
        self.dynamic_loss_scale = self.loss_scaler.dynamic
        self.custom_loss_scaler = False
        self.torch_autocast_gradscaler = None
        self.overflow = False
        self._global_grad_norm = 0.0
        self.consecutive_skipped_steps = 0
        self.checkpoint_folder: str | None = None  # during engine.save_checkpoint: the tag folder
        parts = assemble(
            module,
            basic_optimizer,
            options,
            device=device,
            dtype=dtype,
            accumulate=gradient_accumulation_steps > 1 or unmanaged,  # see [Note: unmanaged gradient accumulation]
            dp_group=dp_group,
            deferred=deferred,
            is_boundary=self.is_gradient_accumulation_boundary,
        )
        try:
            self._adopt(parts, module)
        except BaseException:
            parts.abandon()  # see [Note: initialize as a transaction]
            raise

    def _adopt(self, parts: ChunkedModel, module: torch.nn.Module) -> None:
        self.parts = parts
        self.counters, self.accel, self.chunk_map = parts.counters, parts.accel, parts.chunk_map
        self.manager, self.placement, self.optim_states = parts.manager, parts.placement, parts.optim_states
        self.export, self.adam, self.run = parts.export, parts.adam, parts.run
        self.accounts = StepAccounts(parts)
        self.parking = StateParking(parts)  # see [Note: parked engines]
        self.last_step_counters: dict[str, int | float] = self.counters.as_dict()  # all zero before the first step
        # DeepSpeed's checkpoint code records parameter shapes from these (stage-3 names)
        self.fp16_groups = [
            [i.param for i in self.chunk_map.infos() if i.group_index == g] for g in range(len(self.param_groups))
        ]
        self.bf16_groups = self.fp16_groups
        self._frozen_or_extra = [p for p in module.parameters() if self.chunk_map.info(p) is None]
        self.early = parts.early  # see [Note: host updates in backward]
        self.early.loss_scale = lambda: self.loss_scale

    # ---- scaler interface -------------------------------------------------------
    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.cur_scale

    @property
    def cur_scale(self) -> float:
        return self.loss_scaler.cur_scale

    # ---- engine interface -------------------------------------------------------
    def backward_epilogue(self, **kwargs: Any) -> None:
        """DeepSpeed's engine after ``loss.backward()``: autograd's final callback ended the backward
        already; only a backward that reached none of our hooks ends here (see [Note: end of backward])."""
        if self.run.phase is Phase.FORWARD_DONE:
            self.parts.flow.end_backward()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for param in self._frozen_or_extra:
            param.grad = None

    def finish_accumulation(self) -> None:
        """``managed_gradient_accumulation: false``: ``engine.step()`` is the boundary; see [Note: unmanaged
        gradient accumulation]."""
        if self.run.mid_iteration():
            raise RuntimeError("engine.step() inside a forward or backward of the model")
        self.manager.finish_accumulation()

    def empty_partition_cache(self) -> None:
        """See [Note: the partition cache]."""
        if self.run.mid_iteration():
            raise RuntimeError(
                "engine.empty_partition_cache() was called inside a forward or backward of the model; call it "
                "between them (after a forward, a backward or a step)"
            )
        self.manager.empty_cache()

    def get_global_grad_norm(self) -> float:
        return self._global_grad_norm

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> None:
        """See [Note: step]."""
        if closure is not None:
            raise ValueError("stage 'patrickstar' does not support an optimizer closure")
        if not self.manager.grads_ready():
            raise RuntimeError(
                "optimizer step() called before backward() reached the gradient accumulation "
                "boundary; call engine.backward(loss) (or loss.backward()) first"
            )
        if self.run.forward_without_backward():
            self.placement.drop_forward()  # see [Note: moments and the trace]
        self.run.start_step()  # see [Note: run state]
        try:
            self._step()
        finally:
            self.run.end_step()

    def _step(self) -> None:
        self.placement.host_updates_begin_in_backward(self.early.expected)  # as the step-time model prices them
        wanted = self.placement.plan_step(self.optim_states.capacities())  # see [Note: placement planner]
        if wanted is not None:
            self.optim_states.place(wanted)
        self.placement.step_moment(self.optim_states.on_device)
        loss_scale = self.loss_scale  # the scale the gradients were made with, before update_scale()
        scaled_norm = math.sqrt(self.manager.owned_grad_norm_sq(self.accel.device).item())
        self.overflow = not math.isfinite(scaled_norm)
        self.loss_scaler.update_scale(self.overflow)
        if self.overflow:
            self._skip_step()
        else:
            self.consecutive_skipped_steps = 0
            self._global_grad_norm = scaled_norm / loss_scale
            order = update_order(self.placement.last_iteration(), self.optim_states.capacities())
            grad_scale = 1.0 / combined_scale(scaled_norm, loss_scale, self.clip_grad)
            kept = self.early.settle(grad_scale, 1.0 / loss_scale)
            self.adam.apply(grad_scale, self._place_for_update, order, kept)
            # We stand in for the basic optimizer's step. Its own step() finds no gradient (they live
            # in the chunks) and changes nothing, but whatever wraps it sees a step: a torch LR
            # scheduler uses that to tell a missed step from a real one.
            self.optimizer.step()
        self.manager.finish_step()
        self.placement.end_step()

    def _place_for_update(self, chunk: Chunk) -> None:
        """Hybrid Adam: ``chunk`` is updated where its optimizer states live (see [Note: optimizer-state
        placement]); placement moves it there."""
        self.placement.place_for_update(chunk, chunk.chunk_id in self.optim_states.on_device)

    def _skip_step(self) -> None:
        self._global_grad_norm = float("inf")
        self.early.drop_all()
        self.optim_states.cancel_read_ahead()  # the reads started in backward (see [Note: disk tier])
        self.optim_states.master_to_params()
        self.consecutive_skipped_steps += 1
        _skipped(self.consecutive_skipped_steps, self.options.max_consecutive_skipped_steps, self.loss_scale)

    # ---- checkpoints (see [Note: checkpoint format]) ---------------------------------
    def state_dict(self) -> dict:
        return checkpoint.optimizer_state(
            self.chunk_map,
            self.optim_states,
            self.adam.group_steps,
            self.loss_scaler,
            self.param_groups,
            folder=self.checkpoint_folder,
            update=self.adam.rule.value,
        )

    def load_state_dict(
        self,
        state_dict_list: dict | Iterable[dict],
        load_optimizer_states: bool = True,
        load_from_fp32_weights: bool = True,
        **kwargs: Any,
    ) -> None:
        if isinstance(state_dict_list, dict):
            state_dict_list = [state_dict_list]
        self.early.drop_all()  # they read the states being replaced
        self.optim_states.settle()  # the step's host jobs write the states being replaced
        if load_from_fp32_weights or load_optimizer_states:
            saved = checkpoint.load_optimizer_states(
                self.chunk_map, self.optim_states, state_dict_list, load_optimizer_states, self.adam.rule.value
            )
            if load_optimizer_states:
                self.adam.group_steps = list(saved["group_steps"])
                self.loss_scaler = saved["loss_scaler"]
                for group, hyper in zip(self.param_groups, saved["param_groups"]):
                    group.update(hyper)
        self.manager.release_all_groups()
        self.optim_states.master_to_params()
        self.manager.finish_step()

    def destroy(self) -> None:
        """``engine.destroy()``: the run's hooks, threads, files and memory go (see [Note: engine teardown]);
        the engine's callback registered with us goes too (a cycle the collector would otherwise break)."""
        self.optim_states.settle()  # no host job writes what the teardown frees
        self.parts.close()
        self.unregister_grad_acc_post_hooks()

    def abandon(self) -> None:
        """Initialize failed: the bound parameters get their values back from this rank's chunks (no
        collective) and what the run holds goes (see [Note: initialize as a transaction]). A later
        :meth:`destroy` does nothing more."""
        self.parts.abandon()

    # ---- accounting (``accounts.py``) -----------------------------------------------
    def end_step_counters(self) -> dict[str, int | float]:
        """Close the step: ``counters`` (everything counted since the previous step, including the
        collectives of a ``state_dict()``/``get_fp32_state_dict()`` in between) become
        ``last_step_counters`` and start again from zero. The engine calls this after every
        optimizer step, applied or skipped (see ``PatrickStarEngine._take_model_step``)."""
        self.last_step_counters = self.accounts.close_step()
        return self.last_step_counters

    def model_data_bytes(self) -> int:
        """Bytes of model data: low-precision chunks + fp32 master/momentum/variance (+ accumulators)."""
        return sum(self.accounts.model_data_bytes_split())

    def fp32_state_dict(self, module: torch.nn.Module) -> dict[str, torch.Tensor]:
        """Every parameter's full fp32 value on every rank (a collective with data parallelism)."""
        return self.export.fp32_state_dict(module)

    # ---- partial loads ---------------------------------------------------------------
    def _restore_from_bit16_weights(self) -> None:
        """``load_checkpoint(load_optimizer_states=False)`` or ``load_module_only=True``: the module's load
        already wrote each owned parameter into its chunk and its fp32 master (see [Note: state_dict]),
        as stock's restore from the 16-bit weights does; the optimizer states stay as they were."""
        self.early.drop_all()  # they read gradients the load overwrote
        self.manager.release_all_groups()  # no other rank's chunk stays gathered with its old values
        self.manager.finish_step()


def _skipped(in_a_row: int, limit: int, loss_scale: float) -> None:
    """A step was skipped (``in_a_row`` so far): logged, and an error at ``limit``."""
    logger.info(
        "ds_patrickstar: non-finite gradients, step skipped (%d in a row); loss scale now %s", in_a_row, loss_scale
    )
    if in_a_row >= limit:
        raise RuntimeError(
            f"{in_a_row} consecutive steps were skipped because the gradients were not finite (inf/NaN loss or "
            f"gradients; loss scale now {loss_scale}). Check the data and the learning rate, or raise "
            f"zero_optimization.max_consecutive_skipped_steps (now {limit})."
        )
