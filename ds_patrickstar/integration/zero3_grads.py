"""ZeRO-3's gradient getters and setters on chunks: ``safe_get/set_full_grad``, ``safe_get/set_local_grad`` and
``safe_update_full_grad_vectorized`` (through :class:`~ds_patrickstar.integration.zero3_params.Zero3Params`).

[Note: gradients between backward and step]
Stock ZeRO-3 keeps each rank's partition of the reduced gradient (the mean over the data-parallel ranks, of the
loss the engine scaled by ``1/gradient_accumulation_steps``, summed over the micro-steps so far) in a buffer the
step reads; its getters all-gather that partition. Here the same values live in one of two places (see
[Note: gradient accumulation] in groups/grads.py):

* after the boundary micro-step's backward (:meth:`ChunkManager.grads_ready`), in the owned chunks' slots, in the
  parameter dtype, where the step reads them (the parameter values are in the fp32 masters meanwhile);
* before the boundary (``gradient_accumulation_steps`` > 1), in the owned chunks' fp32 accumulators (with one
  rank every chunk is owned; a chunk without an accumulator has had no gradient yet: zeros). A value written
  there is summed with the later micro-steps' gradients, as stock's buffer is.

So a getter reads this rank's owned pieces of the parameter from the one place (where it lives: accelerator or
host) and, for the full value, all-reduces the sum of the ranks' disjoint pieces (a collective: call it on every
rank, as stock's); a setter writes the owned pieces (rounded to the parameter dtype in a slot, as stock's bf16
gradient buffer rounds; the slot's gradient norm is taken again, so clipping and the overflow check see the value
written, as stock's norm at the step does). Outside the window (before the first backward of a step, or after the
step) no gradient is held: the getters and setters raise saying when to call them. A frozen parameter has none:
None, as stock. The local share is the parameter's elements in the owned chunks, in element order (not stock's 1/W
slice; see [Note: ZeRO-3 parameter attributes]).
"""

from __future__ import annotations

from typing import Any

import torch
from deepspeed import comm as dist

from ..chunks.chunk import Chunk, TensorInfo
from ..chunks.chunk_map import ChunkMap
from ..groups.manager import ChunkManager


class ChunkGradients:
    """Reads and writes gradients where they live between backward and step; see
    [Note: gradients between backward and step]."""

    def __init__(self, chunk_map: ChunkMap, manager: ChunkManager, group: Any) -> None:
        self.map, self.manager, self.group = chunk_map, manager, group

    def _in_slots(self) -> bool:
        """True: the slots hold the step's gradients; False: the accumulators hold the micro-steps' so far."""
        if self.manager.grads_ready():
            return True
        if self.manager.grads.has_accumulated():
            return False
        raise RuntimeError(
            "no gradient is held now: stage 'patrickstar' keeps gradients from backward to engine.step(); "
            "call safe_get/set_full_grad and safe_get/set_local_grad after engine.backward() and before step()"
        )

    def _owned(self, info: TensorInfo) -> list:
        return [piece for piece in info.pieces if self.map.is_owned(self.map.chunks[piece.chunk_id])]

    def _source(self, chunk: Chunk, in_slots: bool) -> torch.Tensor | None:
        return chunk.ready() if in_slots else chunk.ready_acc()

    def _read(self, piece: Any, in_slots: bool) -> torch.Tensor:
        source = self._source(self.map.chunks[piece.chunk_id], in_slots)
        if source is None:  # no gradient reached this chunk yet this step
            return torch.zeros(piece.numel, dtype=torch.float32)
        return source[piece.in_chunk].to("cpu", torch.float32, copy=True)

    def _write(self, piece: Any, values: torch.Tensor, in_slots: bool) -> None:
        chunk = self.map.chunks[piece.chunk_id]
        target = chunk.ready() if in_slots else self.manager.groups[self.map.group_of(chunk)].accumulator(chunk)
        target[piece.in_chunk].copy_(values.detach().reshape(-1))
        if in_slots:  # a final slot changed: its norm is taken again (see [Note: the norm as gradients become final])
            self.manager.grads.norms.record(chunk)

    @torch.no_grad()
    def get_full(self, info: TensorInfo) -> torch.Tensor:
        in_slots = self._in_slots()
        full = torch.zeros(info.numel, dtype=torch.float32)
        for piece in self._owned(info):
            full[piece.in_param] = self._read(piece, in_slots)
        if dist.get_world_size(group=self.group) > 1:
            dist.all_reduce(full, group=self.group)  # each element from its one owner; the others add zeros
        return full.view(info.shape)

    @torch.no_grad()
    def set_full(self, info: TensorInfo, value: torch.Tensor) -> None:
        if value.numel() != info.numel:
            raise ValueError(f"{info.name}: a gradient of {value.numel()} elements for a parameter of {info.numel}")
        in_slots, flat = self._in_slots(), value.reshape(-1)
        for piece in self._owned(info):
            self._write(piece, flat[piece.in_param], in_slots)

    @torch.no_grad()
    def get_local(self, info: TensorInfo) -> torch.Tensor:
        in_slots = self._in_slots()
        parts = [self._read(piece, in_slots) for piece in self._owned(info)]
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.float32)

    @torch.no_grad()
    def set_local(self, info: TensorInfo, value: torch.Tensor) -> None:
        owned, flat, at = self._owned(info), value.reshape(-1), 0
        if flat.numel() != sum(piece.numel for piece in owned):
            raise ValueError(
                f"{info.name}: a local gradient of {flat.numel()} elements; this rank's share has "
                f"{sum(piece.numel for piece in owned)} (safe_get_local_grad gives its shape)"
            )
        in_slots = self._in_slots()
        for piece in owned:
            self._write(piece, flat[at : at + piece.numel], in_slots)
            at += piece.numel
