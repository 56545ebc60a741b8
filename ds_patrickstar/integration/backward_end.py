"""The end of a backward pass, from autograd itself: a final callback queued at its first hook.

[Note: end of backward]
A backward pass of the model ends when autograd has run every node of it: every gradient is in its
slot, every module's backward is over. :class:`BackwardEnd` learns it from autograd, as FSDP2 does:
the first of our hooks that autograd runs in a backward pass (the model's outputs get their
gradient, a module's backward begins, a gradient arrives) queues one final callback on the running
backward (``queue_callback`` of autograd's engine), which runs once the pass is over, on the thread
that runs it, and ends our backward there (the backward epilogue: the leaf modules' and frozen
tensors' uses end, every group's gradients are reduced; see ``groups/manager.py``). So a
``loss.backward()`` called without DeepSpeed's engine ends the same way as ``engine.backward``.

The callback holds a sentinel object and nothing else holds it: while the callback is queued, the
sentinel is alive, and that is what :attr:`BackwardEnd.running` reads. When the pass raises, autograd
drops its final callbacks unrun; the sentinel goes with them and ``running`` is false again, so the
next forward of the model is a forward, not a recomputation (see [Note: run state]). A recomputation
is a hooked module's forward while ``running`` (an activation checkpoint's forward inside backward):
the hook on the model's outputs queues the callback before autograd reaches any module, so a
recomputation of the outermost module is seen as one too. A backward that reaches none of our
hooks (a loss that reads no parameter) queues nothing: DeepSpeed's backward epilogue ends it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch


class _Sentinel:
    """Alive while a final callback is queued on a running backward pass."""


class BackwardEnd:
    """Queues the final callback of a backward pass and tells whether one runs; see [Note: end of backward]."""

    def __init__(self, on_end: Callable[[], None]) -> None:
        self._on_end = on_end
        self._queued: weakref.ref[_Sentinel] | None = None

    @property
    def running(self) -> bool:
        """A backward pass of ours is running now (its final callback is queued and has not run)."""
        return self._queued is not None and self._queued() is not None

    def arm(self) -> None:
        """Our hook runs inside a backward pass: its end is ours too (once per pass)."""
        if self.running:
            return
        sentinel = _Sentinel()
        self._queued = weakref.ref(sentinel)

        def end(held: _Sentinel = sentinel) -> None:
            self._queued = None
            self._on_end()

        torch.autograd.Variable._execution_engine.queue_callback(end)
