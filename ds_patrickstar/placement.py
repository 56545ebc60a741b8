"""Tide-aware placement of chunks between the accelerator and the host.

[Note: placement]
The accelerator holds, at every moment, non-model memory (the activation *tide*) and the
chunks that fit beside it under the budget. At a moment the chunks in use must be on the
accelerator; when one is not, room is made by evicting resident, movable chunks in order
of farthest next use in the trace (Belady's rule: optimal for a known sequence), and the
budget left for model data is ``budget - non_model`` planned for this moment and the next
one (the tide rises before the next moment is reached). After a moment, the chunks of the
next moment are prefetched when they fit without evicting anything. During the warm-up
iteration there is no trace yet: room is made from the least recently used chunks and
nothing is prefetched.

At the optimizer moment, the memory the tide leaves decides how many chunks have their
fp32 master, momentum and variance on the accelerator (updated there by the CUDA kernel);
the others are updated on the host by the CPU kernel (hybrid Adam); see
[Note: optimizer-state placement].

Bookkeeping per moment is O(chunks used) plus O(resident chunks) when something must be
evicted: byte totals are running sums in the :class:`~ds_patrickstar.accelerator.DeviceLedger`
and the resident set is kept by the store, never recomputed over every chunk
(``benchmarks/bench_placement_overhead.py`` measures it with 10,000+ chunks).

The ``static`` policy, for comparison, keeps a fixed fraction of the chunks on the
accelerator for good (like ZeRO-3 offload's static partition), fetches the others on use
and evicts them the moment after, and updates every chunk's optimizer state on the host.
"""
from __future__ import annotations

from typing import Callable, Iterable

from .accelerator import DeviceBudgetExceeded
from .plan import OPTIM_BYTES_PER_ELEMENT
from .tracer import NEVER, Trace

__all__ = ["DeviceBudgetExceeded", "Placer", "belady_victims", "optimizer_chunks_on_device"]


def belady_victims(resident: dict[int, int], need: int, next_use: Callable[[int], int]) -> list[int]:
    """Chunks to evict, farthest next use first, until ``need`` bytes are freed."""
    chosen, freed = [], 0
    for chunk in sorted(resident, key=lambda c: (-next_use(c), c)):
        if freed >= need:
            break
        chosen.append(chunk)
        freed += resident[chunk]
    if freed < need:
        raise DeviceBudgetExceeded(f"cannot free {need} bytes on the accelerator: only {freed} bytes of "
                                   f"movable chunks are resident")
    return chosen


def optimizer_chunks_on_device(free_bytes: int, capacities: dict[int, int], policy: str) -> set[int]:
    """Chunks (in id order) whose optimizer state fits the memory left at the optimizer moment."""
    if policy == "static":
        return set()
    chosen, used = set(), 0
    for chunk, capacity in sorted(capacities.items()):
        cost = capacity * OPTIM_BYTES_PER_ELEMENT
        if used + cost > free_bytes:
            break
        chosen.add(chunk)
        used += cost
    return chosen


class Placer:
    """Decides evictions and prefetches; see [Note: placement]. Pure bookkeeping: the chunk
    manager performs the moves it asks for."""

    def __init__(self, budget: int, policy: str, static_fraction: float, movable: Iterable[int]) -> None:
        self.budget = budget
        self.policy = policy
        movable = sorted(movable)
        keep = int(len(movable) * static_fraction) if policy == "static" else 0
        self.pinned_static = set(movable[:keep])
        self._last_use: dict[int, int] = {}
        self._clock = 0

    def touch(self, chunks: Iterable[int]) -> None:
        self._clock += 1
        for chunk in chunks:
            self._last_use[chunk] = self._clock

    def headroom(self, trace: Trace | None, moment: int, non_model_now: int) -> int:
        """Bytes model data may use on the accelerator at ``moment``."""
        planned = trace.non_model_ahead(moment) if trace is not None and moment < len(trace) else 0
        return self.budget - max(planned, non_model_now)

    def victims(self, trace: Trace | None, moment: int, resident: dict[int, int], need: int) -> list[int]:
        if self.policy == "static":
            resident = {c: b for c, b in resident.items() if c not in self.pinned_static}
        if trace is None or self.policy == "static":
            return belady_victims(resident, need, lambda c: NEVER - self._last_use.get(c, 0))
        return belady_victims(resident, need, lambda c: trace.next_use(c, moment))

    def prefetch(self, trace: Trace | None, moment: int) -> tuple[int, ...]:
        if trace is None or self.policy == "static" or moment + 1 >= len(trace):
            return ()
        return trace.moments[moment + 1].chunks

    def release_after_use(self, chunk: int) -> bool:
        """Static policy: chunks outside the kept fraction go back to the host after use."""
        return self.policy == "static" and chunk not in self.pinned_static
