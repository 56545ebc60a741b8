"""The run's phases and their legal moves (see [Note: run state] in ds_patrickstar/run_state.py)."""
from __future__ import annotations

import pytest

from ds_patrickstar.run_state import IllegalRunTransition, Phase, RunState


def _trained() -> RunState:
    run = RunState()
    assert run.start_forward(grad=True)  # the first training forward since the step begins an iteration
    run.end_forward()
    run.backward_hook()
    run.end_backward()
    run.start_step()
    run.end_step()
    return run


def test_an_illegal_move_raises_naming_both_phases():
    run = RunState()
    with pytest.raises(IllegalRunTransition, match="IDLE -> BACKWARD_DONE"):
        run.end_backward()  # a backward epilogue with no forward since the step
    run.start_forward(grad=True)
    with pytest.raises(IllegalRunTransition, match="FORWARD -> STEP"):
        run.start_step()  # a step inside a forward
    assert run.phase is Phase.FORWARD


def test_a_forward_without_backward_is_not_mid_iteration():
    run = _trained()
    assert run.phase is Phase.IDLE and not run.trains()
    assert run.start_forward(grad=True) and run.trains()
    run.end_forward()  # a validation loss, not backwarded
    assert run.phase is Phase.FORWARD_DONE and not run.trains() and not run.records()
    assert not run.start_forward(grad=True)  # the same iteration goes on
    run.end_forward()
    run.start_step()  # after the boundary backward, a step may follow such a forward
    run.end_step()
    assert run.phase is Phase.IDLE


def test_an_evaluation_forward_returns_to_its_phase_and_a_raised_forward_stays_mid_iteration():
    run = RunState()
    run.start_forward(grad=True)
    run.end_forward()
    assert not run.start_forward(grad=False)
    assert run.phase is Phase.EVAL_FORWARD and not run.records()
    run.end_forward()
    assert run.phase is Phase.FORWARD_DONE
    run.start_forward(grad=True)  # ... and raises: it never ends
    assert run.trains()
    run.start_forward(grad=True)  # the next forward starts afresh
    run.end_forward()
    run.recompute()  # a backward whose first hook is a recomputation
    assert run.recomputing() and run.in_backward() and run.trains()
    run.backward_hook()
    assert run.phase is Phase.BACKWARD
