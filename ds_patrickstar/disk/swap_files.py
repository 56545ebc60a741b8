"""The disk tier's files: the folder checked at initialize, one preallocated file per chunk, the manifest.

[Note: swap files]
Each rank keeps its spilled optimizer states under ``<nvme_path>/ds_patrickstar_swap/rank<r>/``:
one file per spilled chunk (``chunk<id>.swap``), holding the chunk's fp32 master, momentum and
variance in pieces of a bounded number of elements, each piece's three states back to back
(see [Note: swap pieces]), so a piece's states are one read and one write. The files are preallocated at initialize
(``posix_fallocate``) and rewritten in place: on common SSDs and file systems rewriting allocated
blocks is faster than writing new files. They are opened with ``O_DIRECT`` where the file system
allows it (a probe write at initialize), else buffered with a warning (tmpfs on older kernels).
Files that fail part way at initialize close every descriptor they opened and remove their folder
before the error propagates. They are closed once: a later close (the disk tier's finalizer) leaves
the folder alone, since another run may own it by then.

The files are scratch, not a checkpoint: every run writes its states into them at initialize
and a checkpoint copies them out (see [Note: disk tier checkpoints]). ``manifest.json`` records
the run id, the process and the host that own the folder and a ``clean`` flag (false from the
first write of an optimizer step until its last write completed). The folder is locked for the
run's life before anything in it is read, removed or written (see [Note: swap folder lock]): a
folder another run holds is refused; files found in a folder that is not held (a finished run, or
one killed mid-step: ``clean`` false) are stale and removed with a warning, never read.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import uuid
from dataclasses import dataclass

from .io import ALIGNMENT, aligned_empty
from .swap_lock import KEY, SwapLock

logger = logging.getLogger(__name__)

SWAP_FOLDER = "ds_patrickstar_swap"
MANIFEST = "manifest.json"


@dataclass(frozen=True)
class PathProbe:
    """What the file system says about ``nvme_path``."""

    exists: bool
    is_dir: bool
    writable: bool
    read_only: bool
    free: int

    @classmethod
    def of(cls, path: str) -> PathProbe:
        if not os.path.isdir(path):
            return cls(os.path.exists(path), False, False, False, 0)
        stat = os.statvfs(path)
        return cls(True, True, _can_create_in(path), bool(stat.f_flag & os.ST_RDONLY), stat.f_bavail * stat.f_frsize)


def _can_create_in(path: str) -> bool:
    probe = os.path.join(path, f".ds_patrickstar_probe_{os.getpid()}")
    try:
        with open(probe, "w"):
            pass
        os.unlink(probe)
        return True
    except OSError:
        return False


def check_swap_path(
    path: str,
    probe: PathProbe,
    needed: int,
    reusable: int = 0,
    key: str = "zero_optimization.offload_optimizer.nvme_path",
) -> None:
    """Raise ``ValueError`` naming ``path``, the bytes needed and the bytes free unless the disk tier
    can keep ``needed`` bytes there (``reusable``: bytes of stale swap files that will be removed)."""
    free = probe.free + reusable
    numbers = f"the disk tier needs {needed:,} bytes there ({needed / 2**30:.2f} GiB), {free:,} bytes are free"
    if not probe.exists:
        problem = "does not exist"
    elif not probe.is_dir:
        problem = "is not a folder"
    elif probe.read_only:
        problem = "is on a read-only file system"
    elif not probe.writable:
        problem = "is not writable by this process"
    elif free < needed:
        problem = "has too little free space"
    else:
        return
    raise ValueError(f"{key}={path!r} {problem}: {numbers}. Point it at a writable folder with room for the plan.")


def rank_folder(root: str, rank: int) -> str:
    return os.path.join(root, SWAP_FOLDER, f"rank{rank}")


def stale_bytes(folder: str) -> int:
    if not os.path.isdir(folder):
        return 0
    return sum(e.stat().st_size for e in os.scandir(folder) if e.is_file())


class SwapFiles:
    """One preallocated file per spilled chunk of this rank; see [Note: swap files]."""

    def __init__(self, root: str, rank: int, sizes: dict[int, int], direct: bool = True, key: str = KEY) -> None:
        self.folder = rank_folder(root, rank)
        self.run_id = uuid.uuid4().hex
        self.fds: dict[int, int] = {}
        self.sizes = dict(sizes)
        self.clean = True
        self.closed = False
        self._lock = SwapLock.acquire(self.folder, self.run_id, key)  # key: the nvme_path errors name
        try:
            self._take_folder()
            self.direct = direct and _direct_io_works(self.folder)
            if direct and not self.direct:
                logger.warning(
                    "ds_patrickstar: the file system of %s does not take O_DIRECT (tmpfs?): the disk tier uses "
                    "buffered I/O, which goes through the page cache",
                    self.folder,
                )
            self._open_files()
            self._write_manifest()
        except BaseException:
            self.close(remove=True)  # the folder is ours: we hold its lock
            raise

    def _open_files(self) -> None:
        flags = os.O_RDWR | os.O_CREAT | (os.O_DIRECT if self.direct else 0)
        for chunk_id, size in sorted(self.sizes.items()):
            fd = os.open(self.path(chunk_id), flags, 0o600)
            self.fds[chunk_id] = fd
            os.posix_fallocate(fd, 0, size)

    def path(self, chunk_id: int) -> str:
        return os.path.join(self.folder, f"chunk{chunk_id}.swap")

    def _take_folder(self) -> None:
        """Remove what an earlier run left (under the lock: no run holds it) and make the folder."""
        manifest = os.path.join(self.folder, MANIFEST)
        if os.path.isfile(manifest):
            try:
                with open(manifest) as f:
                    old = json.load(f)
            except (OSError, ValueError):
                old = {}
            logger.warning(
                "ds_patrickstar: removing stale swap files in %s (run %s, %s); swap files are scratch, "
                "a run resumes from a checkpoint",
                self.folder,
                old.get("run_id", "unknown"),
                "closed cleanly" if old.get("clean") else "stopped mid-step or unreadable",
            )
        if os.path.isdir(self.folder):
            shutil.rmtree(self.folder)
        os.makedirs(self.folder)

    def set_clean(self, clean: bool) -> None:
        """``False`` before the first write of a step, ``True`` after its last write completed."""
        if clean != self.clean:
            self.clean = clean
            self._write_manifest()

    def _write_manifest(self) -> None:
        path = os.path.join(self.folder, MANIFEST)
        record = {
            "run_id": self.run_id,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "clean": self.clean,
            "chunks": {str(c): s for c, s in sorted(self.sizes.items())},
        }
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump(record, f)
        os.replace(tmp, path)

    def close(self, remove: bool = True) -> None:
        """Close the files; ``remove``: delete the folder (the states were scratch); then release the
        folder's lock. Closing again does nothing: the folder may belong to a later run by then."""
        if self.closed:
            return
        self.closed = True
        fds, self.fds = self.fds, {}
        try:
            for fd in fds.values():
                os.close(fd)
            self.sizes = {}
            if remove and os.path.isdir(self.folder):
                shutil.rmtree(self.folder, ignore_errors=True)
        finally:
            self._lock.release()


def _direct_io_works(folder: str) -> bool:
    """Whether an aligned ``O_DIRECT`` write succeeds in ``folder``."""
    probe = os.path.join(folder, ".direct_probe")
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError:
        return False
    try:
        buffer = aligned_empty(ALIGNMENT)
        os.pwritev(fd, [memoryview(buffer.numpy())], 0)  # type: ignore[arg-type]
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        os.unlink(probe)
