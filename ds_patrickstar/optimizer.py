"""The ZeRO optimizer object DeepSpeed's engine drives for stage 'patrickstar'.

It implements the interface the engine calls on a ZeRO optimizer (backward
prologue/epilogue, ``step``, ``zero_grad``, ``overflow``, ``loss_scale``/``cur_scale``,
``param_groups``, grad norm) on top of the chunk manager. The parameter groups are the
basic optimizer's own group dicts, so an LR scheduler (from the config or the client)
that edits them is read at every step.

[Note: step]
1. one pass over every gradient slot computes the global gradient norm (still scaled by
   the loss scale); a non-finite norm is an overflow: DeepSpeed's loss scaler lowers the
   scale, the slots get their parameters back from the fp32 master, and the step is
   skipped (in bf16 and fp32 too: a NaN step is never applied);
2. otherwise the combined factor ``1 / (loss_scale * clip)`` (the same formula as
   DeepSpeed ZeRO-3, true global-norm clipping) is handed to the Adam backend, which
   updates each chunk in one pass and writes the new low-precision parameters back.

The pieces it is built from, one job each: the chunk plan and the pre-flight check
(:mod:`ds_patrickstar.plan`), the accelerator primitives and the chunk store
(:mod:`ds_patrickstar.accelerator`, :mod:`ds_patrickstar.device`), the chunk manager,
optimizer states and where they live (:mod:`ds_patrickstar.optim_states`), the hook
target (:mod:`ds_patrickstar.flow`) and streaming export (:mod:`ds_patrickstar.export`).
"""
from __future__ import annotations

import logging
import math
from typing import Callable

import torch
from deepspeed.runtime.base_optimizer import ZeROOptimizer
from deepspeed.runtime.fp16.loss_scaler import CreateLossScaler

from . import checkpoint
from .accelerator import EmulatedAccelerator
from .adam_math import AdamHyper, adam_step_reference
from .chunk import Chunk
from .chunk_manager import ChunkManager, plan_chunks
from .comm import ChunkComm
from .config import PatrickStarConfig
from .counters import StepCounters
from .export import ChunkExport
from .flow import TrainingFlow
from .hooks import HookRegistry
from .optim_states import OptimizerStates
from .setup import build_memory

logger = logging.getLogger(__name__)

_UNSUPPORTED_FLAGS = ("amsgrad", "maximize", "capturable", "differentiable")


