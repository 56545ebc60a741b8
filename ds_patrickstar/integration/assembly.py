"""Assembling a run: every collaborator of one model, built in order and wired once.

Order matters (see [Note: pre-flight]): the check runs on the chunk plan before any chunk or
optimizer state is allocated, so a model that does not fit is refused before memory goes.
Then: the accelerator, the chunk store, the default ``keep_gathered`` (from the host memory
before any chunk exists), the chunk map (bound: parameters become views of their
chunks), placement (on CUDA or the emulated accelerator), the chunk manager, deferred values
(``ds_patrickstar.Init``), optimizer states, Adam, the streaming export, the hook target and the
hooks; finally every Adam kernel the run can use is built, so no step waits on a compiler.

[Note: engine teardown]
``engine.destroy()`` ends the run (:meth:`ChunkedModel.close`): every hook we put on the model goes,
the disk tier's I/O threads stop and its files go, and the accelerator gives back every allocation
still held and its pinned host buffers (see [Note: closing the accelerator]), all at once, even if
the caller keeps the engine. The hooks must go: torch keeps a parameter's post-accumulate-grad hooks
in its C++ autograd metadata, where the garbage collector does not look, so a hook's closure (the
hook target, and through it the optimizer and the engine) stayed reachable from every parameter
and the engine was never collected. The parameters are views of the chunks (see [Note: storage
resize]), which go: before they do, every parameter gets its values back as a host tensor of its own
(streamed one chunk group at a time as ``state_dict()`` does, so with data parallelism ``destroy`` is a
collective: call it on every rank, as DeepSpeed's users do). The module stays a plain model with the
trained weights, on the host: it can be read, saved, evaluated or given to a new engine (as the Hugging
Face Trainer does when ``train()`` runs again; a destroyed stock ZeRO-3 engine leaves its partitions
behind instead). Between backward and step the slots hold gradients, so the fp32 masters give the
values then. Where the values cannot be read back, each parameter is left empty (0 elements, with a
warning; a new engine refuses it by name), never a view of freed memory: where reading fails, and,
with data parallelism, where the engine is destroyed inside an iteration (a training moment came
and its backward did not end: a rank that failed mid-step and destroys its engine on the way out
must not start a gather the other ranks never join; it would hang instead of reporting its error).
Such an interrupted engine also keeps its accelerator memory until it is collected: a collective in
flight may still read or write its buffers (gloo's threads, NCCL's stream), and waiting for it could
hang as well.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import psutil
import torch
from torch.distributed import ProcessGroup

from ..activations.offloader import ActivationOffloader, repeated_blocks
from ..chunks.chunk_map import ChunkMap, owner_of
from ..chunks.layout import ChunkSpec, plan_chunks
from ..chunks.state import TensorState
from ..counters import StepCounters
from ..disk.states import DiskStates
from ..disk.tier import host_bytes_saved, open_disk_states, plan_disk_tier
from ..groups.comm import ChunkComm
from ..groups.manager import ChunkManager
from ..groups.reductions import InFlightReductions
from ..io.export import ChunkExport
from ..io.init import DeferredModel
from ..memory.accelerator import Accelerator, HostAccelerator
from ..memory.binding import build_chunk_map
from ..memory.cuda import CudaAccelerator
from ..memory.emulated import EmulatedAccelerator
from ..memory.preflight import check_budget_holds, check_fits, largest_group_bytes, plan_for_rank
from ..memory.store import ChunkStore
from ..optim.chunk_adam import ChunkAdam, adamw_mode
from ..optim.states import OptimizerStates
from ..placement.chunk_needs import chunk_needs
from ..placement.policy import Placer
from ..placement.runtime import PlacementRuntime
from ..placement.tracer import MemoryTracer, SavedTensorMeter
from .config import PatrickStarConfig
from .hook_target import TrainingFlow
from .hooks import HookRegistry
from .host_share import default_keep_gathered

logger = logging.getLogger(__name__)

_VALUES_LOST = "_ds_patrickstar_values_lost"  # a parameter a destroy left empty (see [Note: engine teardown])


@dataclass
class ChunkedModel:
    """Everything one model trains with; see the module docstring for what each part does."""

    counters: StepCounters
    comm: ChunkComm
    accel: Accelerator
    store: ChunkStore
    chunk_map: ChunkMap
    placement: PlacementRuntime | None
    manager: ChunkManager
    optim_states: OptimizerStates
    adam: ChunkAdam
    export: ChunkExport
    flow: TrainingFlow
    hooks: HookRegistry
    disk: DiskStates | None = None  # the disk tier's spilled states, when anything spills
    closed: bool = False

    def close(self) -> None:
        """The run is over (``engine.destroy()``): see [Note: engine teardown]. Closing again does nothing."""
        if self.closed:
            return
        self.closed = True
        interrupted = self.comm.world_size > 1 and self.manager.iteration_open
        self._unbind_parameters(interrupted)
        self.hooks.remove()
        if self.disk is not None:
            self.disk.close()  # its I/O threads stop, its swap files go (see [Note: swap files])
        if not interrupted:  # else collectives in flight may still use its buffers: they go with the engine
            self.accel.close()

    @torch.no_grad()
    def _unbind_parameters(self, interrupted: bool) -> None:
        """Every chunk parameter gets its values as a host tensor of its own (see [Note: engine teardown])."""
        infos = self.chunk_map.infos()
        from_masters = any(info.state is TensorState.HOLD_AFTER_BWD for info in infos)
        why = None
        if interrupted:
            why = "destroyed inside an iteration (after an error?), a gather could wait for ranks that never come"
        else:
            try:
                for info, value in self.export.iter_host_values(fp32_masters=from_masters):
                    info.param.data = value.to(info.param.dtype)
            except Exception as err:
                why = f"reading them failed: {err!r}"
        if why is not None:
            logger.warning(
                "ds_patrickstar: engine.destroy() did not read the weights back from the chunks: %s; the module's "
                "parameters are left empty (load a checkpoint into a new model to go on)",
                why,
            )
            for info in infos:
                info.param.data = torch.empty(0, dtype=info.param.dtype)
                setattr(info.param, _VALUES_LOST, True)
        for info in infos:
            info.param.grad = None


def named_param_groups(module: torch.nn.Module, param_groups: list[dict]) -> list[list[tuple[str, torch.nn.Parameter]]]:
    """The trainable parameters of every param group with their names; bad groups raise ``ValueError``."""
    names: dict[torch.nn.Parameter, str] = {}
    for name, param in module.named_parameters():
        names.setdefault(param, name)
    groups = []
    for index, group in enumerate(param_groups):
        named = []
        for param in group["params"]:
            if getattr(param, _VALUES_LOST, False):
                raise ValueError(
                    f"parameter {names.get(param, '?')} holds no values: its engine's destroy() warned that it "
                    f"did not read the weights back. Build the model again for a new engine and load the "
                    f"weights from a checkpoint."
                )
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
    if not any(groups):
        raise ValueError(
            "the model has no trainable parameters (requires_grad=True) in the optimizer's "
            "param groups; stage 'patrickstar' has nothing to train"
        )
    return groups


DEVICE_RESERVE = 1 << 30
"""Bytes of free GPU memory the default budget leaves alone: NCCL's buffers (made at the first
collective), cuBLAS workspaces and the caching allocator's rounding come after initialize."""


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
    emulate = options.emulate_accelerator
    placement_runs = device.type == "cuda" or emulate
    _warn_ineffective(options, placement_runs)
    if not placement_runs:
        return HostAccelerator()

    budget = resolve_budget(options.device_budget, device, emulate)
    plan = plan_for_rank(
        [s.capacity for s in specs],
        [owner_of(i, comm.world_size) for i in range(len(specs))],
        comm.rank,
        dtype.itemsize,
        accumulate,
    )
    check_fits(plan, budget, psutil.virtual_memory().available, comm.world_size, on_disk)
    check_budget_holds(budget, largest_group_bytes(specs, dtype.itemsize, comm.world_size, accumulate), comm.world_size)
    return CudaAccelerator(device, budget) if device.type == "cuda" else EmulatedAccelerator(budget)


