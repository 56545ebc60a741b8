"""The chunk manager: packs parameters into chunks and owns the per-parameter metadata.

[Note: chunk layout]
Each optimizer param group gets its own list of chunks (so one chunk has one set of
Adam hyper-parameters), filled in the order the group lists its parameters, which for
``model.parameters()`` is registration order and so close to the order of use. Offsets
are aligned to :data:`ALIGN` elements. A tensor larger than ``chunk_size`` gets a chunk of
its own sized to fit it. For every low-precision param chunk there are three fp32
chunks of the same capacity and layout (master, momentum, variance) in
:class:`OptimizerChunk`, plus an fp32 gradient accumulator when
``gradient_accumulation_steps > 1`` (see [Note: gradient accumulation]).

[Note: gradient accumulation]
With GA = 1 a gradient goes straight into its parameter slot
(see [Note: gradient in the param slot]). With GA > 1 the parameters must survive until
the last micro-step, so every micro-step adds its gradient into an fp32 accumulator
chunk instead; on the boundary micro-step the accumulated sum is written into the slot,
rounded to the param dtype once (the same precision a GA = 1 gradient has). Cost: 4 more
bytes per parameter (18 instead of 14 in fp16/bf16), paid only when GA > 1.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from .chunk import Chunk, TensorInfo, TensorState

logger = logging.getLogger(__name__)

ALIGN = 32


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(eq=False)
class OptimizerChunk:
    """fp32 master, momentum, variance (and accumulator) aligned with one param chunk."""

    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    grad_acc: torch.Tensor | None

    @classmethod
    def for_chunk(cls, chunk: Chunk, accumulate: bool) -> "OptimizerChunk":
        zeros = lambda: torch.zeros(chunk.capacity, dtype=torch.float32, device=chunk.device)  # noqa: E731
        master = chunk.payload.to(torch.float32, copy=True)
        return cls(master, zeros(), zeros(), zeros() if accumulate else None)

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.master, self.exp_avg, self.exp_avg_sq, self.grad_acc) if t is not None]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


class ChunkManager:
    """Owns the chunks, the optimizer chunks and the :class:`TensorInfo` of every parameter."""

    def __init__(self, named_groups: list[list[tuple[str, torch.nn.Parameter]]], chunk_size: int,
                 accumulate: bool) -> None:
        self.chunk_size = chunk_size
        self.chunks: list[Chunk] = []
        self._infos: dict[torch.nn.Parameter, TensorInfo] = {}
        for group_index, named in enumerate(named_groups):
            self._pack_group(group_index, named)
        for chunk in self.chunks:
            for info in chunk.tensors:
                self._bind(chunk, info)
        self.optim = [OptimizerChunk.for_chunk(c, accumulate) for c in self.chunks]
        logger.info("ds_patrickstar: %d params in %d chunks (chunk_size=%d elements)", len(self._infos),
                    len(self.chunks), chunk_size)

    # ---- construction -------------------------------------------------------------
    def _new_chunk(self, group_index: int, capacity: int, like: torch.Tensor) -> Chunk:
        chunk = Chunk(len(self.chunks), capacity, like.dtype, like.device, group_index)
        self.chunks.append(chunk)
        return chunk

    def _pack_group(self, group_index: int, named: list[tuple[str, torch.nn.Parameter]]) -> None:
        current: Chunk | None = None
        for name, param in named:
            numel = param.numel()
            if param in self._infos:
                raise ValueError(f"parameter {name} appears in more than one optimizer param group")
            if numel > self.chunk_size:
                logger.info("ds_patrickstar: %s has %d elements > chunk_size=%d; it gets a chunk of its own",
                            name, numel, self.chunk_size)
                chunk = self._new_chunk(group_index, _align(numel), param)
            else:
                if current is None or current.dtype != param.dtype or not current.can_append(_align(numel)):
                    current = self._new_chunk(group_index, self.chunk_size, param)
                chunk = current
            offset = _align(chunk.used)
            info = TensorInfo(name, param, chunk.chunk_id, offset, numel, param.shape, group_index)
            chunk.append(info)
            self._infos[param] = info

    @staticmethod
    def _bind(chunk: Chunk, info: TensorInfo) -> None:
        with torch.no_grad():
            chunk.view_of(info).copy_(info.param.data)
        info.param.data = chunk.view_of(info)

    # ---- lookup -------------------------------------------------------------------
    def info(self, param: torch.Tensor) -> TensorInfo | None:
        return self._infos.get(param)

    def infos(self) -> list[TensorInfo]:
        return list(self._infos.values())

    def chunk_of(self, info: TensorInfo) -> Chunk:
        return self.chunks[info.chunk_id]

    def optim_of(self, info: TensorInfo) -> OptimizerChunk:
        return self.optim[info.chunk_id]

    # ---- gradients ----------------------------------------------------------------
    @torch.no_grad()
    def take_grad(self, info: TensorInfo, grad: torch.Tensor, boundary: bool) -> None:
        """Consume ``param.grad``; see [Note: gradient accumulation]."""
        acc = self.optim_of(info).grad_acc
        slot = self.chunk_of(info).flat_of(info)
        if acc is None:
            if not boundary:
                raise RuntimeError("gradient accumulation without an accumulator")
            slot.copy_(grad.reshape(-1))
            info.grad_written()
            return
        acc_slot = acc[info.offset:info.end]
        acc_slot.add_(grad.reshape(-1).to(acc_slot.dtype))
        if boundary:
            slot.copy_(acc_slot)
            info.grad_written()
        else:
            info.settle()

    @torch.no_grad()
    def fill_missing_grads(self) -> None:
        """At the boundary, give every param that got no gradient this micro-step one."""
        for info in self._infos.values():
            if info.state is TensorState.HOLD_AFTER_BWD:
                continue
            slot = self.chunk_of(info).flat_of(info)
            acc = self.optim_of(info).grad_acc
            if acc is None:
                slot.zero_()
            else:
                slot.copy_(acc[info.offset:info.end])
            info.grad_written()

    def grads_ready(self) -> bool:
        return all(i.state is TensorState.HOLD_AFTER_BWD for i in self._infos.values())

    @torch.no_grad()
    def restore_params(self) -> None:
        """Write the fp32 master back into the slots (after an overflow); grads are dropped."""
        for chunk, opt in zip(self.chunks, self.optim):
            chunk.payload[:chunk.used].copy_(opt.master[:chunk.used])
        self.settle_all()

    @torch.no_grad()
    def reset_accumulators(self) -> None:
        for opt in self.optim:
            if opt.grad_acc is not None:
                opt.grad_acc.zero_()

    def settle_all(self) -> None:
        for info in self._infos.values():
            if info.state is not TensorState.HOLD:
                info.settle()

    # ---- accounting ---------------------------------------------------------------
    def model_data_bytes(self) -> int:
        return sum(c.nbytes for c in self.chunks) + sum(o.nbytes for o in self.optim)

    def num_params(self) -> int:
        return sum(i.numel for i in self._infos.values())
