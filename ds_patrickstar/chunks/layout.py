"""The chunk layout: which parameter goes into which chunk at which offset, planned before any
memory is allocated.

[Note: chunk layout]
Each optimizer param group gets its own list of chunks (so one chunk has one set of
Adam hyper-parameters), filled in the order the group lists its parameters, which for
``model.parameters()`` is registration order and so close to the order of use. With one rank,
offsets are aligned to :data:`ALIGN` elements. A chunk holds at most ``chunk_size`` elements and is
allocated as large as its contents need (so the last chunk of a group wastes nothing); a
tensor larger than ``chunk_size`` gets a chunk of its own sized to fit it (one rank), or is
spread over a chunk group (data parallel). For every owned chunk there are three fp32 tensors
of the same capacity and layout (master, momentum, variance) in
:class:`~ds_patrickstar.optim.states.OptimizerChunk`.

With one rank the plan is first fit among the most recent chunks (:func:`plan_first_fit`).

[Note: balanced chunk groups]
With ``W`` data-parallel ranks a chunk group's ``W`` chunks are all-gathered and
reduce-scattered together, and a collective needs equal sizes. If every chunk held whole
tensors, a group's members would differ in fill and every member would be as large as the
fullest: padding sent over the network, and on many models no set of whole tensors is exactly
``1/W`` of a group (all of GPT "small" at 3 ranks is 28,496 units of 384 elements: not a
multiple of 3), so some rank would send more than ZeRO-3, which splits every tensor ``W`` ways.
:func:`_plan_straddled` therefore lays each group out as one flat sequence: consecutive
tensors in model order (so the order of use is kept), at most ``W x chunk_size`` elements
(a larger tensor is a group of its own), cut into ``W`` equal members of ``ceil(total / W)``
elements, unaligned. A tensor across a cut has a piece in each of two (or more) members:
it *straddles* (see [Note: straddling tensors]). A group pads at most ``W - 1`` elements, so
the bytes a rank sends per group, ``(W - 1) x ceil(total / W)``, never exceed what ZeRO-3
sends for the same tensors, ``(W - 1) x sum(ceil(numel / W))``
(``tests/test_comm_volume.py``). The checkpoint format is per parameter piece, so a layout
change never breaks a checkpoint (resharding loads across layouts).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from .kind import FROZEN_PARAM_GROUP, ChunkKind

logger = logging.getLogger(__name__)

ALIGN = 32
_FIRST_FIT_WINDOW = 64


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(eq=False)
class ChunkSpec:
    """One planned chunk: its size and what goes where, before any memory is allocated."""

    group_index: int
    capacity: int
    dtype: torch.dtype
    # (name, param, offset in the chunk, start in the flattened param, numel): a parameter's piece
    members: list[tuple[str, torch.nn.Parameter, int, int, int]] = field(default_factory=list)
    kind: ChunkKind = ChunkKind.TRAINABLE  # see [Note: frozen chunks]


def plan_first_fit(named: list[tuple[str, torch.nn.Parameter]], chunk_size: int) -> list[list[tuple]]:
    """Split one param group into chunks: a list of [(name, param, offset), ...] per chunk.

    First fit, in order: a tensor goes into the first chunk with room left, else opens a new
    one, so a layer's biases and norms fill the gaps its matrices leave instead of each
    starting a mostly empty chunk. A tensor larger than a chunk gets a chunk of its own.
    """
    plans: list[list[tuple]] = []
    fill: list[int] = []  # elements used in each plan
    for name, param in named:
        numel = param.numel()
        if numel > chunk_size:
            logger.info(
                "ds_patrickstar: %s has %d elements > chunk_size=%d; it gets a chunk of its own",
                name,
                numel,
                chunk_size,
            )
            plans.append([(name, param, 0)])
            fill.append(chunk_size)
            continue
        # first fit among the most recent chunks (older ones are nearly always full): linear, not quadratic
        recent = range(max(0, len(fill) - _FIRST_FIT_WINDOW), len(fill))
        index = next((i for i in recent if _align(fill[i]) + numel <= chunk_size), None)
        if index is None:
            plans.append([])
            fill.append(0)
            index = len(plans) - 1
        offset = _align(fill[index])
        plans[index].append((name, param, offset))
        fill[index] = offset + numel
    return plans


def _plan_straddled(
    named: list[tuple[str, torch.nn.Parameter]], chunk_size: int, world_size: int
) -> list[list[list[tuple]]]:
    """Chunk groups of ``world_size`` equal members; see [Note: balanced chunk groups]."""
    groups: list[list[list[tuple]]] = []
    run: list[tuple[str, torch.nn.Parameter]] = []
    total = 0

    for name, param in named:
        if run and total + param.numel() > world_size * chunk_size:
            groups.append(_cut(run, total, world_size))
            run, total = [], 0
        run.append((name, param))
        total += param.numel()
    if run:
        groups.append(_cut(run, total, world_size))
    return groups


def _cut(run: list[tuple[str, torch.nn.Parameter]], total: int, world_size: int) -> list[list[tuple]]:
    """``run`` back to back in one flat sequence cut into ``world_size`` members of
    ``ceil(total / world_size)`` elements: per member [(name, param, offset, start, numel), ...]."""
    cap = max(1, -(-total // world_size))
    members: list[list[tuple]] = [[] for _ in range(world_size)]
    position = 0
    for name, param in run:
        numel, start = param.numel(), 0
        if numel == 0:
            member = min(position // cap, world_size - 1)
            members[member].append((name, param, position - member * cap, 0, 0))
        while start < numel:
            member, offset = divmod(position, cap)
            take = min(numel - start, cap - offset)
            members[member].append((name, param, offset, start, take))
            position += take
            start += take
    return members


def plan_chunks(
    named_groups: list[list[tuple[str, torch.nn.Parameter]]],
    chunk_size: int,
    world_size: int,
    frozen: list[tuple[str, torch.nn.Parameter]] | None = None,
    frozen_dtype: torch.dtype | None = None,
) -> list[ChunkSpec]:
    """The chunk layout of every param group, in chunk groups of ``world_size``, then the chunks of the
    ``frozen`` parameters (in ``frozen_dtype``, by default their own); see [Note: chunk layout],
    [Note: balanced chunk groups] and [Note: frozen chunks]."""
    specs: list[ChunkSpec] = []
    for group_index, named in enumerate(named_groups):
        dtype = named[0][1].dtype if named else torch.float32
        specs += _plan_kind(named, chunk_size, world_size, group_index, dtype, ChunkKind.TRAINABLE)
    if frozen:
        dtype = frozen_dtype or frozen[0][1].dtype
        specs += _plan_kind(frozen, chunk_size, world_size, FROZEN_PARAM_GROUP, dtype, ChunkKind.FROZEN)
    return specs


def _plan_kind(
    named: list[tuple[str, torch.nn.Parameter]],
    chunk_size: int,
    world_size: int,
    group_index: int,
    dtype: torch.dtype,
    kind: ChunkKind,
) -> list[ChunkSpec]:
    """The chunk groups of one param group (or of the frozen parameters)."""
    if world_size == 1:
        groups = [[[(n, p, o, 0, p.numel()) for n, p, o in plan]] for plan in plan_first_fit(named, chunk_size)]
    else:
        groups = _plan_straddled(named, chunk_size, world_size)
    specs: list[ChunkSpec] = []
    for members in groups:
        # A chunk is as large as its contents need; the members of a group share one size
        # for the collectives.
        capacity = max(1, max(o + k for plan in members for _, _, o, _, k in plan))
        if world_size == 1:
            capacity = _align(capacity)
        specs += [ChunkSpec(group_index, capacity, dtype, plan, kind) for plan in members]
    return specs
