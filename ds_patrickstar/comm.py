"""Collectives over chunk groups, on DeepSpeed's data-parallel process group.

[Note: chunk groups]
With ``W`` data-parallel ranks, each param group's chunk list is padded with empty chunks
to a multiple of ``W``; chunks ``g*W .. g*W+W-1`` form chunk group ``g`` and chunk
``g*W + r`` is owned by rank ``r``. A rank keeps its owned chunk's payload and the fp32
master/momentum/variance of that chunk only. Before use, a group is all-gathered (every
rank receives every chunk of the group); after the last gradient of the group is in its
slots, the group is reduce-scattered (summed, then divided by ``W``) so the owner holds
the averaged gradient, and the other ranks release their copies. With ``W == 1`` every
collective is a no-op and the same code paths run.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .counters import StepCounters


class ChunkComm:
    """The collectives the chunk manager needs; see [Note: chunk groups]."""

    def __init__(self, group: dist.ProcessGroup | None, counters: StepCounters) -> None:
        self.group = group
        initialized = dist.is_available() and dist.is_initialized()
        self.world_size = dist.get_world_size(group) if initialized else 1
        self.rank = dist.get_rank(group) if initialized else 0
        self.counters = counters

    def owner(self, chunk_id: int) -> int:
        return chunk_id % self.world_size

    def all_gather(self, payloads: list[torch.Tensor]) -> None:
        """``payloads[r]`` is rank r's chunk of the group; afterwards every rank has them all."""
        if self.world_size == 1:
            return
        mine = payloads[self.rank].clone()
        dist.all_gather(payloads, mine, group=self.group)
        self.counters.all_gathers += 1
        self.counters.bytes_all_gathered += sum(p.numel() * p.element_size() for p in payloads) - \
            mine.numel() * mine.element_size()

    def reduce_scatter_mean(self, payloads: list[torch.Tensor]) -> None:
        """Average ``payloads[r]`` over ranks into rank r's own ``payloads[r]``."""
        if self.world_size == 1:
            return
        out = torch.empty_like(payloads[self.rank])
        dist.reduce_scatter(out, payloads, op=dist.ReduceOp.SUM, group=self.group)
        payloads[self.rank].copy_(out).div_(self.world_size)
        self.counters.reduce_scatters += 1
        self.counters.bytes_reduce_scattered += sum(p.numel() * p.element_size() for p in payloads) - \
            out.numel() * out.element_size()

    def all_reduce_sum(self, value: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            dist.all_reduce(value, op=dist.ReduceOp.SUM, group=self.group)
        return value
