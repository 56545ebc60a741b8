"""``PatrickStarEngine``: DeepSpeed's engine with our optimizer in the ZeRO slot.

DeepSpeed sees a stage-0 config (see [Note: config split]); the engine reports
``zero_optimization() == True`` so that it drives our optimizer the way it drives a
ZeRO optimizer: backward prologue/epilogue through the optimizer, ``optimizer.step()``
and ``optimizer.zero_grad()`` at the boundary, no module-gradient all-reduce, no
fp32 gradient clipping of its own (the optimizer clips on the global norm).

[Note: no DeepSpeed optimizer]
With an ``optimizer`` block, stock DeepSpeed builds its own Adam (FusedAdam: a JIT build on a
cold cache, which fails on some CUDA set-ups; or DeepSpeedCPUAdam).
We only need an object that holds the param groups and the hyper-parameters an LR scheduler
edits: our fused Adam runs the update. So the engine builds a plain ``torch.optim.AdamW``
(or ``torch.optim.Adam`` with ``"adam_w_mode": false``) from the block, and no DeepSpeed
op is built for it; ``engine.basic_optimizer`` is that object.

[Note: the partition cache]
Stock ZeRO-3's ``empty_partition_cache()`` releases the parameters gathered on the accelerator (kept or
prefetched for a next use) back to their partitions. Here that cache is the gathered chunk groups: the
other ranks' chunks of every gathered group go (their next use gathers them again), but the persistent
groups' (stock keeps its persistent parameters too: see [Note: persistent chunk groups]), and frozen chunks
read from the disk tier go back to it. The owned chunks, this rank's partition, stay where placement
put them (``offload_states()`` moves those). With one rank nothing is gathered: a group is its one chunk.
Not inside a forward or backward (it raises there); between a backward and the step the gradients stay.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from deepspeed import comm as dist
from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum

from ..io.export import host_parameters
from ..io.init import DeferredModel, swap_deferred
from ..memory.host_heap import BuildWindow, map_large_allocations
from .config import PatrickStarConfig
from .engine_checkpoints import CheckpointingEngine
from .optimizer_keys import check_reduction_settings, torch_adam_from_block
from .process_effects import RunEffects
from .stage_answers import StageAnswers, freeze_for_inference
from .take_over import TAKEN_OVER
from .zero3_params import Zero3Params
from .zero_optimizer import PatrickStarOptimizer


class PatrickStarEngine(StageAnswers, CheckpointingEngine):
    def __init__(self, *args, patrickstar_config: PatrickStarConfig, **kwargs) -> None:
        self._patrickstar_config = patrickstar_config
        self._deferred: DeferredModel | None = None  # meta parameters, materialized into chunks (see io/init.py)
        self.process_effects = RunEffects()  # see [Note: process-wide effects]
        if patrickstar_config.nvme is not None:  # from the first allocation of initialize: see [Note: host heap]
            self.process_effects.record("the disk tier's mmap threshold", map_large_allocations().release)
        # The module stays where it was built: chunks are built on the host and placement brings
        # them to the accelerator when used, so a model larger than the device can start.
        with BuildWindow():  # see [Note: host heap]
            super().__init__(*args, dont_change_device=True, **kwargs)
        self.enable_backward_allreduce = False
        self.zero3_params = Zero3Params(self.optimizer, weakref.ref(self))  # see [Note: ZeRO-3 parameter attributes]
        self.zero3_params.expose()

    def zero_optimization(self) -> bool:
        return True

    def _unmanaged_accumulation(self) -> bool:
        """``managed_gradient_accumulation: false`` (a DeepSpeed whose engine knows the key); see
        [Note: unmanaged gradient accumulation]."""
        managed = getattr(self, "managed_gradient_accumulation", None)
        return managed is not None and not managed()

    taken_over = False  # a later initialize on the model destroyed this engine (see take_over.py)

    def _check_held(self) -> None:
        if self.taken_over:
            raise RuntimeError(TAKEN_OVER)

    def empty_partition_cache(self) -> None:
        """Stock ZeRO-3's: the gathered chunk groups go; see [Note: the partition cache]."""
        self._check_held()
        self.optimizer.empty_partition_cache()

    def offload_states(
        self,
        include: Iterable[Any] | None = None,
        device: Any = OffloadDeviceEnum.cpu,
        pin_memory: bool = True,
        non_blocking: bool = False,
    ) -> None:
        """Every chunk and optimizer state on the accelerator to the host; see [Note: parked engines]
        (``pin_memory`` and ``non_blocking`` are ignored there)."""
        self._check_held()
        self.optimizer.parking.offload(include, device)

    def reload_states(self, non_blocking: bool = False) -> None:
        """What :meth:`offload_states` moved back to the accelerator; see [Note: parked engines]."""
        self._check_held()
        self.optimizer.parking.reload()

    def forward(self, *inputs, **kwargs):
        self._check_held()
        return super().forward(*inputs, **kwargs)

    def backward(self, loss, *args, **kwargs):
        self._check_held()
        if not self.is_gradient_accumulation_boundary():  # see [Note: accumulation begun by the caller]
            self.optimizer.manager.accumulation_begins()
        return super().backward(loss, *args, **kwargs)

    def destroy(self) -> None:
        """End the engine: DeepSpeed's teardown, which has our optimizer remove every hook we put on the
        model, stop the disk tier's I/O threads and give back all accelerator memory and pinned host
        buffers at once, even if the engine object is kept (see [Note: engine teardown]); then the
        forward hooks DeepSpeed's engine put on the module go, whose closures hold the engine: a
        caller who keeps the model does not keep the engine. Before the chunks go, the module's
        parameters get their trained values back as host tensors of their own (with data parallelism a
        gather: call it on every rank), so the model stays usable. Calling it again does nothing."""
        try:
            super().destroy()
        finally:
            if getattr(self, "zero3_params", None) is not None:
                self.zero3_params.remove()
            self.process_effects.undo_all()  # see [Note: process-wide effects]
            for name in ("module_forward_pre_hook", "module_forward_post_hook", "first_dataloader_check"):
                handle = getattr(self, name, None)
                if handle is not None:
                    handle.remove()
                    setattr(self, name, None)

    def _configure_distributed_model(self, model) -> None:
        """Meta parameters (``ds_patrickstar.Init``) become storage-less parameters of the training dtype
        before DeepSpeed casts the module; see [Note: deferred init]."""
        self._deferred = swap_deferred(model, self._mixed_precision_dtypes()[0])
        super()._configure_distributed_model(model)

    def _broadcast_model(self) -> None:
        """DeepSpeed's start-up broadcast of the parameters from the source rank. The module is still
        on the host here (chunks are built there), and NCCL needs device tensors: each parameter
        goes through the device on its own, so the device never holds more than the largest one."""
        if self.dist_backend is None:
            return
        from deepspeed.utils import groups

        device = torch.device(self.device)
        deferred = self._deferred_model()
        for param in self.module.parameters():
            if deferred.is_deferred(param):
                continue  # no values yet: deferred init gives the same values on every rank
            data = param.data
            staged = data if device.type == "cpu" or data.device == device else data.to(device)
            dist.broadcast(staged, groups._get_broadcast_src_rank(), group=self.seq_data_parallel_group)
            if staged is not data:
                data.copy_(staged)

    def _configure_zero_optimizer(self, optimizer):
        """No optimizer: every parameter goes into frozen chunks (see [Note: engine without an optimizer])."""
        freeze_for_inference(self.module)
        self._configure_optimizer(torch.optim.AdamW([{"params": []}]), [])
        return self.optimizer

    def _deferred_model(self) -> DeferredModel:
        if self._deferred is None:
            raise RuntimeError("the model's deferred parameters are read before DeepSpeed configured the model")
        return self._deferred

    def _configure_optimizer(self, client_optimizer, model_parameters) -> None:
        model_dtype, grad_accum_dtype = self.get_data_types()
        check_reduction_settings(
            model_dtype=model_dtype,
            communication_data_type=self._config.communication_data_type,
            prescale_gradients=self._config.prescale_gradients,
            gradient_predivide_factor=self._config.gradient_predivide_factor,
            grad_accum_dtype=None if self._config.grad_accum_dtype is None else grad_accum_dtype,
        )
        deferred = self._deferred_model()
        model_parameters = deferred.remap(model_parameters)
        if isinstance(client_optimizer, torch.optim.Optimizer):
            deferred.remap_optimizer(client_optimizer)
        if client_optimizer is None:
            basic = self._torch_adam(model_parameters)
        elif isinstance(client_optimizer, torch.optim.Optimizer):
            basic = client_optimizer
        else:
            basic = client_optimizer(model_parameters)
        basic.param_groups[:] = [g for g in basic.param_groups if len(g["params"]) != 0]
        self.basic_optimizer = basic
        self.optimizer = PatrickStarOptimizer(
            self.module,
            basic,
            self._patrickstar_config,
            device=torch.device(self.device),
            dtype=model_dtype,
            clip_grad=self.gradient_clipping(),
            gradient_accumulation_steps=self.gradient_accumulation_steps(),
            static_loss_scale=self.loss_scale(),
            dynamic_loss_scale=self.dynamic_loss_scale(),
            dynamic_loss_args=self.dynamic_loss_scale_args(),
            dp_group=self.seq_data_parallel_group,
            deferred=self._deferred,
            unmanaged=self._unmanaged_accumulation(),
        )
        self._configure_legacy_compression()

    def _configure_legacy_compression(self) -> None:
        """DeepSpeed < 0.19.8 sets these at the end of its ``_configure_optimizer`` and reads them in
        forward and step; 0.19.8 has neither."""
        if hasattr(self, "_configure_compression_scheduler"):
            self.compression_scheduler = self._configure_compression_scheduler()
        if hasattr(self, "_configure_quantization"):
            self.quantizer = self._configure_quantization()

    def _torch_adam(self, model_parameters) -> torch.optim.Optimizer:
        """A plain torch Adam/AdamW holding the param groups and hyper-parameters of the config's
        ``optimizer`` block; see [Note: no DeepSpeed optimizer]."""
        cls, kwargs, group_keys = torch_adam_from_block(self.optimizer_name(), self.optimizer_params())
        basic = cls(model_parameters, **kwargs)
        for group in basic.param_groups:
            group.update(group_keys)
        return basic

    # ---- per-step counters (see counters.py) ------------------------------------
    def _take_model_step(self, lr_kwargs, *args, **kwargs):
        try:
            return super()._take_model_step(lr_kwargs, *args, **kwargs)
        finally:  # applied, skipped, or raised (too many skipped steps): the step is over
            self.optimizer.end_step_counters()

    def step(self, lr_kwargs=None):
        self._check_held()
        if self._unmanaged_accumulation():  # the step is the boundary
            self.optimizer.finish_accumulation()
        boundary = self.is_gradient_accumulation_boundary()  # super().step() advances micro_steps
        super().step(lr_kwargs)
        if boundary and self.monitor.enabled and self.global_rank == 0:
            self.monitor.write_events(
                [
                    (f"Train/Samples/patrickstar/{name}", value, self.global_samples)
                    for name, value in self.get_patrickstar_counters().items()
                ]
            )

    def get_patrickstar_counters(self) -> dict[str, int | float]:
        """The last completed optimizer step's counters (all zero before the first step; bytes of
        this rank) plus ``model_data_bytes``, what this rank holds for the model now."""
        return {**self.optimizer.last_step_counters, "model_data_bytes": int(self.optimizer.model_data_bytes())}

    # ---- placement ----------------------------------------------------------------
    def tide_plot(self, path: str) -> str:
        """Write a PNG of the last iteration's model vs non-model accelerator memory per moment, its
        recomputation moments shaded (see [Note: recomputation in the trace]), the disk tier's host side
        and last step's I/O in a caption (:func:`~ds_patrickstar.placement.tide_plot.disk_caption`)."""
        from ..placement.tide_plot import disk_caption

        return self.optimizer.placement.plot_tide(path, disk_caption(self.get_patrickstar_counters()))

    def planner_snapshot(self, path: str) -> str:
        """Write the placement planner's last thorough plan, its inputs and its choice, as JSON, to plan again
        elsewhere (``benchmarks/replan.py``; see [Note: planner snapshot]); returns ``path``."""
        return self.optimizer.placement.planner_snapshot(path)

    # ---- model data access ------------------------------------------------------
    @torch.no_grad()
    def get_fp32_state_dict(self) -> dict[str, torch.Tensor]:
        """Full fp32 values of every parameter, keyed by name (a collective with data parallelism)."""
        return self.optimizer.fp32_state_dict(self.module)


@contextlib.contextmanager
def gathered_parameters(engine: PatrickStarEngine) -> Iterator[None]:
    """Every parameter of ``engine.module`` readable inside the block, as a host copy (a collective
    with data parallelism: enter it on every rank); for reading: writes are discarded. Streamed one
    chunk group at a time, within the accelerator budget; see [Note: state_dict]."""
    with host_parameters(engine.optimizer.export):
        yield
