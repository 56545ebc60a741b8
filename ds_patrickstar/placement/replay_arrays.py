"""What the move model's replays read of a trace at every moment, derived once per trace instead of at every
moment of every replay (see [Note: predicted moves] in move_model.py and [Note: the planner's cost] in
state_choice.py).

A replay reads, per moment, the most of the planned tide over a window of moments ahead, the memory beside model
data the driver read then, and the chunks whose last use this iteration it is; the planner replays one trace
some hundreds of times (two iterations per candidate priced), so these are lists built once, O(moments x
window), and the replays index them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from .trace import Trace


@dataclass
class ReplayArrays:
    """Per moment of ``trace``: :attr:`read` (what the driver read beside model data in the hook) and
    :attr:`read_late` (after it), the step's both; :attr:`last_uses`, the chunks whose last use this iteration it
    is (ascending); :attr:`movable`, its chunks that move, in its order; :attr:`gathered_ahead`, those of them its
    hook brought for all-gathers ahead of use (several ranks, ascending); :meth:`tide_ahead`, the planned tide's
    most over a window (built on first use); :attr:`folds`, the chunks whose accumulator a boundary collective adds
    into its slot (see [Note: predicted moves] in move_model.py)."""

    trace: Trace
    read: list[int]
    read_late: list[int]
    beside: list[int]  # with several ranks, the model data the driver does not move (see [Note: predicted moves])
    last_uses: list[tuple[int, ...]]
    movable: list[tuple[int, ...]]
    folds: frozenset[int]
    written: frozenset[int]  # chunks a gradient went into during the iteration (``Moment.written``)
    gathered_ahead: list[tuple[int, ...]]  # per moment (``Moment.gathered_ahead``)
    _tides: dict[int, list[int]] = field(default_factory=dict)

    def tide_ahead(self, window: int) -> list[int]:
        """Per moment, the most planned tide over it and the next ``window - 1`` (wrapping): the trace's
        :meth:`~.trace.Trace.non_model_ahead` at every moment."""
        tides = self._tides.get(window)
        if tides is None:
            tide = [m.non_model for m in self.trace.moments]
            wrapped = tide + tide[: window - 1] if tide else tide
            tides = [max(wrapped[i : i + window]) for i in range(len(tide))]
            self._tides[window] = tides
        return tides


def replay_arrays(trace: Trace, sizes: Mapping[int, int]) -> ReplayArrays:
    """:class:`ReplayArrays` of ``trace`` for the movable chunks of ``sizes``."""
    moments = trace.moments
    read, late = [m.read for m in moments], [m.read_late for m in moments]
    for index, moment in enumerate(moments):
        if moment.label == "step":
            read[index] = late[index] = max(moment.read, moment.read_late)
    movable = [tuple([c for c in m.chunks if c in sizes]) for m in moments]
    last: list[tuple[int, ...]] = [()] * len(moments)
    seen: set[int] = set()
    for index in range(len(moments) - 1, -1, -1):
        fresh = [c for c in moments[index].chunks if c not in seen]
        if fresh:
            seen.update(fresh)
            last[index] = tuple(sorted(set(fresh)))
    folds = frozenset().union(*(m.acc_folding for m in moments))
    written = frozenset().union(*(m.written for m in moments))
    ahead = [tuple(sorted(c for c in m.gathered_ahead if c in sizes)) for m in moments]
    return ReplayArrays(trace, read, late, [m.beside for m in moments], last, movable, folds, written, ahead)
