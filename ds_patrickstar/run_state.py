"""Where the run is: one phase of a training iteration at a time, and the legal moves between them.

A leaf module: the chunk manager, placement and the hook target all ask the one :class:`RunState`
of a run what phase it is in.

[Note: run state]
A run is in one :class:`Phase` at a time:

* ``IDLE``: no training forward since the last optimizer step (or since the start); the next
  training forward begins an iteration (placement starts its trace there, see
  [Note: moments and the trace]);
* ``FORWARD``: a training forward of the root module is running: a forward under grad mode,
  no-grad regions inside it included (a reentrant checkpoint's first forward; see
  [Note: recomputation in the trace]);
* ``FORWARD_DONE``: training forwards have ended and no backward has begun. A forward without a
  backward (a validation loss computed under grad mode) ends here: it opens no iteration; another
  forward, a step, an evaluation or ``destroy`` may follow;
* ``EVAL_FORWARD``: a forward of the root module under ``no_grad``; when it ends the run is back in
  the phase it came from;
* ``BACKWARD``: a backward pass is running (from the first hook autograd fires in it to the
  final callback that ends it, see [Note: end of backward] in integration/backward_end.py);
* ``RECOMPUTE``: inside a backward, a hooked module's forward runs again (an activation-checkpoint
  recomputation); the next backward hook is ``BACKWARD`` again (a non-reentrant checkpoint may
  stop a recomputation early, so its end is not waited for);
* ``BACKWARD_DONE``: a backward has ended; the step or the next micro-step's forward follows;
* ``STEP``: the optimizer step is running; it ends in ``IDLE`` even where it raises.

The hooks move the run (``integration/hook_target.py``: the root module's forward begins and ends,
a backward hook fires, a hooked module's forward runs inside backward, autograd's final callback
ends the backward), and so does the optimizer (the step); every other part only asks. A hooked module called on its own,
outside the root module's forward, moves nothing: its moments are not training moments. The legal
moves are the table :data:`_LEGAL`; anything else raises :class:`IllegalRunTransition` naming both
phases. A backward that begins inside a training forward (``torch.autograd.grad`` called in the forward,
an input-gradient penalty) raises :class:`BackwardInForward` naming the call and the module or parameter
it reached: the forward's chunk groups are in use (kept, released or gathered by the forward's own
rules), and stock ZeRO-3 hangs there. A forward or backward that raised leaves its phase as it was: the run is
*mid-iteration* (``FORWARD``, ``BACKWARD``, ``RECOMPUTE``), and only a new forward of the root
module leaves it (after a backward that raised, through ``IDLE``: see [Note: a backward that raised] in
groups/manager.py). Mid-iteration, with data parallelism, a rank may have failed inside a collective
the others wait in, so ``destroy`` must not gather (see [Note: engine teardown]).

The questions asked of the phase:

* a *training moment* (:meth:`RunState.trains`): ``FORWARD``, ``BACKWARD``, ``RECOMPUTE``: the
  moment belongs to the iteration: chunk groups are kept and prefetched for it, and placement
  records it in the trace; an evaluation forward is placed greedily and recorded nowhere;
* *mid-iteration* (:meth:`RunState.mid_iteration`): the same phases, asked by ``destroy``;
* a *recorded moment* (:meth:`RunState.records`): a training moment or the ``STEP``;
* whether a forward use will be read again by a backward (:meth:`RunState.saves_for_backward`):
  ``FORWARD`` under grad mode (a no-grad region of a training forward saves nothing);
* a backward use (:meth:`RunState.in_backward`): ``BACKWARD`` or ``RECOMPUTE``; a recomputation
  (:meth:`RunState.recomputing`): ``RECOMPUTE``.
"""

from __future__ import annotations

import enum
from collections.abc import Callable

import torch


class IllegalRunTransition(RuntimeError):
    """The run was asked to move between phases in a way [Note: run state] forbids."""


class BackwardInForward(IllegalRunTransition):
    """Autograd ran a backward of the model inside its training forward; see [Note: run state]."""


class Phase(enum.Enum):
    IDLE = "idle"
    FORWARD = "forward"
    FORWARD_DONE = "forward_done"
    EVAL_FORWARD = "eval_forward"
    BACKWARD = "backward"
    RECOMPUTE = "recompute"
    BACKWARD_DONE = "backward_done"
    STEP = "step"


_P = Phase
_NEW_FORWARD = frozenset({_P.FORWARD, _P.EVAL_FORWARD})  # a root forward may begin after any phase but the step
_LEGAL: dict[Phase, frozenset[Phase]] = {
    _P.IDLE: _NEW_FORWARD,
    # FORWARD -> FORWARD / EVAL_FORWARD: the training forward raised, the next root forward starts afresh.
    _P.FORWARD: _NEW_FORWARD | {_P.FORWARD_DONE},
    # -> BACKWARD_DONE: a backward that reached no hooked module; -> STEP: a forward without backward
    # (a validation loss) after the boundary micro-step's backward.
    _P.FORWARD_DONE: _NEW_FORWARD | {_P.BACKWARD, _P.RECOMPUTE, _P.BACKWARD_DONE, _P.STEP},
    # back to the phase the evaluation began in (a mid-iteration one where an earlier forward raised)
    _P.EVAL_FORWARD: _NEW_FORWARD | {_P.IDLE, _P.FORWARD_DONE, _P.BACKWARD, _P.RECOMPUTE, _P.BACKWARD_DONE},
    # -> FORWARD / EVAL_FORWARD: the backward raised
    _P.BACKWARD: _NEW_FORWARD | {_P.RECOMPUTE, _P.BACKWARD_DONE},
    _P.RECOMPUTE: _NEW_FORWARD | {_P.BACKWARD, _P.BACKWARD_DONE},
    # -> BACKWARD_DONE: a backward epilogue that comes twice
    _P.BACKWARD_DONE: _NEW_FORWARD | {_P.BACKWARD_DONE, _P.STEP},
    _P.STEP: frozenset({_P.IDLE}),
}
_TRAINING = frozenset({_P.FORWARD, _P.BACKWARD, _P.RECOMPUTE})


