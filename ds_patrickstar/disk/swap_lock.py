"""The lock on a rank's swap folder, held for the run's life.

[Note: swap folder lock]
Each rank's swap folder (``ds_patrickstar_swap/rank<r>/``, see [Note: swap files]) has a lock
file beside it, ``rank<r>.lock`` (beside, not inside: removing the folder must not remove the
lock). A run takes an exclusive, non-blocking ``flock`` on it before it reads, removes or writes
anything in the folder, and holds it until the swap files are closed (``engine.destroy()``, the
disk tier's finalizer at exit); the holder writes its host, process id and run id into the file.
Another run, in this process or another, that finds the lock taken gets :class:`SwapFolderBusy`
naming the folder, the holder and the ways out. The kernel releases a ``flock`` when the
holder's process ends, however it ends (``kill -9`` included), so a dead holder never blocks and
a lock file left behind needs no removal. The holder removes the lock file while it still holds
the lock; a taker checks, once locked, that the path still names the file it locked (else the
holder removed it in between, and the taker locks afresh), so of runs starting together exactly
one proceeds. This process's own locks are also kept in a set: POSIX locks, which ``flock``
becomes on NFS, do not exclude a second taker in the same process.

A ``flock`` belongs to the open file, which a forked child shares through its copy of the descriptor:
a DataLoader worker forked after initialize would keep the lock after its parent died (until the
worker ends too). So the descriptor is opened ``O_CLOEXEC`` (a program a child executes does not get
it) and a fork handler (:func:`os.register_at_fork`) closes every held lock's descriptor in the child,
which holds no lock of its parent's: closing it there leaves the parent's lock in place, and the child
neither removes the lock file nor unlocks it.

On NFS, Linux implements ``flock`` with the protocol's byte-range locks (NLM for v3, part of v4):
it excludes across hosts where the server supports locking and the client mount does not use
``nolock`` or ``local_lock`` (which make locks local to one host). A host that crashes keeps its
locks until the server notices (NFSv4: the lease, typically 90 s; v3: lock recovery). A file
system that refuses locks fails the lock with a :class:`ValueError` saying so.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import threading
import time
import weakref

KEY = "zero_optimization.offload_optimizer.nvme_path"

_held: set[str] = set()  # lock files this process holds (real paths)
_held_lock = threading.Lock()
_locks: weakref.WeakSet[SwapLock] = weakref.WeakSet()  # the held locks, for the fork handler


class SwapFolderBusy(ValueError):
    """Another run holds the lock of a swap folder; see [Note: swap folder lock]."""


def lock_path(folder: str) -> str:
    return folder.rstrip(os.sep) + ".lock"


class SwapLock:
    """An exclusive ``flock`` on a swap folder's lock file; see [Note: swap folder lock]."""

    def __init__(self, path: str, fd: int) -> None:
        self.path, self._fd = path, fd

    @classmethod
    def acquire(cls, folder: str, run_id: str, key: str = KEY) -> SwapLock:
        """Lock ``folder`` for this run or raise :class:`SwapFolderBusy` naming the holder."""
        path = lock_path(folder)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with _held_lock:
            if os.path.realpath(path) in _held:
                raise SwapFolderBusy(_busy_message(folder, path, _this_process(), key))
            lock = cls._take(folder, path, run_id, key)
            _held.add(os.path.realpath(path))
        return lock

    @classmethod
    def _take(cls, folder: str, path: str, run_id: str, key: str) -> SwapLock:
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                _lock(fd, folder, path, key)
            except BaseException:
                os.close(fd)
                raise
            if _names(path, fd):
                break
            os.close(fd)  # its holder removed it between our open and our lock: lock the new file
        record = {**_this_process(), "run_id": run_id}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode(), 0)
        lock = cls(path, fd)
        _locks.add(lock)
        return lock

    @property
    def held(self) -> bool:
        return self._fd >= 0

    def _forget_in_child(self) -> None:
        """In a forked child: close the inherited descriptor; the parent's lock stays (see the Note)."""
        fd, self._fd = self._fd, -1
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass

    def release(self) -> None:
        """Remove the lock file and unlock (in that order, see the Note); again: nothing."""
        fd, self._fd = self._fd, -1
        if fd < 0:
            return
        _locks.discard(self)
        with _held_lock:
            _held.discard(os.path.realpath(self.path))
            try:
                if _names(self.path, fd):
                    os.unlink(self.path)
            finally:
                os.close(fd)  # closing the last descriptor releases the flock


def _after_fork_in_child() -> None:
    """A forked child holds none of its parent's locks (see [Note: swap folder lock])."""
    global _held_lock
    _held_lock = threading.Lock()  # another thread of the parent may have held it at the fork
    _held.clear()
    for lock in list(_locks):
        lock._forget_in_child()
    _locks.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _lock(fd: int, folder: str, path: str, key: str) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise SwapFolderBusy(_busy_message(folder, path, _holder(fd), key)) from None
    except OSError as err:
        if err.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL):
            raise
        raise ValueError(
            f"{key}: the file system of {folder!r} refuses file locks ({errno.errorcode[err.errno]} on {path!r}), "
            "so the disk tier cannot keep two runs out of one swap folder. Put nvme_path on a local disk, or on an "
            "NFS mount with locking (no `nolock`/`local_lock` mount option)"
        ) from err


def _names(path: str, fd: int) -> bool:
    """Whether ``path`` is the file open as ``fd``."""
    try:
        here, there = os.stat(path), os.fstat(fd)
    except FileNotFoundError:
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


def _this_process() -> dict[str, object]:
    return {"host": socket.gethostname(), "pid": os.getpid(), "since": time.time()}


def _holder(fd: int) -> dict[str, object]:
    try:
        data = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _busy_message(folder: str, path: str, holder: dict[str, object], key: str) -> str:
    host, pid = holder.get("host", "an unknown host"), holder.get("pid", "unknown")
    since = holder.get("since")
    when = time.strftime(" since %Y-%m-%d %H:%M:%S", time.localtime(since)) if isinstance(since, float) else ""
    who = f"process {pid} on host {host}{when}"
    if pid == os.getpid() and host == socket.gethostname():
        who += " (this process: an engine that was not destroyed; call engine.destroy() first)"
    return (
        f"{key}: the swap folder {folder!r} is in use by another run ({who}; lock file {path!r}). Give this run "
        "another nvme_path, or wait until that run ends. A lock is released when its process ends, even when "
        "killed, so a dead process never holds it; only on NFS can a crashed host's lock outlive it, until the "
        "server's lease ends (about 90 s); if that host is gone for good, remove the lock file"
    )
