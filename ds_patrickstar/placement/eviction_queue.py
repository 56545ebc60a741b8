"""The resident chunks in the order placement evicts them: farthest next use first, or free evictions first.

[Note: eviction order]
Belady's rule (evict the chunk used again farthest ahead) brings the fewest chunks back, but with clean
evictions (see [Note: clean evictions] in store/clean_copies.py) evictions do not cost alike: a chunk whose
payload is as it came (a frozen chunk; a trainable one before backward writes its gradients) goes back
without a copy, one written since goes with one. Two orders are kept:

* :attr:`EvictionOrder.BELADY`: farthest next use first;
* :attr:`EvictionOrder.FREE_FIRST`: the chunks whose eviction copies nothing first, farthest next use first
  among them, then the others the same way. It trades a copy out now for, at worst, an earlier copy in.

Neither is better on every trace, so the planner prices both with the step-time model (the moves of a
steady-state iteration in each order, see [Note: predicted moves] in move_model.py) and keeps the faster;
within the tie of [Note: optimizer states by step time] the fewer bytes, then Belady (see [Note: prefetch
distance] in state_choice.py for the rest of the choice). The two orders differ only where some evictions
are free: with clean evictions off (a host budget) and no frozen chunk
whose home is its disk record, every order is Belady's. Counter ``eviction_order`` (0: Belady, 1: free first; 2
and 3: the same keeping accumulators, see [Note: accumulators kept]).

[Note: accumulators kept]
With gradient accumulation a trainable chunk's fp32 accumulator (4 B per element, see [Note: gradient
accumulation] in groups/grads.py) sits beside its payload from its first gradient to the boundary, and it keeps
no copy on the host: evicting it copies it out and back, while the payload of a chunk unchanged since it came
goes for free and comes back at 2 B per element. So the orders ``*_KEEPING_ACCUMULATORS`` evict the payload
alone and leave the accumulator on the accelerator; an accumulator whose payload is away goes only after every
payload that could go (in Belady's order among them, by its chunk's next use), and comes back with its payload.
Where payloads are short of room, keeping accumulators can cost more (a payload evicted now is brought back
before a far accumulator), so the planner prices these orders beside the others where there are accumulators
(the move model replays them; see [Note: predicted moves] in move_model.py). Where the
payloads and the accumulators already alone cannot make the room a moment needs, the payloads chosen take their
accumulators along, as in the other orders (room the driver would otherwise not find). In the queue an
accumulator whose payload is away is the entry :func:`accumulator_key` of its chunk: a negative key, in a class
after the others.

A chunk's priority is its next use (re-keyed at every use, see :class:`EvictionQueue`); whether its
eviction is free changes without a use (a gradient written into it, the step giving its kept buffer back),
so the free class is checked again when a chunk is popped from it: a chunk written since it was pushed moves
to the other class, keeping its priority (only a chunk's arrival makes it free again, and arriving pushes it).
With gradient accumulation an eviction that takes an accumulator along copies it (see [Note: accumulators
kept]): a chunk whose accumulator came into being since it was pushed moves to the other class the same way.
"""

from __future__ import annotations

import enum
import heapq
from collections.abc import Callable

from ..memory.ledger import DeviceBudgetExceeded

_Entry = tuple[int, int, int]  # (priority, chunk, stamp); smallest is evicted first


class EvictionOrder(enum.IntEnum):
    """The order resident chunks are evicted in (see [Note: eviction order]) and whether an evicted payload leaves
    its accumulator on the accelerator (see [Note: accumulators kept]); the value is the counter's."""

    BELADY = 0
    FREE_FIRST = 1
    BELADY_KEEPING_ACCUMULATORS = 2
    FREE_FIRST_KEEPING_ACCUMULATORS = 3

    @property
    def free_first(self) -> bool:
        return self in (EvictionOrder.FREE_FIRST, EvictionOrder.FREE_FIRST_KEEPING_ACCUMULATORS)

    @property
    def keeps_accumulators(self) -> bool:
        return self >= EvictionOrder.BELADY_KEEPING_ACCUMULATORS

    @property
    def label(self) -> str:
        """The order in a log line."""
        label = "free-first" if self.free_first else "Belady's"
        return f"{label}, accumulators kept" if self.keeps_accumulators else label


def accumulator_key(chunk: int) -> int:
    """The queue's entry for ``chunk``'s accumulator while its payload is away (see [Note: accumulators kept]);
    its own inverse."""
    return -1 - chunk


