"""SIGKILL a re-save into the same tag at several points of the save (tests/test_checkpoint_safety.py).

    python tests/scripts/resave_kill.py DIR

Every run: tests/test_checkpoint.py's model and batches on one rank, trained to step 2 and saved as
tags ``"step2"`` and ``"last"`` (``latest`` names ``"last"``), trained to step 4 and saved as
``"last"`` again, and killed with SIGKILL at one point of that second save: the test's own
wrappers around the save's steps (``commit``'s functions, DeepSpeed's file writes) send the
signal, so each run stops at the same place every time; nothing in ds_patrickstar is test-only.
The runs are forked from this process after the imports and before any process group exists
(each child makes its own), two at a time. Then this process trains the uninterrupted run to
step 6 and loads every run's folder: its ``latest`` (refused, or trained two steps from the step it
loaded) and ``"step2"`` (which must train to the uninterrupted losses of
steps 3 and 4). Prints one line, RESULT and a JSON object: the reference losses and what each
point gave.
"""
import io
import json
import os
import signal
import sys
import traceback
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(TESTS.parent), str(TESTS)]  # the working tree's ds_patrickstar, the tests' helpers

import harness
import torch
from test_checkpoint import _batches, _engine, _train

import ds_patrickstar  # noqa: F401
from ds_patrickstar.io import commit

RESULT = "@@RESULT@@"


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _after(name: str):
    original = getattr(commit, name)

    def call_then_die(*args, **kwargs):
        original(*args, **kwargs)
        _die()

    setattr(commit, name, call_then_die)


def _before(name: str):
    setattr(commit, name, lambda *args, **kwargs: _die())


def _half_of(engine, suffix: str):
    """The first file whose name ends with ``suffix`` is written half, then the process dies."""
    original = engine.checkpoint_engine.save

    def save(state_dict, path):
        if not path.endswith(suffix):
            return original(state_dict, path)
        buffer = io.BytesIO()
        torch.save(state_dict, buffer)
        with open(path, "wb") as f:
            f.write(buffer.getvalue()[: len(buffer.getvalue()) // 2])
        _die()

    engine.checkpoint_engine.save = save


def _model_file_then_die(engine):
    engine._save_zero_checkpoint = lambda *args, **kwargs: _die()


def _marker_temporary_then_die():
    def write(path, text):
        if not path.endswith(commit.MARKER):
            return original(path, text)
        with open(f"{path}.tmp{os.getpid()}", "w") as f:
            f.write(text[: len(text) // 2])
        _die()

    original = commit.atomic_write_text
    commit.atomic_write_text = write


def _marker_then_die():
    def write(path, text):
        original(path, text)
        if path.endswith(commit.MARKER):
            _die()

    original = commit.atomic_write_text
    commit.atomic_write_text = write


# the points of the second save, in the order the save reaches them
KILL_AT = {
    "marker_removed": lambda engine: _after("begin_save"),
    "half_of_the_model_file": lambda engine: _half_of(engine, "model_states.pt"),
    "model_file_written": _model_file_then_die,
    "half_of_the_optimizer_file": lambda engine: _half_of(engine, "optim_states.pt"),
    "files_written_not_synced": lambda engine: _before("sync_saved_files"),
    "files_synced_no_marker": lambda engine: _before("write_marker"),
    "marker_temporary_written": lambda engine: _marker_temporary_then_die(),
    "marker_written_latest_not": lambda engine: _marker_then_die(),
}


def _killed_run(point: str, folder: str) -> None:
    harness.ensure_distributed()
    batches = _batches()
    engine = _engine()
    _train(engine, batches[:2])
    engine.save_checkpoint(folder, tag="step2")
    engine.save_checkpoint(folder, tag="last")
    _train(engine, batches[2:4])
    KILL_AT[point](engine)
    engine.save_checkpoint(folder, tag="last")


def _fork(point: str, folder: str) -> int:
    pid = os.fork()
    if pid == 0:
        try:
            _killed_run(point, folder)
        except BaseException:
            traceback.print_exc()
            os._exit(4)
        os._exit(3)  # the save finished: the kill point was never reached
    return pid


def _wait(pid: int, point: str) -> None:
    _, status = os.waitpid(pid, 0)
    if not (os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL):
        raise SystemExit(f"the run killed at {point} ended with status {status}, not by SIGKILL")


def _check(engine, folder: str, batches) -> dict:
    try:
        engine.load_checkpoint(folder)  # `latest`: "last"
        step = engine.global_steps
        latest = {"global_steps": step, "losses": _train(engine, batches[step : step + 2])}
    except commit.CheckpointError as err:
        latest = {"refused": str(err)}
    engine.load_checkpoint(folder, tag="step2")
    return {"latest": latest, "step2": {"global_steps": engine.global_steps, "losses": _train(engine, batches[2:4])}}


def main(root: str) -> None:
    harness.setup_single_process_env()
    running: list[tuple[int, str]] = []
    for point in KILL_AT:
        if len(running) == 2:
            _wait(*running.pop(0))
        running.append((_fork(point, os.path.join(root, point)), point))
    for pid, point in running:
        _wait(pid, point)
    harness.ensure_distributed()
    batches = _batches()
    engine = _engine()
    result = {"reference": _train(engine, batches[:6])}
    result.update({point: _check(engine, os.path.join(root, point), batches) for point in KILL_AT})
    print(RESULT + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
