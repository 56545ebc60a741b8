"""Which chunk group will be needed next: the order the previous step gathered them in.

[Note: gather order]
Every rank runs the same modules in the same order (a leaf module counts as one, see
[Note: leaf modules]; ranks that differ are stopped, see [Note: ranks in lockstep]), so the
sequence of chunk groups a training step all-gathers (forward, then backward for the groups
not kept) repeats from step to step. :class:`GatherOrder` records the sequence of the current step (a group
enters it at its first use after each gather) and, from the previous step's sequence,
tells which groups come next, so the chunk manager can issue their all-gathers ahead of
use (see [Note: asynchronous collectives]). A group used out of the recorded order (the
model's control flow changed) only means no prefetch until the sequence is found again
within a short window; it never changes what is computed. Every rank records the same
sequence, so every rank issues the same collectives in the same order. The
prefetch is independent of placement's trace (it works without an accelerator), and
placement's agreed plan still decides whether a prefetched group fits (see [Note: agreed gather plan]).
"""

from __future__ import annotations

_WINDOW = 64  # entries searched ahead for the group just used: linear, not quadratic


class GatherOrder:
    """Records this step's gather sequence and predicts from the previous step's; see
    [Note: gather order]."""

    def __init__(self) -> None:
        self.previous: list[int] = []
        self.current: list[int] = []
        self.cursor = 0  # position in ``previous`` after the last group found there

    def used(self, group: int) -> None:
        """``group`` was just gathered and is used for the first time."""
        self.current.append(group)
        window = self.previous[self.cursor : self.cursor + _WINDOW]
        if group in window:
            self.cursor += window.index(group) + 1

    def ahead(self, count: int) -> list[int]:
        """The next ``count`` groups the previous step gathered after this point."""
        return self.previous[self.cursor : self.cursor + count]

    def next_step(self) -> None:
        if self.current:
            self.previous = self.current
        self.current, self.cursor = [], 0
