"""The memory tracer: non-model memory and chunk use at every moment of an iteration.

[Note: moments and the trace]
A *moment* is a hooked module's pre-forward or pre-backward, or the optimizer step. In the
warm-up iteration the tracer records, at each moment, which chunks are used and how much
non-model memory (activations, temporaries) the accelerator holds: on CUDA the allocator's
bytes minus the bytes of our chunks, and the peak since the previous moment; on the
emulated accelerator the bytes autograd has saved for backward that are not chunk
payloads, and the blocks' inputs for as long as they are held (see :class:`~.saved_meter.SavedTensorMeter`
and [Note: held inputs]). Afterwards the placer reads, for any moment, the
next use of a chunk and the non-model memory to plan for. An iteration begins at the first
training forward after a step; its moments are the recorded ones of [Note: run state] (training
moments and the step): an evaluation forward's moments are placed but not traced.

An iteration whose inputs are larger than every traced shape is traced anew, and its trace covers
the shapes seen; a batch whose tide rises above the plan re-plans at the step (see
[Note: traces across input shapes]). An iteration whose moments differ from the trace (control
flow: a different number of moments, or another module at a moment, noticed at the first
differing moment) is traced anew and its trace replaces the old one, so a stale trace is never
used silently (the log says so). While tracing, placement is conservative (least recently used
eviction, no prefetch). A new trace also re-plans where optimizer states live (see
[Note: optimizer-state placement]).
A training forward with no backward after it (a validation loss under grad mode: another forward
or the step follows it) is not part of the iteration: its moments are taken back
(:meth:`MemoryTracer.rewind`), and where it was the iteration's first forward the next one begins
the iteration again, so such a forward neither changes the trace nor holds an iteration open.
The meter's saved-tensor hooks keep a detached tensor (the same storage, no autograd history): a
saved output of a node kept as itself would hold the node that saves it, a cycle through autograd's
graph that Python's collector does not see, and a forward never followed by a backward (which frees
what it saved) would keep its activations, and the tide, for good.

[Note: recomputation in the trace]
Activation checkpointing (``torch.utils.checkpoint``, reentrant or not, ``deepspeed.checkpointing``,
Hugging Face's ``gradient_checkpointing_enable``) runs a checkpointed block's forward again inside
backward. Its module hooks fire there, and each such pre-forward is a moment like any other,
labelled ``rec:<module>`` (:data:`RECOMPUTE`) instead of ``fwd:``: the trace holds, in backward, the
block's recomputation just before (reentrant: before; non-reentrant: right after the block's
pre-backward, when autograd unpacks what the block saved) the backward moments of its modules. So
Belady's next use of a chunk a recomputation needs is that recomputation, and the prefetch of the
moment before it brings the chunk in before the recomputation starts, not at its first use. A
recomputed module's tensors stay in use (``COMPUTE``, their chunks unmovable) until its backward
moment: :meth:`Trace.held_chunks` gives, per moment, the chunks in use then. The recomputation and
the backward moment are one backward use of those tensors, which the module's post-backward ends
(a frozen tensor's, see [Note: frozen chunks]): only the backward moment counts as a use.
A reentrant checkpoint's first forward runs under ``torch.no_grad()`` inside the run's ``FORWARD``
phase (see [Note: run state]), so those moments are part of the iteration (recorded, planned, kept
gathered) and not taken for an evaluation forward; a recomputation runs in the ``RECOMPUTE``
phase. The counters report the recomputation moments per step (``recompute_moments``) and the
tide plot shades them.
On CUDA the recomputed activations are in the allocator's bytes the tracer reads, a second, short
tide inside backward; the emulated accelerator's meter counts what autograd saves in the training
forward (and the blocks' inputs a checkpoint holds, see [Note: held inputs]), not what a
recomputation saves.

On CUDA the tracer reads the allocator's statistics without ever resetting them (the
user's peak statistics, and any "max allocated" a comparison reports, stay intact): the
highest allocation since the previous moment is known from the growth of the
process-wide peak, else the current allocation stands in (see
:meth:`~ds_patrickstar.memory.cuda.CudaAccelerator.memory_in_use`).
"""

from __future__ import annotations

import logging

from ..memory.accelerator import Accelerator
from ..memory.ledger import DeviceLedger
from .saved_meter import SavedTensorMeter
from .shapes import RetraceLog, RetraceReason, Signature, covers, widen
from .trace import NEVER, AccumulatorEvent, Moment, Trace

logger = logging.getLogger(__name__)