class EvictionQueue:
    """Resident chunks by eviction priority, with lazy updates: O(log n) per change and per victim.

    The priority of a chunk is its next use in the trace (Belady: farthest first) or, while there
    is no trace, its last use (least recently used first). A chunk's next use changes only when
    it is used, and every use re-keys it, so keys stay exact between uses. Moments are counted
    on an absolute clock across iterations (the trace wraps), so keys from two iterations compare.
    Entries superseded by a newer key or by an eviction are skipped when popped. With ``free`` (whether
    a chunk's eviction copies nothing now), those chunks come first (see [Note: eviction order]); accumulators
    whose payload is away (negative keys) come last (see [Note: accumulators kept]).
    """

    def __init__(self, free: Callable[[int], bool] | None = None) -> None:
        self.free = free
        # free evictions (with ``free``), the others, accumulators whose payload is away
        self._heaps: tuple[list[_Entry], list[_Entry], list[_Entry]] = ([], [], [])
        self._stamp: dict[int, int] = {}
        self._pushed = 0  # entries pushed since the heaps were last compacted

    @property
    def entries(self) -> int:
        """Entries held, superseded ones included (compacted now and then)."""
        return sum(len(heap) for heap in self._heaps)

    def push(self, chunk: int, priority: int) -> None:
        stamp = self._stamp.get(chunk, 0) + 1
        self._stamp[chunk] = stamp
        self._put((priority, chunk, stamp))
        self._pushed += 1
        if self._pushed > len(self._stamp) + 1024:  # superseded entries: compact, O(n) now and then
            self._pushed = 0
            if self.entries > 2 * len(self._stamp) + 1024:
                for heap in self._heaps:
                    heap[:] = [e for e in heap if self._stamp.get(e[1]) == e[2]]
                    heapq.heapify(heap)

    def reorder(self, free: Callable[[int], bool] | None) -> None:
        """Free evictions first by ``free`` from now on (None: Belady alone); the priorities stay."""
        live = [e for heap in self._heaps for e in heap if self._stamp.get(e[1]) == e[2]]
        self.free = free
        for heap in self._heaps:
            heap.clear()
        for entry in live:
            self._put(entry)

    def _put(self, entry: _Entry) -> None:
        if entry[1] < 0:
            heapq.heappush(self._heaps[2], entry)
            return
        free = self.free is not None and self.free(entry[1])
        heapq.heappush(self._heaps[0 if free else 1], entry)

    def drop(self, chunk: int) -> None:
        self._stamp[chunk] = self._stamp.get(chunk, 0) + 1

    def _pop(self, limit: int | None) -> _Entry | None:
        """The next live entry in eviction order (of priority below ``limit``), popped; None when none is left."""
        for index, heap in enumerate(self._heaps):
            while heap and (limit is None or heap[0][0] < limit):
                entry = heapq.heappop(heap)
                if self._stamp.get(entry[1]) != entry[2]:
                    continue
                if index == 0 and not (self.free is not None and self.free(entry[1])):  # written since
                    heapq.heappush(self._heaps[1], entry)
                    continue
                return entry
        return None

    def take(self, need: int, size_if_evictable: Callable[[int], int | None]) -> list[int]:
        """Pop chunks in eviction order until ``need`` bytes are covered; chunks that cannot go
        now (``size_if_evictable`` gives None) keep their place."""
        chosen, freed = self._take(need, size_if_evictable, None)
        if chosen is None:
            raise DeviceBudgetExceeded(
                f"cannot free {need} bytes on the accelerator: only {freed} bytes of movable chunks are resident"
            )
        return chosen

    def take_below(self, need: int, size_if_evictable: Callable[[int], int | None], limit: int) -> list[int] | None:
        """Like :meth:`take`, but only chunks of priority below ``limit``; None, taking nothing, when
        they do not cover ``need``."""
        return self._take(need, size_if_evictable, limit)[0]

    def _take(
        self, need: int, size_if_evictable: Callable[[int], int | None], limit: int | None
    ) -> tuple[list[int] | None, int]:
        """The chunks taken and the bytes they free; none taken (None) when they would not cover ``need``."""
        chosen, freed, popped = [], 0, []
        while freed < need and (entry := self._pop(limit)) is not None:
            popped.append(entry)
            size = size_if_evictable(entry[1])
            if size is not None:
                chosen.append(entry[1])
                freed += size
        if freed < need:
            for entry in popped:
                self._put(entry)
            return None, freed
        taken = set(chosen)
        for entry in popped:
            if entry[1] in taken:
                self.drop(entry[1])
            else:
                self._put(entry)
        return chosen, freed

    def clear(self) -> None:
        for heap in self._heaps:
            heap.clear()
        self._stamp.clear()