def make_placement(
    options: PatrickStarConfig,
    accel: Accelerator,
    store: ChunkStore,
    counters: StepCounters,
    chunk_map: ChunkMap,
    reductions: InFlightReductions,
    accumulate: bool,
) -> PlacementRuntime:
    """Tide-aware (or static) placement on CUDA or the emulated accelerator; see [Note: placement]."""
    model_storages = chunk_map.model_storages()
    meter = None
    if isinstance(accel, EmulatedAccelerator):
        meter = SavedTensorMeter(lambda s: s._cdata in model_storages, accel.activation_memory)
    owned = {c.chunk_id for c in chunk_map.owned_chunks()}
    placer = Placer(accel.ledger.budget, options.placement, options.static_fraction, owned)
    runtime = PlacementRuntime(
        placer,
        MemoryTracer(accel, meter),
        store,
        counters,
        chunk_map.chunks,
        reductions,
        lambda trace: chunk_needs(trace, chunk_map, accumulate),
    )
    if options.offload_activations != "none":  # see [Note: activation offload]
        runtime.activations = ActivationOffloader(
            accel,
            meter or SavedTensorMeter(lambda s: s._cdata in model_storages),
            options.offload_activations,
            counters,
            lambda: runtime.moment,
        )
    logger.info(
        "ds_patrickstar: %s placement, accelerator budget %.3f GiB%s",
        options.placement,
        accel.ledger.budget / 2**30,
        " (emulated)" if meter is not None else "",
    )
    return runtime


