"""fp32 master, momentum and variance of the owned chunks, and where they live (hybrid Adam).

[Note: optimizer-state placement]
Every owned chunk has three fp32 tensors of its capacity and layout. They start on the
host when placement is active (on the only device otherwise). After each trace (the
warm-up iteration, and every re-trace when shapes or control flow change) the memory
the tide leaves at its highest decides which chunks' states live on the accelerator,
in chunk order, and the states move to match the new decision: a re-trace with a higher
tide sends states back to the host, a lower one brings more in. A chunk is updated by
Adam where its states live; the others are updated on the host by the CPU kernel, and
their chunks are not brought to the accelerator for the step. With the disk tier, the states of
the *spilled* chunks live on disk instead (see [Note: disk tier]); they are updated on the host
and never move to the accelerator.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..chunks.chunk import Chunk
from ..memory.accelerator import Accelerator
from ..memory.ledger import DeviceBudgetExceeded
from ..placement.policy import optimizer_chunks_on_device
from ..placement.tracer import Trace

if TYPE_CHECKING:
    from .disk_states import DiskStates

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class OptimizerChunk:
    """fp32 master, momentum and variance aligned with one owned param chunk."""

    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.master, self.exp_avg, self.exp_avg_sq

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


class OptimizerStates:
    """Creates the states of the owned chunks and moves them; see [Note: optimizer-state placement]."""

    def __init__(
        self, chunks: list[Chunk], accel: Accelerator, start_on_device: bool, disk: DiskStates | None = None
    ) -> None:
        self.accel = accel
        self.chunks = {c.chunk_id: c for c in chunks}
        self.disk = disk
        self.spilled: set[int] = set(disk.capacities) if disk is not None else set()
        self.states: dict[int, OptimizerChunk] = {}  # the states in memory (host or accelerator)
        self.on_device: set[int] = set()
        for chunk in chunks:
            if chunk.chunk_id in self.spilled and disk is not None:
                disk.initialize(chunk.chunk_id, chunk.ready())
                continue
            self.states[chunk.chunk_id] = self._create(chunk, start_on_device)
            if start_on_device:
                self.on_device.add(chunk.chunk_id)
        self.trace_planned: Trace | None = None  # the trace the current decision was made from

    def _create(self, chunk: Chunk, on_device: bool) -> OptimizerChunk:
        values = chunk.ready()
        if on_device:
            tensors = self._device_tensors(chunk.chunk_id, chunk.capacity)
        else:
            tensors = [self.accel.host_empty(chunk.capacity, torch.float32) for _ in range(3)]
        tensors[0].copy_(values)
        tensors[1].zero_()
        tensors[2].zero_()
        return OptimizerChunk(*tensors)

    # ---- placement ------------------------------------------------------------------
    def plan(
        self, trace: Trace, budget: int, policy: str, moment_bytes: Callable[[tuple[int, ...]], int], chunk: int
    ) -> None:
        """Re-decide from ``trace`` which chunks' states live on the accelerator and move them:
        what the tide leaves at its highest, less the busiest moment's chunks (``moment_bytes``:
        their groups gathered, with what gradient accumulation adds) and room for two chunks of
        ``chunk`` bytes in flight."""
        if trace is self.trace_planned:
            return
        self.trace_planned = trace
        peak_non_model = max(m.non_model for m in trace.moments)
        busiest = max(moment_bytes(m.chunks) for m in trace.moments)
        free = budget - peak_non_model - busiest - 2 * chunk
        capacities = {cid: c.capacity for cid, c in self.chunks.items() if cid not in self.spilled}
        wanted = optimizer_chunks_on_device(free, capacities, policy)
        for chunk_id in sorted(self.on_device - wanted):
            self._move(chunk_id, to_device=False)
        for chunk_id in sorted(wanted - self.on_device):
            try:
                self._move(chunk_id, to_device=True)
            except DeviceBudgetExceeded as err:  # the tide is higher now than traced: keep the rest on the host
                logger.info("ds_patrickstar: optimizer states stay on the host from chunk %d on (%s)", chunk_id, err)
                break
        logger.info(
            "ds_patrickstar: optimizer states of %d of %d chunks on the accelerator",
            len(self.on_device),
            len(capacities),
        )

    def all_to_host(self) -> None:
        """Before a (re-)trace: every state on the host, so the new tide is measured without them."""
        for chunk_id in sorted(self.on_device):
            self._move(chunk_id, to_device=False)
        self.trace_planned = None

    def _move(self, chunk_id: int, to_device: bool) -> None:
        old = self.states[chunk_id]
        numel = old.master.numel()
        if to_device:
            new = self._device_tensors(chunk_id, numel)
        else:
            new = [self.accel.host_empty(numel, torch.float32) for _ in range(3)]
        copies = [self.accel.copy(dst, src) for dst, src in zip(new, old.tensors())]
        for pending in copies:
            pending.wait()
        for tensor, pending in zip(old.tensors(), copies):
            if to_device:
                self.accel.host_free(tensor, after=pending)
            else:
                self.accel.free(tensor, "optim", after=pending)
        if to_device:
            self.on_device.add(chunk_id)
        else:
            self.on_device.discard(chunk_id)
        self.states[chunk_id] = OptimizerChunk(*new)

    def _device_tensors(self, chunk_id: int, numel: int) -> list[torch.Tensor]:
        """Three charged fp32 tensors on the accelerator, or none: when the budget runs out part
        way, the ones already allocated are released before the error goes on (else their bytes
        would stay charged while the states live on the host: counted twice)."""
        tensors: list[torch.Tensor] = []
        try:
            for _ in range(3):
                what = f"the optimizer states of chunk {chunk_id}"
                tensors.append(self.accel.empty(numel, torch.float32, "optim", what))
        except DeviceBudgetExceeded:
            for tensor in tensors:
                self.accel.free(tensor, "optim")
            raise
        return tensors

    # ---- values -----------------------------------------------------------------------
    def state_of(self, chunk_id: int, write: bool = False) -> OptimizerChunk:
        """The states of an owned chunk wherever they live; a spilled chunk's through the disk tier's
        one-chunk cache (``write``: changes are kept on :meth:`flush`)."""
        if chunk_id in self.spilled and self.disk is not None:
            return self.disk.cached(chunk_id, write)
        return self.states[chunk_id]

    def flush(self) -> None:
        """Spilled states changed through :meth:`state_of` go back to disk."""
        if self.disk is not None:
            self.disk.flush()

    @torch.no_grad()
    def params_to_master(self) -> None:
        """After the parameters were overwritten (a module state_dict load): masters follow them."""
        for chunk_id, chunk in self.chunks.items():
            self.state_of(chunk_id, write=True).master[: chunk.used].copy_(chunk.ready()[: chunk.used])
        self.flush()

    @torch.no_grad()
    def master_to_params(self) -> None:
        """After the masters were loaded (or an overflow): the owned slots get their values."""
        for chunk_id, chunk in self.chunks.items():
            chunk.ready()[: chunk.used].copy_(self.state_of(chunk_id).master[: chunk.used])
        self.flush()

    def bytes_on_host(self) -> int:
        """States in host memory (spilled states and the disk tier's buffers not included)."""
        return sum(s.nbytes for c, s in self.states.items() if c not in self.on_device)

    def bytes_on_disk(self) -> int:
        return self.disk.bytes_on_disk if self.disk is not None else 0
