"""Flat gradient buffers of chunk groups: the one tensor a reduce-scatter reads.

[Note: flat group buffers]
A collective on a list of tensors is not what the process group runs: NCCL (and gloo) flatten
the list into a temporary of the whole group and copy in and out, memory no budget sees. A
chunk group's gradients are therefore reduce-scattered from one flat buffer of ``W`` chunks that
we allocate, charged to the device ledger (kind ``grad_buffer``, room made by placement first),
with ``reduce_scatter_single`` in place: the owner's piece of the buffer is the output. Before the
boundary of gradient accumulation the micro-step's gradients are written into it directly (see
[Note: gradient accumulation]). On the boundary (and with GA = 1) they are in the slots, where
they replace the parameters; the slots are copied into the buffer (divided by ``W`` on the
way), the other ranks' chunks released at once, and the owner's piece copied into its slot
when the reduce-scatter completes: the group's memory while it is reduced is the buffer and the
owned chunk (``W + 1`` chunks), against the gathered group plus the process group's hidden
temporary (``2 W``) that a list would take, and the whole of it is counted. The copies are the
ones the process group made on a list. What is left: the all-gather still receives into a list
of the members' own payloads (each its own storage, released and moved one by one, see
[Note: chunk locations]), which NCCL flattens the same way; receiving in place needs a group's
chunks laid out as views of one flat buffer, with the owned chunk moving into it while its
group is gathered.
"""

from __future__ import annotations

import torch

from ..chunks.chunk import Chunk
from ..memory.store import ChunkStore
from ..placement.runtime import PlacementRuntime

KIND = "grad_buffer"


class FlatBuffers:
    """Allocates and frees the flat gradient buffers of chunk groups; see [Note: flat group buffers]."""

    def __init__(self, store: ChunkStore, placement: PlacementRuntime | None) -> None:
        self._store, self._placement = store, placement

    def zeros(self, members: list[Chunk], keep: set[int], group: int) -> torch.Tensor:
        """A zeroed buffer of ``members``' size (room made for it first with placement)."""
        buf = self.empty(members, keep, group)
        buf.zero_()
        return buf

    def empty(self, members: list[Chunk], keep: set[int], group: int) -> torch.Tensor:
        numel = sum(c.capacity for c in members)
        dtype = members[0].dtype
        if self._placement is not None:
            self._placement.make_room(numel * dtype.itemsize, keep)
        return self._store.accel.empty(numel, dtype, KIND, f"the gradient buffer of chunk group {group}")

    def free(self, buf: torch.Tensor) -> None:
        self._store.accel.free(buf, KIND)
