"""Building the memory side of a run: the accelerator, the pre-flight check, the store, placement.

Order matters (see [Note: pre-flight]): the check runs on the chunk plan before any chunk
or optimizer state is allocated, so a model that does not fit is refused before memory goes.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from .accelerator import Accelerator, CudaAccelerator, EmulatedAccelerator, HostAccelerator
from .counters import StepCounters
from .device import ChunkStore, PlacementRuntime
from .placement import Placer
from .plan import check_fits, plan_for_rank
from .tracer import MemoryTracer, SavedTensorMeter

logger = logging.getLogger(__name__)


def resolve_budget(device_budget: int | float | None, device: torch.device, emulate: bool) -> int:
    """The accelerator budget in bytes: a byte count, or a fraction of the device's memory
    (of the host's memory on the emulated accelerator)."""
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
    else:
        import psutil

        total = psutil.virtual_memory().total
    if device_budget is None:
        if emulate:
            raise ValueError("zero_optimization.emulate_accelerator=true needs zero_optimization.device_budget: "
                             "the emulated accelerator's size in bytes (an integer) or a fraction of host memory")
        device_budget = 0.9
    return int(total * device_budget) if isinstance(device_budget, float) else int(device_budget)


@dataclass
class Memory:
    accel: Accelerator
    store: ChunkStore
    options: object
    counters: StepCounters

    def attach_placement(self, manager) -> PlacementRuntime | None:
        """A :class:`PlacementRuntime` on CUDA or the emulated accelerator; ``None`` on a plain CPU run."""
        if not self.store.movable:
            return None
        options, accel = self.options, self.accel
        owned = {c.chunk_id for c in manager.owned_chunks()}
        meter = None
        if isinstance(accel, EmulatedAccelerator):
            model_storages = manager.model_storages()
            meter = SavedTensorMeter(lambda s: s._cdata in model_storages)
        placer = Placer(accel.ledger.budget, options.placement, options.static_fraction, owned)
        runtime = PlacementRuntime(placer, MemoryTracer(accel, meter), self.store, self.counters, manager.chunks)
        manager.attach_placement(runtime)
        logger.info("ds_patrickstar: %s placement, accelerator budget %.3f GiB%s", options.placement,
                    accel.ledger.budget / 2**30, " (emulated)" if meter is not None else "")
        return runtime


def build_memory(options, device: torch.device, specs, comm, counters: StepCounters, dtype: torch.dtype,
                 accumulate: bool) -> Memory:
    """The accelerator and chunk store for this run, after the pre-flight check."""
    emulate = options.emulate_accelerator
    placement = device.type == "cuda" or emulate
    if placement:
        import psutil

        budget = resolve_budget(options.device_budget, device, emulate)
        plan = plan_for_rank([s.capacity for s in specs], [comm.owner(i) for i in range(len(specs))], comm.rank,
                             dtype.itemsize, accumulate)
        check_fits(plan, budget, psutil.virtual_memory().available, comm.world_size)
        accel = CudaAccelerator(device, budget) if device.type == "cuda" else EmulatedAccelerator(budget)
    else:
        accel = HostAccelerator()
    return Memory(accel, ChunkStore(accel, counters, movable=placement), options, counters)
