"""Tide-aware placement of chunks between the accelerator and the host.

[Note: placement]
The accelerator holds, at every moment, non-model memory (the activation *tide*) and the
chunks that fit beside it under the budget. At a moment the chunks in use must be on the
accelerator; when one is not, room is made by evicting resident, movable chunks in order
of farthest next use in the trace (Belady's rule: optimal for a known sequence; or those whose
eviction copies nothing first, where the step-time model prefers it: [Note: eviction order]), and the
budget left for model data is ``budget - non_model`` planned for this moment and the next
one (the tide rises before the next moment is reached). After a moment, the chunks of the
next moment are prefetched when they fit, if need be after evicting resident chunks whose next
use comes after that moment (Belady would evict them for it anyway: the same evictions, one
moment earlier, and the copy in overlaps the compute in between; this is what brings a
checkpointed block's chunks in before its recomputation, see [Note: recomputation in the
trace]); never a chunk needed sooner. During the warm-up
iteration there is no trace yet: room is made from the least recently used chunks and
nothing is prefetched.

At the optimizer moment, the memory the tide leaves decides how many chunks have their
fp32 master, momentum and variance on the accelerator (updated there by the CUDA kernel);
the others are updated on the host by the CPU kernel (hybrid Adam); see
[Note: optimizer-state placement].

Bookkeeping per moment is O(chunks used) plus O(log resident chunks) per eviction: byte totals
are running sums in the :class:`~ds_patrickstar.memory.ledger.DeviceLedger`, and the resident
chunks sit in an :class:`~.eviction_queue.EvictionQueue` keyed by next use (or last use), updated when a chunk
is used, arrives or leaves; nothing is recomputed over every chunk
(``benchmarks/bench_placement_overhead.py`` measures it with 10,000+ chunks).

The ``static`` policy, for comparison, keeps a fixed fraction of the chunks on the
accelerator for good (like ZeRO-3 offload's static partition), fetches the others on use
and evicts them the moment after, and updates every chunk's optimizer state on the host.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from .eviction_queue import EvictionOrder, EvictionQueue, accumulator_key
from .planner import headroom, prefetch_for
from .trace import Trace

__all__ = ["Placer"]


class Placer:
    """The planner's eviction order kept online (see [Note: placement planner]): which resident chunk goes
    first, by next use in the trace; see [Note: placement]. Bookkeeping only: the driver performs the moves
    it asks for and tells it which chunks arrive on the accelerator."""

    def __init__(self, budget: int, policy: str, static_fraction: float, movable: Iterable[int]) -> None:
        self.budget = budget
        self.policy = policy
        movable = sorted(movable)
        keep = int(len(movable) * static_fraction) if policy == "static" else 0
        self.pinned_static = set(movable[:keep])
        self._clock = 0  # one tick per moment, across iterations
        self._queue = EvictionQueue()
        self._trace: Trace | None = None  # the trace the queue's priorities come from
        self._resident: set[int] = set()
        self.resident_bytes = 0  # the payload bytes of the resident chunks, a running total
        self._orphans: set[int] = set()  # accumulators on the accelerator whose payload is away
        self._base = 0  # absolute clock of this iteration's moment 0 (Belady priorities)
        self._moment = -1
        self.distance = 1  # moments prefetched ahead (see [Note: prefetch distance] in state_choice.py)
        self.order = EvictionOrder.BELADY  # see [Note: eviction order] in eviction_queue.py

    # ---- what is where ------------------------------------------------------------
    @property
    def resident(self) -> set[int]:
        """The chunks on the accelerator now (a copy)."""
        return set(self._resident)

    def arrived(self, chunk: int, nbytes: int) -> None:
        """``chunk`` (a payload of ``nbytes``) is now backed on the accelerator (with its accumulator)."""
        if chunk not in self._resident:
            self.resident_bytes += nbytes
        self._resident.add(chunk)
        self._queue.push(chunk, self._priority(chunk))
        self.accumulator_left(chunk)  # an accumulator that stayed is the chunk's again

    def left(self, chunk: int, nbytes: int, accumulator_stays: bool = False) -> None:
        """``chunk`` (a payload of ``nbytes``) went to the host; its accumulator stays on the accelerator where
        ``accumulator_stays`` (see [Note: accumulators kept] in eviction_queue.py)."""
        if chunk in self._resident:
            self.resident_bytes -= nbytes
        self._resident.discard(chunk)
        self._queue.drop(chunk)
        if accumulator_stays:
            self._orphans.add(chunk)
            self._queue.push(accumulator_key(chunk), self._priority(chunk))

    def accumulator_left(self, chunk: int) -> None:
        """The accumulator that stayed when ``chunk``'s payload went is no longer an entry of its own."""
        if chunk in self._orphans:
            self._orphans.discard(chunk)
            self._queue.drop(accumulator_key(chunk))

    def touch(self, chunks: Iterable[int], trace: Trace | None, moment: int, new_iteration: bool) -> None:
        """A moment uses ``chunks``: their priorities move on."""
        self._clock += 1
        if trace is not self._trace:
            self._trace = trace
            self._rekey_all(moment)
        elif trace is not None and new_iteration:
            self._base += len(trace)  # the trace wrapped
        self._moment = moment
        for chunk in chunks:
            if chunk in self._resident:
                self._queue.push(chunk, self._priority(chunk))

    def rekey(self, trace: Trace | None, moment: int) -> None:
        """Priorities made afresh from ``trace`` at ``moment`` (an evaluation begins or ends, a forward
        was taken back; see [Note: evaluation moments])."""
        self._trace = trace
        self._rekey_all(moment)

    def _rekey_all(self, moment: int) -> None:
        self._base, self._moment = 0, moment
        self._queue.clear()
        for chunk in self._resident:
            self._queue.push(chunk, self._priority(chunk))
        for chunk in self._orphans:
            self._queue.push(accumulator_key(chunk), self._priority(chunk))

    def _priority(self, chunk: int) -> int:
        if self._trace is None or self.policy == "static":
            return self._clock  # least recently used first
        return -(self._base + self._trace.next_use(chunk, self._moment))  # farthest next use first

    def set_order(self, order: EvictionOrder, free: Callable[[int], bool]) -> None:
        """Evict in ``order`` from now on; ``free``: whether a chunk's eviction copies nothing now (see [Note:
        eviction order] in eviction_queue.py)."""
        self.order = order
        self._queue.reorder(free if order.free_first else None)

    def headroom(self, trace: Trace | None, moment: int, non_model_now: int, span: int = 1) -> int:
        """Bytes model data may use on the accelerator from ``moment`` over ``span`` moments
        (:func:`~.planner.headroom`)."""
        return headroom(self.budget, trace, moment, non_model_now, span)

    def victims(self, need: int, size_if_evictable: Callable[[int], int | None]) -> list[int]:
        """Chunks to evict for ``need`` bytes, by priority; see :class:`EvictionQueue`."""
        if self.policy == "static":
            pinned = self.pinned_static
            return self._queue.take(need, lambda c: None if c in pinned else size_if_evictable(c))
        return self._queue.take(need, size_if_evictable)

    def victims_used_after(
        self, need: int, size_if_evictable: Callable[[int], int | None], moment: int
    ) -> list[int] | None:
        """Room for a prefetch for ``moment``: chunks whose next use comes after it (Belady would evict
        them at that moment anyway), farthest first; None when they do not cover ``need``."""
        if self._trace is None or self.policy == "static":
            return None
        return self._queue.take_below(need, size_if_evictable, -(self._base + moment))

    def prefetch(self, trace: Trace | None, moment: int) -> tuple[tuple[int, tuple[int, ...]], ...]:
        """What to bring after ``moment``, per target moment (:func:`~.planner.prefetch_for`)."""
        return prefetch_for(trace, moment, self.policy, self.distance)

    def release_after_use(self, chunk: int) -> bool:
        """Static policy: chunks outside the kept fraction go back to the host after use."""
        return self.policy == "static" and chunk not in self.pinned_static
