"""Building the chunk map with memory: chunk buffers created, parameters made views of them.

One chunk group at a time: its chunks get their buffers from the :class:`ChunkStore`, its
parameters become views of their chunk's payload (of their joined buffer when they straddle
chunks, see [Note: straddling tensors]) after their values are copied into the owned pieces,
and what this rank does not keep is let go before the next group. So binding holds this rank's
chunks and one gathered group beside the parameters' own tensors, which are freed once nothing
else holds them (``deepspeed.initialize`` holds them until it returns, to give them back if it
fails: see [Note: initialize as a transaction]); the views stay valid as chunks move (see
[Note: storage resize]).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from ..chunks.chunk import TensorInfo
from ..chunks.chunk_map import ChunkMap
from ..chunks.layout import ChunkSpec
from .store import ChunkStore

logger = logging.getLogger(__name__)


def build_chunk_map(
    specs: list[ChunkSpec],
    world_size: int,
    rank: int,
    store: ChunkStore,
    has_values: Callable[[torch.nn.Parameter], bool],
) -> ChunkMap:
    """The chunk map of ``specs`` with every parameter bound to it. ``has_values(param)`` is False
    for a parameter built without values (``ds_patrickstar.Init``, see [Note: deferred init])."""
    chunk_map = ChunkMap(world_size, rank)
    for first in range(0, len(specs), world_size):
        members, infos = chunk_map.add_group(specs[first : first + world_size])
        owned = members[rank]
        if world_size > 1:  # see [Note: gathered group storage]
            store.create_group(members, owned)
        else:
            store.create(owned, True)
        for info in infos:
            _bind(chunk_map, store, info, has_values(info.param))
        store.settle(owned)
        if world_size > 1:
            store.release_group(members, owned)
    logger.info(
        "ds_patrickstar: %d params in %d chunks (%d rank(s))", len(chunk_map.infos()), len(chunk_map.chunks), world_size
    )
    return chunk_map


@torch.no_grad()
def _bind(chunk_map: ChunkMap, store: ChunkStore, info: TensorInfo, has_values: bool) -> None:
    """The parameter becomes a view of its chunk payload (of its joined buffer when it straddles
    chunks); its values go into the owned pieces (on the host with placement) when it
    ``has_values``, and it lets go of its own storage."""
    chunk = chunk_map.chunk_of(info)
    if info.param.dtype != chunk.dtype:
        raise ValueError(
            f"parameter {info.name} has dtype {info.param.dtype} but its param group's chunks "
            f"hold {chunk.dtype}; put parameters of different dtypes in different param groups"
        )
    if has_values:
        _check_backed(info)
        chunk_map.write_pieces(info, info.param.data.reshape(-1), lambda c: c.ready())
    if info.straddles:
        joined = store.accel.empty(info.numel, chunk.dtype, "chunk", f"{info.name} (joined)")
        info.joined = joined
        info.param.data = joined.view(info.shape)
        store.accel.free(joined, "chunk")
    else:
        info.param.data = chunk.view_of(info)


def _check_backed(info: TensorInfo) -> None:
    """A parameter whose storage does not hold its values (resized away by something else): a clear
    error instead of torch's "setStorage ... out of bounds"."""
    param = info.param
    needed = (param.storage_offset() + param.numel()) * param.element_size()
    held = param.untyped_storage().nbytes()
    if held < needed:
        raise ValueError(
            f"parameter {info.name} holds no values ({held} of {needed} bytes): its storage was resized or "
            f"freed; build the model again for a new engine."
        )
