"""The chunk layout: which parameter goes into which chunk at which offset, planned before any
memory is allocated.

[Note: chunk layout]
Each optimizer param group gets its own list of chunks (so one chunk has one set of
Adam hyper-parameters), filled in the order the group lists its parameters, which for
``model.parameters()`` is registration order and so close to the order of use. Offsets are
aligned to :data:`ALIGN` elements. A chunk holds at most ``chunk_size`` elements and is
allocated as large as its contents need (so the last chunk of a group wastes nothing); a
tensor larger than ``chunk_size`` gets a chunk of its own sized to fit it (one rank), or a
chunk group sized for it (data parallel). For every owned chunk there are three fp32 tensors
of the same capacity and layout (master, momentum, variance) in
:class:`~ds_patrickstar.optim_states.OptimizerChunk`.

With one rank the plan is first fit among the most recent chunks (:func:`_plan_group`).

[Note: balanced chunk groups]
With ``W`` data-parallel ranks a chunk group's ``W`` chunks are all-gathered and
reduce-scattered together, and a collective needs equal sizes, so every member is as large
as the fullest one: a group's traffic is ``W x`` its largest member, and everything a member
lacks is padding sent over the network. :func:`_plan_balanced` therefore plans *groups*: it
takes the ordered tensors in windows of about four groups' worth (``4 x W x cap`` elements,
``cap = max(chunk_size, largest tensor of the window)``), packs each window into chunks of
at most ``c`` elements first fit decreasing, puts chunks of similar fill in one group,
improves each group by moves and swaps between its fullest and emptiest member, and keeps,
among chunk sizes ``c`` from ``cap / 4`` to ``cap``, the packing with the least padding (a
partial last group counts as padding). The groups are ordered by their first tensor (so the
order of use is kept at the granularity of a window). A tensor larger than a chunk is
grouped with others instead of padding ``W - 1`` partners to its size. Padding is then a few percent at most on transformer models
(``tests/test_comm_volume.py``); the checkpoint format is per parameter, so a layout change
never breaks a checkpoint (resharding loads across layouts).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

logger = logging.getLogger(__name__)

ALIGN = 32
_FIRST_FIT_WINDOW = 64
_WINDOW_GROUPS = 8  # chunk groups' worth of tensors packed together
_CAP_STEPS = 16  # chunk sizes tried per window: cap x 4/16 .. 16/16


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(eq=False)
class ChunkSpec:
    """One planned chunk: its size and what goes where, before any memory is allocated."""

    group_index: int
    capacity: int
    dtype: torch.dtype
    members: list[tuple[str, torch.nn.Parameter, int]] = field(default_factory=list)  # (name, param, offset)


def _plan_group(named: list[tuple[str, torch.nn.Parameter]], chunk_size: int) -> list[list[tuple]]:
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
            logger.info("ds_patrickstar: %s has %d elements > chunk_size=%d; it gets a chunk of its own",
                        name, numel, chunk_size)
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


def _plan_balanced(named: list[tuple[str, torch.nn.Parameter]], chunk_size: int,
                   world_size: int) -> list[list[list[tuple]]]:
    """Chunk groups of ``world_size`` balanced members; see [Note: balanced chunk groups]."""
    sizes = [_align(param.numel()) for _, param in named]
    groups: list[tuple[int, list[list[int]]]] = []  # (first tensor index, members)
    i = 0
    while i < len(named):
        window, total, largest = [], 0, 0
        while i < len(named) and (not window or total < _WINDOW_GROUPS * world_size * max(chunk_size, largest)):
            window.append(i)
            total += sizes[i]
            largest = max(largest, sizes[i])
            i += 1
        top = max(chunk_size, largest)  # no chunk above chunk_size unless one tensor is larger
        caps = sorted({max(largest, top * k // _CAP_STEPS) for k in range(_CAP_STEPS // 4, _CAP_STEPS + 1)})
        packings = [_pack(window, sizes, world_size, cap) for cap in reversed(caps)]
        _, best = min(packings, key=lambda packing: packing[0])  # least padding; ties: the largest chunks
        groups += [(min(k for m in members for k in m), members) for members in best]
    groups.sort(key=lambda g: g[0])  # groups in the order the model lists (and mostly uses) them
    return [[_offsets([named[k] for k in sorted(member)]) for member in members] for _, members in groups]


def _pack(window: list[int], sizes: list[int], world_size: int, cap: int) -> tuple[int, list[list[list[int]]]]:
    """``window``'s tensors in chunks of at most ``cap`` (first fit decreasing), chunks of similar
    fill in one group, each group balanced by :func:`_improve`: ``(padding, groups)``."""
    bins: list[list[int]] = []
    fills: list[int] = []
    for k in sorted(window, key=lambda k: -sizes[k]):
        b = next((b for b in range(len(bins)) if fills[b] + sizes[k] <= cap), None)
        if b is None:
            bins.append([])
            fills.append(0)
            b = len(bins) - 1
        bins[b].append(k)
        fills[b] += sizes[k]
    bins += [[] for _ in range(-len(bins) % world_size)]
    fills += [0] * (len(bins) - len(fills))
    ranked = sorted(range(len(bins)), key=lambda b: -fills[b])
    groups, padding = [], 0
    for start in range(0, len(ranked), world_size):
        chosen = ranked[start:start + world_size]
        members, fill = [list(bins[b]) for b in chosen], [fills[b] for b in chosen]
        _improve(members, fill, sizes)
        padding += world_size * max(fill) - sum(fill)
        groups.append(members)
    return padding, groups


def _improve(members: list[list[int]], fill: list[int], sizes: list[int], rounds: int = 64) -> None:
    """Lower the fullest member by moving one tensor to the emptiest member, or swapping a pair,
    whichever brings the two closest to equal; stop when nothing helps."""
    for _ in range(rounds):
        a = max(range(len(fill)), key=fill.__getitem__)
        b = min(range(len(fill)), key=fill.__getitem__)
        gap = fill[a] - fill[b]
        best, move = gap, None  # the larger of the two fills after the change, above fill[b]
        for x in members[a]:
            for y in [None] + members[b]:
                delta = sizes[x] - (sizes[y] if y is not None else 0)
                if 0 < delta < gap and max(gap - delta, delta) < best:
                    best, move = max(gap - delta, delta), (x, y, delta)
        if move is None:
            return
        x, y, delta = move
        members[a].remove(x)
        members[b].append(x)
        if y is not None:
            members[b].remove(y)
            members[a].append(y)
        fill[a] -= delta
        fill[b] += delta


def _offsets(named: list[tuple[str, torch.nn.Parameter]]) -> list[tuple]:
    """One chunk's [(name, param, offset), ...], back to back at aligned offsets in model order."""
    plan, fill = [], 0
    for name, param in named:
        plan.append((name, param, fill))
        fill += _align(param.numel())
    return plan


def plan_chunks(named_groups: list[list[tuple[str, torch.nn.Parameter]]], chunk_size: int,
                world_size: int) -> list[ChunkSpec]:
    """The chunk layout of every param group, in chunk groups of ``world_size``; see
    [Note: chunk layout] and [Note: balanced chunk groups]."""
    specs: list[ChunkSpec] = []
    for group_index, named in enumerate(named_groups):
        dtype = named[0][1].dtype if named else torch.float32
        if world_size == 1:
            groups = [[plan] for plan in _plan_group(named, chunk_size)]
        else:
            groups = _plan_balanced(named, chunk_size, world_size)
        for members in groups:
            # A chunk is as large as its contents need; the members of a group share one size
            # for the collectives.
            capacity = max([ALIGN] + [_align(o + p.numel()) for plan in members for _, p, o in plan])
            specs += [ChunkSpec(group_index, capacity, plan[0][1].dtype if plan else dtype, plan) for plan in members]
    return specs