def adamw_mode(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` decouples weight decay (AdamW); raise if it is not an Adam."""
    name = type(optimizer).__name__
    if hasattr(optimizer, "adam_w_mode"):  # DeepSpeed FusedAdam / DeepSpeedCPUAdam
        return bool(optimizer.adam_w_mode)
    if isinstance(optimizer, torch.optim.Adam):  # torch AdamW subclasses Adam
        group = optimizer.param_groups[0] if optimizer.param_groups else {}
        for flag in _UNSUPPORTED_FLAGS:
            if any(g.get(flag) for g in optimizer.param_groups):
                raise ValueError(f"{name}({flag}=True) is not supported by stage 'patrickstar'; "
                                 f"set {flag}=False")
        return bool(group.get("decoupled_weight_decay", isinstance(optimizer, torch.optim.AdamW)))
    raise ValueError(f"stage 'patrickstar' updates parameters with its own fused Adam and supports "
                     f"Adam and AdamW only, got optimizer {name}. Use \"type\": \"Adam\" or \"AdamW\" in the "
                     f"optimizer block, or pass torch.optim.Adam / torch.optim.AdamW.")


def _adam_backend(device: torch.device) -> Callable:
    try:
        from .kernels import get_adam_backend
    except ImportError:
        return adam_step_reference
    return get_adam_backend(device)


def _named_groups(module: torch.nn.Module, param_groups: list[dict]) -> list[list[tuple[str, torch.nn.Parameter]]]:
    names = {}
    for name, param in module.named_parameters():
        names.setdefault(param, name)
    groups = []
    for index, group in enumerate(param_groups):
        named = []
        for param in group["params"]:
            if param not in names:
                raise ValueError(f"optimizer param group {index} holds a tensor of shape {tuple(param.shape)} "
                                 f"that is not a parameter of the model; pass model_parameters="
                                 f"model.parameters() (or groups of the model's own parameters)")
            if param.requires_grad:
                if not param.is_floating_point():
                    raise ValueError(f"parameter {names[param]} has dtype {param.dtype}; only floating point "
                                     f"parameters can be trained: make it float or set requires_grad=False")
                named.append((names[param], param))
        groups.append(named)
    if not any(groups):
        raise ValueError("the model has no trainable parameters (requires_grad=True) in the optimizer's "
                         "param groups; stage 'patrickstar' has nothing to train")
    return groups


class PatrickStarOptimizer(ZeROOptimizer):
    """Chunk-based mixed-precision Adam; see [Note: step]."""

    def __init__(self, module: torch.nn.Module, basic_optimizer: torch.optim.Optimizer,
                 options: PatrickStarConfig, *, device: torch.device, dtype: torch.dtype, clip_grad: float,
                 gradient_accumulation_steps: int, static_loss_scale: float, dynamic_loss_scale: bool,
                 dynamic_loss_args: dict | None, dp_group=None, deferred=None) -> None:
        super().__init__()
        self.optimizer = basic_optimizer
        self.param_groups = basic_optimizer.param_groups
        self.adamw = adamw_mode(basic_optimizer)
        self.options = options
        self.clip_grad = clip_grad
        self.dp_process_group = dp_group
        self.counters = StepCounters()
        self.last_step_counters: dict[str, int] = self.counters.as_dict()  # all zero before the first step
        accumulate = gradient_accumulation_steps > 1
        comm = ChunkComm(dp_group, self.counters)
        specs = plan_chunks(_named_groups(module, self.param_groups), options.chunk_size, comm.world_size)
        memory = build_memory(options, device, specs, comm, self.counters, dtype, accumulate)
        self.accel, self.placement = memory.accel, None
        comm.bind(self.accel, poison=isinstance(self.accel, EmulatedAccelerator))
        self.manager = ChunkManager(specs, options.chunk_size, accumulate, comm, memory.store, deferred,
                                    keep_gathered=options.keep_gathered, prefetch_groups=options.prefetch_groups)
        if deferred:  # values from each module's own init, into the owned chunks only (see init.py)
            deferred.materialize(self.manager)
        module.to(device)  # buffers and frozen parameters; chunk parameters are views already there
        self.optim_states = OptimizerStates(self.manager.owned_chunks(), self.accel,
                                            start_on_device=not memory.store.movable)
        self.placement = memory.attach_placement(self.manager)
        self.export = ChunkExport(self.manager, self.optim_states)
        self.consecutive_skipped_steps = 0
        # DeepSpeed's checkpoint code records parameter shapes from these (stage-3 names)
        self.fp16_groups = [[i.param for i in self.manager.infos() if i.group_index == g]
                            for g in range(len(self.param_groups))]
        self.bf16_groups = self.fp16_groups
        self.flow = TrainingFlow(module, self.manager, self.placement, self.export, self.optim_states,
                                 self.is_gradient_accumulation_boundary)
        self.hooks = HookRegistry(module, self.manager.info, self.flow)
        self.loss_scaler = CreateLossScaler(dtype=dtype, static_loss_scale=static_loss_scale,
                                            dynamic_scaling=dynamic_loss_scale, dynamic_loss_args=dynamic_loss_args)
        self.dynamic_loss_scale = self.loss_scaler.dynamic
        self.custom_loss_scaler = False
        self.torch_autocast_gradscaler = None
        self.overflow = False
        self._global_grad_norm = 0.0
        self.group_steps = [0] * len(self.param_groups)
        self._frozen_or_extra = [p for p in module.parameters() if self.manager.info(p) is None]
        # build every Adam kernel this run can use now (hybrid Adam: the host's too), not in a step
        for kernel_device in {self.accel.device, torch.device("cpu")} if self.placement else {self.accel.device}:
            _adam_backend(kernel_device)

    # ---- scaler interface -------------------------------------------------------
    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.cur_scale

    @property
    def cur_scale(self) -> float:
        return self.loss_scaler.cur_scale

    # ---- engine interface -------------------------------------------------------
    def backward_epilogue(self, **kwargs) -> None:
        self.manager.end_backward(self.is_gradient_accumulation_boundary())

    def zero_grad(self, set_to_none: bool = True) -> None:
        for param in self._frozen_or_extra:
            param.grad = None

    def get_global_grad_norm(self) -> float:
        return self._global_grad_norm

    def _combined_scale(self, scaled_norm: float, loss_scale: float) -> float:
        """``loss_scale`` times DeepSpeed ZeRO-3's clip factor, when clipping applies."""
        combined = loss_scale
        if self.clip_grad > 0.0:
            clip = (scaled_norm / loss_scale + 1e-6) / self.clip_grad
            if clip > 1.0:
                combined = clip * loss_scale
        return combined

    @torch.no_grad()
    def step(self, closure=None) -> None:
        if closure is not None:
            raise ValueError("stage 'patrickstar' does not support an optimizer closure")
        if not self.manager.grads_ready():
            raise RuntimeError("optimizer step() called before backward() reached the gradient accumulation "
                               "boundary; call engine.backward(loss) (or loss.backward()) first")
        if self.placement is not None:
            self._begin_step_moment()
        loss_scale = self.loss_scale  # the scale the gradients were made with, before update_scale()
        scaled_norm = math.sqrt(self.manager.owned_grad_norm_sq(self.accel.device).item())
        self.overflow = not math.isfinite(scaled_norm)
        self.loss_scaler.update_scale(self.overflow)
        if self.overflow:
            self._skip_step()
        else:
            self.consecutive_skipped_steps = 0
            self._global_grad_norm = scaled_norm / loss_scale
            self._apply_adam(1.0 / self._combined_scale(scaled_norm, loss_scale))
            # We stand in for the basic optimizer's step: a torch LR scheduler built on it checks this
            # flag (set by its wrapper around optimizer.step) to tell a missed step from a real one.
            self.optimizer._opt_called = True
        self.manager.finish_step()
        if self.placement is not None:
            self.placement.note_peaks(self.placement.tracer.non_model_now(self.accel.ledger))

    def _begin_step_moment(self) -> None:
        """The step is a moment; after a (re-)trace, optimizer states are re-placed (see
        [Note: optimizer-state placement]) and the step uses only the chunks updated on the device."""
        runtime = self.placement
        self.flow.step_since_forward = True
        trace = runtime.tracer.current_trace()
        if trace is not None and trace is not self.optim_states.trace_planned:
            self.optim_states.plan(trace, runtime.placer.budget, runtime.placer.policy,
                                   {c.chunk_id: c.nbytes for c in self.manager.chunks})
            step_moment = next((i for i, m in enumerate(trace.moments) if m.label == "step"), None)
            if step_moment is not None:
                trace.replace_chunks(step_moment, tuple(sorted(self.optim_states.on_device)))
        runtime.begin_moment("step", tuple(sorted(self.optim_states.on_device)))

    def _skip_step(self) -> None:
        self._global_grad_norm = float("inf")
        self.optim_states.master_to_params()
        self.consecutive_skipped_steps += 1
        limit = self.options.max_consecutive_skipped_steps
        logger.info("ds_patrickstar: non-finite gradients, step skipped (%d in a row); loss scale now %s",
                    self.consecutive_skipped_steps, self.loss_scale)
        if self.consecutive_skipped_steps >= limit:
            raise RuntimeError(f"{self.consecutive_skipped_steps} consecutive steps were skipped because the gradients "
                               f"were not finite (inf/NaN loss or gradients; loss scale now {self.loss_scale}). "
                               f"Check the data and the learning rate, or raise "
                               f"zero_optimization.max_consecutive_skipped_steps (now {limit}).")

    def _apply_adam(self, grad_scale: float) -> None:
        for index in {c.group_index for c in self.manager.chunks}:
            self.group_steps[index] += 1
        for chunk in self.manager.owned_chunks():
            if chunk.used == 0:
                continue
            state = self.optim_states.states[chunk.chunk_id]
            hyper = AdamHyper.from_group(self.param_groups[chunk.group_index], self.adamw)
            data = self._chunk_for_adam(chunk)[:chunk.used]
            _adam_backend(data.device)(data, state.master[:chunk.used], state.exp_avg[:chunk.used],
                                       state.exp_avg_sq[:chunk.used], step=self.group_steps[chunk.group_index],
                                       hyper=hyper, grad_scale=grad_scale)

    def _chunk_for_adam(self, chunk: Chunk) -> torch.Tensor:
        """Hybrid Adam: a chunk is updated where its optimizer state lives (see
        [Note: optimizer-state placement])."""
        runtime = self.placement
        if runtime is not None:
            if chunk.chunk_id in self.optim_states.on_device:
                runtime.bring(chunk, {chunk.chunk_id})
                self.counters.adam_chunks_device += 1
            else:
                runtime.evict(chunk)
                self.counters.adam_chunks_host += 1
        return chunk.ready()

    # ---- checkpoints (see [Note: checkpoint format]) ---------------------------------
    def state_dict(self) -> dict:
        return checkpoint.optimizer_state(self.manager, self.optim_states.states, self.group_steps,
                                          self.loss_scaler, self.param_groups)

    def load_state_dict(self, state_dict_list, load_optimizer_states: bool = True,
                        load_from_fp32_weights: bool = True, **kwargs) -> None:
        if isinstance(state_dict_list, dict):
            state_dict_list = [state_dict_list]
        if load_from_fp32_weights or load_optimizer_states:
            saved = checkpoint.load_optimizer_states(self.manager, self.optim_states.states, state_dict_list,
                                                     load_optimizer_states)
            if load_optimizer_states:
                self.group_steps = list(saved["group_steps"])
                self.loss_scaler = saved["loss_scaler"]
                for group, hyper in zip(self.param_groups, saved["param_groups"]):
                    group.update(hyper)
        self.manager.release_all_groups()
        self.optim_states.master_to_params()
        self.manager.finish_step()

    # ---- accounting -------------------------------------------------------------
    def end_step_counters(self) -> dict[str, int]:
        """Close the step: ``counters`` (everything counted since the previous step, including the
        collectives of a ``state_dict()``/``get_fp32_state_dict()`` in between) become
        ``last_step_counters`` and start again from zero. The engine calls this after every
        optimizer step, applied or skipped (see ``PatrickStarEngine._take_model_step``)."""
        device, host = self.model_data_bytes_split()
        self.counters.model_bytes_device, self.counters.model_bytes_host = device, host
        self.last_step_counters = self.counters.as_dict()
        self.counters.reset()
        self.accel.ledger.reset_peak()
        return self.last_step_counters

    def model_data_bytes_split(self) -> tuple[int, int]:
        """Model data this rank holds now, ``(on the accelerator, on the host)``: chunks, gradient
        accumulators and optimizer states (gathered temporaries excluded; an evicted buffer still
        being copied out counts where its values now live, see [Note: deferred frees])."""
        self.accel.reclaim()
        kinds = self.accel.ledger.by_kind
        # buffers whose copy to the host is still in flight hold values that live on the host already
        device = sum(kinds.get(k, 0) for k in ("chunk", "grad_acc", "optim")) - self.accel.in_flight_bytes()
        host = self.manager.store.host_bytes + self.optim_states.bytes_on_host()
        if self.placement is None:  # one memory: the "accelerator" is the host
            device, host = 0, device + host
        return device, host

    def model_data_bytes(self) -> int:
        """Bytes of model data: low-precision chunks + fp32 master/momentum/variance (+ accumulators)."""
        return sum(self.model_data_bytes_split())

    def fp32_state_dict(self, module: torch.nn.Module) -> dict[str, torch.Tensor]:
        """Every parameter's full fp32 value on every rank (a collective with data parallelism)."""
        return self.export.fp32_state_dict(module)
