"""Adam over the owned chunks: one fused update per chunk, where its optimizer states live.

[Note: step]
1. one pass over every gradient slot computes the global gradient norm (still scaled by
   the loss scale); a non-finite norm is an overflow: DeepSpeed's loss scaler lowers the
   scale, the slots get their parameters back from the fp32 master, and the step is
   skipped (in bf16 and fp32 too: a NaN step is never applied);
2. otherwise the combined factor ``1 / (loss_scale * clip)`` (the same formula as
   DeepSpeed ZeRO-3, true global-norm clipping, :func:`combined_scale`) is handed to the Adam
   backend, which updates each chunk in one pass and writes the new low-precision parameters back.

A chunk is updated where its optimizer states live (hybrid Adam, see
[Note: optimizer-state placement]): on the accelerator by the CUDA kernel, on the host by the
CPU kernel (:mod:`~ds_patrickstar.optim.kernels`) on the host worker, behind the next forward (see
[Note: overlapped host Adam] in memory/host_work.py), with the pure-torch reference as the fallback.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch

from ..chunks.chunk import Chunk
from ..memory.optimizer_chunk import OptimizerChunk
from .adam_math import AdamHyper, AdamStep, AdamStepFrom, adam_step_from_reference, adam_step_reference
from .frozen_steps import Run, SkippedSteps, update_runs
from .rules import UpdateRule
from .sgd_math import SgdHyper, sgd_step_reference
from .states import OptimizerStates

logger = logging.getLogger(__name__)


@functools.cache
def _warn_no_kernels(reason: str) -> None:
    logger.warning(
        "ds_patrickstar: the fused Adam kernels' loader cannot be imported (%s); Adam runs on the "
        "pure-torch reference, which gives the same results more slowly",
        reason,
    )


def adam_backend(device: torch.device) -> AdamStep:
    """The fused kernel for ``device`` (built on first use), else the pure-torch reference (with one
    warning when the kernels' loader itself cannot be imported: it needs POSIX file locks)."""
    try:
        from .kernels import get_adam_backend
    except ImportError as err:
        _warn_no_kernels(repr(err))
        return adam_step_reference
    return get_adam_backend(device)


def adam_from_backend(device: torch.device) -> AdamStepFrom:
    """The update from one set of buffers into another on ``device`` (see [Note: one Adam, several backends])."""
    try:
        from .kernels import get_adam_from_backend
    except ImportError:
        return adam_step_from_reference
    return get_adam_from_backend(device)


def build_kernels(devices: set[torch.device]) -> None:
    """Build every Adam kernel a run on ``devices`` can use now (hybrid Adam: the host's too), not in a step."""
    for device in devices:
        adam_backend(device)


def combined_scale(scaled_norm: float, loss_scale: float, clip_grad: float) -> float:
    """``loss_scale`` times DeepSpeed ZeRO-3's clip factor, when clipping applies."""
    combined = loss_scale
    if clip_grad > 0.0:
        clip = (scaled_norm / loss_scale + 1e-6) / clip_grad
        if clip > 1.0:
            combined = clip * loss_scale
    return combined


class ChunkAdam:
    """Runs the update of every owned chunk, Adam's or SGD's (see [Note: SGD on chunks]); see [Note: step]."""

    def __init__(
        self,
        chunks: list[Chunk],
        states: OptimizerStates,
        param_groups: list[dict[str, Any]],
        rule: UpdateRule,
        stepped_groups: set[int],
        overlap: bool = False,
    ) -> None:
        self._chunks = chunks  # the owned chunks
        self.overlap = overlap  # hand host updates to the host worker (see [Note: overlapped host Adam])
        self._stepped_groups = stepped_groups  # param groups with chunks on any rank: their step counts advance
        self.states = states
        self.param_groups = param_groups
        self.rule = rule
        self.group_steps = [0] * len(param_groups)

    @property
    def adamw(self) -> bool:
        return self.rule.adamw

    def apply(
        self,
        grad_scale: float,
        place: Callable[[Chunk], None],
        order: list[int] | None = None,
        kept: set[int] | None = None,
    ) -> None:
        """One Adam step of every owned chunk, gradients multiplied by ``grad_scale``, each after
        ``place(chunk)`` has put it where its optimizer states live (the step's driver asks placement:
        see [Note: placement planner]). With overlap, the chunks updated on the host are handed to the
        host worker first, in ``order`` (chunk ids, the next forward's), and the step returns without
        waiting for them (see [Note: overlapped host Adam] in memory/host_work.py); the spilled chunks'
        pieces stream behind the others, their first reads started in backward or now (see [Note: disk
        tier]). The chunks in ``kept`` were updated on the host already, only placed (see [Note: host updates
        in backward] in early_updates.py)."""
        for index in self._stepped_groups:
            self.group_steps[index] += 1
        kept = kept or set()
        disk, extents = self.states.disk, self.states.spilled_extents()
        stream = disk.stream(extents) if disk is not None and extents else None
        if stream is not None:
            stream.start()
        chunks = [c for c in self._in_order(order) if c.used and c.chunk_id not in self.states.spilled]
        handed = {c.chunk_id for c in chunks if self.overlap and c.chunk_id not in self.states.on_device}
        for chunk in chunks:
            if chunk.chunk_id in handed:
                place(chunk)
                if chunk.chunk_id not in kept:
                    self._hand_over(chunk, grad_scale)
        for chunk in chunks:
            if chunk.chunk_id not in handed:
                place(chunk)
                self.update(chunk, self._values(chunk), self.states.state(chunk.chunk_id), grad_scale)
        if stream is not None:
            self._stream_spilled(stream, grad_scale, place)

    def _in_order(self, order: list[int] | None) -> list[Chunk]:
        if order is None:
            return self._chunks
        by_id, listed = {c.chunk_id: c for c in self._chunks}, set(order)
        return [by_id[i] for i in order if i in by_id] + [c for c in self._chunks if c.chunk_id not in listed]

    def _hand_over(self, chunk: Chunk, grad_scale: float) -> None:
        """The chunk's update as a host job; what it reads from the groups is read now."""
        state = self.states.state(chunk.chunk_id)
        hyper = self.rule.hyper(self.param_groups[chunk.group_index])
        step = self.group_steps[chunk.group_index]

        def start(values: torch.Tensor, after: list) -> Any:
            used = values.numel()
            writes = [values, state.master[:used], state.exp_avg[:used], state.exp_avg_sq[:used]]
            runs = self.runs(chunk, 0, used, step)  # requires_grad read now, not in the next forward
            work = functools.partial(self.update, chunk, values, state, grad_scale, hyper, step, runs)
            return self.states.accel.host_work(work, writes, after)

        chunk.hand_over(start)

    def _stream_spilled(self, stream: Any, grad_scale: float, place: Callable[[Chunk], None]) -> None:
        values: dict[int, torch.Tensor] = {}
        try:
            for chunk_id, start, state in stream:
                chunk = self.states.chunks[chunk_id]
                if chunk_id not in values:
                    place(chunk)
                    values[chunk_id] = self._values(chunk)
                self.update(chunk, values[chunk_id][start : start + state.master.numel()], state, grad_scale)
        except BaseException:
            stream.abandon()
            raise

    def update(
        self,
        chunk: Chunk,
        data: torch.Tensor,
        state: OptimizerChunk,
        grad_scale: float,
        hyper: AdamHyper | SgdHyper | None = None,
        step: int | None = None,
        runs: list[Run] | None = None,
    ) -> None:
        """The update (Adam's or SGD's) on ``data`` (elements of the chunk's values, the gradient on entry) and
        the states aligned with it, as far as the chunk is used; ``hyper``, ``step`` and ``runs``, when given, as
        read when the update was handed over (else from the groups now). It runs in runs of pieces with
        one step count, a frozen run getting its values back from the master (see
        [Note: requires_grad after initialize])."""
        if hyper is None:
            hyper = self.rule.hyper(self.param_groups[chunk.group_index])
        if runs is None:
            start = _offset_in_chunk(chunk, data)
            runs = self.runs(chunk, start, start + data.numel(), step)
        adam: AdamStep = sgd_step_reference if self.rule.sgd else adam_backend(data.device)
        base = runs[0].start
        for run in runs:
            part = slice(run.start - base, run.stop - base)
            if run.step is None:
                data[part].copy_(state.master[part])
                continue
            adam(
                data[part],
                state.master[part],
                state.exp_avg[part],
                state.exp_avg_sq[part],
                step=run.step,
                hyper=hyper,
                grad_scale=grad_scale,
            )

    def update_from(
        self,
        chunk: Chunk,
        grad: torch.Tensor,
        source: OptimizerChunk,
        values: torch.Tensor,
        target: OptimizerChunk,
        grad_scale: float,
        hyper: AdamHyper | SgdHyper,
        step: int,
        runs: list[Run],
    ) -> None:
        """:meth:`update` from ``grad`` (the chunk's used values) and ``source`` (its states, as far as used) into
        ``values`` and ``target`` (spare buffers as large), which the step would write in place (see [Note: host
        updates in backward] in early_updates.py); SGD and the reference copy first, then update in place."""
        adam_from = None if self.rule.sgd else adam_from_backend(grad.device)
        base = runs[0].start
        for run in runs:
            part = slice(run.start - base, run.stop - base)
            pieces = (
                grad[part],
                *(t[part] for t in source.tensors()),
                values[part],
                *(t[part] for t in target.tensors()),
            )
            if run.step is None or adam_from is None:
                for out, src in zip(pieces[4:], pieces[:4]):
                    out.copy_(src)
                self.update(chunk, values[part], target.sliced(part.start, part.stop), grad_scale, hyper, step, [run])
                continue
            adam_from(*pieces, step=run.step, hyper=hyper, grad_scale=grad_scale)

    def runs(self, chunk: Chunk, start: int, stop: int, step: int | None) -> list[Run]:
        """Elements ``[start, stop)`` of ``chunk`` in runs of one step count, skipped steps counted (see
        [Note: requires_grad after initialize]); ``step``: the group's step count as read at hand-over."""
        group = chunk.group_index
        group_step = self.group_steps[group] if step is None else step
        return update_runs(chunk, start, stop, SkippedSteps(self.param_groups[group]), group_step)

    @staticmethod
    def _values(chunk: Chunk) -> torch.Tensor:
        """The chunk's used values where it is now (placed for its update)."""
        return chunk.ready()[: chunk.used]


def _offset_in_chunk(chunk: Chunk, data: torch.Tensor) -> int:
    """Where ``data``, a slice of the chunk's values as :meth:`Chunk.ready` gives them (a spilled chunk's
    piece, or its whole used range), starts in the chunk."""
    base = chunk.ready()
    offset = (data.data_ptr() - base.data_ptr()) // data.element_size()
    if not 0 <= offset <= chunk.used - data.numel():
        raise RuntimeError(f"chunk {chunk.chunk_id}: the values to update are not a slice of the chunk's values")
    return offset