class MemoryTracer:
    """Records the moments of one iteration; see [Note: moments and the trace] and
    [Note: traces across input shapes]."""

    def __init__(self, accel: Accelerator, meter: SavedTensorMeter | None) -> None:
        self.accel = accel
        self.meter = meter
        self.trace: Trace | None = None
        self._recording = Trace()
        self.moment = -1
        self.tracing = True
        self.signature: Signature = ()  # the envelope of the traced input shapes
        self._before_forward: Signature | None = None  # the envelope before the last forward widened it
        self.log = RetraceLog(logger)
        self.retraced: RetraceReason | None = None  # why this iteration is traced anew (None: not a re-trace)
        self._covered: Trace | None = None  # the trace a re-trace for larger inputs covers too
        self._diverged_at = NEVER  # the moment a re-trace for another order began at

    def non_model_now(self, ledger: DeviceLedger) -> int:
        """Non-model accelerator bytes now; on CUDA also what the allocator's peak since the previous
        call says beyond the backend's own peak in the same interval (a chunk that arrived and left
        between two moments is ours, not the tide's)."""
        if self.meter is not None:
            return self.meter.bytes
        now, highest = self.accel.memory_in_use()
        return max(0, now - ledger.total, highest - ledger.interval_peak())

    def reading(self, ledger: DeviceLedger) -> tuple[int, int]:
        """``(non_model_now(ledger), the allocator's stranded bytes)`` from one read of the allocator (see
        [Note: one reading per hook] in moves.py)."""
        if self.meter is not None:
            return self.meter.bytes, self.accel.fragmentation()
        now, highest, stranded = self.accel.memory_reading()
        return max(0, now - ledger.total, highest - ledger.interval_peak()), stranded

    def note_written(self, chunk: int) -> None:
        """While tracing, a gradient went into ``chunk``'s payload at the current moment (see [Note: clean
        evictions] in store/clean_copies.py)."""
        if self.tracing and 0 <= self.moment < len(self._recording):
            self._recording.note_written(self.moment, chunk)

    def note_accumulator(self, chunk: int, event: AccumulatorEvent) -> None:
        """While tracing, ``event`` befell ``chunk``'s gradient accumulator at the current moment."""
        if self.tracing and 0 <= self.moment < len(self._recording):
            self._recording.note_accumulator(self.moment, chunk, event)

    def note_read(self, nbytes: int, late: bool) -> None:
        """Placement read ``nbytes`` beside model data at the current moment of the trace recorded or followed, in
        its hook or ``late``."""
        trace = self._recording if self.tracing else self.trace
        if trace is not None and 0 <= self.moment < len(trace):
            trace.note_read(self.moment, nbytes, late)

    def note_beside(self, nbytes: int) -> None:
        """Model data placement does not move at the end of the current moment's hook (several ranks)."""
        trace = self._recording if self.tracing else self.trace
        if trace is not None and 0 <= self.moment < len(trace):
            trace.note_beside(self.moment, nbytes)

    def note_gathered_ahead(self, chunks: frozenset[int]) -> None:
        """Own chunks the current moment's hook brought for their groups' all-gathers ahead of use (several ranks)."""
        trace = self._recording if self.tracing else self.trace
        if trace is not None and 0 <= self.moment < len(trace):
            trace.note_gathered_ahead(self.moment, chunks)

    def current_trace(self) -> Trace | None:
        """The trace to plan from, or None while an iteration is being traced."""
        return None if self.tracing else self.trace

    def last_iteration(self) -> Trace | None:
        """The moments of the iteration that has just ended (at its step): the one being traced, or
        the trace it followed; None before any."""
        trace = self._recording if self.tracing else self.trace
        return trace if trace is not None and len(trace) else None

    def start_iteration(self, signature: Signature = ()) -> None:
        """Called at the first forward after an optimizer step, with the shapes of the inputs."""
        self.log.new_iteration()
        self.retraced = None
        if self.tracing and len(self._recording):
            self.trace, self._recording = self._recording, Trace()
            self.tracing = False
            logger.info("ds_patrickstar: traced %d moments", len(self.trace))
        if not self.tracing and not covers(self.signature, signature):
            self._retrace(
                RetraceReason.SHAPE, f"input shapes changed from {self.signature} to {signature}", covered=self.trace
            )
        self._before_forward, self.signature = self.signature, widen(self.signature, signature)
        self.moment = -1

    def micro_step_inputs(self, signature: Signature) -> bool:
        """A later micro-step's first forward, with the shapes of its inputs: the envelope widens to hold them;
        returns whether they lay beyond it while the iteration follows a trace (see [Note: a risen tide] in
        activations/plan.py)."""
        beyond = not self.tracing and not covers(self.signature, signature)
        if beyond:
            logger.info(
                "ds_patrickstar: a micro-step's input shapes %s lie beyond every traced shape %s: every block's "
                "activations it saves are offloaded (where activations are offloaded), and the plan is made again "
                "from the tide it measured",
                signature,
                self.signature,
            )
        self._before_forward, self.signature = self.signature, widen(self.signature, signature)
        return beyond

    def _retrace(self, reason: RetraceReason, detail: str, covered: Trace | None = None) -> None:
        self.log.retraced(reason, detail)
        self.tracing, self.retraced, self._covered = True, reason, covered
        self._recording = Trace()
        self._diverged_at = NEVER

    def cover_previous(self) -> None:
        """At the step of an iteration traced for larger inputs: its tide covers the previous trace's
        (see [Note: traces across input shapes])."""
        if self.tracing and self._covered is not None:
            self._recording.cover(self._covered)
        self._covered = None

    def rewind(self, moment: int) -> None:
        """The moments after ``moment`` are taken back (a forward without a backward, see
        [Note: moments and the trace]); a re-trace that began among them is undone, and so is the widening of the
        envelope by that forward's shapes (no tide was measured for them: a later training forward as large is
        beyond it)."""
        if self._before_forward is not None:
            self.signature, self._before_forward = self._before_forward, None
        self.moment = moment
        if not self.tracing:
            return
        if self._diverged_at > moment and self._diverged_at != NEVER:
            self.tracing, self.retraced, self._diverged_at = False, None, NEVER
            self._recording = Trace()
            return
        self._recording.truncate(moment + 1)

    def record(self, label: str, chunks: tuple[int, ...], ledger: DeviceLedger) -> int:
        """Advance to the next moment; returns its index."""
        self.moment += 1
        trace = self.current_trace()
        if trace is not None:
            expected = trace.moments[self.moment] if self.moment < len(trace) else None
            if expected is None or expected.label != label:
                self._retrace(
                    RetraceReason.ORDER, f"iteration differs from the trace at moment {self.moment} ({label})"
                )
                for moment in trace.moments[: self.moment]:
                    self._recording.add(moment)
                self._diverged_at = self.moment
        if self.tracing:
            self._recording.add(Moment(label, chunks, self.non_model_now(ledger)))
        return self.moment
