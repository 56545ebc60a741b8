"""The reduce-scatters in flight: issued asynchronously, completed oldest first.

Each reduce-scatter holds its group's flat gradient buffer until it is waited on (its ``after``
action puts the owner's piece where it belongs and frees the buffer, see
[Note: flat group buffers] in groups/flat.py), so at most :data:`LIMIT` are in flight; placement
completes them all first when it is short of room (:meth:`InFlightReductions.drain`, see
[Note: kept groups] in groups/keep.py). It sits on the memory floor, beside the other buffers in
flight, so that placement calls it directly: nothing calls up.
One whose collective has finished is waited on at the next backward moment or gradient
(:meth:`InFlightReductions.reap`, which never blocks), so its buffer does not stay until the
limit or the end of backward; what is freed when changes no value and no collective.
"""

from __future__ import annotations

from .pending import Pending

LIMIT = 2


class InFlightReductions:
    """Reduce-scatters issued and not waited on yet, oldest first."""

    def __init__(self, limit: int = LIMIT) -> None:
        self.limit = limit
        self._queue: list[Pending] = []

    def add(self, pending: Pending) -> None:
        """A reduce-scatter was issued; the oldest are completed beyond the limit."""
        self.reap()
        self._queue.append(pending)
        while len(self._queue) > self.limit:
            self._queue.pop(0).wait()

    def reap(self) -> None:
        """Complete, oldest first, the reduce-scatters whose collective has finished, without blocking."""
        while self._queue and self._queue[0].finished():
            self._queue.pop(0).wait()

    def drain(self) -> int:
        """Complete every reduce-scatter in flight; returns how many there were."""
        count = len(self._queue)
        while self._queue:
            self._queue.pop(0).wait()
        return count
