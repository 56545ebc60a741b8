"""Building the chunk map with memory: chunk buffers created, parameters made views of them.

One chunk group at a time: its chunks get their buffers from the :class:`ChunkStore`, its
parameters become views of their chunk's payload (when they straddle chunks, of their joined
buffer or their group's storage, see [Note: straddling tensors]) after their values are copied into the owned pieces,
and what this rank does not keep is let go before the next group. So initialize holds one
group's payloads beside the model at most and never doubles model memory (see [Note: storage resize]).
Only this rank's own chunks receive values here; a parameter once a view is marked ``bound``, so
that a failed initialize gives back the values of exactly those (see
[Note: initialize as a transaction]). What can refuse a parameter (:func:`check_bindable`) runs
before the first one is bound.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from ..chunks.chunk import TensorInfo
from ..chunks.chunk_map import ChunkMap
from ..chunks.layout import ChunkSpec
from .chunk_store import ChunkStore

logger = logging.getLogger(__name__)


def build_chunk_map(
    chunk_map: ChunkMap,
    specs: list[ChunkSpec],
    store: ChunkStore,
    has_values: Callable[[torch.nn.Parameter], bool],
) -> ChunkMap:
    """``chunk_map`` (empty) with the chunks of ``specs`` and every parameter bound to them; a failure part
    way leaves the groups before it bound in ``chunk_map``. ``has_values(param)`` is False for a parameter
    built without values (``ds_patrickstar.Init``, see [Note: deferred init])."""
    world_size, rank = chunk_map.world_size, chunk_map.rank
    for first in range(0, len(specs), world_size):
        members, infos = chunk_map.add_group(specs[first : first + world_size])
        owned = members[rank]
        if world_size > 1:  # see [Note: gathered group storage]
            store.create_group(members, owned)
        else:
            store.create(owned, True)
        for info in infos:
            _bind(chunk_map, store, info, has_values(info.param))
        store.settle(owned, any(has_values(info.param) for info in owned.tensors))
        if world_size > 1:
            store.release_group(members, owned)
    logger.info(
        "ds_patrickstar: %d params in %d chunks (%d rank(s))", len(chunk_map.infos()), len(chunk_map.chunks), world_size
    )
    return chunk_map


def check_bindable(specs: list[ChunkSpec], has_values: Callable[[torch.nn.Parameter], bool]) -> None:
    """Raise ``ValueError`` for a parameter that cannot be bound: its dtype is not its chunks' (a frozen
    one is cast to them, see [Note: frozen chunks]), or its storage does not hold the values it should have."""
    for spec in specs:
        for name, param, *_ in spec.members:
            if param.dtype != spec.dtype and spec.kind.trainable:
                raise ValueError(
                    f"parameter {name} has dtype {param.dtype} but its param group's chunks "
                    f"hold {spec.dtype}; put parameters of different dtypes in different param groups"
                )
            if has_values(param):
                _check_backed(name, param)


@torch.no_grad()
def _bind(chunk_map: ChunkMap, store: ChunkStore, info: TensorInfo, has_values: bool) -> None:
    """The parameter becomes a view of its chunk payload (when it straddles chunks: of its joined
    buffer, or, frozen, of its group's storage); its values go into the owned pieces (on the host
    with placement, cast to the chunk's dtype) when it ``has_values``, and its own storage is dropped."""
    chunk = chunk_map.chunk_of(info)
    if has_values:
        chunk_map.write_pieces(info, info.param.data.reshape(-1), lambda c: c.ready())
    if info.joins:
        joined = store.accel.empty(info.numel, chunk.dtype, "chunk", f"{info.name} (joined)")
        info.joined = joined
        info.param.data = joined.view(info.shape)
        store.accel.released_views.bind(info.param)
        store.accel.free(joined, "chunk")
    elif info.straddles:  # frozen: a view of its group's storage, landing slot included
        members = chunk_map.group_members(chunk_map.group_of(chunk))
        first = info.pieces[0]
        start = (first.chunk_id - members[0].chunk_id) * chunk.capacity + first.offset
        info.param.data = store.group_storage(members)[start : start + info.numel].view(info.shape)
    else:
        info.param.data = chunk.view_of(info)
    if not info.joins:
        store.accel.released_views.bind(info.param)  # see [Note: released parameters read as empty]
    info.bound = True


def _check_backed(name: str, param: torch.nn.Parameter) -> None:
    """A parameter whose storage does not hold its values (resized away by something else): a clear
    error instead of torch's "setStorage ... out of bounds"."""
    needed = (param.storage_offset() + param.numel()) * param.element_size()
    held = param.untyped_storage().nbytes()
    if held < needed:
        raise ValueError(
            f"parameter {name} holds no values ({held} of {needed} bytes): its storage was resized or "
            f"freed; build the model again for a new engine."
        )
