"""A model of the CUDA caching allocator, for the accelerator memory the emulated accelerator does not
charge to its ledger (the activations).

[Note: caching allocator model]
On a GPU the activations (what autograd saves, the blocks' inputs, the buffers an offloaded
activation comes back into) live in the caching allocator's segments, and the free pieces they
leave there are reserved memory (see [Note: stranded allocator bytes] in ``cuda.py``). The strict
emulated accelerator (see [Note: strict emulated accelerator]) gives those storages to
:class:`CachingAllocatorModel` as the tracer's meter counts them (``placement/tracer.py``), so that
:meth:`~ds_patrickstar.memory.accelerator.Accelerator.fragmentation` is what a GPU would report and
placement's rule for stranded pieces runs on CPU:

* **Requests.** A request is rounded up to :attr:`AllocatorGeometry.round` bytes (CUDA: 512 B). One up
  to :attr:`AllocatorGeometry.small_limit` (CUDA: 1 MiB) comes from the small pool, whose segments
  are :attr:`AllocatorGeometry.small_segment` bytes (CUDA: 2 MiB); a larger one from the large pool,
  a segment of its own size when no free piece fits.
* **Reuse.** A request takes the smallest free piece of its pool that fits (best fit; ties: the
  oldest segment, the lowest offset) and splits it when at least ``round`` bytes remain; a freed
  block merges with the free pieces beside it in its segment. Segments stay until released.
* **What counts.** :attr:`CachingAllocatorModel.stranded`: the free bytes of the segments that have a
  block in use (CUDA's ``inactive_split_bytes``): only requests that fit them can use them. A segment
  with no block in use is free memory (CUDA returns it when it needs room, and at
  :meth:`~CachingAllocatorModel.release_free`, ``torch.cuda.empty_cache``): it is in
  :attr:`~CachingAllocatorModel.reserved` (every segment, CUDA's ``reserved_bytes``) but not in
  :attr:`~CachingAllocatorModel.busy` (the segments with a block in use: the allocated blocks and the
  stranded pieces, what a GPU could not give back now).

Simplifications: only the storages the meter counts are seen, at the moment it counts them
(temporaries that a GPU would also place in these segments are not); the large pool splits a piece
whenever ``round`` bytes remain (CUDA keeps remainders up to 1 MiB inside the block) and gives each
large request a segment of its own size (CUDA shares 20 MiB segments among requests under 10 MiB).
The twin's budgets are kilobytes where a GPU's are gigabytes: :data:`TWIN_GEOMETRY` scales CUDA's
pool sizes by 1/1024 (MiB to KiB), so that small requests stay small beside the budget as on a GPU,
and keeps the 512 B rounding.
"""

from __future__ import annotations

import bisect
from collections.abc import Hashable
from dataclasses import dataclass

__all__ = ["AllocatorGeometry", "CachingAllocatorModel", "TWIN_GEOMETRY"]


@dataclass(frozen=True)
class AllocatorGeometry:
    """The sizes of the allocator's pools; see [Note: caching allocator model]."""

    round: int
    small_limit: int
    small_segment: int


TWIN_GEOMETRY = AllocatorGeometry(round=512, small_limit=1 << 10, small_segment=2 << 10)


class _Segment:
    __slots__ = ("ident", "size", "small", "blocks", "in_use")

    def __init__(self, ident: int, size: int, small: bool) -> None:
        self.ident, self.size, self.small = ident, size, small
        self.blocks: list[list] = [[0, size, None]]  # [offset, size, key or None when free], by offset
        self.in_use = 0  # bytes of its blocks in use


class CachingAllocatorModel:
    """Segments, blocks and free pieces of a caching allocator; see [Note: caching allocator model]."""

    def __init__(self, geometry: AllocatorGeometry) -> None:
        self.geometry = geometry
        self._segments: dict[int, _Segment] = {}
        self._next_segment = 0
        self._free: dict[bool, list[tuple[int, int, int]]] = {True: [], False: []}  # (size, segment, offset)
        self._where: dict[Hashable, tuple[_Segment, int]] = {}  # key of a block in use -> (segment, offset)
        self.allocated = 0  # bytes of the blocks in use (rounded)
        self.reserved = 0  # bytes of every segment
        self.busy = 0  # bytes of the segments with a block in use

    @property
    def stranded(self) -> int:
        """Free bytes inside segments partly in use (CUDA's ``inactive_split_bytes``)."""
        return self.busy - self.allocated

    def malloc(self, key: Hashable, nbytes: int) -> None:
        """A block of ``nbytes`` (rounded) for ``key`` until :meth:`free`."""
        if key in self._where:
            raise RuntimeError(f"caching allocator model: {key!r} holds a block already")
        geometry = self.geometry
        size = -(-max(nbytes, 1) // geometry.round) * geometry.round
        small = size <= geometry.small_limit
        pool = self._free[small]
        index = bisect.bisect_left(pool, (size, -1, -1))
        if index < len(pool):
            _, ident, offset = pool.pop(index)
            segment = self._segments[ident]
        else:
            segment = _Segment(self._next_segment, geometry.small_segment if small else size, small)
            self._segments[segment.ident] = segment
            self._next_segment += 1
            self.reserved += segment.size
            offset = 0
        self._take(segment, offset, size, key)

    def _take(self, segment: _Segment, offset: int, size: int, key: Hashable) -> None:
        at = next(i for i, block in enumerate(segment.blocks) if block[0] == offset)
        block = segment.blocks[at]
        rest = block[1] - size
        if rest >= self.geometry.round:  # split: the rest stays a free piece
            segment.blocks.insert(at + 1, [offset + size, rest, None])
            bisect.insort(self._free[segment.small], (rest, segment.ident, offset + size))
            block[1] = size
        block[2] = key
        if not segment.in_use:
            self.busy += segment.size
        segment.in_use += block[1]
        self.allocated += block[1]
        self._where[key] = (segment, offset)

    def free(self, key: Hashable) -> None:
        """``key``'s block goes back to its segment, merged with the free pieces beside it."""
        where = self._where.pop(key, None)
        if where is None:
            raise RuntimeError(f"caching allocator model: {key!r} holds no block")
        segment, offset = where
        blocks = segment.blocks
        at = next(i for i, block in enumerate(blocks) if block[0] == offset)
        size = blocks[at][1]
        segment.in_use -= size
        self.allocated -= size
        if not segment.in_use:
            self.busy -= segment.size
        blocks[at][2] = None
        pool = self._free[segment.small]
        if at + 1 < len(blocks) and blocks[at + 1][2] is None:  # merge the next free piece into it
            after = blocks.pop(at + 1)
            pool.remove((after[1], segment.ident, after[0]))
            blocks[at][1] += after[1]
        if at > 0 and blocks[at - 1][2] is None:  # and it into the previous free piece
            before = blocks[at - 1]
            pool.remove((before[1], segment.ident, before[0]))
            before[1] += blocks.pop(at)[1]
            at -= 1
        bisect.insort(pool, (blocks[at][1], segment.ident, blocks[at][0]))

    def release_free(self) -> None:
        """Give back every segment with no block in use (``torch.cuda.empty_cache``)."""
        for segment in [s for s in self._segments.values() if not s.in_use]:
            del self._segments[segment.ident]
            self._free[segment.small].remove((segment.size, segment.ident, 0))
            self.reserved -= segment.size
