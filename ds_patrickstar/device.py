"""Chunk buffers on the accelerator and the host, and the runtime that moves them under a budget.

[Note: chunk locations]
A parameter is always a view of its chunk's accelerator payload. An owned chunk is in one
place at a time: on the accelerator (payload backed, no host buffer) or on the host
(values in a host buffer, pinned on CUDA; payload storage resized to zero so the views
stay valid and come back to life when the chunk returns, see [Note: storage resize]).
Model data therefore costs 14 bytes per parameter over device and host together. Chunks
are built on the host (initialize never needs the model on the accelerator) and placement
brings them in when used. A chunk owned by another rank exists only while its group is
gathered. With gradient accumulation a chunk's fp32 accumulator follows the payload: on
the accelerator while the chunk is there, on the host otherwise.

Every move is an asynchronous copy (:mod:`ds_patrickstar.accelerator`): evictions and
prefetches run on the copy stream, and the consumer waits through :meth:`Chunk.ready`.
"""
from __future__ import annotations

import logging
from typing import Callable

import torch

from .accelerator import Accelerator, DeviceBudgetExceeded
from .chunk import Chunk
from .counters import StepCounters
from .hooks import inside_backward
from .placement import Placer
from .tracer import MemoryTracer

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

    def _drop_host(self, buf: torch.Tensor) -> None:
        self.host_bytes -= buf.numel() * buf.element_size()

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
        pending = self.accel.copy(chunk.payload, chunk.host)
        self._drop_host(chunk.host)
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
                chunk.acc = self.accel.empty(chunk.capacity, torch.float32, "grad_acc",
                                             f"the gradient accumulator of chunk {chunk.chunk_id}")
                chunk.acc.zero_()
        return chunk.ready_acc()

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
        acc = self.accel.empty(chunk.capacity, torch.float32, "grad_acc",
                               f"the gradient accumulator of chunk {chunk.chunk_id}")
        chunk.pending.append(self.accel.copy(acc, chunk.acc_host))
        self._drop_host(chunk.acc_host)
        chunk.acc, chunk.acc_host = acc, None


