"""Host updates begun during backward, into spare buffers, kept at ``step()`` only where the step turned out as
they assumed.

[Note: host updates in backward]
The overlapped host Adam (see [Note: overlapped host Adam] in memory/host_work.py) starts at ``step()``, so
the next forward waits for the updates of the chunks it needs first while the host worker was idle through
backward. Yet a host-updated chunk's gradient is final, and on the host, during backward (see [Note: gradients
leave in backward] in placement/grad_release.py). Its update cannot simply run then: a non-finite gradient
anywhere skips the step (fp16's overflow, and a NaN in bf16 or fp32), gradient clipping scales every gradient
by a factor known only when the last gradient is in, a script may set the learning rate between
``backward()`` and ``step()``, and the gradient lives in the parameter's slot, which the update overwrites,
while ``safe_get_full_grad``, ``safe_set_full_grad`` and checkpoints read or write it before the step.

So the update begins on the host worker into spare buffers: the same kernel reads the chunk's gradient, master,
momentum and variance and writes the new parameters and states into a spare set (the chunk's capacity, 12 B of
states and the payload's bytes per element; the CPU kernel's ``adam_step_from``, as much memory traffic as the
update in place, see [Note: one Adam, several backends] in optim/adam_math.py), assuming that the step will not
be skipped, that clipping will not apply (the gradient factor ``1 / loss_scale``), and the step count and
hyper-parameters read as it begins.
At ``step()``, once the norm is known, each begun update is kept where every assumption held: the same
gradient factor (no overflow, no clipping), the same step count, hyper-parameters and frozen pieces (none),
the states still in host memory, and the gradient slot not written since (its version counter). Keeping
swaps the spare states in (no copy) and hands the chunk a host job copying the new parameters into its slot;
the replaced states become the next spare set. Anything else drops the update (not run, where it had not
started) and the chunk is updated at ``step()`` as before. A kept update ran the same kernel on the same
inputs as the step would, so losses and weights are bit-identical to the serial step, with clipping on or
off, in fp16, bf16 and fp32. Until ``step()`` the chunk's states and slot are the ones before the update:
every read between ``backward()`` and ``step()`` sees what it saw before. A step that clipped begins none in
the next backward (it would likely clip again); after a step that did not, updates begin again.

How many begin: ``host_adam_in_backward`` (an integer: at most that many chunks a step; 0: none), or "auto"
(default): a chunk begins only while the host worker is idle (a job begun late would hold up the updates the
next forward needs first, which go to the worker at ``step()`` in its order: at most one job's rest does), and the spare
sets, kept from step to step, take at most a quarter of the host memory available when the first is made (none
with the disk tier, whose host budget bounds host memory).
Counters ``host_updates_in_backward`` (kept) and ``host_updates_redone`` (dropped). On the strict twin a begun
update is a deferred host job like any (run when waited on, its spare buffers poisoned until then).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psutil
import torch

from ..chunks.chunk import Chunk
from ..counters import StepCounters
from ..memory.optimizer_chunk import OptimizerChunk
from ..memory.pending import Pending
from .chunk_adam import ChunkAdam
from .frozen_steps import Run

logger = logging.getLogger(__name__)

AUTO_HOST_SHARE = 0.25  # "auto": the spare sets' share of the host memory available at the first


@dataclass(eq=False)
class Spare:
    """Buffers one chunk's update may begin in: states and the new parameters."""

    states: OptimizerChunk
    values: torch.Tensor
    reader: Pending | None = None  # a job that may still read them: waited on before they are written again

    def fits(self, chunk: Chunk) -> bool:
        return self.states.master.numel() == chunk.capacity and self.values.dtype == chunk.dtype


@dataclass(eq=False)
class Begun:
    """An update begun in backward and what it assumed."""

    chunk: Chunk
    spare: Spare
    job: Pending
    grad_scale: float
    hyper: Any
    step: int
    runs: list[Run]
    version: int  # the gradient slot's version counter once the job was handed over


