"""The order a step uses its frozen chunks on disk in, and, from the previous step's, which come next.

[Note: frozen use order]
Every rank runs the same modules in the same order (see [Note: gather order]), so the sequence of
uses of this rank's frozen chunks on disk repeats from step to step: forward, then (with
activation checkpointing) each block's recomputation followed at once by its backward.
:class:`UseOrder` records every use (a chunk used by consecutive modules once), whether the chunk
had to be read or was still there, so the sequence does not depend on what was kept, and matches
each use against the previous step's sequence (within a short window, as the gather order does).
From the match it answers two questions of :class:`~ds_patrickstar.disk.frozen.FrozenDisk`:
which chunks are used next (:meth:`UseOrder.ahead`: their reads are issued ahead) and when each
chunk is used again (:meth:`UseOrder.next_use`: of the chunks brought from disk, those used again
soonest stay, the others go first, so a block's chunks read for its recomputation stay for its
backward). A step that differs from the previous one (the first, or a change of control flow)
predicts nothing until the sequence is found again; it changes no value, only what is read when.
"""

from __future__ import annotations

import bisect

_WINDOW = 64  # entries searched ahead for the chunk just used: linear, not quadratic

NEVER = 1 << 62
""":meth:`UseOrder.next_use` of a chunk the rest of the previous step never uses (or of any chunk when the
step is not matched)."""


class UseOrder:
    """Records this step's uses of frozen chunks on disk and predicts from the previous step's; see
    [Note: frozen use order]."""

    def __init__(self) -> None:
        self.previous: list[int] = []
        self.current: list[int] = []
        self.cursor = 0  # position in ``previous`` after the last use found there
        self.matched = False  # the last use was found in ``previous``
        self._positions: dict[int, list[int]] = {}  # chunk id -> its positions in ``previous``

    def used(self, chunk_id: int) -> None:
        """``chunk_id`` is used now."""
        if self.current and self.current[-1] == chunk_id:
            return
        self.current.append(chunk_id)
        window = self.previous[self.cursor : self.cursor + _WINDOW]
        self.matched = chunk_id in window
        if self.matched:
            self.cursor += window.index(chunk_id) + 1

    def ahead(self, count: int) -> list[int]:
        """The next ``count`` uses of the previous step after this point (a chunk may come more than once)."""
        return self.previous[self.cursor : self.cursor + count] if self.matched else []

    def next_use(self, chunk_id: int) -> int:
        """How many uses from now the previous step used ``chunk_id`` next (0: the use just made), or
        :data:`NEVER`."""
        if not self.matched:
            return NEVER
        positions = self._positions.get(chunk_id, [])
        at = bisect.bisect_left(positions, self.cursor - 1)
        return positions[at] - self.cursor + 1 if at < len(positions) else NEVER

    def next_step(self) -> None:
        """A step is over: its sequence predicts the next step."""
        if self.current:
            self.previous = self.current
            self._positions = {}
            for position, chunk_id in enumerate(self.previous):
                self._positions.setdefault(chunk_id, []).append(position)
        self.current, self.cursor = [], 0
        self.matched = bool(self.previous)
