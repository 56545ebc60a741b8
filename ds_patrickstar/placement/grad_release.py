"""Host-updated chunks sent to the host during backward, once their last use is behind.

[Note: gradients leave in backward]
A chunk Adam updates on the host leaves the accelerator with its gradient (in its slot, see [Note: gradient in
the param slot]) for the host update. Where the trace says its last use this iteration is behind (a moment
before the current one; no later moment, recomputations included, uses it), it is sent at the next moment it
is movable (no tensor of it in use) and its gradient is final (the gradient sink says so, when it takes the
chunk's norm: its last gradient is in; with ``W`` ranks, its group's reduce-scatter has put this rank's piece
in the slot, see [Note: the norm as gradients become final]), during backward instead of at the step: the copy
runs behind the rest of backward's compute, and the room it leaves serves the moments after it. It is the
eviction Belady would choose first anyway (next use: the next iteration), made early. With ``W`` ranks a chunk
whose collective is still in flight waits for a later moment (it is never evicted through a wait on it): the
reduce-scatter completes when the backend has run it (reaped at the next moment or gradient, at the latest two
reduce-scatters later, see memory/reductions.py), so the moment it leaves can differ from run to run, never
its bytes or its values. Only once a step has placed the optimizer states from this trace (before, any chunk
may turn out to be updated on the accelerator); with gradient accumulation the last use is in the boundary
micro-step. The move model models it (at several ranks as at the moment after the last use, the same bytes); the
counter ``grads_released_in_backward`` counts them, and where the collective completes late a chunk still waiting
may leave through an eviction making room instead (counted in ``evictions``).
"""

from __future__ import annotations

from collections.abc import Callable

from ..chunks.chunk import Chunk
from ..counters import StepCounters
from .moves import ChunkMoves
from .trace import Trace


class GradientRelease:
    """The chunks whose gradients leave during backward (see [Note: gradients leave in backward])."""

    def __init__(self, moves: ChunkMoves, counters: StepCounters, trainable: set[int]) -> None:
        self.moves, self.counters, self.trainable = moves, counters, trainable
        self._finished: set[int] = set()  # host-updated chunks whose last use is behind, still on the accelerator
        self._final: set[int] = set()  # chunks whose slot holds the final gradient of this iteration
        # told of each chunk sent (or found) home with its final gradient (see [Note: host updates in backward])
        self.on_home: Callable[[Chunk], None] | None = None

    def gradient_final(self, chunk_id: int) -> None:
        """``chunk_id``'s slot holds its final gradient of this iteration; it leaves at the next moment."""
        self._final.add(chunk_id)

    def after_moment(self, trace: Trace | None, moment: int, on_device: set[int]) -> None:
        """At recorded ``moment`` of ``trace`` (None: no trace whose optimizer states were placed; ``on_device``:
        the chunks updated on the accelerator): the chunks last used at the moment before join those waiting,
        and those movable whose gradient is final leave. A new iteration (moment 0) starts with none waiting
        and no gradient final."""
        if moment < 1:
            self._finished.clear()
            self._final.clear()
        if trace is None or moment < 1:
            return
        before, end = moment - 1, len(trace)
        if before < end:
            for chunk in trace.moments[before].chunks:
                if chunk in self.trainable and chunk not in on_device and trace.next_use(chunk, before) >= end:
                    self._finished.add(chunk)
        for chunk_id in sorted(self._finished & self._final):
            finished = self.moves.chunks[chunk_id]
            if finished.on_host:
                self._finished.discard(chunk_id)
            elif finished.movable and not _in_flight(finished):
                self._finished.discard(chunk_id)
                self.moves.evict(finished)
                self.counters.grads_released_in_backward += 1
            else:
                continue
            if self.on_home is not None:
                self.on_home(finished)


def _in_flight(chunk: Chunk) -> bool:
    """A collective into ``chunk`` is pending (not waited on): evicting it would wait for it."""
    return any(p.collective and not p.done() for p in chunk.pending)
