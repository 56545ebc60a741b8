"""Assembling a run: every collaborator of one model, built in order and wired once, and given back at
its end (``teardown.py``: see [Note: engine teardown]).

First the plan (:func:`~ds_patrickstar.integration.planning.plan_run`: chunk layout, disk tier plan,
pre-flight, accelerator), then what needs no parameter's values: the check that every parameter can be
bound and every Adam kernel the run can use (built now, so no step waits on a compiler); all before
any parameter changes. Then the parts that allocate: the disk tier's files and I/O, the chunk store,
the chunk map (bound: parameters become views of their chunks), placement (on CUDA or the emulated
accelerator), the chunk manager, deferred values (``ds_patrickstar.Init``), optimizer states, Adam,
the streaming export, the hook target and the hooks. A failure among them gives the bound parameters
their values back and what was built goes (see [Note: initialize as a transaction]).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch.distributed import ProcessGroup

from ..activations.offloader import ActivationOffloader
from ..chunks.chunk_map import ChunkMap
from ..chunks.state import TensorState
from ..counters import StepCounters
from ..disk.frozen import FrozenDisk
from ..disk.states import DiskStates
from ..disk.tier import open_disk_tier
from ..groups.comm import ChunkComm
from ..groups.manager import ChunkManager
from ..io.export import ChunkExport
from ..io.init import DeferredModel
from ..memory.accelerator import Accelerator
from ..memory.emulated import EmulatedAccelerator
from ..memory.reductions import InFlightReductions
from ..optim.chunk_adam import ChunkAdam, build_kernels
from ..optim.early_updates import EarlyHostUpdates
from ..optim.states import OptimizerStates
from ..placement.bytes_floor import FloorMeter
from ..placement.chunk_costs import ChunkCosts
from ..placement.chunk_needs import chunk_needs, gathered_storage
from ..placement.interface import NullPlacement, Placement
from ..placement.move_model import MovePredictor
from ..placement.moves import ChunkMoves
from ..placement.policy import Placer
from ..placement.runtime import PlacementRuntime
from ..placement.saved_meter import SavedTensorMeter
from ..placement.state_choice import StateChooser
from ..placement.step_time import H100_PROFILE, DeviceProfile, HostOverlap, StepTimer
from ..placement.tracer import MemoryTracer
from ..run_state import RunState
from ..store.binding import build_chunk_map, check_bindable
from ..store.chunk_store import ChunkStore
from .activation_setup import activation_blocks, activation_mode, traced_keep
from .config import PatrickStarConfig
from .device_profile import device_profile
from .hook_target import TrainingFlow
from .hooks import HookRegistry
from .leaf_modules import divergence_advice, leaf_tensors
from .planning import RunPlan, plan_run
from .teardown import give_back, give_back_logged, release, unbind_parameters

logger = logging.getLogger(__name__)


@dataclass
class ChunkedModel:
    """Everything one model trains with; see the module docstring for what each part does."""

    counters: StepCounters
    comm: ChunkComm
    accel: Accelerator
    store: ChunkStore
    chunk_map: ChunkMap
    placement: Placement
    run: RunState
    manager: ChunkManager
    optim_states: OptimizerStates
    adam: ChunkAdam
    export: ChunkExport
    flow: TrainingFlow
    hooks: HookRegistry
    has_values: Callable[[torch.nn.Parameter], bool]  # False for a deferred parameter (``ds_patrickstar.Init``)
    early: EarlyHostUpdates  # host updates begun in backward (see [Note: host updates in backward])
    disk: DiskStates | None = None  # the disk tier's spilled states, when anything spills
    frozen_disk: FrozenDisk | None = None  # the frozen chunks on disk, when any is (see [Note: frozen chunks on disk])
    closed: bool = False

    def close(self) -> None:
        """The run is over (``engine.destroy()``): see [Note: engine teardown]. Closing again does nothing."""
        if self.closed:
            return
        self.closed = True
        self.flow.end_saved_tensor_hooks()
        infos = self.chunk_map.infos()
        if self.comm.world_size > 1 and self.run.mid_iteration():  # see [Note: run state]
            why = "destroyed inside an iteration (after an error?), a gather could wait for ranks that never come"
            unbind_parameters(infos, None, "engine.destroy()", why)
            # collectives in flight may still use the accelerator's buffers: they go with the engine; the
            # agreement's side group stays too: another rank waiting in a check there would fail with a lost
            # connection, reported before this rank's own error (see [Note: rank agreement])
            release(self.hooks, self.disk, None, self.frozen_disk)
            return
        self.early.close()
        from_masters = any(info.state is TensorState.HOLD_AFTER_BWD for info in infos)
        unbind_parameters(
            infos, lambda: self.export.iter_host_values(fp32_masters=from_masters), "engine.destroy()", ""
        )
        release(self.hooks, self.disk, self.accel, self.frozen_disk, self.comm.agreement)

    def abandon(self) -> None:
        """Initialize failed after this was built: what :meth:`close` gives back goes, and the parameters
        get their values back from this rank's chunks without a collective (see
        [Note: initialize as a transaction]). Closing or abandoning again does nothing."""
        if self.closed:
            return
        self.closed = True
        self.flow.end_saved_tensor_hooks()
        parts = (self.hooks, self.disk, self.accel, self.frozen_disk, self.store, self.comm.agreement)
        give_back(self.chunk_map, self.has_values, *parts)


def make_placement(
    options: PatrickStarConfig,
    accel: Accelerator,
    store: ChunkStore,
    counters: StepCounters,
    chunk_map: ChunkMap,
    reductions: InFlightReductions,
    accumulate: bool,
    run: RunState,
) -> PlacementRuntime:
    """Tide-aware (or static) placement on CUDA or the emulated accelerator; see [Note: placement]."""
    model_storages = chunk_map.model_storages()
    meter = None
    if isinstance(accel, EmulatedAccelerator):
        meter = SavedTensorMeter(lambda s: s._cdata in model_storages, accel.activation_memory)
    owned = {c.chunk_id for c in chunk_map.owned_chunks()}
    profile = device_profile(accel, options.device_profile) if options.placement == "auto" else H100_PROFILE
    placer = Placer(accel.ledger.budget, options.placement, options.static_fraction, owned)
    moves = ChunkMoves(placer, MemoryTracer(accel, meter), store, counters, chunk_map.chunks, reductions, run)
    moves.chunk_size = options.chunk_size
    store.copies.enabled = _keeps_copies(options)
    costs = _chunk_costs(chunk_map, accumulate, store.copies.enabled)
    # the bytes floor, one per run (the chooser logs what the counter reads); several ranks: without accumulators
    one_rank = chunk_map.world_size == 1
    floor_costs = costs if one_rank else replace(costs, accumulators=None)
    gathered = None if one_rank else gathered_storage(chunk_map)
    floor = FloorMeter(accel.ledger.budget, floor_costs, gathered) if options.placement == "auto" else None
    runtime = PlacementRuntime(
        moves,
        lambda trace: chunk_needs(trace, chunk_map, accumulate),
        predictor=MovePredictor(accel.ledger.budget, costs),
        timer=_step_timer(accel, chunk_map, _host_overlap(options), profile),
        chooser=_state_chooser(options, accel, costs, profile, floor),
        trainable=_released_in_backward(options, chunk_map),
        floor=floor,
        notes_unmoved=not one_rank,
    )
    mode = activation_mode(options, chunk_map, accel.ledger.budget)
    if mode != "none":  # see [Note: activation offload]
        runtime.activations = ActivationOffloader(
            accel,
            meter or SavedTensorMeter(lambda s: s._cdata in model_storages),
            mode,
            counters,
            runtime.current_moment,
            traced_keep(accel, chunk_map, accumulate) if mode == "auto" else None,
        )
    logger.info(
        "ds_patrickstar: %s placement, accelerator budget %.3f GiB%s",
        options.placement,
        accel.ledger.budget / 2**30,
        " (emulated)" if meter is not None else "",
    )
    return runtime


def _keeps_copies(options: PatrickStarConfig) -> bool:
    """Chunks keep their host buffer (see [Note: clean evictions]): tide-aware placement, host memory not budgeted."""
    return options.placement == "auto" and options.host_budget is None


def _chunk_costs(chunk_map: ChunkMap, accumulate: bool, clean: bool) -> ChunkCosts:
    """What the move model and the step-time model need of the owned chunks (see [Note: predicted moves])."""
    owned = chunk_map.owned_chunks()
    trainable = [c for c in owned if c.trainable]
    return ChunkCosts(
        sizes={c.chunk_id: c.nbytes for c in owned},
        elements={c.chunk_id: c.used for c in trainable},
        capacities={c.chunk_id: c.capacity for c in trainable},
        uncopied={c.chunk_id for c in owned if c.on_disk},
        clean_copies=clean,
        accumulators={c.chunk_id: 4 * c.capacity for c in trainable} if accumulate else None,
    )


def _state_chooser(
    options: PatrickStarConfig, accel: Accelerator, costs: ChunkCosts, profile: DeviceProfile, floor: FloorMeter | None
) -> StateChooser | None:
    """The step-time model's choice of the optimizer states on the accelerator (see [Note: optimizer states by step
    time]); None: every state that fits."""
    if options.placement != "auto" or options.optimizer_placement != "time" or floor is None:
        return None
    return StateChooser(accel.ledger.budget, costs, profile, _host_overlap(options), floor)


def _released_in_backward(options: PatrickStarConfig, chunk_map: ChunkMap) -> set[int] | None:
    """The chunks whose gradients may leave during backward when updated on the host (see [Note: gradients leave
    in backward] in placement/grad_release.py): tide-aware placement, any number of ranks."""
    if options.placement != "auto":
        return None
    return {c.chunk_id for c in chunk_map.trainable_owned()}


def _host_overlap(options: PatrickStarConfig) -> HostOverlap:
    """How the step-time model prices the host Adam at first (the step's driver says when updates begin in
    backward, see [Note: host updates in backward])."""
    return HostOverlap.FROM_STEP if options.overlap_host_adam else HostOverlap.OFF


def _step_timer(accel: Accelerator, chunk_map: ChunkMap, overlap: HostOverlap, profile: DeviceProfile) -> StepTimer:
    """The step-time model's clock and figures (see [Note: step-time model] and [Note: device profile])."""
    elements = {c.chunk_id: c.used for c in chunk_map.trainable_owned()}
    waits = accel.host_waits  # see [Note: host waits] in memory/host_work.py
    return StepTimer(accel.clock, accel.seconds_between, elements, profile, overlap, lambda: waits.seconds, accel.reach)


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
    fails, the bound parameters get their values back, what was built goes and the error propagates (see
    [Note: initialize as a transaction])."""
    plan = plan_run(
        module, basic_optimizer, options, device=device, dtype=dtype, accumulate=accumulate, dp_group=dp_group
    )
    counters, comm, accel = plan.counters, plan.comm, plan.accel

    def has_values(param: torch.nn.Parameter) -> bool:
        return not (deferred and deferred.is_deferred(param))

    chunk_map = ChunkMap(comm.world_size, comm.rank)
    disk: DiskStates | None = None
    frozen_disk: FrozenDisk | None = None
    hooks: HookRegistry | None = None
    store: ChunkStore | None = None
    try:
        check_bindable(plan.specs, has_values)
        if not plan.rule.sgd:  # SGD runs on pure torch (see [Note: SGD on chunks])
            build_kernels({accel.device, torch.device("cpu")} if plan.movable else {accel.device})
        pins = (accel.pin_host_range, accel.unpin_host_range)
        disk, frozen_disk = open_disk_tier(options.nvme, plan.disk, comm.rank, plan.poison, pins)
        run = RunState()
        accel.released_views.allowed, run.on_settled = run.settled, accel.released_views.sweep
        store = ChunkStore(accel, counters, movable=plan.movable, disk=frozen_disk)
        placement, manager = _build_chunks(
            module, options, plan, chunk_map, has_values, device, deferred, accumulate, run, store
        )
        owned = chunk_map.trainable_owned()  # frozen chunks have no optimizer states (see [Note: frozen chunks])
        optim_states = OptimizerStates(owned, accel, start_on_device=not plan.movable, disk=disk)
        if isinstance(placement, PlacementRuntime):  # see [Note: states give way]
            placement.moves.room_from_states = optim_states.give_room
        adam = ChunkAdam(
            owned,
            optim_states,
            basic_optimizer.param_groups,
            plan.rule,
            stepped_groups={c.group_index for c in chunk_map.chunks if c.trainable},
            overlap=options.overlap_host_adam,
        )
        export = ChunkExport(chunk_map, comm, store, optim_states)
        leaves = leaf_tensors(module, chunk_map.info)  # see [Note: leaf modules]
        comm.agreement.advice = divergence_advice(module)  # see [Note: ranks in lockstep]
        flow = TrainingFlow(module, manager, placement, export, optim_states, is_boundary, run, leaves)
        hooks = HookRegistry(
            module, chunk_map.info, flow, activation_blocks(module, placement, options.offload_activations), leaves
        )
    except BaseException:
        give_back_logged(chunk_map, has_values, hooks, disk, accel, frozen_disk, store, comm.agreement)
        raise
    return ChunkedModel(
        counters,
        comm,
        accel,
        store,
        chunk_map,
        placement,
        run,
        manager,
        optim_states,
        adam,
        export,
        flow,
        hooks,
        has_values,
        _updates_in_backward(placement, adam, options, counters),
        disk,
        frozen_disk,
    )


def _build_chunks(
    module: torch.nn.Module,
    options: PatrickStarConfig,
    plan: RunPlan,
    chunk_map: ChunkMap,
    has_values: Callable[[torch.nn.Parameter], bool],
    device: torch.device,
    deferred: DeferredModel | None,
    accumulate: bool,
    run: RunState,
    store: ChunkStore,
) -> tuple[Placement, ChunkManager]:
    """The chunks with the parameters bound to them (the first change to the model), placement and the manager."""
    counters, comm, accel = plan.counters, plan.comm, plan.accel
    build_chunk_map(chunk_map, plan.specs, store, has_values)
    reductions = InFlightReductions()
    placement: Placement = NullPlacement()  # one memory (see [Note: null placement])
    if plan.movable:
        placement = make_placement(options, accel, store, counters, chunk_map, reductions, accumulate, run)
    manager = ChunkManager(
        chunk_map,
        comm,
        store,
        placement,
        reductions,
        run,
        accumulate=accumulate,
        keep_gathered=plan.keep_gathered,
        prefetch_groups=options.prefetch_groups,
        persistence=(options.stage3_param_persistence_threshold, options.stage3_model_persistence_threshold),
    )
    if deferred:  # values from each module's own init, into the owned chunks only (see io/init.py)
        with store.disk.writing() if store.disk is not None else contextlib.nullcontext():
            deferred.materialize(chunk_map, store.values)
    module.to(device)  # buffers (and non-float frozen parameters); chunk parameters are views already there
    return placement, manager


def _updates_in_backward(
    placement: Placement, adam: ChunkAdam, options: PatrickStarConfig, counters: StepCounters
) -> EarlyHostUpdates:
    """Host updates that begin in backward, told by the gradients' release (see [Note: host updates in
    backward]); none begins where no gradient leaves in backward or the key says none."""
    limit = options.host_adam_in_backward
    release = placement.release if isinstance(placement, PlacementRuntime) else None
    if release is None or not options.overlap_host_adam:
        limit = 0
    elif limit == "auto" and options.nvme is not None:  # host memory is what the disk tier budgets
        logger.info("ds_patrickstar: with the disk tier no host update begins in backward (host_adam_in_backward)")
        limit = 0
    early = EarlyHostUpdates(adam, None if limit == "auto" else limit, counters)
    if release is not None and limit != 0:
        release.on_home = early.begin
    return early
