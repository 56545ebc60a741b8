"""The disk tier of the optimizer states: spilled chunks' fp32 master/momentum/variance on disk.

[Note: disk tier]
With ``offload_optimizer: {"device": "nvme"}`` the host-Adam chunks whose states do not fit
``host_budget`` are *spilled*: their states live in one swap file per chunk, in pieces of a
bounded number of elements (see [Note: swap files] and [Note: swap pieces]), and pass through a
few aligned host buffers of one piece each. During the step (:class:`DiskStream`) the spilled
chunks' pieces stream in chunk order: for piece ``i``, the reads of the next pieces and the write
of piece ``i-1`` run on the I/O threads while the CPU Adam updates piece ``i`` (Adam is
elementwise: a piece is updated as the whole chunk would be); ``buffer_count`` buffers are
``buffer_count - 2`` read-aheads, one being computed, one written behind. The first reads start
while backward still runs: the spilled chunks are the last in chunk order and states do not
depend on gradients, so at the first backward moment of the boundary micro-step
(:meth:`DiskStates.read_ahead`) the step's stream issues its first ``buffer_count - 1`` reads;
the step takes that stream over, and anything else that reaches the states first (an fp16
overflow's restore, a checkpoint) waits for those reads and drops them. The manifest's ``clean``
flag is false from the first write of a step until its last write completed; a failed read or
write fails the step with its error, naming the swap file and the error number (see [Note: disk I/O]).

Outside the step (checkpoints, ``state_dict``, an overflow's restore) a spilled chunk is reached
piece by piece through a one-piece cache (:meth:`DiskStates.slices`): read on first use, written
back when another piece is needed or on :meth:`DiskStates.flush`, so nothing outside the step
holds more than one piece of a spilled chunk beside the buffers; the first states are written
through the step buffers (:meth:`DiskStates.initialize`). Chunks whose
Adam runs on the accelerator never touch the disk: the spilled chunks are the last ones in chunk
order, and the accelerator takes optimizer states from the first ones (see
[Note: optimizer-state placement]).
"""

from __future__ import annotations

import logging
import weakref
from collections import deque
from collections.abc import Iterator
from typing import NamedTuple

import torch

from ..memory.optimizer_chunk import OptimizerChunk
from .budget import MIN_DISK_BUFFERS as MIN_BUFFERS
from .io import DiskIO, DiskPending
from .swap_files import SwapFiles
from .swap_layout import PIECE_ELEMENTS, SwapPiece, piece_buffer_bytes, piece_elements, swap_pieces

logger = logging.getLogger(__name__)

Unit = tuple[int, int]  # (chunk id, piece index)


class DiskCounts(NamedTuple):
    """What the tier did since the last :meth:`DiskStates.take_counts`."""

    bytes_read: int
    bytes_written: int
    io_seconds: float
    wait_seconds: float
    bytes_read_ahead: int  # of the reads, those issued before the step began (in backward)


class _Slot:
    """One aligned host buffer and the piece it holds."""

    def __init__(self, raw: torch.Tensor) -> None:
        self.raw = raw
        self.unit: Unit | None = None

    def states(self, piece: SwapPiece) -> OptimizerChunk:
        stride, length = piece.stride, piece.numel * 4
        views = [self.raw[k * stride : k * stride + length].view(torch.float32) for k in range(3)]
        return OptimizerChunk(*views)

    def record(self, piece: SwapPiece) -> torch.Tensor:
        return self.raw[: piece.nbytes]


