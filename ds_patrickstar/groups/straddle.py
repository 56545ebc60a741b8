"""Joined buffers of the tensors that straddle the chunks of their group.

[Note: straddling tensors]
With data parallelism a chunk group is one flat sequence cut into ``W`` equal members (see
[Note: balanced chunk groups]), so a tensor may have pieces in two or more members of its
group, each owned by another rank. Everything that works on chunk elements (the all-gather,
the gradient slots and the reduce-scatter, the fp32 masters and Adam, the gradient norm,
checkpoints) works on pieces and needs nothing else. Only the module needs the tensor whole
and contiguous: such a trainable parameter is a view of its own *joined* buffer (charged to the device
ledger like a chunk, storage resized to zero while it is not needed). The buffer gets memory when
its group is all-gathered and is filled from the pieces at the tensor's first use after the gather
has completed (:meth:`JoinedBuffers.join`); it is freed with the group, and also when the group is
*kept* between uses (see [Note: kept groups]): the pieces stay gathered, and the next use gets the
buffer back and fills it again from them (a local copy, no communication), so a rank holding
every group gathered does not also hold a second copy of every straddling tensor. Autograd's
saved views of the parameter stay valid across the free (its storage is resized, not replaced). Its
gradient is copied piece by piece into the slots, as any gradient is copied into its slot. At
most ``W - 1`` tensors per group straddle, so the extra memory is a few tensors while gathered;
a gathered group counts its joined buffers, a kept one too (see [Note: chunk group bytes]).

A frozen tensor that straddles (see [Note: frozen chunks]) has no joined buffer: its values never
change and it has no gradient, so once the all-gather into the group's storage has completed (this
rank's landing slot included, see [Note: gathered group storage]) the storage holds it whole and
contiguous, and the parameter is a view of it there, valid while the group is gathered, as the other
ranks' chunks are. It takes nothing beside the gathered group.
"""

from __future__ import annotations

import torch

from ..chunks.chunk import Chunk, TensorInfo
from ..memory.accelerator import Accelerator


def _joined(info: TensorInfo) -> torch.Tensor:
    if info.joined is None:
        raise RuntimeError(f"{info.name} straddles chunks but has no joined buffer")
    return info.joined


def _backed(info: TensorInfo) -> bool:
    return _joined(info).untyped_storage().nbytes() > 0


def _nbytes(info: TensorInfo) -> int:
    return info.numel * _joined(info).element_size()


class JoinedBuffers:
    """Memory and contents of one chunk group's joined buffers; see [Note: straddling tensors]."""

    def __init__(self, straddling: list[TensorInfo], chunks: list[Chunk], accel: Accelerator) -> None:
        self._straddling = straddling  # the group's tensors with pieces in several chunks
        self._chunks = chunks  # every chunk of the map, by id
        self._accel = accel
        self._unjoined: set[TensorInfo] = set()  # backed, not filled since the last gather

    def missing_bytes(self) -> int:
        """Accelerator bytes the joined buffers take when the group is gathered now."""
        return sum(_nbytes(info) for info in self._straddling if not _backed(info))

    def charge_gathered(self) -> None:
        """The group is being all-gathered: its joined buffers get memory now, contents at first use."""
        for info in self._straddling:
            self._accel.materialize(_joined(info), "chunk", f"{info.name} (joined)")
            self._unjoined.add(info)

    def drop(self) -> None:
        """The joined buffers go; their values stay in the pieces."""
        for info in self._straddling:
            if _backed(info):
                self._accel.free(_joined(info), "chunk")
            self._unjoined.discard(info)

    @staticmethod
    def rejoin_bytes(info: TensorInfo) -> int:
        """Bytes :meth:`rejoin` will allocate: a straddling tensor of a kept group whose buffer went."""
        return _nbytes(info) if info.joins and not _backed(info) else 0

    def rejoin(self, info: TensorInfo) -> None:
        """A straddling tensor of a kept group is about to be used: its buffer comes back (filled
        by :meth:`join`)."""
        if self.rejoin_bytes(info):
            self._accel.materialize(_joined(info), "chunk", f"{info.name} (joined)")
            self._unjoined.add(info)

    def join_all(self) -> None:
        """Every joined buffer of the group backed and filled (a persistent group between steps: see [Note:
        persistent chunk groups] in groups/persistent.py)."""
        for info in self._straddling:
            self.rejoin(info)
            self.join(info)

    @torch.no_grad()
    def join(self, info: TensorInfo) -> None:
        """Fill a straddling tensor's buffer from its pieces (once per gather; the pieces' chunks are
        ready)."""
        if info not in self._unjoined:
            return
        self._unjoined.discard(info)
        joined = _joined(info)
        for piece in info.pieces:
            joined[piece.in_param].copy_(self._chunks[piece.chunk_id].ready()[piece.in_chunk])