def activation_blocks(module: torch.nn.Module, placement: PlacementRuntime | None, mode: str) -> list[torch.nn.Module]:
    """The blocks whose inputs the emulated accelerator's meter counts (see [Note: held inputs]) and whose
    activations may be offloaded (see [Note: activation offload]); none without either."""
    if placement is None or (placement.activations is None and placement.tracer.meter is None):
        return []
    blocks = repeated_blocks(module)
    if not blocks and placement.activations is not None:
        logger.warning(
            "ds_patrickstar: zero_optimization.offload_activations=%r finds no blocks (a ModuleList or Sequential "
            "of at least two modules) in %s: no activation is offloaded",
            mode,
            type(module).__name__,
        )
    return blocks


def assemble(
    module: torch.nn.Module,
    basic_optimizer: torch.optim.Optimizer,
    options: PatrickStarConfig,
    *,
    device: torch.device,
    dtype: torch.dtype,
    accumulate: bool,
    dp_group: ProcessGroup | None,
    deferred: DeferredModel | None,
    is_boundary: Callable[[], bool],
) -> ChunkedModel:
    """Build every part of a run for ``module``; see the module docstring for the order."""
    adamw = adamw_mode(basic_optimizer)  # refuse a non-Adam optimizer before anything is built
    counters = StepCounters()
    comm = ChunkComm(dp_group, counters)
    specs = plan_chunks(named_param_groups(module, basic_optimizer.param_groups), options.chunk_size, comm.world_size)
    spilled = plan_disk_tier(options.offload_optimizer, options.host_budget, specs, comm, dtype, accumulate)
    on_disk = host_bytes_saved(options.offload_optimizer, spilled)
    accel = make_accelerator(options, device, specs, comm, dtype, accumulate, on_disk)
    comm.bind(accel, poison=isinstance(accel, EmulatedAccelerator))
    movable = not isinstance(accel, HostAccelerator)  # chunks have a host home: placement
    store = ChunkStore(accel, counters, movable=movable)
    keep_gathered = options.keep_gathered
    if keep_gathered is None and not movable:  # before the chunks: see [Note: default kept groups from host memory]
        owners = [owner_of(i, comm.world_size) for i in range(len(specs))]
        rank_plan = plan_for_rank([s.capacity for s in specs], owners, comm.rank, dtype.itemsize, accumulate)
        keep_gathered = default_keep_gathered(module, rank_plan, comm)
    chunk_map = build_chunk_map(
        specs, comm.world_size, comm.rank, store, has_values=lambda p: not (deferred and deferred.is_deferred(p))
    )
    reductions = InFlightReductions()
    placement = make_placement(options, accel, store, counters, chunk_map, reductions, accumulate) if movable else None
    manager = ChunkManager(
        chunk_map,
        comm,
        store,
        placement,
        reductions,
        accumulate=accumulate,
        keep_gathered=keep_gathered,
        prefetch_groups=options.prefetch_groups,
    )
    if deferred:  # values from each module's own init, into the owned chunks only (see io/init.py)
        deferred.materialize(chunk_map)
    module.to(device)  # buffers and frozen parameters; chunk parameters are views already there
    owned = chunk_map.owned_chunks()
    disk = open_disk_states(
        options.offload_optimizer, spilled, comm.rank, poison=isinstance(accel, EmulatedAccelerator)
    )
    optim_states = OptimizerStates(owned, accel, start_on_device=not movable, disk=disk)
    adam = ChunkAdam(
        owned,
        optim_states,
        basic_optimizer.param_groups,
        adamw,
        placement,
        counters,
        stepped_groups={c.group_index for c in chunk_map.chunks},
    )
    export = ChunkExport(chunk_map, comm, accel, optim_states)
    flow = TrainingFlow(module, manager, placement, export, optim_states, is_boundary)
    hooks = HookRegistry(
        module, chunk_map.info, flow, activation_blocks(module, placement, options.offload_activations)
    )
    adam.build_kernels({accel.device, torch.device("cpu")} if placement else {accel.device})
    return ChunkedModel(
        counters, comm, accel, store, chunk_map, placement, manager, optim_states, adam, export, flow, hooks, disk
    )
