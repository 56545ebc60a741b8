"""Where JIT-built ops go, and build locks that no build will ever release.

[Note: JIT build folder]
torch builds C++ ops (DeepSpeed's, and our Adam kernels) into ``TORCH_EXTENSIONS_DIR``, by default
``~/.cache/torch_extensions``: one folder for every Python environment of the user, so environments
with different torch or DeepSpeed builds rebuild each other's ops, and share each other's build
locks. So ``import ds_patrickstar`` (the autoload hook imports it with DeepSpeed) sets
``TORCH_EXTENSIONS_DIR`` to ``<sys.prefix>/torch_extensions`` when it is not set and the
environment's folder is writable, as ``.ci/run`` does; a value the user set always wins.

A build holds a ``lock`` file in its op's folder while ninja runs; another process that needs the op
waits for that file to go, with no timeout and no message. A build killed part way leaves it behind,
and every later run hangs at ``deepspeed.initialize``. :func:`report_stale_locks` (also at import)
warns, naming the file and the fix, about each lock older than :data:`STALE_AFTER_S` in whose folder
no process runs (a build's ninja and compilers run there).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path

logger = logging.getLogger(__name__)

STALE_AFTER_S = 600.0  # a cold build of one op takes a minute or two; ten on a loaded machine


def default_extensions_dir() -> str | None:
    """Set ``TORCH_EXTENSIONS_DIR`` to this environment's folder unless it is set (see [Note: JIT build folder]);
    the folder JIT builds use, or None for torch's default."""
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return os.environ["TORCH_EXTENSIONS_DIR"]
    if not os.access(sys.prefix, os.W_OK):
        return None
    folder = os.path.join(sys.prefix, "torch_extensions")
    os.environ["TORCH_EXTENSIONS_DIR"] = folder
    return folder


def _busy_folders() -> set[Path]:
    """The working folders of this machine's processes that we may read (ninja runs in the op's folder)."""
    busy = set()
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            busy.add(Path(os.readlink(proc / "cwd")))
        except OSError:
            continue
    return busy


def stale_locks(folder: str, now: float | None = None) -> list[Path]:
    """The build locks under ``folder`` (in an op's folder, one or two levels down: torch's default
    root has a ``py311_cpu``-style level) older than
    :data:`STALE_AFTER_S` in whose folder no process runs."""
    root = Path(folder)
    if not root.is_dir():
        return []
    now = time.time() if now is None else now
    old = []
    for lock in [*root.glob("*/lock"), *root.glob("*/*/lock")]:
        try:
            if now - lock.stat().st_mtime > STALE_AFTER_S:
                old.append(lock)
        except OSError:
            continue
    if not old:
        return []
    busy = _busy_folders()
    return [lock for lock in old if not any(p == lock.parent or lock.parent in p.parents for p in busy)]


def report_stale_locks(folder: str | None) -> list[Path]:
    """Warn about each stale build lock under ``folder`` (torch's default folder when None), with the fix."""
    if folder is None:
        from torch.utils.cpp_extension import get_default_build_root

        folder = get_default_build_root()
    found = stale_locks(folder)
    for lock in found:
        minutes = (time.time() - lock.stat().st_mtime) / 60
        logger.warning(
            "JIT build lock %s is %.0f minutes old and no process is building in its folder: a build was "
            "stopped part way, and loading that op (at deepspeed.initialize) would wait for it forever. "
            "Remove it (rm %s) and run again; the op is rebuilt.",
            lock,
            minutes,
            lock,
        )
    return found