class DiskStates:
    """States of the spilled chunks, in their swap files; see [Note: disk tier]."""

    def __init__(
        self,
        files: SwapFiles,
        io: DiskIO,
        capacities: dict[int, int],
        buffer_count: int,
        piece: int = PIECE_ELEMENTS,
    ) -> None:
        self._handles = _Handles(io, files)
        self.files = files
        self.capacities = dict(capacities)
        self.piece = piece_elements(piece)
        self.layouts = {cid: swap_pieces(c, self.piece) for cid, c in capacities.items()}
        nbytes = piece_buffer_bytes(list(capacities.values()), self.piece)
        self._slots = [_Slot(io.empty(nbytes)) for _ in range(max(buffer_count, MIN_BUFFERS))]
        self._cache = _Slot(io.empty(nbytes))
        self._dirty = False
        self._ahead: DiskStream | None = None
        self._read_ahead_bytes = 0
        self._counted = DiskCounts(0, 0, 0.0, 0.0, 0)
        weakref.finalize(self, self._handles.close)

    @property
    def buffer_bytes(self) -> int:
        return sum(s.raw.numel() for s in (*self._slots, self._cache))

    @property
    def bytes_on_disk(self) -> int:
        return sum(p.nbytes for pieces in self.layouts.values() for p in pieces)

    @property
    def io(self) -> DiskIO:
        return self._handles.io

    def replace_io(self, io: DiskIO) -> None:
        """Use another implementation of the interface (the old one is closed)."""
        self.cancel_read_ahead()
        self._handles.io.close()
        self._handles.io = io

    # ---- one piece at a time -----------------------------------------------------------
    def read(self, unit: Unit, slot: _Slot) -> DiskPending:
        chunk_id, index = unit
        piece = self.layouts[chunk_id][index]
        pending = self.io.read(self.files.fds[chunk_id], piece.offset, slot.record(piece))
        return pending.of_file(self.files.path(chunk_id))

    def write(self, unit: Unit, slot: _Slot) -> DiskPending:
        chunk_id, index = unit
        piece = self.layouts[chunk_id][index]
        pending = self.io.write(self.files.fds[chunk_id], piece.offset, slot.record(piece))
        return pending.of_file(self.files.path(chunk_id))

    @torch.no_grad()
    def initialize(self, chunk_id: int, values: torch.Tensor) -> None:
        """The chunk's first states: master from ``values``, zero moments (nothing is read); a piece
        is filled in one step buffer while the ones before it are written."""
        self.cancel_read_ahead()
        self.flush()
        self.files.set_clean(False)
        writes: deque[DiskPending] = deque()
        for index, piece in enumerate(self.layouts[chunk_id]):
            if len(writes) == len(self._slots):
                writes.popleft().wait()  # the write of the slot used ``len(slots)`` pieces ago
            slot = self._slots[index % len(self._slots)]
            slot.record(piece).zero_()
            slot.states(piece).master.copy_(values[piece.start : piece.stop])
            writes.append(self.write((chunk_id, index), slot))
        for pending in writes:
            pending.wait()
        self.files.set_clean(True)

    def slices(
        self, chunk_id: int, start: int = 0, stop: int | None = None, write: bool = False
    ) -> Iterator[tuple[int, OptimizerChunk]]:
        """``(element, states of elements element ..)`` for each piece of the chunk that elements
        ``start .. stop`` overlap, through the one-piece cache (``write``: changes are written back
        by :meth:`flush`); each is valid until the next is asked for."""
        self.cancel_read_ahead()
        stop = self.capacities[chunk_id] if stop is None else stop
        for index in range(start // self.piece, -(-stop // self.piece)):
            piece = self.layouts[chunk_id][index]
            lo, hi = max(start, piece.start), min(stop, piece.stop)
            yield lo, self._load((chunk_id, index), write).sliced(lo - piece.start, hi - piece.start)

    def _load(self, unit: Unit, write: bool) -> OptimizerChunk:
        if self._cache.unit != unit:
            self._evict()
            self.read(unit, self._cache).wait()
            self._cache.unit = unit
        self._dirty = self._dirty or write
        return self._cache.states(self.layouts[unit[0]][unit[1]])

    def _evict(self) -> None:
        """Write the cached piece back if it was changed (the files are not clean until :meth:`flush`)."""
        if self._dirty and self._cache.unit is not None:
            self.files.set_clean(False)
            self.write(self._cache.unit, self._cache).wait()
        self._dirty = False
        self._cache.unit = None

    def flush(self) -> None:
        """Write the cached piece back if it was changed, and forget it: the files are clean."""
        self._evict()
        self.files.set_clean(True)

    # ---- the step -----------------------------------------------------------------------
    def read_ahead(self, extents: dict[int, int]) -> None:
        """Start the next step's reads now (``extents``: chunk id -> elements used); see [Note: disk tier]."""
        if self._ahead is not None:
            return
        self.flush()
        self._ahead = DiskStream(self, extents, self._slots)
        before = self.io.bytes_read
        self._ahead.start()
        self._read_ahead_bytes += self.io.bytes_read - before

    @property
    def reading_ahead(self) -> bool:
        return self._ahead is not None

    def cancel_read_ahead(self) -> None:
        """Wait for the reads :meth:`read_ahead` issued and drop them (nothing was written)."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            ahead.finish()

    def stream(self, extents: dict[int, int]) -> DiskStream:
        """The step's pass over the first ``extents[c]`` elements of each spilled chunk ``c``: the
        one :meth:`read_ahead` started, if any."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead.extents == extents:
            return ahead
        if ahead is not None:
            ahead.finish()
        self.flush()
        return DiskStream(self, extents, self._slots)

    def take_counts(self) -> DiskCounts:
        """What the tier did since the last call."""
        io = self.io
        now = DiskCounts(io.bytes_read, io.bytes_written, io.io_seconds, io.wait_seconds, self._read_ahead_bytes)
        before, self._counted = self._counted, now
        return DiskCounts(
            now.bytes_read - before.bytes_read,
            now.bytes_written - before.bytes_written,
            now.io_seconds - before.io_seconds,
            now.wait_seconds - before.wait_seconds,
            now.bytes_read_ahead - before.bytes_read_ahead,
        )

    def close(self) -> None:
        """The I/O stops, the files go, and so do the buffers (freed once nothing else views them)."""
        self.cancel_read_ahead()
        self._handles.close()
        self._slots, self._cache = [], _Slot(torch.empty(0, dtype=torch.uint8))


class _Handles:
    """The I/O and the files, closed (the files removed: they are scratch) when the states go away."""

    def __init__(self, io: DiskIO, files: SwapFiles) -> None:
        self.io, self.files = io, files

    def close(self) -> None:
        self.io.close()
        self.files.close(remove=True)


class DiskStream:
    """One step's pass over the spilled chunks' pieces: reads ahead, writes behind; see [Note: disk tier]."""

    def __init__(self, tier: DiskStates, extents: dict[int, int], slots: list[_Slot]) -> None:
        self._tier = tier
        self.extents = dict(extents)
        self._units = deque(
            (cid, i) for cid, used in sorted(extents.items()) for i, p in enumerate(tier.layouts[cid]) if p.start < used
        )
        self._free = deque(slots)
        self._reads: deque[tuple[Unit, _Slot, DiskPending]] = deque()
        self._writes: deque[tuple[_Slot, DiskPending]] = deque()
        self._read_ahead = len(slots) - 2
        self._wrote = False

    def start(self) -> None:
        """Issue the first reads (before the in-memory chunks are updated, or in backward)."""
        self._issue_reads(self._read_ahead + 1)

    def _issue_reads(self, depth: int) -> None:
        while self._units and len(self._reads) < depth:
            if not self._free:
                if not self._writes:
                    return
                slot, pending = self._writes.popleft()
                pending.wait()
                self._free.append(slot)
            unit = self._units.popleft()
            slot = self._free.popleft()
            self._reads.append((unit, slot, self._tier.read(unit, slot)))

    def __iter__(self) -> Iterator[tuple[int, int, OptimizerChunk]]:
        """``(chunk id, first element, states)`` of each piece in turn, updated in place by the caller."""
        self.start()
        while self._reads:
            unit, slot, pending = self._reads.popleft()
            pending.wait()
            self._issue_reads(self._read_ahead)
            piece = self._tier.layouts[unit[0]][unit[1]]
            yield unit[0], piece.start, slot.states(piece)
            if not self._wrote:
                self._wrote = True
                self._tier.files.set_clean(False)
            self._writes.append((slot, self._tier.write(unit, slot)))
            self._issue_reads(self._read_ahead)
        self.finish()

    def abandon(self) -> None:
        """After a failed step: wait for every request (their errors are the step's error, raised
        already), so that none lands in a buffer later; the files stay marked not clean."""
        while self._reads:
            _, slot, pending = self._reads.popleft()
            _wait_quietly(pending)
            self._free.append(slot)
        while self._writes:
            slot, pending = self._writes.popleft()
            _wait_quietly(pending)
            self._free.append(slot)
        self._units.clear()

    def finish(self) -> None:
        """Wait for every read and write; the files are clean again only when all writes succeeded."""
        while self._reads:  # a stream dropped before its step (an overflow): its reads must not land later
            _, slot, pending = self._reads.popleft()
            pending.wait()
            self._free.append(slot)
        while self._writes:
            slot, pending = self._writes.popleft()
            pending.wait()
            self._free.append(slot)
        if self._wrote:
            self._tier.files.set_clean(True)
            self._wrote = False


def _wait_quietly(pending: DiskPending) -> None:
    try:
        pending.wait()
    except OSError:
        pass