def check_move(old: Phase, new: Phase) -> None:
    if new not in _LEGAL[old]:
        raise IllegalRunTransition(
            f"illegal run phase transition {old.name} -> {new.name}; "
            f"from {old.name} only {sorted(p.name for p in _LEGAL[old])} are allowed"
        )


def _backward_in_forward(where: str) -> str:
    return (
        f"a backward pass reached {where} while the model's training forward was still running: "
        f"torch.autograd.grad (or .backward()) called inside the forward, such as an input-gradient penalty "
        f"or forces computed as -dE/dx, is not supported by stage 'patrickstar' (its chunks are in use by the "
        f"forward; stock ZeRO-3 hangs there). Train this model with ZeRO stage 0-2, or compute the term "
        f"without autograd inside the forward"
    )


class RunState:
    """The phase of one run and its moves; see [Note: run state]."""

    def __init__(self) -> None:
        self.phase = Phase.IDLE
        self._before_eval = Phase.IDLE  # where an evaluation forward returns to
        self.on_settled: Callable[[], None] | None = None  # called on entering a settled phase

    def _move(self, new: Phase) -> None:
        check_move(self.phase, new)
        was, self.phase = self.settled(), new
        if self.on_settled is not None and not was and self.settled():
            self.on_settled()

    def settled(self) -> bool:
        """No autograd graph of the run is alive: ``IDLE`` or ``BACKWARD_DONE`` (a parameter may point away from its
        released memory, see [Note: released parameters read as empty] in memory/released_views.py)."""
        return self.phase in (Phase.IDLE, Phase.BACKWARD_DONE)

    # ---- moves ---------------------------------------------------------------------
    def start_forward(self, grad: bool) -> bool:
        """The root module's forward begins (``grad``: under grad mode); returns whether it begins an
        iteration (the first training forward since the step)."""
        if not grad:
            if self.phase is not Phase.EVAL_FORWARD:
                self._before_eval = self.phase
            self._move(Phase.EVAL_FORWARD)
            return False
        first = self.phase is Phase.IDLE or (self.phase is Phase.EVAL_FORWARD and self._before_eval is Phase.IDLE)
        self._move(Phase.FORWARD)
        return first

    def end_forward(self) -> None:
        """The root module's forward is over."""
        self._move(self._before_eval if self.phase is Phase.EVAL_FORWARD else Phase.FORWARD_DONE)

    def backward_hook(self, where: str = "the model") -> None:
        """Autograd runs one of our backward hooks (a module's backward, a gradient's arrival) for ``where``."""
        if self.phase is Phase.FORWARD:
            raise BackwardInForward(_backward_in_forward(where))
        if self.phase is not Phase.BACKWARD:
            self._move(Phase.BACKWARD)

    def recompute(self) -> None:
        """A hooked module's forward runs inside backward."""
        if self.phase is not Phase.RECOMPUTE:
            self._move(Phase.RECOMPUTE)

    def end_backward(self) -> None:
        self._move(Phase.BACKWARD_DONE)

    def abort_iteration(self) -> None:
        """A backward that raised is abandoned (see [Note: a backward that raised] in groups/manager.py)."""
        if self.phase not in (Phase.BACKWARD, Phase.RECOMPUTE):
            raise IllegalRunTransition(f"abandoning an iteration from {self.phase.name}: no backward raised")
        self.phase = Phase.IDLE

    def start_step(self) -> None:
        self._move(Phase.STEP)

    def end_step(self) -> None:
        self._move(Phase.IDLE)

    # ---- questions -----------------------------------------------------------------
    def forward_without_backward(self) -> bool:
        """The last training forward ended and no backward followed it (yet): a forward or the step
        now makes it a forward without backward (a validation loss under grad mode)."""
        phase = self._before_eval if self.phase is Phase.EVAL_FORWARD else self.phase
        return phase is Phase.FORWARD_DONE

    def trains(self) -> bool:
        """A moment now is a training moment."""
        return self.phase in _TRAINING

    def backward_raised(self) -> bool:
        """A backward began and did not end (asked when no backward is running: it raised)."""
        return self.phase in (Phase.BACKWARD, Phase.RECOMPUTE)

    def mid_iteration(self) -> bool:
        """A training forward or backward began and did not end (it may have raised)."""
        return self.phase in _TRAINING

    def records(self) -> bool:
        """A moment now is recorded in the trace: a training moment or the step."""
        return self.phase in _TRAINING or self.phase is Phase.STEP

    def saves_for_backward(self) -> bool:
        """A forward use now is read again by a backward: a training forward under grad mode."""
        return self.phase is Phase.FORWARD and torch.is_grad_enabled()

    def in_backward(self) -> bool:
        return self.phase is Phase.BACKWARD or self.phase is Phase.RECOMPUTE

    def recomputing(self) -> bool:
        return self.phase is Phase.RECOMPUTE
