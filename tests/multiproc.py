"""Run a function on N real processes (gloo, file store) with a deadline; re-raise worker errors.

The processes are kept: one pool per world size (1, 2 or 3 ranks), spawned on first use, each
worker importing torch and DeepSpeed and joining its pool's gloo group (a file store) once, then
running one job after another: ``fn(rank, world_size, *args)`` on every rank of the pool. Before
each job a worker puts back what a fresh process would have (its environment, working
directory, torch's default seed, one thread, grad mode, DeepSpeed's comms logger, accelerate's
singletons) and after it collects the garbage the job left.

Failures are contained by throwing the pool away: a rank raising while another is still running,
a rank dying (``os._exit``, SIGKILL) or a deadline passing terminates every process of that pool
(the others may be blocked in a collective), and the next call with that world size spawns a fresh
one. So one failing test cannot poison later ones. A job that raised on the last rank still running
(every other rank had finished it; always so on one rank, as in a refused checkpoint load) leaves
every worker waiting for its next job, with its exception caught: that pool is kept.

``fresh=True`` runs the call on a throwaway set of processes (spawned for it, ended after it),
for jobs whose assertion depends on a process that did nothing before (peak resident memory) or
that patch classes inside the worker (the patch would outlive the job in a kept process).

``memo=True`` keeps the per-rank results of a successful call (as the bytes the workers sent)
for the rest of the session, keyed by the function and its arguments, and gives each later
identical call its own copy: for reference runs (stock ZeRO-3) that several tests compare with.
Only for deterministic functions whose arguments name everything they depend on (no paths of
per-test temporary directories).
"""
from __future__ import annotations

import atexit
import io
import itertools
import os
import pickle
import queue
import socket
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.multiprocessing as mp


