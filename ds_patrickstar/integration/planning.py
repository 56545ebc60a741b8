"""Planning a run: everything initialize decides before any parameter of the model changes.

The trainable parameters by param group and the frozen ones (see [Note: frozen chunks]), the
chunk layout, the disk tier's spill plan and the check of
its folder, the pre-flight check (see [Note: pre-flight]: it runs on the chunk plan before any chunk
or optimizer state is allocated, so a model that does not fit is refused before memory goes), the
accelerator and the default ``keep_gathered`` (from the host memory before any chunk exists). A run
refused here leaves nothing to undo but the accelerator (see [Note: initialize as a transaction]).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import psutil
import torch
from torch.distributed import ProcessGroup

from ..chunks.layout import ChunkSpec, plan_chunks
from ..counters import StepCounters
from ..disk.config import frozen_buffer_count
from ..disk.tier import DiskPlan, host_bytes_saved, plan_disk_tier
from ..groups.comm import ChunkComm
from ..memory.accelerator import Accelerator, HostAccelerator
from ..memory.cuda import CudaAccelerator
from ..memory.emulated import EmulatedAccelerator
from ..memory.preflight import check_budget_holds, check_fits, largest_group_bytes, plan_for_specs
from ..optim.rules import UpdateRule, update_rule
from .config import PatrickStarConfig
from .host_share import default_keep_gathered, step_bytes

logger = logging.getLogger(__name__)

VALUES_LOST = "_ds_patrickstar_values_lost"  # a parameter left empty (see [Note: engine teardown])

DEVICE_RESERVE = 1 << 30
"""Bytes of free GPU memory the default budget leaves alone: NCCL's buffers (made at the first
collective), cuBLAS workspaces and the caching allocator's rounding come after initialize."""


@dataclass(frozen=True)
class RunPlan:
    """What :func:`plan_run` decided: the parts of a run that exist before its chunks."""

    rule: UpdateRule  # what the step computes (Adam, AdamW or SGD)
    counters: StepCounters
    comm: ChunkComm
    specs: list[ChunkSpec]
    disk: DiskPlan  # what the disk tier holds of this rank's chunks
    accel: Accelerator
    keep_gathered: int | None

    @property
    def movable(self) -> bool:
        """Chunks have a host home: placement runs."""
        return not isinstance(self.accel, HostAccelerator)

    @property
    def poison(self) -> bool:
        """The strict emulated accelerator: data not waited for reads as NaN."""
        return isinstance(self.accel, EmulatedAccelerator)


def plan_run(
    module: torch.nn.Module,
    basic_optimizer: torch.optim.Optimizer,
    options: PatrickStarConfig,
    *,
    device: torch.device,
    dtype: torch.dtype,
    accumulate: bool,
    dp_group: ProcessGroup | None,
) -> RunPlan:
    """Plan a run of ``module``; raises ``ValueError`` for a run that cannot start."""
    rule = update_rule(basic_optimizer)  # refuse an unsupported optimizer before anything is built
    counters = StepCounters()
    comm = ChunkComm(dp_group, counters, options.lockstep)
    try:
        return _plan(module, basic_optimizer, options, device, dtype, accumulate, counters, comm, rule)
    except BaseException:
        comm.agreement.destroy()  # its side group (see [Note: rank agreement])
        raise


def _plan(
    module: torch.nn.Module,
    basic_optimizer: torch.optim.Optimizer,
    options: PatrickStarConfig,
    device: torch.device,
    dtype: torch.dtype,
    accumulate: bool,
    counters: StepCounters,
    comm: ChunkComm,
    rule: UpdateRule,
) -> RunPlan:
    """:func:`plan_run`'s work, once the collectives' ``comm`` is made."""
    groups = named_param_groups(module, basic_optimizer.param_groups)
    specs = plan_chunks(groups, options.chunk_size, comm.world_size, frozen_parameters(module), dtype)
    buffers = frozen_buffer_count(options.offload_optimizer, options.offload_param)
    block = "offload_optimizer" if options.offload_optimizer is not None else "offload_param"
    key = f"zero_optimization.{block}.nvme_path"
    host = not placement_runs(options, device)
    disk = plan_disk_tier(
        options.nvme, buffers, options.host_budget, specs, (comm.world_size, comm.rank), dtype, accumulate, key, host
    )
    on_disk = host_bytes_saved(options.nvme, disk)
    accel = make_accelerator(options, device, specs, comm, dtype, accumulate, on_disk)
    comm.bind(accel, poison=isinstance(accel, EmulatedAccelerator))
    keep_gathered = options.keep_gathered
    if keep_gathered is None and isinstance(accel, HostAccelerator):  # see [Note: default kept groups from host memory]
        rank_plan = plan_for_specs(specs, comm.world_size, comm.rank, dtype.itemsize, accumulate)
        step = step_bytes(specs, dtype.itemsize, comm.world_size, accumulate, options.prefetch_groups)
        keep_gathered = default_keep_gathered(module, rank_plan, step, comm)
    return RunPlan(rule, counters, comm, specs, disk, accel, keep_gathered)


def check_values_held(module: torch.nn.Module) -> None:
    """Raise ``ValueError`` naming a parameter left without values (see [Note: engine teardown]); runs
    before any collective of initialize."""
    for name, param in module.named_parameters():
        if getattr(param, VALUES_LOST, False):
            raise ValueError(
                f"parameter {name} holds no values: its engine's destroy() warned that it did not read the "
                f"weights back (or a failed deepspeed.initialize did: with data parallelism they were on another "
                f"rank). Build the model again for a new engine and load the weights from a checkpoint."
            )


