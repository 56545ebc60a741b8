"""The chunk map: every chunk of one model and every chunk parameter's :class:`TensorInfo`, trainable
or frozen (see [Note: frozen chunks] in chunks/kind.py).

Chunks come in groups of ``W`` (the data-parallel world size); chunk ``g*W + r`` of group ``g``
is owned by rank ``r`` (see [Note: chunk groups] in ``groups/comm.py``). The map is built from the
layout (:func:`~ds_patrickstar.chunks.layout.plan_chunks`) one group at a time and answers
lookups; nothing here allocates or moves memory (``store/binding.py`` gives the chunks their
buffers and makes the parameters views of them).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .chunk import Chunk, Piece, TensorInfo
from .group_bytes import GroupBytes, group_bytes
from .layout import ChunkSpec


def owner_of(chunk_id: int, world_size: int) -> int:
    """The rank that owns chunk ``chunk_id``."""
    return chunk_id % world_size


class ChunkMap:
    """Chunks, tensor metadata and their relations; see the module docstring."""

    def __init__(self, world_size: int, rank: int) -> None:
        self.world_size = world_size
        self.rank = rank
        self.chunks: list[Chunk] = []
        self._infos: dict[torch.nn.Parameter, TensorInfo] = {}

    def add_group(self, specs: list[ChunkSpec]) -> tuple[list[Chunk], list[TensorInfo]]:
        """Append one chunk group (``W`` specs); returns its chunks and its tensors' new metadata."""
        members = []
        for spec in specs:
            chunk = Chunk(len(self.chunks), spec.capacity, spec.dtype, spec.group_index, kind=spec.kind)
            self.chunks.append(chunk)
            members.append(chunk)
        infos: dict[torch.nn.Parameter, TensorInfo] = {}
        for chunk, spec in zip(members, specs):
            for name, param, offset, start, numel in spec.members:
                info = infos.get(param)
                if info is None:
                    info = infos[param] = TensorInfo(
                        name, param, [], param.numel(), param.shape, spec.group_index, kind=spec.kind
                    )
                piece = Piece(chunk.chunk_id, offset, start, numel)
                info.pieces.append(piece)
                chunk.append(info, piece)
        self._infos.update(infos)
        return members, list(infos.values())

    # ---- ownership ------------------------------------------------------------------
    def is_owned(self, chunk: Chunk) -> bool:
        return owner_of(chunk.chunk_id, self.world_size) == self.rank

    def owned_chunks(self) -> list[Chunk]:
        return [c for c in self.chunks if self.is_owned(c)]

    def trainable_owned(self) -> list[Chunk]:
        """The owned chunks of trainable parameters: those with optimizer states."""
        return [c for c in self.chunks if c.trainable and self.is_owned(c)]

    def owns_any(self, info: TensorInfo) -> bool:
        return any(self.is_owned(self.chunks[cid]) for cid in info.chunk_ids)

    # ---- tensors ----------------------------------------------------------------------
    def info(self, param: torch.Tensor) -> TensorInfo | None:
        return self._infos.get(param)  # type: ignore[call-overload]

    def infos(self) -> list[TensorInfo]:
        return list(self._infos.values())

    def trainable_infos(self) -> list[TensorInfo]:
        return [info for info in self._infos.values() if info.trainable]

    def chunk_of(self, info: TensorInfo) -> Chunk:
        """The chunk of a tensor's first piece (all its pieces are in that chunk's group)."""
        return self.chunks[info.pieces[0].chunk_id]

    def write_pieces(self, info: TensorInfo, flat: torch.Tensor, target: Callable[[Chunk], torch.Tensor]) -> None:
        """``flat`` (the whole flattened parameter) into ``target(chunk)`` of every owned chunk
        holding a piece of ``info``."""
        for piece in info.pieces:
            chunk = self.chunks[piece.chunk_id]
            if self.is_owned(chunk):
                target(chunk)[piece.in_chunk].copy_(flat[piece.in_param])

    # ---- groups -----------------------------------------------------------------------
    @property
    def num_groups(self) -> int:
        return len(self.chunks) // self.world_size

    def is_trainable_group(self, group: int) -> bool:
        return self.chunks[group * self.world_size].trainable

    def group_members(self, group: int) -> list[Chunk]:
        return self.chunks[group * self.world_size : (group + 1) * self.world_size]

    def group_of(self, chunk: Chunk) -> int:
        return chunk.chunk_id // self.world_size

    def group_of_info(self, info: TensorInfo) -> int:
        return self.group_of(self.chunk_of(info))

    def group_tensors(self, group: int) -> list[TensorInfo]:
        """Every tensor with a piece in ``group``, once, in layout order."""
        return list(dict.fromkeys(info for chunk in self.group_members(group) for info in chunk.tensors))

    def straddling(self, group: int) -> list[TensorInfo]:
        """The tensors of ``group`` with pieces in several chunks (see [Note: straddling tensors])."""
        return [info for info in self.group_tensors(group) if info.straddles]

    def joined_tensors(self, group: int) -> list[TensorInfo]:
        """The tensors of ``group`` with joined buffers (see [Note: straddling tensors])."""
        return [info for info in self.group_tensors(group) if info.joins]

    def group_bytes(self, group: int, accumulate: bool) -> GroupBytes:
        """What ``group`` takes on this rank's accelerator, part by part (see [Note: chunk group bytes]
        in chunks/group_bytes.py)."""
        members = self.group_members(group)
        joined = sum(info.numel for info in self.joined_tensors(group))
        grads = accumulate and members[0].trainable  # see [Note: frozen chunks]
        return group_bytes(members[0].capacity, members[0].dtype.itemsize, self.world_size, grads, joined)

    def model_storages(self) -> set[int]:
        """The storages model data lives in on the accelerator (payloads and joined buffers)."""
        tensors = [c.payload for c in self.chunks] + [i.joined for i in self._infos.values()]
        return {t.untyped_storage()._cdata for t in tensors if t is not None}
