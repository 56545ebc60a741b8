"""The disk tier of the optimizer states: spilled chunks' fp32 master/momentum/variance on disk.

[Note: disk tier]
With ``offload_optimizer: {"device": "nvme"}`` the host-Adam chunks whose states do not fit
``host_budget`` are *spilled*: their states live in one swap file per chunk (see
[Note: swap files]) and pass through a few aligned host buffers. During the step
(:class:`DiskStream`) the reads of the first spilled chunks are issued before the chunks whose
states are in memory are updated; then, for spilled chunk ``i``, the read of chunk ``i+1`` (and
more with more buffers) and the write of chunk ``i-1`` run on the I/O threads while the CPU Adam
updates chunk ``i``: ``buffer_count`` buffers are ``buffer_count - 2`` read-aheads, one being
computed, one written behind. The manifest's ``clean`` flag is false from the first write of a
step until the last write completed; a failed read or write fails the step with its error.

Outside the step (checkpoints, ``state_dict``, an overflow's restore) a spilled chunk is reached
through a one-chunk cache (:meth:`DiskStates.cached`): read on first use, written back when
another chunk is needed or on :meth:`DiskStates.flush`. Chunks whose Adam runs on the accelerator
never touch the disk: the spilled chunks are the last ones in chunk order, and the accelerator
takes optimizer states from the first ones (see [Note: optimizer-state placement]).
"""

from __future__ import annotations

import logging
import weakref
from collections import deque
from collections.abc import Iterator

import torch

from ..memory.disk_io import ALIGNMENT, DiskIO, DiskPending, align_up
from ..memory.preflight import MIN_DISK_BUFFERS as MIN_BUFFERS
from ..memory.preflight import record_bytes
from ..memory.swap_files import SwapFiles
from .states import OptimizerChunk

logger = logging.getLogger(__name__)


class _Slot:
    """One aligned host buffer and the states of the chunk it holds."""

    def __init__(self, raw: torch.Tensor) -> None:
        self.raw = raw
        self.chunk_id: int | None = None

    def states(self, capacity: int) -> OptimizerChunk:
        stride = align_up(capacity * 4)
        views = [self.raw[k * stride : k * stride + capacity * 4].view(torch.float32) for k in range(3)]
        return OptimizerChunk(*views)

    def record(self, capacity: int) -> torch.Tensor:
        return self.raw[: record_bytes(capacity)]


class DiskStates:
    """States of the spilled chunks, in their swap files; see [Note: disk tier]."""

    def __init__(self, files: SwapFiles, io: DiskIO, capacities: dict[int, int], buffer_count: int) -> None:
        self._handles = _Handles(io, files)
        self.files = files
        self.capacities = dict(capacities)
        largest = max((record_bytes(c) for c in capacities.values()), default=ALIGNMENT)
        self._slots = [_Slot(io.empty(largest)) for _ in range(max(buffer_count, MIN_BUFFERS))]
        self._cache = _Slot(io.empty(largest))
        self._dirty = False
        self._counted = (0, 0, 0.0, 0.0)
        weakref.finalize(self, self._handles.close)

    @property
    def buffer_bytes(self) -> int:
        return sum(s.raw.numel() for s in (*self._slots, self._cache))

    @property
    def bytes_on_disk(self) -> int:
        return sum(record_bytes(c) for c in self.capacities.values())

    @property
    def io(self) -> DiskIO:
        return self._handles.io

    def replace_io(self, io: DiskIO) -> None:
        """Use another implementation of the interface (the old one is closed)."""
        self._handles.io.close()
        self._handles.io = io

    # ---- one chunk at a time -----------------------------------------------------------
    def read(self, chunk_id: int, slot: _Slot) -> DiskPending:
        slot.chunk_id = chunk_id
        return self.io.read(self.files.fds[chunk_id], 0, slot.record(self.capacities[chunk_id]))

    def write(self, chunk_id: int, slot: _Slot) -> DiskPending:
        return self.io.write(self.files.fds[chunk_id], 0, slot.record(self.capacities[chunk_id]))

    @torch.no_grad()
    def initialize(self, chunk_id: int, values: torch.Tensor) -> None:
        """The chunk's first states: master from ``values``, zero moments."""
        self.flush()
        slot = self._cache
        slot.raw.zero_()
        slot.states(self.capacities[chunk_id]).master.copy_(values)
        self.write(chunk_id, slot).wait()
        slot.chunk_id = None

    def cached(self, chunk_id: int, write: bool) -> OptimizerChunk:
        """The chunk's states in the one-chunk cache (``write``: written back by :meth:`flush`)."""
        if self._cache.chunk_id != chunk_id:
            self.flush()
            self.read(chunk_id, self._cache).wait()
        self._dirty = self._dirty or write
        return self._cache.states(self.capacities[chunk_id])

    def flush(self) -> None:
        """Write the cached chunk back if it was changed, and forget it."""
        if self._dirty and self._cache.chunk_id is not None:
            self.files.set_clean(False)
            self.write(self._cache.chunk_id, self._cache).wait()
            self.files.set_clean(True)
        self._dirty = False
        self._cache.chunk_id = None

    def record_view(self, chunk_id: int) -> torch.Tensor:
        """The chunk's whole swap record (read through the cache), for a checkpoint file."""
        self.cached(chunk_id, write=False)
        return self._cache.record(self.capacities[chunk_id])

    # ---- the step -----------------------------------------------------------------------
    def stream(self, chunk_ids: list[int]) -> DiskStream:
        self.flush()
        return DiskStream(self, chunk_ids, self._slots)

    def take_counts(self) -> tuple[int, int, float, float]:
        """``(bytes read, bytes written, I/O seconds, seconds waited)`` since the last call."""
        now = (self.io.bytes_read, self.io.bytes_written, self.io.io_seconds, self.io.wait_seconds)
        delta = tuple(a - b for a, b in zip(now, self._counted))
        self._counted = now
        return int(delta[0]), int(delta[1]), float(delta[2]), float(delta[3])

    def close(self) -> None:
        self._handles.close()