def named_param_groups(module: torch.nn.Module, param_groups: list[dict]) -> list[list[tuple[str, torch.nn.Parameter]]]:
    """The trainable parameters of every param group with their names; bad groups raise ``ValueError``."""
    names: dict[torch.nn.Parameter, str] = {}
    for name, param in module.named_parameters():
        names.setdefault(param, name)
    groups = []
    for index, group in enumerate(param_groups):
        named = []
        for param in group["params"]:
            if param not in names:
                raise ValueError(
                    f"optimizer param group {index} holds a tensor of shape {tuple(param.shape)} "
                    f"that is not a parameter of the model; pass model_parameters="
                    f"model.parameters() (or groups of the model's own parameters)"
                )
            if param.requires_grad:
                if not param.is_floating_point():
                    raise ValueError(
                        f"parameter {names[param]} has dtype {param.dtype}; only floating point "
                        f"parameters can be trained: make it float or set requires_grad=False"
                    )
                named.append((names[param], param))
        groups.append(named)
    if param_groups and not any(groups):  # no groups at all: an engine without an optimizer (frozen chunks only)
        raise ValueError(
            "the model has no trainable parameters (requires_grad=True) in the optimizer's "
            "param groups; stage 'patrickstar' has nothing to train"
        )
    _warn_left_out(names, groups)
    return groups


def frozen_parameters(module: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """The floating-point parameters with ``requires_grad=False``, once each, in registration order: the
    frozen chunks' contents (see [Note: frozen chunks]); other dtypes stay outside the chunks."""
    seen: set[torch.nn.Parameter] = set()
    frozen = []
    for name, param in module.named_parameters():
        if not param.requires_grad and param.is_floating_point() and param not in seen:
            seen.add(param)
            frozen.append((name, param))
    return frozen


def _warn_left_out(names: dict[torch.nn.Parameter, str], groups: list[list[tuple[str, torch.nn.Parameter]]]) -> None:
    """Trainable parameters in no param group are never updated: they stay outside the chunks (their
    gradients are neither kept nor averaged across ranks); say which."""
    grouped = {param for group in groups for _, param in group}
    left_out = [name for param, name in names.items() if param.requires_grad and param not in grouped]
    if left_out:
        shown = ", ".join(left_out[:8]) + (f" and {len(left_out) - 8} more" if len(left_out) > 8 else "")
        logger.warning(
            "ds_patrickstar: %d trainable parameter(s) are in no optimizer param group and will not be "
            "trained (kept outside the chunks): %s. Pass model_parameters="
            "model.parameters(), or set requires_grad=False on parameters you mean to freeze",
            len(left_out),
            shown,
        )


def resolve_budget(device_budget: int | float | None, device: torch.device, emulate: bool) -> int:
    """The accelerator budget in bytes: a byte count, or a fraction of the device's total memory
    (of the host's memory on the emulated accelerator); by default on CUDA, the free memory now
    less :data:`DEVICE_RESERVE`."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
    else:
        free, total = 0, psutil.virtual_memory().total
    if device_budget is None:
        if emulate or device.type != "cuda":
            raise ValueError(
                "zero_optimization.emulate_accelerator=true needs zero_optimization.device_budget: "
                "the emulated accelerator's size in bytes (an integer) or a fraction of host memory"
            )
        return max(0, free - DEVICE_RESERVE)
    return int(total * device_budget) if isinstance(device_budget, float) else int(device_budget)


def _warn_ineffective(options: PatrickStarConfig, placement_runs: bool) -> None:
    """A setting that does nothing says so."""
    idle = options.ineffective_keys(placement_runs)
    if not idle:
        return
    why = (
        "placement runs on a CUDA device or with zero_optimization.emulate_accelerator=true, and this run "
        "has neither: model data stays in host memory"
        if not placement_runs
        else 'static_fraction is the share of chunks placement "static" keeps on the accelerator'
    )
    logger.warning("zero_optimization keys %s do nothing in this run (%s); remove them", idle, why)


def placement_runs(options: PatrickStarConfig, device: torch.device) -> bool:
    """Chunks move between an accelerator and the host: a CUDA device, or the emulated accelerator."""
    return device.type == "cuda" or options.emulate_accelerator


def make_accelerator(
    options: PatrickStarConfig,
    device: torch.device,
    specs: list[ChunkSpec],
    comm: ChunkComm,
    dtype: torch.dtype,
    accumulate: bool,
    on_disk: int = 0,
) -> Accelerator:
    """The accelerator of this run, after the pre-flight check (see [Note: pre-flight]); ``on_disk``:
    host bytes the disk tier saves, its spilled states less its buffers (see [Note: disk tier plan])."""
    runs = placement_runs(options, device)
    _warn_ineffective(options, runs)
    if not runs:
        return HostAccelerator()

    budget = resolve_budget(options.device_budget, device, options.emulate_accelerator)
    plan = plan_for_specs(specs, comm.world_size, comm.rank, dtype.itemsize, accumulate)
    check_fits(plan, budget, psutil.virtual_memory().available, comm.world_size, on_disk)
    need, largest = (
        largest_group_bytes(specs, dtype.itemsize, comm.world_size, accumulate),
        max((s.capacity for s in specs), default=0),
    )
    check_budget_holds(budget, need, comm.world_size, largest, options.chunk_size)
    return CudaAccelerator(device, budget) if device.type == "cuda" else EmulatedAccelerator(budget)
