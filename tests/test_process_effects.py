"""Process-wide effects end with the run (see [Note: process-wide effects]): the disk tier's mmap threshold
is back after ``destroy()`` and after a rolled-back initialize (seen in what glibc does with a 4 MiB
allocation, and in the threshold this package set); a user's ``GLIBC_TUNABLES`` threshold is left alone; a
forked child does not hold the swap folder's lock; 20 initialize/destroy cycles leave no extra thread."""

from __future__ import annotations

import ctypes
import os
import signal
import threading
import time

import pytest
import torch
from multiproc import run_ranks
from torch import nn

PROBE = 4 << 20  # between the disk tier's threshold (1 MiB) and the ceiling (32 MiB)


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def mapped_on_its_own(nbytes: int = PROBE) -> bool:
    """Whether glibc serves a ``malloc(nbytes)`` with an mmap of its own now (its threshold is below it)."""
    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = _Mallinfo2
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    before = libc.mallinfo2().hblks
    block = libc.malloc(nbytes)
    after = libc.mallinfo2().hblks
    libc.free(block)
    return after > before


def _config(nvme: str, bad: bool = False) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {
            "stage": "patrickstar",
            "chunk_size": 1024,
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme},
            "host_budget": 4096,
        },
    }


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))


def _threshold_across_a_run(rank: int, world_size: int, nvme: str) -> dict:
    import deepspeed

    import ds_patrickstar  # noqa: F401
    from ds_patrickstar.memory import host_heap

    seen = {}
    model = _model()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=_config(nvme))
    seen["run"] = (host_heap.threshold_set(), mapped_on_its_own(), engine.process_effects.active())
    engine.destroy()
    seen["destroyed"] = (host_heap.threshold_set(), mapped_on_its_own(), engine.process_effects.active())
    model = _model()
    stranger = torch.zeros(3, requires_grad=True)  # not a parameter of the model: initialize fails, rolls back
    with pytest.raises(ValueError, match="not a parameter of the model"):
        deepspeed.initialize(model=model, model_parameters=[*model.parameters(), stranger], config=_config(nvme))
    seen["rolled back"] = (host_heap.threshold_set(), mapped_on_its_own(), [])
    return seen


def test_the_disk_tiers_mmap_threshold_is_back_after_destroy_and_rollback(tmp_path):
    from ds_patrickstar.memory.host_heap import DYNAMIC_CEILING, MMAP_THRESHOLD

    (seen,) = run_ranks(_threshold_across_a_run, 1, str(tmp_path), timeout=120, fresh=True)
    assert seen["run"][:2] == (MMAP_THRESHOLD, True) and "the disk tier's mmap threshold" in seen["run"][2], seen
    assert seen["destroyed"] == (DYNAMIC_CEILING, False, []), seen
    assert seen["rolled back"] == (DYNAMIC_CEILING, False, []), seen


def _tunables(rank: int, world_size: int) -> tuple:
    import os

    from ds_patrickstar.memory import host_heap

    os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
    os.environ["GLIBC_TUNABLES"] = "glibc.malloc.trim_threshold=1:glibc.malloc.mmap_threshold=65536"
    setting = host_heap.user_setting()
    hold = host_heap.map_large_allocations()
    try:
        held = host_heap.threshold_set()
    finally:
        hold.release()
    os.environ["GLIBC_TUNABLES"] = "glibc.malloc.trim_threshold=1"
    return setting, held, host_heap.user_setting()


def test_a_threshold_set_in_glibc_tunables_is_the_users():
    """In a fresh process (a kept worker or this one may hold a threshold an earlier engine set)."""
    from ds_patrickstar.memory import host_heap

    ((setting, held, unset),) = run_ranks(_tunables, 1, timeout=120, fresh=True)
    assert setting == "GLIBC_TUNABLES=glibc.malloc.mmap_threshold"
    assert held != host_heap.MMAP_THRESHOLD
    assert unset is None


def test_a_forked_child_does_not_hold_the_swap_lock(tmp_path):
    """The parent's lock ends (its descriptor closed, as when it is killed) while a child it forked lives
    on: the folder can be locked again at once. Forked from a fresh process: a long-lived test worker's
    address space can be too large for the kernel's overcommit heuristic to let it fork (ENOMEM)."""
    ((child_saw, relocked),) = run_ranks(_fork_while_locked, 1, str(tmp_path / "rank0"), timeout=120, fresh=True)
    assert child_saw == b"free" and relocked


def _fork_while_locked(rank: int, world_size: int, folder: str) -> tuple[bytes, bool]:
    import fcntl

    from ds_patrickstar.disk.swap_lock import SwapLock, lock_path

    lock = SwapLock.acquire(folder, "run")
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: say whether the lock file is among its descriptors, then live on
        try:
            os.write(write, b"held" if os.path.realpath(lock_path(folder)) in _open_files() else b"free")
            time.sleep(30)
        finally:
            os._exit(0)
    try:
        os.close(write)
        child_saw = os.read(read, 4)
        os.close(lock._fd)  # the parent's lock ends; the lock file stays, as after a kill -9
        lock._fd = -1
        fd = os.open(lock_path(folder), os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError if the child held it
        finally:
            os.close(fd)
        return child_saw, True
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(read)


def _open_files() -> set[str]:
    files = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            files.add(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass  # the listing's own descriptor, closed by now
    return files


def _cycles(rank: int, world_size: int, nvme: str, cycles: int) -> tuple[list[str], list[str]]:
    import deepspeed

    import ds_patrickstar  # noqa: F401

    def threads() -> list[str]:
        return sorted(t.name for t in threading.enumerate())

    counts = []
    for i in range(cycles):
        model = _model()
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=_config(nvme))
        loss = engine(torch.randn(2, 16)).sum()
        engine.backward(loss)
        engine.step()
        engine.destroy()
        if i == 0:
            first = threads()
            tasks = len(os.listdir("/proc/self/task"))
        counts.append(len(os.listdir("/proc/self/task")) - tasks)
    return first, threads(), counts


def test_twenty_initialize_destroy_cycles_leave_no_extra_thread(tmp_path):
    (first, last, counts) = run_ranks(_cycles, 1, str(tmp_path), 20, timeout=240, fresh=True)[0]
    assert last == first, (first, last)
    assert max(counts) == 0, counts