class _Handles:
    """The I/O and the files, closed (the files removed: they are scratch) when the states go away."""

    def __init__(self, io: DiskIO, files: SwapFiles) -> None:
        self.io, self.files = io, files

    def close(self) -> None:
        self.io.close()
        self.files.close(remove=True)


class DiskStream:
    """One step's pass over the spilled chunks: reads ahead, writes behind; see [Note: disk tier]."""

    def __init__(self, tier: DiskStates, chunk_ids: list[int], slots: list[_Slot]) -> None:
        self._tier = tier
        self._ids = deque(chunk_ids)
        self._free = deque(slots)
        self._reads: deque[tuple[int, _Slot, DiskPending]] = deque()
        self._writes: deque[tuple[_Slot, DiskPending]] = deque()
        self._read_ahead = len(slots) - 2
        self._started = False

    def start(self) -> None:
        """Issue the first reads (before the in-memory chunks are updated)."""
        if not self._started and self._ids:
            self._started = True
            self._tier.files.set_clean(False)
        self._issue_reads(self._read_ahead + 1)

    def _issue_reads(self, depth: int) -> None:
        while self._ids and len(self._reads) < depth:
            if not self._free:
                if not self._writes:
                    return
                slot, pending = self._writes.popleft()
                pending.wait()
                self._free.append(slot)
            chunk_id = self._ids.popleft()
            slot = self._free.popleft()
            self._reads.append((chunk_id, slot, self._tier.read(chunk_id, slot)))

    def __iter__(self) -> Iterator[tuple[int, OptimizerChunk]]:
        self.start()
        while self._reads:
            chunk_id, slot, pending = self._reads.popleft()
            pending.wait()
            self._issue_reads(self._read_ahead)
            yield chunk_id, slot.states(self._tier.capacities[chunk_id])
            self._writes.append((slot, self._tier.write(chunk_id, slot)))
            self._issue_reads(self._read_ahead)
        self.finish()

    def finish(self) -> None:
        """Wait for every write; the files are clean again only when all of them succeeded."""
        while self._reads:  # an abandoned stream (the step failed): its reads must not land later
            _, slot, pending = self._reads.popleft()
            pending.wait()
            self._free.append(slot)
        while self._writes:
            slot, pending = self._writes.popleft()
            pending.wait()
            self._free.append(slot)
        if self._started:
            self._tier.files.set_clean(True)
            self._started = False