class EarlyHostUpdates:
    """Begins host updates during backward and keeps or drops them at ``step()``; see [Note: host updates in
    backward]."""

    def __init__(self, adam: ChunkAdam, limit: int | None, counters: StepCounters) -> None:
        self._adam, self._states, self._counters = adam, adam.states, counters
        self._accel = adam.states.accel
        self.limit = limit  # None: "auto"
        self.loss_scale: Callable[[], float] = lambda: 1.0  # the scale of the gradients being made
        self._free: list[Spare] = []
        self._made = 0
        self.spare_bytes = 0  # host bytes of the spare sets made (counter spare_bytes_host; not model data)
        self._cap: int | None = None  # "auto": the most spare sets
        self._begun: dict[int, Begun] = {}
        self._clipped = False  # the last step clipped: none begins in the next backward

    @property
    def expected(self) -> bool:
        """Whether updates may begin in the next backward (the last step did not clip)."""
        return self.limit != 0 and not self._clipped

    @property
    def spare_sets(self) -> int:
        """Spare sets made so far (each pinned once, then kept from step to step)."""
        return self._made

    # ---- backward --------------------------------------------------------------------
    def begin(self, chunk: Chunk) -> None:
        """``chunk``'s final gradient is on the host or on its way there: its update may begin."""
        if chunk.chunk_id in self._begun:
            self._drop(self._begun.pop(chunk.chunk_id))
        if not self._may_begin(chunk):
            return
        spare = self._spare(chunk)
        if spare is None:
            return
        adam, group = self._adam, chunk.group_index
        hyper, step = adam.rule.hyper(adam.param_groups[group]), adam.group_steps[group] + 1
        runs = adam.runs(chunk, 0, chunk.used, step)  # every piece trainable: nothing is counted
        grad_scale = 1.0 / self.loss_scale()
        live = self._states.state(chunk.chunk_id)

        def start(values: torch.Tensor, after: list[Pending]) -> Pending:
            used = values.numel()

            def work() -> None:
                for dst, src in zip(spare.states.tensors(), live.tensors()):
                    dst[used:].copy_(src[used:])  # beyond the used elements as they are: the states it may replace
                source, target = live.sliced(0, used), spare.states.sliced(0, used)
                adam.update_from(chunk, values, source, spare.values[:used], target, grad_scale, hyper, step, runs)

            return self._accel.host_work(work, [spare.values[:used], *spare.states.tensors()], after)

        chunk.hand_over(start)
        version = chunk.host_buffer()._version
        self._begun[chunk.chunk_id] = Begun(chunk, spare, chunk.pending[-1], grad_scale, hyper, step, runs, version)

    def _may_begin(self, chunk: Chunk) -> bool:
        states = self._states
        if self._clipped or not chunk.used or chunk.chunk_id in states.on_device or chunk.chunk_id in states.spilled:
            return False
        if not all(info.param.requires_grad for info in chunk.tensors):
            return False  # a frozen piece counts its skipped step when the update is handed over
        if self.limit is not None:
            return len(self._begun) < self.limit
        return self._accel.host_jobs_waiting() == 0

    def _spare(self, chunk: Chunk) -> Spare | None:
        for index, spare in enumerate(self._free):
            if spare.fits(chunk):
                del self._free[index]
                if spare.reader is not None:
                    spare.reader.wait()
                    spare.reader = None
                return spare
        nbytes = chunk.capacity * (12 + chunk.dtype.itemsize)
        if self.limit is None:
            if self._cap is None:
                self._cap = int(AUTO_HOST_SHARE * psutil.virtual_memory().available) // nbytes
                logger.info("ds_patrickstar: host updates in backward: at most %d spare sets", self._cap)
            if self._made >= self._cap:
                return None
        host_empty = self._accel.host_empty
        states = OptimizerChunk(*(host_empty(chunk.capacity, torch.float32) for _ in range(3)))
        self._made += 1
        self.spare_bytes += nbytes
        return Spare(states, host_empty(chunk.capacity, chunk.dtype))

    # ---- step() ----------------------------------------------------------------------
    def settle(self, grad_scale: float, unclipped: float) -> set[int]:
        """At ``step()``, before the update, gradients multiplied by ``grad_scale`` (``unclipped`` where clipping
        does not apply): the chunks whose begun update is kept; the others' are dropped."""
        kept = set()
        for chunk_id, begun in sorted(self._begun.items()):
            if self._holds(begun, grad_scale):
                self._keep(begun)
                kept.add(chunk_id)
            else:
                self._drop(begun)
        self._begun.clear()
        self._clipped = grad_scale != unclipped
        self._counters.host_updates_in_backward += len(kept)
        return kept

    def _holds(self, begun: Begun, grad_scale: float) -> bool:
        chunk, adam = begun.chunk, self._adam
        group = chunk.group_index
        return (
            begun.grad_scale == grad_scale
            and begun.step == adam.group_steps[group] + 1
            and begun.hyper == adam.rule.hyper(adam.param_groups[group])
            and chunk.on_host
            and chunk.chunk_id not in self._states.on_device
            and all(info.param.requires_grad for info in chunk.tensors)
            and chunk.host_buffer()._version == begun.version
        )

    def _keep(self, begun: Begun) -> None:
        chunk, spare = begun.chunk, begun.spare
        old = self._states.adopt(chunk.chunk_id, spare.states)

        def start(values: torch.Tensor, after: list[Pending]) -> Pending:
            def work() -> None:
                values.copy_(spare.values[: values.numel()])

            return self._accel.host_work(work, [values], after)

        chunk.hand_over(start)
        self._free.append(Spare(old, spare.values, reader=chunk.pending[-1]))

    def _drop(self, begun: Begun) -> None:
        chunk, job = begun.chunk, begun.job
        if job.cancel():
            chunk.pending = [p for p in chunk.pending if p is not job]
            reader = None
        else:
            reader = job  # it runs or ran: it stays in the chunk's pending list, before the step's update
        self._free.append(Spare(begun.spare.states, begun.spare.values, reader))
        self._counters.host_updates_redone += 1

    def drop_all(self) -> None:
        """The step is skipped, or the states are replaced (a checkpoint load): no begun update is kept."""
        for begun in self._begun.values():
            self._drop(begun)
        self._begun.clear()

    def close(self) -> None:
        """The run ends: the spare sets go back to the host pool, once no job reads them."""
        self.drop_all()
        for spare in self._free:
            if spare.reader is not None:
                spare.reader.wait()
            for tensor in (*spare.states.tensors(), spare.values):
                self._accel.host_free(tensor)
        self._free, self.spare_bytes = [], 0
