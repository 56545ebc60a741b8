"""Gradient accumulation with data parallelism: each micro-step's gradients reduce-scattered into
the owner's fp32 accumulator (see [Note: gradient accumulation])."""

from __future__ import annotations

import torch

from ..chunks.chunk import Chunk, TensorInfo
from ..chunks.chunk_map import ChunkMap
from ..memory.host_heap import release_free_pages
from ..memory.reductions import InFlightReductions
from .comm import ChunkComm
from .group import ChunkGroup


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
        groups: list[ChunkGroup],
        comm: ChunkComm,
        reductions: InFlightReductions,
    ) -> None:
        self._map, self._groups, self._comm, self._reductions = chunk_map, groups, comm, reductions
        self._on_host = False  # a buffer of this micro-step was host memory (the C heap's)

    def _member_index(self, chunk: Chunk) -> int:
        return chunk.chunk_id - self._map.group_of(chunk) * self._comm.world_size

    def _buffer(self, group: ChunkGroup, keep: set[int]) -> torch.Tensor:
        if group.grad_buffer is None:
            group.grad_buffer = group.flat_buffer(keep)
            self._on_host = self._on_host or group.grad_buffer.device.type == "cpu"
        return group.grad_buffer

    @torch.no_grad()
    def add(self, info: TensorInfo, flat: torch.Tensor) -> None:
        """A micro-step's gradient of ``info`` (flattened) into its group's buffer."""
        buf = self._buffer(self._groups[self._map.group_of_info(info)], set(info.chunk_ids))
        for piece in info.pieces:
            chunk = self._map.chunks[piece.chunk_id]
            start = self._member_index(chunk) * chunk.capacity + piece.offset
            buf[start : start + piece.numel].add_(flat[piece.in_param])

    def reduce(self, index: int) -> None:
        """Issue the reduce-scatter of group ``index``'s buffer (zeros if no gradient of the group came
        this micro-step: every rank reduces every group once per micro-step); when it completes the
        owner's piece goes into the owned accumulator and the buffer is freed."""
        group = self._groups[index]
        owned = group.owned
        keep = group.chunk_ids
        buf = self._buffer(group, keep)
        group.grad_buffer = None
        group.bring(owned, keep)  # the owned chunk, then room for its new accumulator beside it
        if owned.acc is None and owned.acc_host is None:
            group.make_room(group.nbytes.accumulator, keep)
        group.accumulator(owned)
        pending = self._comm.reduce_scatter_mean_single_async(
            buf, f"micro-step reduce-scatter of chunk group {index}", after=lambda: self._add_owned(group, buf)
        )
        owned.pending.append(pending)  # the owned chunk (and its accumulator) stays until it completes
        self._reductions.add(pending)

    @torch.no_grad()
    def _add_owned(self, group: ChunkGroup, buf: torch.Tensor) -> None:
        owned = group.owned
        acc = owned.ready_acc()
        if acc is None:
            raise RuntimeError(f"chunk {owned.chunk_id}: its gradient accumulator went before its reduce-scatter")
        rank = self._comm.rank
        acc.add_(buf[rank * owned.capacity : (rank + 1) * owned.capacity])
        group.free_flat_buffer(buf)

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

    def micro_step_over(self) -> None:
        """Every buffer of the micro-step is freed: the pages the C heap keeps free go back to the system
        (host buffers only; see [Note: gradient accumulation])."""
        if self._on_host:
            release_free_pages()
        self._on_host = False

    def discard(self) -> None:
        """Buffers of a micro-step that did not finish (none after a complete backward) go."""
        for group in self._groups:
            if group.grad_buffer is not None:
                group.free_flat_buffer(group.grad_buffer)
                group.grad_buffer = None
