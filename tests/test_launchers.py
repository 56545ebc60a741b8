"""Real launchers: ``torchrun`` and ``deepspeed`` start tests/scripts/tiny_train.py on 2 ranks (gloo on CPU).

Both ranks see the same data, so their losses are identical, and identical between launchers.
A failure on one rank must end the run (non-zero exit, within the timeout) with that rank's
error in the output, not hang the other rank in a collective. About 10-15 s per launch here.
"""
import json
import math
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from multiproc import free_port

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "scripts" / "tiny_train.py"
TIMEOUT = 180
LAUNCHERS = ("torchrun", "deepspeed")
# the pytest process carries single-rank settings (conftest); a launcher must set its own
DIST_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
            "CROSS_RANK", "CROSS_SIZE")


def _launcher_cmd(launcher):
    port = str(free_port())
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", port]
    exe = shutil.which("deepspeed")
    if exe is None:
        pytest.skip("the deepspeed launcher is not on PATH")
    # CPU-only: --num_gpus (alias --num_accelerators) is the number of local processes
    return [exe, "--num_gpus", "2", "--master_port", port]


def _start(launcher, out, *extra):
    """(launcher, the started launch, its master port)."""
    env = {k: v for k, v in os.environ.items() if k not in DIST_ENV}
    env.setdefault("OMP_NUM_THREADS", "1")
    cmd = _launcher_cmd(launcher) + [str(SCRIPT), "--out", str(out), *extra]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    return launcher, proc, cmd[cmd.index("--master_port") + 1]


def _finish(started):
    """The launch's exit code and output; a launch not done within ``TIMEOUT`` is killed and fails the test."""
    launcher, proc, port = started
    try:
        output = proc.communicate(timeout=TIMEOUT)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"{launcher} did not finish within {TIMEOUT} s:\n{(proc.communicate()[0] or '')[-4000:]}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
        _remove_shm_buffers(port)
    return proc.returncode, output


def _side_by_side(started):
    """:func:`_finish` of each launch in ``started`` (from :func:`_start`, each with its own port and
    output folder); any still running when one fails the test is killed."""
    try:
        return [_finish(launch) for launch in started]
    finally:
        for _, proc, port in started:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
                _remove_shm_buffers(port)


def _remove_shm_buffers(port):
    """DeepSpeed's shm comm op leaves ``/dev/shm/deepspeed_allreduce_buffer_*_<port>_<rank>`` (69 MB
    each) behind when a rank is killed; a machine running this suite often would fill its /dev/shm."""
    for path in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"):
        path.unlink(missing_ok=True)


def _losses(out):
    runs = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["world_size"] for r in runs] == [2, 2]
    return [r["losses"] for r in runs]


def test_torchrun_and_deepspeed_launchers_agree(tmp_path):
    losses = {}
    _launcher_cmd("deepspeed")  # skips before any launch where the deepspeed launcher is not installed
    finished = _side_by_side([_start(launcher, tmp_path / launcher) for launcher in LAUNCHERS])
    for launcher, (rc, output) in zip(LAUNCHERS, finished):
        assert rc == 0, f"{launcher} exited {rc}:\n{output[-4000:]}"
        per_rank = _losses(tmp_path / launcher)
        assert len(per_rank[0]) == 5 and all(math.isfinite(v) for v in per_rank[0])
        assert per_rank[0] == per_rank[1], f"{launcher}: ranks disagree (same data on both): {per_rank}"
        losses[launcher] = per_rank[0]
    assert losses["torchrun"] == losses["deepspeed"]


@pytest.fixture(scope="module")
def failed_launches(tmp_path_factory):
    """Each launcher's run with a failure on rank 1, side by side: launcher -> (exit code, output,
    output folder); a launcher not installed is left out."""
    root = tmp_path_factory.mktemp("failed")
    started = [_start(launcher, root / launcher, "--fail-rank", "1", "--fail-step", "2") for launcher in LAUNCHERS
               if launcher != "deepspeed" or shutil.which("deepspeed") is not None]
    return {launch[0]: (*done, root / launch[0]) for launch, done in zip(started, _side_by_side(started))}


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_failure_on_one_rank_ends_the_run_with_its_error(failed_launches, launcher):
    if launcher not in failed_launches:
        _launcher_cmd(launcher)  # skips, saying why
    rc, output, out = failed_launches[launcher]
    assert rc != 0, output[-4000:]
    assert "injected failure on rank 1 at step 2" in output, output[-4000:]
    assert not (out / "rank0.json").exists()  # rank 0 did not finish training
