"""The trace of an iteration: its moments, each with the chunks it uses and the memory beside model data, and
what the planners read of them (see [Note: moments and the trace] and [Note: recomputation in the trace] in
tracer.py, which records it)."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field, replace
from typing import Literal, get_args

Reading = Literal["read", "read_late", "beside", "gathered_ahead"]
"""The readings a moment keeps the most of (see :meth:`Trace.note_read`, :meth:`Trace.note_beside`; of
:meth:`Trace.note_gathered_ahead`, the union)."""
AccumulatorEvent = Literal["acc_born", "acc_folding", "acc_gone"]
"""What became of a gradient accumulator at a moment (the :class:`Moment` field that records it)."""

NEVER = 1 << 60
RECOMPUTE = "rec:"
"""Label prefix of a recomputation moment; see [Note: recomputation in the trace] in tracer.py."""
BACKWARD = "bwd:"
"""Label prefix of a backward moment."""
FORWARD = "fwd:"
"""Label prefix of a forward moment (not a recomputation)."""


@dataclass(frozen=True)
class Moment:
    label: str
    chunks: tuple[int, ...]
    non_model: int
    traced: int = -1  # the tide as traced, before any plan changed it (-1: ``non_model``)
    written: frozenset[int] = frozenset()  # chunks whose payload its gradients went into (see [Note: clean evictions])
    read: int = (
        0  # the most placement read beside model data in its hook (see [Note: predicted moves] in move_model.py)
    )
    read_late: int = 0  # the most it read after the hook, before the next moment (a gradient's room, the step)
    beside: int = 0  # with several ranks, the most model data placement does not move at its hook's end
    acc_born: frozenset[int] = frozenset()  # chunks whose gradient accumulator came into being during it
    acc_folding: frozenset[int] = frozenset()  # those whose boundary sum comes with a collective issued during it
    acc_gone: frozenset[int] = frozenset()  # chunks whose gradient accumulator went during it
    gathered_ahead: frozenset[int] = frozenset()  # with several ranks, own chunks its hook brought for an all-gather

    @property
    def measured(self) -> int:
        return self.non_model if self.traced < 0 else self.traced


@dataclass
class Trace:
    moments: list[Moment] = field(default_factory=list)
    _uses: dict[int, list[int]] = field(default_factory=dict)
    revision: int = 0  # moves when a moment's reading or planned tide changes (what the move model reads)
    _stale: set[tuple[int, Reading]] = field(default_factory=set)  # readings the next one replaces (restart_readings)

    def add(self, moment: Moment) -> None:
        index = len(self.moments)
        self.moments.append(moment)
        for chunk in moment.chunks:
            self._uses.setdefault(chunk, []).append(index)

    def copy(self) -> Trace:
        """A trace of the same moments, changed apart from this one (its moments are values)."""
        copy = Trace()
        for moment in self.moments:
            copy.add(moment)
        return copy

    def next_use(self, chunk: int, after: int) -> int:
        """First moment > ``after`` using ``chunk`` (this iteration), else the first use next
        iteration (moments wrap around), else :data:`NEVER`."""
        uses = self._uses.get(chunk)
        if not uses:
            return NEVER
        i = bisect.bisect_right(uses, after)
        return uses[i] if i < len(uses) else uses[0] + len(self.moments)

    def non_model_ahead(self, moment: int, window: int = 2) -> int:
        """Most non-model memory over this moment and the next ``window - 1``."""
        if not self.moments:
            return 0
        return max(self.moments[(moment + k) % len(self.moments)].non_model for k in range(window))

    def replace_chunks(self, index: int, chunks: tuple[int, ...]) -> None:
        """The chunks used at moment ``index`` changed (the step's, after optimizer states moved)."""
        old = self.moments[index]
        for chunk in old.chunks:
            self._uses[chunk].remove(index)
        for chunk in chunks:
            bisect.insort(self._uses.setdefault(chunk, []), index)
        self.moments[index] = replace(old, chunks=tuple(chunks), traced=old.measured)

    def note_written(self, index: int, chunk: int) -> None:
        """A gradient went into ``chunk``'s payload during moment ``index``."""
        old = self.moments[index]
        if chunk not in old.written:
            self.moments[index] = replace(old, written=old.written | {chunk})

    def note_accumulator(self, index: int, chunk: int, event: AccumulatorEvent) -> None:
        """``event`` befell ``chunk``'s gradient accumulator during moment ``index``."""
        old = self.moments[index]
        self.moments[index] = replace(old, **{event: getattr(old, event) | {chunk}})

    def note_read(self, index: int, nbytes: int, late: bool = False) -> None:
        """Placement read ``nbytes`` beside model data (the tide and the allocator's stranded pieces) during
        moment ``index``, in its hook or ``late`` (after it): the most of the readings is kept, and
        :attr:`revision` moves when it rises."""
        self._note(index, "read_late" if late else "read", nbytes)

    def note_beside(self, index: int, nbytes: int) -> None:
        """With several ranks, ``nbytes`` of model data placement does not move (gathered groups, gradient and
        collective buffers) stood on the accelerator at the end of moment ``index``'s hook (see [Note: predicted
        moves] in move_model.py): the most is kept."""
        self._note(index, "beside", nbytes)

    def note_gathered_ahead(self, index: int, chunks: frozenset[int]) -> None:
        """With several ranks, moment ``index``'s hook issued the all-gathers of the groups of this rank's ``chunks``
        ahead of their use (see [Note: predicted moves] in move_model.py): the union of the readings is kept."""
        old = self.moments[index]
        stale = (index, "gathered_ahead") in self._stale
        self._stale.discard((index, "gathered_ahead"))
        chunks = chunks if stale else old.gathered_ahead | chunks
        if chunks != old.gathered_ahead:
            self.moments[index] = replace(old, gathered_ahead=chunks)
            self.revision += 1

    def _note(self, index: int, kind: Reading, nbytes: int) -> None:
        old = self.moments[index]
        kept = getattr(old, kind)
        stale = (index, kind) in self._stale
        self._stale.discard((index, kind))
        if nbytes > kept or (stale and nbytes != kept):
            if kind == "read":
                self.moments[index] = replace(old, read=nbytes)
            elif kind == "read_late":
                self.moments[index] = replace(old, read_late=nbytes)
            else:
                self.moments[index] = replace(old, beside=nbytes)
            self.revision += 1

    def restart_readings(self) -> None:
        """The plan changed: each moment's next reading replaces the most read so far, which another plan's
        allocations left (see [Note: the plan checked on steady times] in step_planner.py)."""
        self._stale = {(index, kind) for index in range(len(self.moments)) for kind in get_args(Reading)}

    def set_non_model(self, index: int, non_model: int) -> None:
        """The tide planned at moment ``index`` (activation offload re-plans it, see
        [Note: auto activation offload])."""
        old = self.moments[index]
        self.moments[index] = replace(old, non_model=non_model, traced=old.measured)
        self.revision += 1

    def raise_tide(self, index: int, non_model: int) -> None:
        """A batch's tide at moment ``index`` rose above the plan: plan for it from now on (see
        [Note: traces across input shapes])."""
        old = self.moments[index]
        self.moments[index] = replace(old, non_model=max(old.non_model, non_model), traced=max(old.measured, non_model))
        self.revision += 1

    def cover(self, other: Trace) -> bool:
        """Where ``other`` has the same moments, the higher traced tide of the two at each; returns
        whether it had (see [Note: traces across input shapes])."""
        if [m.label for m in other.moments] != [m.label for m in self.moments]:
            return False
        for index, (mine, theirs) in enumerate(zip(self.moments, other.moments)):
            tide = max(mine.measured, theirs.measured)
            self.moments[index] = replace(mine, non_model=tide, traced=tide)
        self.revision += 1
        return True

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` moments."""
        for moment in self.moments[length:]:
            for chunk in moment.chunks:
                self._uses[chunk] = [i for i in self._uses[chunk] if i < length]
        del self.moments[length:]

    def held_chunks(self) -> list[tuple[int, ...]]:
        """Per moment, the chunks in use then: the moment's own and those of the modules recomputed
        before it whose backward moment has not passed (their tensors stay in use from the
        recomputation to their backward; with no backward moment, to the end of that backward
        pass); see [Note: recomputation in the trace] in tracer.py."""
        held = [list(m.chunks) for m in self.moments]
        for index, moment in enumerate(self.moments):
            if not moment.label.startswith(RECOMPUTE):
                continue
            backward = BACKWARD + moment.label[len(RECOMPUTE) :]
            for later in range(index + 1, len(self.moments)):
                label = self.moments[later].label
                if not label.startswith((BACKWARD, RECOMPUTE)):
                    break
                held[later].extend(moment.chunks)
                if label == backward:
                    break
        return [tuple(dict.fromkeys(chunks)) for chunks in held]

    def micro_steps(self) -> list[int]:
        """Per moment, the index of its micro-step: a forward moment after a moment of another kind
        starts the next one; the step moment belongs to the last (the boundary micro-step)."""
        index, previous, micro = -1, "", []
        for moment in self.moments:
            if moment.label.startswith(FORWARD) and not previous.startswith(FORWARD):
                index += 1
            micro.append(max(index, 0))
            previous = moment.label
        return micro

    def recomputations(self) -> list[int]:
        """Indices of the recomputation moments; see [Note: recomputation in the trace] in tracer.py."""
        return [i for i, m in enumerate(self.moments) if m.label.startswith(RECOMPUTE)]

    def __len__(self) -> int:
        return len(self.moments)
