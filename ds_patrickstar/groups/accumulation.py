"""Gradient accumulation with data parallelism: each micro-step's gradients reduce-scattered into
the owner's fp32 accumulator (see [Note: gradient accumulation])."""

from __future__ import annotations

import torch

from ..chunks.chunk import Chunk, TensorInfo
from ..chunks.chunk_map import ChunkMap
from ..memory.store import ChunkStore
from ..placement.interface import Placement
from .comm import ChunkComm
from .flat import FlatBuffers
from .reductions import InFlightReductions


class ScatteredAccumulation:
    """Before the boundary micro-step (``W > 1``): a chunk group's gradients go into one flat
    buffer of the group (``W`` chunks, param dtype, zeroed, in the ledger, see [Note: flat group
    buffers]), which is reduce-scattered in place once the group's last gradient of the
    micro-step is in; the owner adds its piece into its chunk's fp32 accumulator and the buffer
    is freed. At the boundary the gradients go into the slots as with GA = 1 and :meth:`fold`
    adds the accumulator after their reduce-scatter."""

    def __init__(
        self,
        chunk_map: ChunkMap,
        comm: ChunkComm,
        store: ChunkStore,
        placement: Placement,
        reductions: InFlightReductions,
        flat: FlatBuffers,
    ) -> None:
        self._map, self._comm, self._store = chunk_map, comm, store
        self._placement, self._reductions, self._flat = placement, reductions, flat
        self._buffers: dict[int, torch.Tensor] = {}  # group -> its gradient buffer this micro-step

    def _member_index(self, chunk: Chunk) -> int:
        return chunk.chunk_id - self._map.group_of(chunk) * self._comm.world_size

    def _owned(self, group: int) -> Chunk:
        return self._map.group_members(group)[self._comm.rank]

    def _buffer(self, group: int, keep: set[int]) -> torch.Tensor:
        buf = self._buffers.get(group)
        if buf is None:
            buf = self._buffers[group] = self._flat.zeros(self._map.group_members(group), keep, group)
        return buf

    @torch.no_grad()
    def add(self, info: TensorInfo, flat: torch.Tensor) -> None:
        """A micro-step's gradient of ``info`` (flattened) into its group's buffer."""
        group = self._map.group_of_info(info)
        buf = self._buffer(group, set(info.chunk_ids))
        for piece in info.pieces:
            chunk = self._map.chunks[piece.chunk_id]
            start = self._member_index(chunk) * chunk.capacity + piece.offset
            buf[start : start + piece.numel].add_(flat[piece.in_param])

    def reduce(self, group: int) -> None:
        """Issue the reduce-scatter of ``group``'s buffer (zeros if no gradient of the group came this
        micro-step: every rank reduces every group once per micro-step); when it completes the
        owner's piece goes into the owned accumulator and the buffer is freed."""
        owned = self._owned(group)
        keep = {c.chunk_id for c in self._map.group_members(group)}
        buf = self._buffer(group, keep)
        del self._buffers[group]
        self._placement.bring(owned, keep)  # the owned chunk, then room for its new accumulator beside it
        if owned.acc is None and owned.acc_host is None:
            self._placement.make_room(4 * owned.capacity, keep)
        self._store.accumulator(owned)
        pending = self._comm.reduce_scatter_mean_single_async(buf, after=lambda: self._add_owned(owned, buf))
        owned.pending.append(pending)  # the owned chunk (and its accumulator) stays until it completes
        self._reductions.add(pending)

    @torch.no_grad()
    def _add_owned(self, owned: Chunk, buf: torch.Tensor) -> None:
        acc = owned.ready_acc()
        if acc is None:
            raise RuntimeError(f"chunk {owned.chunk_id}: its gradient accumulator went before its reduce-scatter")
        rank = self._comm.rank
        acc.add_(buf[rank * owned.capacity : (rank + 1) * owned.capacity])
        self._flat.free(buf)

    @torch.no_grad()
    def fold(self, owned: Chunk) -> None:
        """Boundary: the owned slot holds the last micro-step's reduced gradient; it becomes the
        accumulated sum, rounded to the param dtype once."""
        acc = owned.ready_acc()
        if acc is None:
            return
        slot = owned.ready()
        acc.add_(slot)
        slot.copy_(acc)

    def discard(self) -> None:
        """Buffers of a micro-step that did not finish (none after a complete backward) go."""
        for buf in self._buffers.values():
            self._flat.free(buf)
        self._buffers.clear()
