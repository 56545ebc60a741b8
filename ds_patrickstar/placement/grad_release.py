"""Host-updated chunks sent to the host during backward, once their last use is behind.

[Note: gradients leave in backward]
A chunk Adam updates on the host leaves the accelerator with its gradient (in its slot, see [Note: gradient in
the param slot]) for the host update. Where the trace says its last use this iteration is behind (a moment
before the current one; no later moment, recomputations included, uses it), it is sent at the next moment it
is movable (no tensor of it in use: a gradient still to come keeps a tensor in ``COMPUTE``), during backward
instead of at the step: the copy runs behind the rest of backward's compute, and the room it leaves serves the
moments after it. It is the eviction Belady would choose first anyway (next use: the next iteration), made
early. Only once a step has placed the optimizer states from this trace (before, any chunk may turn out to be
updated on the accelerator); one rank (the move model's scope, which models it; with gradient accumulation the last
use is in the boundary micro-step);
the counter ``grads_released_in_backward`` counts them.
"""

from __future__ import annotations

from ..counters import StepCounters
from .moves import ChunkMoves
from .tracer import Trace


class GradientRelease:
    """The chunks whose gradients leave during backward (see [Note: gradients leave in backward])."""

    def __init__(self, moves: ChunkMoves, counters: StepCounters, trainable: set[int]) -> None:
        self.moves, self.counters, self.trainable = moves, counters, trainable
        self._finished: set[int] = set()  # host-updated chunks whose last use is behind, still on the accelerator

    def after_moment(self, trace: Trace | None, moment: int, on_device: set[int]) -> None:
        """At recorded ``moment`` of ``trace`` (None: no trace whose optimizer states were placed; ``on_device``:
        the chunks updated on the accelerator): the chunks last used at the moment before join those waiting,
        and those movable leave. A new iteration (moment 0) starts with none waiting."""
        if moment < 1:
            self._finished.clear()
        if trace is None or moment < 1:
            return
        before, end = moment - 1, len(trace)
        if before < end:
            for chunk in trace.moments[before].chunks:
                if chunk in self.trainable and chunk not in on_device and trace.next_use(chunk, before) >= end:
                    self._finished.add(chunk)
        for chunk_id in sorted(self._finished):
            finished = self.moves.chunks[chunk_id]
            if finished.on_host or finished.movable:
                self._finished.discard(chunk_id)
            if not finished.on_host and finished.movable:
                self.moves.evict(finished)
                self.counters.grads_released_in_backward += 1
