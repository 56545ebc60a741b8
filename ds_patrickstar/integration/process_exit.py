"""Before the interpreter ends: wait until gloo's worker threads have let go of the last collective.

[Note: gloo workers idle at exit]
A gloo process group runs each collective on a worker thread of its own (``pt_gloo_runloop``).
The caller's ``wait`` returns when the collective is done; the worker lets go of the collective's
tensors a moment later, and a tensor with a Python object needs the GIL for that. When a script's
last collective (Hugging Face's evaluation loss gathered over the ranks, a final barrier) ends
just before the script does, the worker can get there after the interpreter has begun to
finalize: CPython then ends the thread (``pthread_exit``), its unwinding crosses a C++ destructor
that may not throw, and the C++ runtime aborts the process after its work is done (``terminate
called without an active exception``, SIGABRT). Plain torch on gloo does the same without
DeepSpeed; ``destroy_process_group`` at the end of a script avoids it only where it destroys the
group, which joins its workers: a group still referenced elsewhere (``torch.distributed.nn``
keeps the default group as a default argument, DeepSpeed's engine keeps its data-parallel group)
is not destroyed, and its workers keep running.

So the first "patrickstar" ``deepspeed.initialize`` of a process registers
:func:`wait_for_gloo_workers` with :mod:`atexit` (exit handlers run before finalization, with the
interpreter whole). It releases the GIL in short sleeps until every ``pt_gloo_runloop`` thread of
the process has been blocked (not running or runnable, read from ``/proc/self/task``) for
:data:`SETTLE_S` without a break: a worker that still holds a collective is running, runnable, or
waiting for the GIL that the sleeping main thread leaves free, so it is seen before it settles.
Nothing is destroyed or changed: the process groups stay usable by exit handlers registered
earlier, a script that ends them itself is unaffected, and a collective left in flight (after an
error) does not hold the exit, since a worker blocked in it counts as settled. The wait is bounded
(:data:`TIMEOUT_S`) and is skipped where ``/proc`` is not readable or no gloo worker runs.
"""

from __future__ import annotations

import atexit
import logging
import os
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

TASKS = "/proc/self/task"
WORKER_NAME = "pt_gloo_runloop"  # the name torch's ProcessGroupGloo gives its worker threads
SETTLE_S = 0.05  # every worker blocked this long without a break: settled
TIMEOUT_S = 2.0  # the longest the exit waits
POLL_S = 0.002

_registered_in: int | None = None  # the process that registered the handler (not a forked child)


def register_wait_at_exit() -> None:
    """Register :func:`wait_for_gloo_workers` once per process; see [Note: gloo workers idle at exit]."""
    global _registered_in
    if _registered_in == os.getpid():
        return
    _registered_in = os.getpid()
    atexit.register(wait_for_gloo_workers)


def _thread_state(task: str) -> str | None:
    """The scheduler state of one thread (``R``, ``S``, ...), or None when it is gone."""
    try:
        with open(os.path.join(TASKS, task, "stat")) as f:
            stat = f.read()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2]  # the field after "(name)"


def gloo_worker_states() -> list[str]:
    """The scheduler states of this process's gloo worker threads (empty where ``/proc`` is not readable)."""
    try:
        tasks = os.listdir(TASKS)
    except OSError:
        return []
    states = []
    for task in tasks:
        try:
            with open(os.path.join(TASKS, task, "comm")) as f:
                if f.read().strip() != WORKER_NAME:
                    continue
        except OSError:
            continue
        state = _thread_state(task)
        if state is not None:
            states.append(state)
    return states


def wait_until_settled(
    states: Callable[[], list[str]],
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    settle_s: float = SETTLE_S,
    timeout_s: float = TIMEOUT_S,
) -> bool:
    """Sleep until every thread in ``states()`` has been blocked (``S``) for ``settle_s`` without a
    break; False when ``timeout_s`` passes first."""
    start = clock()
    quiet_since: float | None = None
    while True:
        now = clock()
        if all(state == "S" for state in states()):
            quiet_since = now if quiet_since is None else quiet_since
            if now - quiet_since >= settle_s:
                return True
        else:
            quiet_since = None
        if now - start >= timeout_s:
            return False
        sleep(POLL_S)


def wait_for_gloo_workers() -> None:
    """The exit handler; see [Note: gloo workers idle at exit]."""
    if _registered_in != os.getpid() or not gloo_worker_states():
        return
    if not wait_until_settled(gloo_worker_states):
        logger.debug("gloo worker threads still busy after %.1f s at exit", TIMEOUT_S)
