"""Host work in flight: a function the accelerator's host worker runs beside the compute (the CPU
Adam of the chunks whose optimizer states live on the host), and the :class:`Pending` that hands
back its buffers.

[Note: overlapped host Adam]
Without overlap, the step updates every chunk before ``step()`` returns, and the host kernel's time
for the chunks whose states live on the host is on the critical path: the next forward waits for
the last chunk's update although it needs the first chunk first. With overlap (the default,
``overlap_host_adam``), the step's driver hands each such chunk's update to one worker thread, in
the order the next forward first uses the chunks (the trace's), and returns once the chunks
updated on the accelerator are done. A host update is a :class:`HostJob` in the chunk's
``pending`` list, so the one accessor that waits (``Chunk.ready``) waits for it, and the chunk
store waits for it before it copies the chunk's values anywhere; the optimizer states wait for it
before anyone reads or moves them. The next forward therefore waits per chunk, only where the
update has not finished yet.

It is exact. The update is the same kernel on the same inputs (the gradient in the chunk, the
states, the step count and the hyper-parameters and gradient factor fixed when the job is handed
over: an LR scheduler that edits the groups after ``step()`` changes the next step only), so the
values are bit-identical to the serial step. The global gradient norm is known before any job
starts (the step computes it first), so gradient clipping stays exact, which overlaps that start
the update during backward cannot offer. The CPU kernel releases the GIL while it runs, so the
Python thread that drives the accelerator keeps going.

On the strict twin the worker's job runs when it is waited on, as the twin's copies do, and the
buffers it writes are poisoned (NaN) until then: a reader that does not wait sees NaN, and a copy
enqueued from them before the wait raises :class:`~ds_patrickstar.memory.pending.CopyHazard` when
it runs (see [Note: strict emulated accelerator]).

[Note: host waits]
The seconds the thread that drives the accelerator spends blocked on host jobs (on the twin: running them)
add up in :class:`HostWaits`, read at every moment by the step-time model's clock, which takes them out of
the moment's time: a moment that waited for a host update is not that long in compute, and the model prices
the wait itself (see [Note: step-time model] in placement/step_time.py).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from .pending import Pending


class HostWaits:
    """Seconds the driving thread spent waiting for host jobs, a running total (see [Note: host waits])."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def timed(self, wait: Callable[[], None]) -> None:
        """Run ``wait`` (a blocking wait for a host job), adding its time."""
        started = time.perf_counter()
        try:
            wait()
        finally:
            self.seconds += time.perf_counter() - started


class HostJob(Pending):
    """A function handed to the host worker; :meth:`wait` blocks until it has run (and raises its error)."""

    host_work = True

    def __init__(self, future: Future[None], waits: HostWaits) -> None:
        self._future, self._waits = future, waits

    def wait(self) -> None:
        if self._future.done():
            self._future.result()
        else:
            self._waits.timed(self._future.result)

    def done(self) -> bool:
        return self._future.done()

    def cancel(self) -> bool:
        """Whether the job will not run (it had not started); else it runs or ran, and :meth:`wait` waits."""
        return self._future.cancel()


class HostWorker:
    """One thread that runs host jobs in the order they were handed over, started at the first job
    and joined by :meth:`close` (see [Note: overlapped host Adam])."""

    def __init__(self, waits: HostWaits) -> None:
        self._executor: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self.waits = waits
        self._jobs: list[HostJob] = []  # handed over, perhaps not finished (see :meth:`waiting`)

    def submit(self, work: Callable[[], None], after: list[Pending]) -> HostJob:
        """Run ``work`` once the copies in ``after`` have completed (waited on by the worker)."""

        def job() -> None:
            for pending in after:
                pending.wait_host()
            with torch.no_grad():
                work()

        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ds_patrickstar-host-adam")
            handed = HostJob(self._executor.submit(job), self.waits)
            self._jobs = [j for j in self._jobs if not j.done()] + [handed]
            return handed

    def waiting(self) -> int:
        """Jobs handed over that have not finished (the one running included)."""
        with self._lock:
            self._jobs = [j for j in self._jobs if not j.done()]
            return len(self._jobs)

    @property
    def running(self) -> bool:
        return self._executor is not None

    def close(self) -> None:
        """Wait for the jobs handed over and end the thread (a job's error is left to its :meth:`HostJob.wait`)."""
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)


class DeferredHostJob(Pending):
    """The strict twin's host job: ``work`` runs when the job is waited on; the buffers it writes
    hold NaN until then (see [Note: overlapped host Adam])."""

    host_work = True

    def __init__(self, work: Callable[[], None], writes: list[torch.Tensor], waits: HostWaits) -> None:
        self._work: Callable[[], None] | None = work
        self._writes, self._waits = writes, waits
        self._saved = [tensor.clone() for tensor in writes]
        with torch.no_grad():
            for tensor in writes:
                tensor.fill_(float("nan"))

    def wait(self) -> None:
        if self._work is None:
            return
        work, self._work = self._work, None
        with torch.no_grad():
            for tensor, saved in zip(self._writes, self._saved):
                tensor.copy_(saved)
            self._saved = []
            self._waits.timed(work)

    def done(self) -> bool:
        return self._work is None

    def drop(self) -> None:
        """The run is over: the job will not run (its buffers are freed)."""
        self._work, self._saved = None, []

    def cancel(self) -> bool:
        """The job will not run; what it writes keeps its poison (the writer's buffers are spare)."""
        self.drop()
        return True
