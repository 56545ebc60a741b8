"""Flat gradient buffers of chunk groups: the one tensor a micro-step's reduce-scatter reads.

[Note: flat group buffers]
A collective on a list of tensors is not what the process group runs: NCCL (and gloo) flatten
the list into a temporary of the whole group and copy in and out, memory no budget sees. Every
collective on a chunk group therefore runs on one flat tensor with ``all_gather_single`` /
``reduce_scatter_single`` (in place on gloo too, see [Note: in-place collectives on gloo] in
groups/comm.py). The all-gather and the boundary's reduce-scatter run in place in the
group's own storage (see [Note: gathered group storage] in store/chunk_store.py). Before the boundary
of gradient accumulation the slots keep the parameters, so a micro-step's gradients are written
into a flat buffer of ``W`` chunks allocated here, charged to the device ledger (kind
``grad_buffer``, room made by placement first), and reduce-scattered in place: the owner's piece
of the buffer is the output (see [Note: gradient accumulation]).
"""

from __future__ import annotations

import torch

from ..chunks.chunk import Chunk
from ..placement.interface import Placement
from ..store.chunk_store import ChunkStore

KIND = "grad_buffer"


class FlatBuffers:
    """Allocates and frees the flat gradient buffers of chunk groups; see [Note: flat group buffers]."""

    def __init__(self, store: ChunkStore, placement: Placement) -> None:
        self._store, self._placement = store, placement

    def zeros(self, members: list[Chunk], keep: set[int], group: int) -> torch.Tensor:
        """A zeroed buffer of ``members``' size (room made for it first with placement)."""
        buf = self.empty(members, keep, group)
        buf.zero_()
        return buf

    def empty(self, members: list[Chunk], keep: set[int], group: int) -> torch.Tensor:
        numel = sum(c.capacity for c in members)
        dtype = members[0].dtype
        self._placement.make_room(numel * dtype.itemsize, keep)
        return self._store.accel.empty(numel, dtype, KIND, f"the gradient buffer of chunk group {group}")

    def free(self, buf: torch.Tensor) -> None:
        self._store.accel.free(buf, KIND)
