"""How often a 2-rank gloo run aborts at interpreter exit, with and without the engine's wait for
gloo's workers (see [Note: gloo workers idle at exit] in ds_patrickstar/integration/process_exit.py).

    python benchmarks/exit_abort.py --runs 60

Runs ``torchrun --nproc_per_node 2 tests/scripts/tiny_train.py --unmodified-end`` (ends with a loss
averaged over the ranks and no ``destroy_process_group``, as an unmodified Hugging Face script ends)
``--runs`` times each with and without ``--no-exit-wait``, alternating, and counts the runs whose
output has ``terminate called`` (a rank ended by SIGABRT after its work was done). Each run is a
fresh pair of processes (about 10 s on 2 cores); the rate depends on the machine's load.
"""

import argparse
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "scripts" / "tiny_train.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_run(wait: bool, out: str) -> str:
    """``aborted``, ``ok`` or ``failed`` for one 2-rank run."""
    cmd = ["torchrun", "--nproc_per_node", "2", "--master_port", str(_free_port()), str(SCRIPT),
           "--out", out, "--unmodified-end"] + ([] if wait else ["--no-exit-wait"])
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if "terminate called" in done.stdout + done.stderr:
        return "aborted"
    if done.returncode != 0:
        sys.stderr.write(done.stderr[-3000:])
        return "failed"
    return "ok"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=60, help="runs of each variant")
    args = p.parse_args(argv)
    counts = {True: {"aborted": 0, "ok": 0, "failed": 0}, False: {"aborted": 0, "ok": 0, "failed": 0}}
    with tempfile.TemporaryDirectory() as out:
        for i in range(args.runs):
            for wait in (False, True):
                counts[wait][one_run(wait, out)] += 1
            print(f"run {i + 1}: without the wait {counts[False]}, with it {counts[True]}", flush=True)
    for wait, label in ((False, "without the exit wait"), (True, "with the exit wait")):
        c = counts[wait]
        print(f"{label}: {c['aborted']} of {args.runs} runs aborted at exit ({c['failed']} failed otherwise)")


if __name__ == "__main__":
    main()
