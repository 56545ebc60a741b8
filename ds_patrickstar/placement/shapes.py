"""The input shapes a trace covers, and the record of re-traces.

[Note: traces across input shapes]
A trace is the order of an iteration's moments, the chunks each uses and the non-model memory at
each (see [Note: moments and the trace]). The order and the chunks do not change with the shapes
of the inputs (a batch padded to its own longest sequence runs the same modules on the same
parameters); the tide does. So the trace is kept across shapes, and its tide is planned for the
largest inputs seen: the tracer keeps the *envelope* of the input shapes traced so far (per input
tensor, the largest size along each dimension) and an iteration whose inputs fit inside it
(:func:`covers`) follows the trace. Inputs larger than the envelope along some dimension (a longer
sequence than any traced, a larger batch) are traced anew; the new trace's tide at each moment is
the higher of the new and the old trace's traced tide where the two have the same moments, so the
trace covers every shape seen, and the envelope widens to hold the new shape (:func:`widen`).
Inputs of another structure (another number of tensors, dtype or number of dimensions) are
traced anew and replace the envelope. The tide of inputs within the envelope is at most the
planned one when activations grow with the inputs' sizes; when a batch's tide still rises above
what the plan gave room for at a moment (the planned tide there and at the next moment), the run
goes on (placement makes room from the tide it measures) and, at the step, the trace's tide at
those moments is raised to what was measured and everything planned from the tide is planned
again from it: which optimizer states live on the accelerator, the agreed gather plan, and the blocks
"auto" activation offload moves (a *re-plan*, counted by ``tide_replans``). With gradient accumulation a
later micro-step's inputs are checked too, and beyond the envelope they offload every block's activations
(see [Note: a risen tide] in activations/plan.py). A trace whose order differs (control flow) is
traced anew.

Every plan made from a trace follows it: the optimizer-state plan, the gather plan and "auto"
activation offload are made again after a re-trace or a re-plan only. The counters give each
re-trace with its reason (``retraces_shape``, ``retraces_order``) and the tide plot's caption the
re-traces so far; when more than :data:`RETRACE_LIMIT` re-traces fall in :data:`RETRACE_WINDOW`
iterations, a warning says why (the reasons and the shapes), once per window.
"""

from __future__ import annotations

import enum
import logging
from collections import deque

import torch

Signature = tuple[tuple[tuple[int, ...], torch.dtype], ...]
"""Per input tensor of an iteration's first forward, its shape and dtype."""

RETRACE_LIMIT = 3
RETRACE_WINDOW = 20


class RetraceReason(enum.Enum):
    SHAPE = "inputs larger than every traced shape"
    ORDER = "a different sequence of moments"


def _same_structure(a: Signature, b: Signature) -> bool:
    return len(a) == len(b) and all(
        dtype_a == dtype_b and len(shape_a) == len(shape_b) for (shape_a, dtype_a), (shape_b, dtype_b) in zip(a, b)
    )


def covers(envelope: Signature, signature: Signature) -> bool:
    """Whether inputs of ``signature`` fit inside ``envelope``; see [Note: traces across input shapes]."""
    return _same_structure(envelope, signature) and all(
        all(s <= e for s, e in zip(shape, outer)) for (shape, _), (outer, _) in zip(signature, envelope)
    )


def widen(envelope: Signature, signature: Signature) -> Signature:
    """The envelope holding both (``signature`` alone when their structures differ)."""
    if not _same_structure(envelope, signature):
        return signature
    return tuple(
        (tuple(max(s, e) for s, e in zip(shape, outer)), dtype)
        for (shape, dtype), (outer, _) in zip(signature, envelope)
    )


class RetraceLog:
    """The re-traces of a run: counted per iteration, kept for the tide plot's caption, and warned
    about when they repeat; see [Note: traces across input shapes]."""

    def __init__(self, log: logging.Logger) -> None:
        self._log = log  # the tracer's
        self.iteration = 0
        self.history: deque[tuple[int, RetraceReason]] = deque(maxlen=256)
        self._warned_at = -RETRACE_WINDOW

    def new_iteration(self) -> None:
        self.iteration += 1

    def retraced(self, reason: RetraceReason, detail: str) -> None:
        self.history.append((self.iteration, reason))
        self._log.info("ds_patrickstar: %s (%s); re-tracing", detail, reason.value)
        recent = [r for i, r in self.history if i > self.iteration - RETRACE_WINDOW]
        if len(recent) > RETRACE_LIMIT and self.iteration - self._warned_at >= RETRACE_WINDOW:
            self._warned_at = self.iteration
            counts = {r.value: recent.count(r) for r in RetraceReason if r in recent}
            self._log.warning(
                "ds_patrickstar: %d re-traces in the last %d iterations (%s; the last: %s). Each re-traced "
                "iteration places conservatively (least recently used eviction, no prefetch, optimizer states "
                "on the host). Larger inputs than any seen re-trace: pad to a few fixed lengths (bucketing), or "
                "run the longest batch first; a changing order of modules (control flow) re-traces whenever "
                "it changes",
                len(recent),
                RETRACE_WINDOW,
                ", ".join(f"{n}x {v}" for v, n in counts.items()),
                detail,
            )

    def caption(self) -> str:
        """A line for the tide plot: the re-traces so far, by reason."""
        if not self.history:
            return f"traced once in {self.iteration} iterations"
        counts = {r.value: sum(1 for _, x in self.history if x is r) for r in RetraceReason}
        reasons = ", ".join(f"{n} for {v}" for v, n in counts.items() if n)
        last = self.history[-1][0]
        return f"re-traced {len(self.history)}x in {self.iteration} iterations ({reasons}; last in iteration {last})"
