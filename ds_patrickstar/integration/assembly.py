"""Assembling a run: every collaborator of one model, built in order and wired once.

First the plan (:func:`~ds_patrickstar.integration.planning.plan_run`: chunk layout, disk tier plan,
pre-flight, accelerator), before any parameter changes. Then the parts that allocate: the disk tier's
files and I/O, the chunk store, the chunk map (bound: parameters become views of their chunks),
placement (on CUDA or the emulated accelerator), the chunk manager, deferred values
(``ds_patrickstar.Init``), optimizer states, Adam, the streaming export, the hook target and the
hooks; finally every Adam kernel the run can use is built, so no step waits on a compiler. A failure
among them gives back what was built (see [Note: initialize as a transaction]).

[Note: engine teardown]
``engine.destroy()`` ends the run (:meth:`ChunkedModel.close`): every hook we put on the model goes,
the disk tier's I/O threads stop and its files go, and the accelerator gives back every allocation
still held and its pinned host buffers (see [Note: closing the accelerator]), all at once, even if
the caller keeps the engine. The hooks must go: torch keeps a parameter's post-accumulate-grad hooks
in its C++ autograd metadata, where the garbage collector does not look, so a hook's closure (the
hook target, and through it the optimizer and the engine) would keep the engine reachable from every
parameter. The parameters are views of the chunks (see [Note: storage resize]), which go: before
they do, every parameter gets its values back as a host tensor of its own (streamed one chunk group
at a time as ``state_dict()`` does, so with data parallelism ``destroy`` is a collective: call it on
every rank, as DeepSpeed's users do). The module stays a plain model with the trained weights, on
the host: it can be read, saved, evaluated or given to a new engine (as the Hugging Face Trainer
does when ``train()`` runs again; a destroyed stock ZeRO-3 engine leaves its partitions behind
instead). Between backward and step the slots hold gradients, so the fp32 masters give the values
then. Where the values cannot be read back, each parameter is left empty (0 elements, with a
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

import torch
from torch.distributed import ProcessGroup

from ..activations.offloader import ActivationOffloader, repeated_blocks
from ..chunks.chunk_map import ChunkMap
from ..chunks.state import TensorState
from ..counters import StepCounters
from ..disk.states import DiskStates
from ..disk.tier import open_disk_states
from ..groups.comm import ChunkComm
from ..groups.manager import ChunkManager
from ..groups.reductions import InFlightReductions
from ..io.export import ChunkExport
from ..io.init import DeferredModel
from ..memory.accelerator import Accelerator
from ..memory.binding import build_chunk_map
from ..memory.emulated import EmulatedAccelerator
from ..memory.store import ChunkStore
from ..optim.chunk_adam import ChunkAdam
from ..optim.states import OptimizerStates
from ..placement.chunk_needs import chunk_needs
from ..placement.policy import Placer
from ..placement.runtime import PlacementRuntime
from ..placement.tracer import MemoryTracer, SavedTensorMeter
from .config import PatrickStarConfig
from .hook_target import TrainingFlow
from .hooks import HookRegistry
from .planning import VALUES_LOST, RunPlan, plan_run

logger = logging.getLogger(__name__)


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
        # with ``interrupted``, collectives in flight may still use the accelerator's buffers: they go with the engine
        release(self.hooks, self.disk, None if interrupted else self.accel)

    def abandon(self) -> None:
        """Initialize failed after this was built: what :meth:`close` gives back goes, but nothing is read
        back (no collective runs); the caller gives the parameters their own tensors back (see
        [Note: initialize as a transaction]). Closing or abandoning again does nothing."""
        if self.closed:
            return
        self.closed = True
        release(self.hooks, self.disk, self.accel)

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
                setattr(info.param, VALUES_LOST, True)
        for info in infos:
            info.param.grad = None


def release(hooks: HookRegistry | None, disk: DiskStates | None, accel: Accelerator | None) -> None:
    """Our hooks leave the model, the disk tier's I/O threads stop and its files go (see [Note: swap files]),
    the accelerator gives back its memory; each even when one before it raised."""
    try:
        if hooks is not None:
            hooks.remove()
    finally:
        try:
            if disk is not None:
                disk.close()
        finally:
            if accel is not None:
                accel.close()


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
    """Build every part of a run for ``module``; see the module docstring for the order. When a part
    fails, what was built goes and the error propagates; the parameters' own tensors come back from the
    caller (see [Note: initialize as a transaction])."""
    plan = plan_run(
        module, basic_optimizer, options, device=device, dtype=dtype, accumulate=accumulate, dp_group=dp_group
    )
    counters, comm, accel = plan.counters, plan.comm, plan.accel
    disk: DiskStates | None = None
    hooks: HookRegistry | None = None
    try:
        disk = open_disk_states(options.offload_optimizer, plan.spilled, comm.rank, poison=plan.poison)
        store, chunk_map, placement, manager = _build_chunks(module, options, plan, device, deferred, accumulate)
        owned = chunk_map.owned_chunks()
        optim_states = OptimizerStates(owned, accel, start_on_device=not plan.movable, disk=disk)
        adam = ChunkAdam(
            owned,
            optim_states,
            basic_optimizer.param_groups,
            plan.adamw,
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
    except BaseException:
        _give_back(hooks, disk, accel)
        raise
    return ChunkedModel(
        counters, comm, accel, store, chunk_map, placement, manager, optim_states, adam, export, flow, hooks, disk
    )


def _build_chunks(
    module: torch.nn.Module,
    options: PatrickStarConfig,
    plan: RunPlan,
    device: torch.device,
    deferred: DeferredModel | None,
    accumulate: bool,
) -> tuple[ChunkStore, ChunkMap, PlacementRuntime | None, ChunkManager]:
    """The chunks with the parameters bound to them (the first change to the model), placement and the manager."""
    counters, comm, accel = plan.counters, plan.comm, plan.accel
    store = ChunkStore(accel, counters, movable=plan.movable)
    chunk_map = build_chunk_map(
        plan.specs, comm.world_size, comm.rank, store, has_values=lambda p: not (deferred and deferred.is_deferred(p))
    )
    reductions = InFlightReductions()
    placement = (
        make_placement(options, accel, store, counters, chunk_map, reductions, accumulate) if plan.movable else None
    )
    manager = ChunkManager(
        chunk_map,
        comm,
        store,
        placement,
        reductions,
        accumulate=accumulate,
        keep_gathered=plan.keep_gathered,
        prefetch_groups=options.prefetch_groups,
    )
    if deferred:  # values from each module's own init, into the owned chunks only (see io/init.py)
        deferred.materialize(chunk_map)
    module.to(device)  # buffers and frozen parameters; chunk parameters are views already there
    return store, chunk_map, placement, manager


def _give_back(hooks: HookRegistry | None, disk: DiskStates | None, accel: Accelerator) -> None:
    """After a failed :func:`assemble`: what it built goes; an error doing so is logged, the failure's
    own error is the one that propagates."""
    try:
        release(hooks, disk, accel)
    except Exception:
        logger.exception("ds_patrickstar: giving back what a failed initialize built failed too")
