"""Setting up the disk tier at initialize: the host budget, which chunks spill, the folder check, the files.

See [Note: disk tier plan] for the arithmetic and [Note: disk tier] for what runs in a step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import psutil
import torch

from ..chunks.chunk_map import owner_of
from ..chunks.layout import ChunkSpec
from ..memory.preflight import OPTIM_BYTES_PER_ELEMENT, local_world_size, plan_for_specs
from .aio import AIO_UNCHECKED, AioDiskIO, load_async_io, lock_problem
from .budget import disk_buffer_bytes, disk_plan, frozen_host_slots, frozen_pool_bytes, record_bytes
from .config import NvmeOffload
from .frozen import FrozenDisk
from .io import DiskIO, ThreadDiskIO
from .states import DiskStates
from .swap_files import PathProbe, SwapFiles, check_swap_path, rank_folder, stale_bytes
from .swap_layout import frozen_record_bytes, piece_elements

logger = logging.getLogger(__name__)

HOST_MARGIN_FRACTION = 0.10
"""Of the host's total memory, left out of the default host budget (activations, the framework,
the page cache), at least :data:`HOST_MARGIN_MIN` bytes."""
HOST_MARGIN_MIN = 1 << 30

AUTO_REASON = (
    "it sees the result of every read and write, where DeepSpeed's aio_handle does not check each libaio "
    'completion; ask for "aio" explicitly to use it anyway'
)


def resolve_host_budget(host_budget: int | float | None, world_size: int) -> int:
    """Bytes of model data this rank may keep in RAM: the option (a fraction: of total memory), or
    the available memory less the margin, shared by the ranks on this host."""
    memory = psutil.virtual_memory()
    if isinstance(host_budget, float):
        return int(memory.total * host_budget)
    if isinstance(host_budget, int):
        return host_budget
    margin = max(HOST_MARGIN_MIN, int(memory.total * HOST_MARGIN_FRACTION))
    return max(0, memory.available - margin) // local_world_size(world_size)


@dataclass(frozen=True)
class DiskPlan:
    """What the disk tier holds for this rank: spilled chunks' states (id -> capacity) and frozen chunks
    (id -> bytes of their record), how many host buffers frozen chunks are read into, and how many
    record-sized host buffers they take in all (:func:`~ds_patrickstar.disk.budget.frozen_host_slots`)."""

    spilled: dict[int, int] = field(default_factory=dict)
    frozen: dict[int, int] = field(default_factory=dict)
    frozen_buffers: int = 0
    frozen_slots: int = 0
    key: str = "zero_optimization.offload_optimizer.nvme_path"  # the key errors about the folder name

    @property
    def frozen_buffer_bytes(self) -> int:
        return frozen_pool_bytes(list(self.frozen.values()), self.frozen_slots, self.frozen_buffers)


def plan_disk_tier(
    nvme: NvmeOffload | None,
    frozen_buffers: int,
    host_budget: int | float | None,
    specs: list[ChunkSpec],
    ranks: tuple[int, int],
    dtype: torch.dtype,
    accumulate: bool,
    key: str = "zero_optimization.offload_optimizer.nvme_path",
    host_accelerator: bool = False,
) -> DiskPlan:
    """What goes to disk on this rank (see [Note: disk tier plan]), after checking ``nvme_path`` has room
    for it (``ranks``: the data-parallel ``(world size, rank)``; ``nvme``: the disk tier's settings when an
    offload block names a disk, else None; ``key``: the ``nvme_path`` key an error names;
    ``host_accelerator``: the host is the accelerator, no placement)."""
    if nvme is None:
        return DiskPlan()
    world_size, rank = ranks
    plan = plan_for_specs(specs, world_size, rank, dtype.itemsize, accumulate)
    mine = [(i, s) for i, s in enumerate(specs) if owner_of(i, world_size) == rank]
    owned = {i: s.capacity for i, s in mine if s.kind.trainable}  # only trainable chunks have optimizer states
    frozen = {i: frozen_record_bytes(s.capacity, dtype.itemsize) for i, s in mine if not s.kind.trainable}
    budget = resolve_host_budget(host_budget, world_size)
    other = plan.model_data_bytes - OPTIM_BYTES_PER_ELEMENT * plan.owned_elements
    slots = frozen_host_slots(frozen_buffers, host_accelerator)
    buffers = (nvme.buffer_count, piece_elements(nvme.buffer_size), slots, frozen_buffers)
    states, on_disk = disk_plan(owned, frozen, other, budget, buffers, frozen_first=not accumulate)
    result = DiskPlan(
        {c: owned[c] for c in sorted(states)}, {c: frozen[c] for c in sorted(on_disk)}, frozen_buffers, slots, key
    )
    needed = sum(record_bytes(c) for c in result.spilled.values()) + sum(result.frozen.values())
    folder = rank_folder(nvme.nvme_path, rank)
    check_swap_path(nvme.nvme_path, PathProbe.of(nvme.nvme_path), needed, stale_bytes(folder), key)
    logger.info(
        "ds_patrickstar: disk tier: host budget %.3f GiB; optimizer states of %d of %d owned chunks and %d of %d "
        "owned frozen chunks on disk (%.3f GiB in %s), %.3f GiB of buffers (pieces of %d elements)",
        budget / 2**30,
        len(result.spilled),
        len(owned),
        len(result.frozen),
        len(frozen),
        needed / 2**30,
        folder,
        (buffer_bytes(nvme, result.spilled) + result.frozen_buffer_bytes) / 2**30,
        piece_elements(nvme.buffer_size),
    )
    held = plan.model_data_bytes - host_bytes_saved(nvme, result)
    if held > budget:
        logger.warning(
            "ds_patrickstar: disk tier: host_budget %.3f GiB cannot hold what this rank keeps in RAM even with "
            "every frozen chunk and optimizer state it can move on disk: %.3f GiB (the trainable chunks and the "
            "disk tier's buffers, the frozen ones sized by the largest frozen chunks on disk); a smaller "
            "buffer_count or chunk_size lowers it",
            budget / 2**30,
            held / 2**30,
        )
    return result


def buffer_bytes(nvme: NvmeOffload | None, spilled: dict[int, int]) -> int:
    """Host bytes of the disk tier's buffers for these spilled chunks (what :class:`DiskStates` allocates)."""
    if nvme is None:
        return 0
    return disk_buffer_bytes(list(spilled.values()), nvme.buffer_count, piece_elements(nvme.buffer_size))


