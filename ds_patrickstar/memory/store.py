"""Chunk buffers on the accelerator and the host: created, freed and moved, with running totals.

[Note: chunk locations]
A parameter is always a view of its chunk's accelerator payload. An owned chunk is in one
place at a time: on the accelerator (payload backed, no host buffer) or on the host
(values in a buffer of the host pool, see [Note: pinned host memory]; payload storage
resized to zero so the views stay valid and come back to life when the chunk returns,
see [Note: storage resize]).
Model data therefore costs 14 bytes per parameter over device and host together. Chunks
are built on the host (initialize never needs the model on the accelerator) and placement
brings them in when used. A chunk owned by another rank exists only while its group is
gathered. With gradient accumulation a chunk's fp32 accumulator follows the payload: on
the accelerator while the chunk is there, on the host otherwise.

Every move is an asynchronous copy (:mod:`ds_patrickstar.memory.accelerator`): evictions and
prefetches run on the copy stream, and the consumer waits through :meth:`Chunk.ready`.
"""

from __future__ import annotations

import logging

import torch

from ..chunks.chunk import Chunk
from ..counters import StepCounters
from .accelerator import Accelerator, Pending

logger = logging.getLogger(__name__)


class ChunkStore:
    """Creates, frees and moves chunk buffers; keeps running totals of what is where."""

    def __init__(self, accel: Accelerator, counters: StepCounters, movable: bool) -> None:
        self.accel = accel
        self.counters = counters
        self.movable = movable  # chunks have a host home (placement); else they stay put
        self.host_bytes = 0  # model data on the host: host buffers and accumulators

    # ---- creation -----------------------------------------------------------------
    def create(self, chunk: Chunk, owned: bool) -> None:
        """Give ``chunk`` its payload, backed for now so that parameter views can be made of it
        (:meth:`settle` follows). An owned chunk's values go to the host with placement."""
        chunk.payload = self.accel.empty(chunk.capacity, chunk.dtype, "chunk", f"chunk {chunk.chunk_id}")
        # the pool may cache one chunk's host buffers: payload, accumulator, three optimizer states
        self.accel.host_pool.cache_at_least(chunk.capacity * (chunk.dtype.itemsize + 16))
        if owned and self.movable:
            chunk.host = self._host_zeros(chunk.capacity, chunk.dtype)
            chunk.on_host = True
        elif owned:
            chunk.payload.zero_()

    def settle(self, chunk: Chunk, owned: bool) -> None:
        """After the views were made: the payload keeps memory only if the chunk lives there."""
        if chunk.on_host or not owned:
            self.accel.free(chunk.payload, "chunk")
        if not owned:
            chunk.mark_released()

    def _host_zeros(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        buf = self.accel.host_empty(numel, dtype)
        buf.zero_()
        self.host_bytes += buf.numel() * buf.element_size()
        return buf

    def _drop_host(self, buf: torch.Tensor, after: Pending | None = None) -> None:
        """Give ``buf`` back to the host pool (once ``after``, a copy reading it, has completed)."""
        self.host_bytes -= buf.numel() * buf.element_size()
        self.accel.host_free(buf, after)

    # ---- another rank's chunks: present while gathered -----------------------------
    def materialize(self, chunk: Chunk) -> None:
        if not chunk.is_materialized:
            self.accel.materialize(chunk.payload, "chunk", f"chunk {chunk.chunk_id}")
            self._acc_to_device(chunk)
        chunk.mark_present()

    def release(self, chunk: Chunk) -> None:
        chunk.mark_released()
        if chunk.is_materialized:
            chunk.wait_pending()
            self._acc_to_host(chunk)
            self.accel.free(chunk.payload, "chunk")

    # ---- owned chunks: between the accelerator and the host -------------------------
    @staticmethod
    def _wait_collectives(chunk: Chunk) -> None:
        """A collective reading or writing the chunk completes before the chunk moves."""
        for pending in [p for p in chunk.pending if p.collective]:
            pending.wait()
        chunk.pending = [p for p in chunk.pending if not p.collective]

    def to_host(self, chunk: Chunk) -> None:
        if chunk.on_host:
            return
        self._wait_collectives(chunk)
        host = self.accel.host_empty(chunk.capacity, chunk.dtype)
        self.host_bytes += chunk.nbytes
        pending = self.accel.copy(host, chunk.payload)  # ordered after every earlier copy of the chunk
        self.accel.free(chunk.payload, "chunk", after=pending)
        chunk.host, chunk.on_host, chunk.pending = host, True, [pending]
        self._acc_to_host(chunk)
        chunk.prefetched = False
        self.counters.bytes_to_host += chunk.nbytes

    def to_device(self, chunk: Chunk) -> None:
        if not chunk.on_host:
            return
        self._wait_collectives(chunk)
        self.accel.materialize(chunk.payload, "chunk", f"chunk {chunk.chunk_id}")
        host = chunk.host_buffer()
        pending = self.accel.copy(chunk.payload, host)
        self._drop_host(host, after=pending)
        chunk.host, chunk.on_host, chunk.pending = None, False, [pending]
        self._acc_to_device(chunk)
        self.counters.bytes_to_device += chunk.nbytes

    # ---- gradient accumulators (see [Note: gradient accumulation]) ---------------------
    def accumulator(self, chunk: Chunk) -> torch.Tensor:
        """The chunk's fp32 accumulator, created (zeroed, beside the payload) on first use."""
        if chunk.acc is None and chunk.acc_host is None:
            if chunk.on_host or not chunk.is_materialized:
                chunk.acc_host = self._host_zeros(chunk.capacity, torch.float32)
            else:
                chunk.acc = self.accel.empty(
                    chunk.capacity, torch.float32, "grad_acc", f"the gradient accumulator of chunk {chunk.chunk_id}"
                )
                chunk.acc.zero_()
        acc = chunk.ready_acc()
        if acc is None:
            raise RuntimeError(f"chunk {chunk.chunk_id}: its gradient accumulator was not created")
        return acc

    def drop_accumulator(self, chunk: Chunk) -> None:
        chunk.wait_pending()
        if chunk.acc is not None:
            self.accel.free(chunk.acc, "grad_acc")
            chunk.acc = None
        if chunk.acc_host is not None:
            self._drop_host(chunk.acc_host)
            chunk.acc_host = None

    def _acc_to_host(self, chunk: Chunk) -> None:
        if chunk.acc is None:
            return
        host = self.accel.host_empty(chunk.capacity, torch.float32)
        self.host_bytes += chunk.acc_nbytes
        pending = self.accel.copy(host, chunk.acc)
        self.accel.free(chunk.acc, "grad_acc", after=pending)
        chunk.acc, chunk.acc_host = None, host
        chunk.pending.append(pending)

    def _acc_to_device(self, chunk: Chunk) -> None:
        if chunk.acc_host is None:
            return
        acc = self.accel.empty(
            chunk.capacity, torch.float32, "grad_acc", f"the gradient accumulator of chunk {chunk.chunk_id}"
        )
        pending = self.accel.copy(acc, chunk.acc_host)
        chunk.pending.append(pending)
        self._drop_host(chunk.acc_host, after=pending)
        chunk.acc, chunk.acc_host = acc, None
