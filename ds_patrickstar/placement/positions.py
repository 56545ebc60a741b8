"""Where in the trace a moment stands: a training moment, an evaluation forward's moment, a forward
taken back; and the tide a batch brought above the plan.

[Note: evaluation moments]
A forward under ``no_grad`` (an evaluation, see [Note: run state]) is recorded nowhere, but its
moments are placed: each is a moment of its own, counted from the evaluation's first forward.
While its modules run in the order of the trace's first forward moments (the evaluation of the
model that trains), an evaluation moment stands at that trace moment: evictions are keyed by the
next use after it, the room is planned from the training tide there (higher than an evaluation's,
which saves nothing for backward), and the next moment's chunks are prefetched while the next
trace moment is a forward one. Where the evaluation leaves that order, or there is no trace yet,
its moments are placed least recently used, without prefetch. The eviction keys are made again
when an evaluation begins and when training moments resume, so neither side's keys come from the
other's moment.
"""

from __future__ import annotations

from .trace import FORWARD, Trace


class TracePositions:
    """The trace position of evaluation moments, the start of the current training forward, and the
    tide above the plan; see [Note: evaluation moments] and [Note: traces across input shapes]."""

    def __init__(self, tolerance: int) -> None:
        self.tolerance = tolerance  # tide above the plan ignored (allocator noise)
        self.evaluating = False
        self.rekey = False  # the eviction keys are made again at the next moment
        self._eval_count = -1
        self.forward_mark = -1  # the last recorded moment before the current training forward
        self.over: dict[int, int] = {}  # moment -> tide measured above the plan there

    def evaluation_begins(self) -> None:
        self._eval_count = -1

    def evaluation_moment(self, label: str, trace: Trace | None) -> int | None:
        """The trace position of the next evaluation moment, labelled ``label``; None off the trace."""
        self._eval_count += 1
        if not self.evaluating:
            self.evaluating, self.rekey = True, True
        at = self._eval_count
        if trace is None or at >= len(trace) or trace.moments[at].label != label:
            return None
        return at

    def training_moment(self) -> None:
        if self.evaluating:
            self.evaluating, self.rekey = False, True

    def take_rekey(self) -> bool:
        rekey, self.rekey = self.rekey, False
        return rekey

    @staticmethod
    def prefetches_in_evaluation(trace: Trace, at: int) -> bool:
        return at + 1 < len(trace) and trace.moments[at + 1].label.startswith(FORWARD)

    def note_tide(self, trace: Trace, moment: int, non_model: int) -> None:
        """A following iteration's tide at ``moment``: kept where it is above what the plan gave room for."""
        if 0 <= moment < len(trace) and non_model > trace.non_model_ahead(moment) + self.tolerance:
            self.over[moment] = max(self.over.get(moment, 0), non_model)

    def drop_after(self, moment: int) -> None:
        self.over = {m: v for m, v in self.over.items() if m <= moment}
        self.rekey = True

    def take_over(self) -> dict[int, int]:
        over, self.over = self.over, {}
        return over
