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

[Note: state_dict]
With data parallelism a rank keeps only its own chunks between uses; a parameter of a
released chunk is a view of an empty storage and must not be read directly.
``engine.module.state_dict()`` is therefore a collective (call it on every rank, as
Hugging Face's save path does): it gathers every released chunk group (and brings chunks
that placement moved to the host onto the accelerator, past the budget for that moment),
returns *copies* of the parameters (under every name of a tied or shared parameter, see
[Note: every name is a copy]), and releases or moves them back again.
``load_state_dict()`` does the same around torch's copy into the parameter views.
Reading parameters another way between steps needs :func:`ds_patrickstar.gathered_parameters`.
"""
from __future__ import annotations

import logging
import math
from typing import Callable

import torch
from deepspeed.runtime.base_optimizer import ZeROOptimizer
from deepspeed.runtime.fp16.loss_scaler import CreateLossScaler

from . import checkpoint
from .adam_math import AdamHyper, adam_step_reference
from .chunk import TensorInfo, TensorState
from .chunk_manager import ChunkManager
from .comm import ChunkComm
from .counters import StepCounters
from .config import PatrickStarConfig
from .device import build_placement
from .hooks import HookRegistry, inside_backward, iter_tensors
from .placement import optimizer_chunks_on_device
from .shared_params import chunk_storages, copy_chunk_views

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


class PatrickStarOptimizer(ZeROOptimizer):
    """Chunk-based mixed-precision Adam; see [Note: step]."""

    def __init__(self, module: torch.nn.Module, basic_optimizer: torch.optim.Optimizer,
                 options: PatrickStarConfig, *, dtype: torch.dtype, clip_grad: float,
                 gradient_accumulation_steps: int, static_loss_scale: float, dynamic_loss_scale: bool,
                 dynamic_loss_args: dict | None, dp_group=None) -> None:
        super().__init__()
        self.optimizer = basic_optimizer
        self.param_groups = basic_optimizer.param_groups
        self.adamw = adamw_mode(basic_optimizer)
        self.options = options
        self.clip_grad = clip_grad
        self.dp_process_group = dp_group
        self.counters = StepCounters()
        self.last_step_counters: dict[str, int] = self.counters.as_dict()  # all zero before the first step
        device = next(iter(module.parameters())).device
        self.manager = ChunkManager(self._named_groups(module), options.chunk_size,
                                    accumulate=gradient_accumulation_steps > 1,
                                    comm=ChunkComm(dp_group, self.counters),
                                    optim_device=torch.device("cpu") if device.type == "cuda" else None)
        self.consecutive_skipped_steps = 0
        # DeepSpeed's checkpoint code records parameter shapes from these (stage-3 names)
        self.fp16_groups = [[i.param for i in self.manager.infos() if i.group_index == g]
                            for g in range(len(self.param_groups))]
        self.bf16_groups = self.fp16_groups
        self._module_names = {m: n for n, m in module.named_modules()}
        self._step_since_forward = True
        self._meter_ctx = None
        self.device_optim: set[int] | None = None  # chunks whose Adam runs on the accelerator
        self.placement = build_placement(options, self.manager, self.counters, device, dtype,
                                         accumulate=gradient_accumulation_steps > 1)
        self.hooks = HookRegistry(module, self.manager.info, self)
        self.loss_scaler = CreateLossScaler(dtype=dtype, static_loss_scale=static_loss_scale,
                                            dynamic_scaling=dynamic_loss_scale, dynamic_loss_args=dynamic_loss_args)
        self.dynamic_loss_scale = self.loss_scaler.dynamic
        self.custom_loss_scaler = False
        self.torch_autocast_gradscaler = None
        self.overflow = False
        self._global_grad_norm = 0.0
        self.group_steps = [0] * len(self.param_groups)
        self._frozen_or_extra = [p for p in module.parameters() if self.manager.info(p) is None]
        _adam_backend(device)  # build the kernel (or fall back, with one warning) now, not in the first step

    def _named_groups(self, module: torch.nn.Module) -> list[list[tuple[str, torch.nn.Parameter]]]:
        names = {}
        for name, param in module.named_parameters():
            names.setdefault(param, name)
        groups = []
        for index, group in enumerate(self.param_groups):
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

    # ---- scaler interface -------------------------------------------------------
    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.cur_scale

    @property
    def cur_scale(self) -> float:
        return self.loss_scaler.cur_scale

    # ---- hook target (see hooks.py) ---------------------------------------------
    def root_forward_start(self, inputs) -> None:
        if self.placement is None or inside_backward() or not torch.is_grad_enabled():
            return
        if self._step_since_forward:
            signature = tuple((tuple(t.shape), t.dtype) for t in iter_tensors(inputs))
            self.placement.tracer.start_iteration(signature)
            self._step_since_forward = False
        meter = self.placement.tracer.meter
        if meter is not None:
            self._meter_ctx = meter.hooks()
            self._meter_ctx.__enter__()

    def root_forward_end(self) -> None:
        if self._meter_ctx is not None and not inside_backward():
            self._meter_ctx.__exit__(None, None, None)
            self._meter_ctx = None

    def pre_forward(self, module: torch.nn.Module, infos: list[TensorInfo]) -> None:
        self.manager.access(infos, "fwd:" + self._module_names.get(module, "?"))

    def post_forward(self, module: torch.nn.Module, infos: list[TensorInfo]) -> None:
        if inside_backward():
            return  # an activation-checkpoint recomputation: the tensors stay in COMPUTE for backward
        self.manager.after_forward(infos)

    def pre_backward(self, module: torch.nn.Module, infos: list[TensorInfo]) -> None:
        self.manager.access(infos, "bwd:" + self._module_names.get(module, "?"))

    def grad_ready(self, info: TensorInfo, grad: torch.Tensor) -> None:
        self.manager.take_grad(info, grad, self.is_gradient_accumulation_boundary())

    def before_load_state_dict(self) -> None:
        self._gathered_for_load = self.manager.gather_all()

    def after_load_state_dict(self) -> None:
        """The module's new values become the fp32 masters (an optimizer load may refine them)."""
        self.manager.params_to_master()
        self.manager.release_groups(self._gathered_for_load)

    def before_state_dict(self) -> None:
        self._gathered_for_state_dict = self.manager.gather_all()

    def after_state_dict(self, state_dict: dict, prefix: str) -> None:
        """See [Note: state_dict]."""
        names = {info.name: info for info in self.manager.infos()}
        for key in state_dict:
            info = names.get(key[len(prefix):]) if key.startswith(prefix) else None
            if info is None:
                continue
            if info.state is TensorState.HOLD_AFTER_BWD:
                raise RuntimeError(f"state_dict() was called between backward and step: the slot of {info.name} "
                                   f"holds its gradient. Call it before backward or after engine.step().")
        copy_chunk_views(state_dict, chunk_storages(c.payload for c in self.manager.chunks))
        self.manager.release_groups(self._gathered_for_state_dict)

    # ---- engine interface -------------------------------------------------------
    def backward_epilogue(self, **kwargs) -> None:
        self.manager.end_backward(self.is_gradient_accumulation_boundary())

    def zero_grad(self, set_to_none: bool = True) -> None:
        for param in self._frozen_or_extra:
            param.grad = None

    def get_global_grad_norm(self) -> float:
        return self._global_grad_norm

    @torch.no_grad()
    def _scaled_grad_norm(self) -> float:
        return math.sqrt(self.manager.owned_grad_norm_sq().item())

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
            self._step_since_forward = True
            self.placement.begin_moment("step", tuple(c.chunk_id for c in self.manager.owned_chunks()))
            if self.device_optim is None and self.placement.tracer.trace is not None:
                self._place_optimizer_states()
        loss_scale = self.loss_scale  # the scale the gradients were made with, before update_scale()
        scaled_norm = self._scaled_grad_norm()
        self.overflow = not math.isfinite(scaled_norm)
        self.loss_scaler.update_scale(self.overflow)
        if self.overflow:
            self._skip_step()
            return
        self.consecutive_skipped_steps = 0
        self._global_grad_norm = scaled_norm / loss_scale
        self._apply_adam(1.0 / self._combined_scale(scaled_norm, loss_scale))
        self.manager.finish_step(restore=False)
        # We stand in for the basic optimizer's step: a torch LR scheduler built on it checks this
        # flag (set by its wrapper around optimizer.step) to tell a missed step from a real one.
        self.optimizer._opt_called = True

    def _skip_step(self) -> None:
        self._global_grad_norm = float("inf")
        self.manager.finish_step(restore=True)
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
            opt = self.manager.optim[chunk.chunk_id]
            group = self.param_groups[chunk.group_index]
            hyper = AdamHyper.from_group(group, self.adamw)
            used = chunk.used
            if used == 0:
                continue
            data = self._chunk_for_adam(chunk)
            _adam_backend(data.device)(data[:used], opt.master[:used], opt.exp_avg[:used], opt.exp_avg_sq[:used],
                                       step=self.group_steps[chunk.group_index], hyper=hyper, grad_scale=grad_scale)

    def _chunk_for_adam(self, chunk) -> torch.Tensor:
        """Hybrid Adam: a chunk is updated where its optimizer state lives (see [Note: placement])."""
        runtime = self.placement
        if runtime is None:
            return chunk.payload
        if self.device_optim is not None and chunk.chunk_id in self.device_optim:
            runtime.bring(chunk, {chunk.chunk_id})
            self.counters.adam_chunks_device += 1
            return chunk.payload
        runtime.mover.to_host(chunk)
        self.counters.adam_chunks_host += 1
        return chunk.host

    def _place_optimizer_states(self) -> None:
        """After warm-up: the memory the tide leaves at its highest decides which chunks' fp32
        master/momentum/variance live (and are updated) on the accelerator."""
        runtime, chunks = self.placement, self.manager.chunks
        trace = runtime.tracer.trace
        peak_non_model = max(m.non_model for m in trace.moments)
        busiest = max(sum(chunks[c].nbytes for c in m.chunks) for m in trace.moments)
        free = runtime.placer.budget - peak_non_model - busiest - 2 * max(c.nbytes for c in chunks)
        capacities = {c.chunk_id: c.capacity for c in self.manager.owned_chunks()}
        self.device_optim = optimizer_chunks_on_device(free, capacities, runtime.placer.policy)
        device = chunks[0].device
        for chunk_id in self.device_optim:
            opt = self.manager.optim[chunk_id]
            opt.master, opt.exp_avg, opt.exp_avg_sq = (t.to(device) for t in opt.tensors())
            runtime.optim_device_bytes += opt.nbytes
        logger.info("ds_patrickstar: optimizer states of %d of %d chunks on the accelerator",
                    len(self.device_optim), len(capacities))

    # ---- checkpoints (see [Note: checkpoint format]) ---------------------------------
    def state_dict(self) -> dict:
        return checkpoint.optimizer_state(self.manager, self.group_steps, self.loss_scaler, self.param_groups)

    def load_state_dict(self, state_dict_list, load_optimizer_states: bool = True,
                        load_from_fp32_weights: bool = True, **kwargs) -> None:
        if isinstance(state_dict_list, dict):
            state_dict_list = [state_dict_list]
        if load_from_fp32_weights or load_optimizer_states:
            saved = checkpoint.load_optimizer_states(self.manager, state_dict_list, load_optimizer_states)
            if load_optimizer_states:
                self.group_steps = list(saved["group_steps"])
                self.loss_scaler = saved["loss_scaler"]
                for group, hyper in zip(self.param_groups, saved["param_groups"]):
                    group.update(hyper)
        self.manager.master_to_params()

    # ---- accounting -------------------------------------------------------------
    def end_step_counters(self) -> dict[str, int]:
        """Close the step: ``counters`` (everything counted since the previous step, including the
        collectives of a ``state_dict()``/``get_fp32_state_dict()`` in between) become
        ``last_step_counters`` and start again from zero. The engine calls this after every
        optimizer step, applied or skipped (see ``PatrickStarEngine._take_model_step``)."""
        self.last_step_counters = self.counters.as_dict()
        self.counters.reset()
        return self.last_step_counters

    def model_data_bytes(self) -> int:
        """Bytes of model data: low-precision chunks + fp32 master/momentum/variance (+ accumulators)."""
        return self.manager.model_data_bytes()

    @torch.no_grad()
    def fp32_state_dict(self, module: torch.nn.Module) -> dict[str, torch.Tensor]:
        """Every parameter's full fp32 value on every rank; the owners broadcast their masters."""
        manager = self.manager
        flats = []
        for chunk in manager.chunks:
            opt = manager.optim.get(chunk.chunk_id)
            flat = opt.master.clone() if opt is not None else torch.zeros(chunk.capacity, device=chunk.device)
            flats.append(flat)
        for group in range(manager.num_groups):
            manager.comm.all_gather(flats[group * manager.comm.world_size:(group + 1) * manager.comm.world_size])
        result = {}
        for name, param in module.named_parameters(remove_duplicate=False):
            info = manager.info(param)
            if info is None:
                result[name] = param.detach().float().cpu().clone()
            else:
                result[name] = flats[info.chunk_id][info.offset:info.end].view(info.shape).cpu().clone()
        return result