class WorkerError(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------------------------------------
# worker side
# ----------------------------------------------------------------------------------------------
_HANG_DUMP_S = 60  # a job running longer than this dumps every thread's stack to stderr (once)


def _fresh_state(env: dict, cwd: str, seed: int) -> None:
    """Put back, before a job, what a freshly spawned worker had."""
    import random

    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    torch.manual_seed(seed)  # torch's default seed: what an unseeded fresh process draws from
    random.seed()
    torch.set_num_threads(1)
    torch.set_grad_enabled(True)
    torch.set_default_dtype(torch.float32)
    torch.use_deterministic_algorithms(False)
    import gc

    gc.enable()
    from deepspeed.comm import comm as ds_comm
    from deepspeed.utils import groups

    # The gloo group and the groups DeepSpeed cloned from it stay valid for the pool's lifetime
    # (the world never changes); what a job may have set on top of them goes.
    groups.mpu = None
    groups.mesh_device = None
    ds_comm.comms_logger.enabled = False
    ds_comm.comms_logger.reset_data()
    try:
        from deepspeed.runtime.python_gc import python_gc_manager

        python_gc_manager._active_engines = 0
        python_gc_manager._restore_enabled = False
    except ImportError:  # pragma: no cover - older DeepSpeed
        pass
    import sys

    harness = sys.modules.get("harness")
    if harness is not None:  # its one-time set-up (2 threads, environment) runs again, as in a new process
        harness._ENV_READY = False
    if "accelerate.state" in sys.modules:  # Trainer / Accelerator singletons of an earlier job
        from accelerate.state import AcceleratorState, GradientState, PartialState

        AcceleratorState._reset_state(reset_partial_state=True)
        PartialState._reset_state()
        GradientState._reset_state()
    if "transformers.integrations.deepspeed" in sys.modules:
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config

        unset_hf_deepspeed_config()


def _die_with_parent() -> None:
    """Linux: SIGKILL this worker when the process that spawned it dies (a killed pytest must not
    leave pool workers behind, also not ones blocked in a job). Elsewhere the job loop's check of
    the parent pid, between jobs, is all there is."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _worker(rank: int, world_size: int, store: str, port: int, jobs, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
                      OMP_NUM_THREADS="1")  # also for jobs that run harness's set-up (see there)
    import faulthandler
    import gc

    parent = os.getppid()
    _die_with_parent()
    try:
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
        import deepspeed  # noqa: F401  (imported once, for every job)

        gc.collect()
        gc.freeze()  # the imports live as long as the worker: kept out of every later collection
    except BaseException:  # the traceback travels to the parent
        results.put((None, rank, False, traceback.format_exc(), 0))
        return
    env, cwd, seed = dict(os.environ), os.getcwd(), torch.initial_seed()
    while True:
        try:
            job = jobs.get(timeout=2.0)
        except queue.Empty:
            if os.getppid() != parent:  # the test session is gone (killed): so is the pool
                break
            continue
        if job is None:
            break
        job_id, payload = job
        faulthandler.dump_traceback_later(_HANG_DUMP_S, exit=False)
        try:
            _fresh_state(env, cwd, seed)
            fn, args = pickle.loads(payload)
            buffer = io.BytesIO()
            torch.save(fn(rank, world_size, *args), buffer)  # plain bytes: no shared-memory handles
            message = (job_id, rank, True, buffer.getvalue(), _groups_made())
        except BaseException:
            message = (job_id, rank, False, traceback.format_exc(), _groups_made())
        finally:
            faulthandler.cancel_dump_traceback_later()
        results.put(message)
        message = buffer = None
        gc.collect()  # the job's engines (hooks, chunks) go now, not during the next job
        gc.freeze()  # what lives on (modules the job imported, caches) is left out of later collections


def _groups_made() -> int:
    """How many process groups this worker has made: torch names each new group after this count, which
    every rank must call ``new_group`` for, so ranks whose counts differ would meet under different names."""
    from torch.distributed import distributed_c10d

    return distributed_c10d._world.group_count


# ----------------------------------------------------------------------------------------------
# parent side
# ----------------------------------------------------------------------------------------------
def _remove_shm_buffers(port: int) -> None:
    """DeepSpeed's shm comm op names its buffers after MASTER_PORT; a killed rank leaves them."""
    for path in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"):
        path.unlink(missing_ok=True)


class _Pool:
    def __init__(self, world_size: int):
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self.store = tempfile.mktemp(prefix="ds_ps_store_")
        self.port = free_port()
        self.results = ctx.Queue()
        self.jobs = [ctx.Queue() for _ in range(world_size)]
        self.procs = [ctx.Process(target=_worker, args=(r, world_size, self.store, self.port, self.jobs[r],
                                                        self.results), daemon=True)
                      for r in range(world_size)]
        self._ids = itertools.count(1)
        self.intact = True  # after a failed job: whether every rank is still waiting for jobs
        for p in self.procs:
            p.start()

    def run(self, fn, args, timeout: float) -> list[bytes]:
        """Every rank's result of one job, as the bytes it sent, in rank order; raises WorkerError."""
        payload = pickle.dumps((fn, args))
        job_id = next(self._ids)
        self.intact = False
        for q in self.jobs:
            q.put((job_id, payload))
        deadline = time.monotonic() + timeout
        out: dict[int, bytes] = {}
        made: dict[int, int] = {}
        while len(out) < self.world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise WorkerError(f"ranks {sorted(set(range(self.world_size)) - set(out))} did not finish "
                                  f"within {timeout} s")
            try:
                got, rank, ok, value, made[rank] = self.results.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                dead = [(r, p.exitcode) for r, p in enumerate(self.procs) if p.exitcode is not None]
                if dead:
                    rank, code = dead[0]
                    raise WorkerError(f"rank {rank} died (exit code {code}) before finishing") from None
                continue
            if got is None:
                raise WorkerError(f"rank {rank} failed to start:\n{value}")
            if got != job_id:  # pragma: no cover - a pool is thrown away after any failure with ranks still running
                continue
            if not ok:
                # every other rank finished its job: none is left blocked in a collective, and the
                # failing one caught its exception and waits for the next job
                self.intact = len(out) == self.world_size - 1 and len(set(made.values())) == 1
                raise WorkerError(f"rank {rank} failed:\n{value}{self._other_failures(job_id, rank, out)}")
            out[rank] = value
        # [Note: groups made on every rank] A job whose ranks made different numbers of process groups
        # leaves them naming their next group differently: the next job's new_group would connect to
        # another group's stale address in the store. Such a job fails here, naming the counts.
        if len(set(made.values())) > 1:
            raise WorkerError(f"the ranks made different numbers of process groups: {made} (rank: count)")
        self.intact = True
        return [out[r] for r in range(self.world_size)]

    def _other_failures(self, job_id: int, failed: int, out: dict) -> str:
        """The tracebacks of other ranks that fail within a few seconds of the first: which rank failed first
        is often the one that saw its peer go (a closed connection), not the cause."""
        waiting = set(range(self.world_size)) - set(out) - {failed}
        deadline, found = time.monotonic() + 3.0, []
        while waiting and time.monotonic() < deadline:
            try:
                got, rank, ok, value, _ = self.results.get(timeout=0.25)
            except queue.Empty:
                continue
            waiting.discard(rank)
            if got == job_id and not ok:
                found.append(f"\nrank {rank} failed too:\n{value}")
        return "".join(found)

    def close(self, graceful: bool) -> None:
        if graceful:
            for q in self.jobs:
                try:
                    q.put(None)
                except (OSError, ValueError):
                    pass
            for p in self.procs:
                p.join(timeout=5)
        for p in self.procs:
            if p.is_alive():
                p.terminate()
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        for q in (*self.jobs, self.results):
            q.cancel_join_thread()
            q.close()
        if os.path.exists(self.store):
            os.remove(self.store)
        _remove_shm_buffers(self.port)


_pools: dict[int, _Pool] = {}
_memo: dict[tuple, list[bytes]] = {}


def _call(fn, world_size: int, args: tuple, timeout: float, fresh: bool) -> list[bytes]:
    pool = _Pool(world_size) if fresh else _pools.get(world_size)
    if pool is None:
        pool = _pools[world_size] = _Pool(world_size)
    ok = False
    try:
        raw = pool.run(fn, args, timeout)
        ok = True
        return raw
    finally:
        # a failed pool may have ranks blocked in a collective or dead: all go (not when the
        # failing rank was the only one still running: a single rank raising, as in a refused load)
        if fresh or not (ok or pool.intact):
            if not fresh:
                del _pools[world_size]
            pool.close(graceful=ok)


def run_ranks(fn, world_size: int, *args, timeout: float = 240.0, fresh: bool = False, memo: bool = False) -> list:
    """``fn(rank, world_size, *args)`` on every rank; returns the per-rank results in rank order.

    A worker exception ends the run at once: the other workers are terminated (they may be
    blocked in a collective) and the first failing rank's traceback is raised; so does a worker
    that dies, and a run not done within ``timeout`` seconds. ``fresh``: on processes spawned
    for this call only. ``memo``: reuse the results of an identical earlier call (see above).
    """
    key = None
    if memo:
        key = (fn.__module__, fn.__qualname__, world_size, pickle.dumps(args))
        if key in _memo:
            return [torch.load(io.BytesIO(b), weights_only=False) for b in _memo[key]]
    raw = _call(fn, world_size, args, timeout, fresh)
    if key is not None:
        _memo[key] = raw
    return [torch.load(io.BytesIO(b), weights_only=False) for b in raw]


def shutdown() -> None:
    """End every kept pool (at the end of the session; safe to call more than once)."""
    while _pools:
        _, pool = _pools.popitem()
        pool.close(graceful=True)


atexit.register(shutdown)