def host_bytes_saved(nvme: NvmeOffload | None, plan: DiskPlan) -> int:
    """Host bytes the disk tier takes off the model data: the spilled states and the frozen chunks'
    payloads on disk, less its buffers."""
    frozen = sum(plan.frozen.values()) - plan.frozen_buffer_bytes  # a record: the payload, padded to 4 KiB
    return OPTIM_BYTES_PER_ELEMENT * sum(plan.spilled.values()) - buffer_bytes(nvme, plan.spilled) + frozen


def open_disk_tier(
    nvme: NvmeOffload | None,
    plan: DiskPlan,
    rank: int,
    poison: bool,
    pins: tuple[Callable[[int, int], None], Callable[[int], None]] | None = None,
) -> tuple[DiskStates | None, FrozenDisk | None]:
    """The swap files and the I/O of the spilled chunks and the frozen chunks on disk (None for a part
    that holds nothing); ``pins``: the accelerator's pin and unpin of a host range, for the frozen
    chunks' read buffers."""
    if nvme is None or not (plan.spilled or plan.frozen):
        return None, None
    sizes = {cid: record_bytes(c) for cid, c in plan.spilled.items()} | plan.frozen
    files = SwapFiles(nvme.nvme_path, rank, sizes, key=plan.key)
    io: DiskIO | None = None
    try:
        io = make_disk_io(nvme, files.direct, poison, buffer_bytes(nvme, plan.spilled) + plan.frozen_buffer_bytes)
        states = DiskStates(files, io, plan.spilled, nvme.buffer_count, nvme.buffer_size) if plan.spilled else None
        frozen = FrozenDisk(files, io, plan.frozen, plan.frozen_buffers) if plan.frozen else None
        if frozen is not None and pins is not None:
            frozen.pin_buffers(*pins)
        return states, frozen
    except BaseException:
        if io is not None:
            io.close()
        files.close(remove=True)
        raise


def make_disk_io(nvme: NvmeOffload, direct: bool, poison: bool, locked: int = 0) -> DiskIO:
    """The I/O backend ``offload_optimizer.io_backend`` asks for (see [Note: disk tier configuration]);
    ``locked``: bytes of buffers the ``aio_handle`` would page-lock."""
    if nvme.io_backend != "aio":
        if nvme.io_backend == "auto":
            logger.info('ds_patrickstar: disk tier I/O: "threads" (io_backend "auto": %s)', AUTO_REASON)
        return ThreadDiskIO(nvme.threads, nvme.block_size, poison=poison)
    why = "" if direct else f"the file system of nvme_path={nvme.nvme_path!r} does not take O_DIRECT"
    why = why or lock_problem(locked) or load_async_io()[1]
    if why:
        raise ValueError(
            f'zero_optimization.offload_optimizer.io_backend="aio" cannot be used: {why}. DeepSpeed\'s aio_handle '
            "needs libaio-dev (to build its async_io op), O_DIRECT on nvme_path's file system and page-lockable "
            'buffers; or use "threads" (or "auto", which is "threads")'
        )
    logger.warning("ds_patrickstar: %s", AIO_UNCHECKED)
    return AioDiskIO(
        nvme.block_size, nvme.queue_depth, nvme.single_submit, nvme.overlap_events, nvme.threads, poison=poison
    )
