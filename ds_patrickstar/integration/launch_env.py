"""One process without a launcher: the environment ``torch.distributed`` needs, filled in.

[Note: no launcher]
``python train.py --deepspeed cfg.json`` starts one process with none of the variables a
launcher sets. DeepSpeed's ``init_distributed`` then falls back to MPI discovery and fails
with ``No module named 'mpi4py'``. For a "patrickstar" run that is not initialized yet, when
no launcher variable is set (no ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, and no MPI
launcher's ``OMPI_COMM_WORLD_*`` / ``PMI_*``), :func:`fill_single_process_env` sets what is
missing of ``RANK=0``, ``LOCAL_RANK=0``, ``WORLD_SIZE=1``, ``MASTER_ADDR=127.0.0.1`` and a
free ``MASTER_PORT``, logs what it set, and never overrides a value the user set (e.g.
``MASTER_PORT``). A launch that sets some launcher variables is left to DeepSpeed.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import MutableMapping

logger = logging.getLogger(__name__)

LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMI_RANK")


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def fill_single_process_env(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set the single-process defaults that are missing when no launcher started this process;
    return what was set (empty when a launcher did); see [Note: no launcher]."""
    env = os.environ if environ is None else environ
    if any(name in env for name in LAUNCHER_VARIABLES):
        return {}
    defaults = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
    if "MASTER_PORT" not in env:
        defaults["MASTER_PORT"] = _free_port()
    set_now = {name: value for name, value in defaults.items() if name not in env}
    env.update(set_now)
    logger.warning(
        "no launcher variables (RANK, WORLD_SIZE, LOCAL_RANK) are set: running as a single process with %s",
        " ".join(f"{k}={v}" for k, v in set_now.items()),
    )
    return set_now