class PlacementRuntime:
    """Carries out the placer's decisions at every moment; see [Note: placement]."""

    def __init__(self, placer: Placer, tracer: MemoryTracer, store: ChunkStore, counters: StepCounters,
                 chunks: list[Chunk]) -> None:
        self.placer, self.tracer, self.store, self.counters = placer, tracer, store, counters
        self.ledger = store.accel.ledger
        self.chunks = chunks
        self.moment = -1
        self.recording = False
        self.tide: list[tuple[int, int, int]] = []  # (moment, model bytes, non-model bytes) this iteration
        # completes the chunk manager's reduce-scatters in flight; how many (see [Note: kept groups])
        self.drain_reductions: Callable[[], int] = lambda: 0

    # ---- accounting (running totals: O(1) per moment, see [Note: placement]) -----------
    def model_bytes_on_device(self) -> int:
        return self.ledger.total

    @staticmethod
    def _bytes(chunk: Chunk) -> int:
        """What the chunk occupies on the accelerator when it is there (payload + accumulator)."""
        return chunk.nbytes + chunk.acc_nbytes

    def _evictable(self, keep: set[int]):
        chunks = self.chunks

        def size(chunk_id: int) -> int | None:
            chunk = chunks[chunk_id]
            return None if chunk_id in keep or not chunk.movable else self._bytes(chunk)

        return size

    def _to_device(self, chunk: Chunk) -> None:
        self.store.to_device(chunk)
        self.placer.arrived(chunk.chunk_id)

    def evict(self, chunk: Chunk) -> None:
        """``chunk`` to the host (an asynchronous copy; see [Note: chunk locations])."""
        if not chunk.on_host:
            self.store.to_host(chunk)
            self.placer.left(chunk.chunk_id)

    def _non_model(self) -> int:
        non_model = self.tracer.non_model_now(self.ledger)
        self.ledger.non_model = non_model
        return non_model

    # ---- moments ------------------------------------------------------------------
    def begin_moment(self, label: str, chunk_ids: tuple[int, ...]) -> None:
        """A training moment advances the trace; a no-grad forward (evaluation) is placed
        greedily without touching the trace or the tide."""
        self.recording = torch.is_grad_enabled() or inside_backward() or label == "step"
        if self.recording:
            self.moment = self.tracer.record(label, chunk_ids, self.ledger)
            if self.moment == 0:
                self.tide = []
        new_iteration = self.recording and self.moment == 0
        self.placer.touch(chunk_ids, self.tracer.current_trace(), self.moment, new_iteration)

    def make_room(self, need: int, keep: set[int]) -> None:
        """Evict until ``need`` more bytes of model data fit beside the tide. Evictions whose copies
        are still in flight count as occupied until they complete (see [Note: deferred frees]):
        new victims are chosen only for what those will not free, then the oldest are waited on."""
        accel = self.store.accel
        accel.reclaim()
        trace = self.tracer.current_trace()
        headroom = self.placer.headroom(trace, self.moment, self._non_model()) - accel.fragmentation()
        over = self.ledger.total + need - headroom
        if over <= 0:
            return
        if self.drain_reductions():  # reduce-scatters in flight hold other ranks' chunks: done first
            accel.reclaim()
            over = self.ledger.total + need - headroom
            if over <= 0:
                return
        short = over - accel.in_flight_bytes()
        if short > 0:
            try:
                victims = self.placer.victims(short, self._evictable(keep))
            except DeviceBudgetExceeded as err:
                raise DeviceBudgetExceeded(
                    f"the accelerator budget of {self.placer.budget:,} B cannot hold the chunks needed at moment "
                    f"{self.moment}: the backend holds {self.ledger.total:,} B and needs {need:,} B more, next to "
                    f"{self.placer.budget - headroom:,} B of non-model memory ({err}; needed now: {sorted(keep)}). "
                    f"Raise zero_optimization.device_budget or lower chunk_size.") from None
            for victim in victims:
                self.evict(self.chunks[victim])
                self.counters.evictions += 1
        accel.reclaim(need_below=headroom - need)


    def bring(self, chunk: Chunk, keep: set[int]) -> None:
        """``chunk`` on the accelerator (room made for it), its copy waited on."""
        if chunk.on_host:
            self.make_room(self._bytes(chunk), keep | {chunk.chunk_id})
            self._to_device(chunk)
        chunk.wait_pending()

    def end_moment(self, in_use: set[int]) -> None:
        """Check the budget (the tide may have risen), record peaks, prefetch the next moment."""
        self.make_room(0, in_use)
        model, non_model = self.ledger.total, self._non_model()
        if model + non_model > self.placer.budget:
            raise DeviceBudgetExceeded(f"model data {model:,} B + non-model {non_model:,} B exceed the accelerator "
                                       f"budget of {self.placer.budget:,} B at moment {self.moment}")
        if self.recording:
            self.tide.append((self.moment, model, non_model))
        self.note_peaks(non_model)
        trace = self.tracer.current_trace()
        for chunk_id in self.placer.prefetch(trace, self.moment):
            chunk = self.chunks[chunk_id]
            if chunk.on_host and self._fits(self._bytes(chunk), trace):
                self._to_device(chunk)
                self.counters.prefetches += 1
                chunk.prefetched = True

    def note_peaks(self, non_model: int) -> None:
        counters, ledger = self.counters, self.ledger
        counters.peak_model_bytes_device = max(counters.peak_model_bytes_device, ledger.peak)
        counters.peak_non_model_bytes_device = max(counters.peak_non_model_bytes_device, non_model)
        counters.peak_device_bytes = max(counters.peak_device_bytes, ledger.total + non_model)

    def can_prefetch(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more (a group gathered ahead of use) fit beside the tide planned for
        this moment and the next without evicting anything; never while tracing."""
        trace = self.tracer.current_trace()
        return trace is not None and self._fits(nbytes, trace)

    def can_keep(self, nbytes: int, reserve: int) -> bool:
        """Whether ``nbytes`` more can stay on the accelerator for the rest of the iteration, next
        to ``reserve`` bytes (a chunk group gathered later) and the highest tide the trace plans
        from here on; never while tracing."""
        trace = self.tracer.current_trace()
        if trace is None:
            return False
        tide = max([self._non_model()] + [m.non_model for m in trace.moments[self.moment + 1:]])
        return self.ledger.total + nbytes + reserve <= self.placer.budget - tide - self.store.accel.fragmentation()

    def _fits(self, nbytes: int, trace) -> bool:
        headroom = self.placer.headroom(trace, self.moment + 1, self._non_model())
        return self.ledger.total + nbytes <= headroom - self.store.accel.fragmentation()

    def after_use(self, chunk: Chunk) -> None:
        if self.placer.release_after_use(chunk.chunk_id) and chunk.movable:
            self.evict(chunk)
