"""Moving chunks between the accelerator and the host, under a budget.

[Note: chunk locations]
A parameter is always a view of its chunk's accelerator payload. A chunk on the host has
its values in a host buffer (pinned on CUDA) and its payload storage resized to zero, so
the views stay valid and come back to life when the chunk returns (see
[Note: storage resize]). On CUDA a move to the accelerator runs on a copy stream and is
waited for with an event just before use, so prefetches overlap compute.

On a CPU-only machine the *emulated accelerator* (``emulate_accelerator: true``) runs the
same code: the "accelerator" payload and the host buffer are separate CPU tensors, every
move is a real copy, and the budget is enforced (a move that would exceed it raises
:class:`~ds_patrickstar.placement.DeviceBudgetExceeded`), so a missed move or a stale
view breaks the numbers the tests compare.
"""
from __future__ import annotations

import logging

import torch

from .chunk import Chunk
from .counters import StepCounters
from .hooks import inside_backward
from .placement import DeviceBudgetExceeded, Placer
from .tracer import MemoryTracer

logger = logging.getLogger(__name__)


class ChunkMover:
    """Copies chunk payloads to the host and back; see [Note: chunk locations]."""

    def __init__(self, device: torch.device, counters: StepCounters) -> None:
        self.device = device
        self.counters = counters
        self.pin = device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._events: dict[int, torch.cuda.Event] = {}

    def to_host(self, chunk: Chunk) -> None:
        if chunk.on_host:
            return
        self.wait(chunk)
        if chunk.host is None:
            chunk.host = torch.empty(chunk.capacity, dtype=chunk.dtype, device="cpu", pin_memory=self.pin)
        chunk.host.copy_(chunk.payload)
        chunk.payload.untyped_storage().resize_(0)
        chunk.on_host = True
        self.counters.bytes_to_host += chunk.nbytes

    def to_device(self, chunk: Chunk) -> None:
        if not chunk.on_host:
            return
        chunk.payload.untyped_storage().resize_(chunk.nbytes)
        if self.copy_stream is None:
            chunk.payload.copy_(chunk.host)
        else:
            self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.copy_stream):
                chunk.payload.copy_(chunk.host, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self.copy_stream)
            self._events[chunk.chunk_id] = event
        chunk.on_host = False
        self.counters.bytes_to_device += chunk.nbytes

    def wait(self, chunk: Chunk) -> None:
        event = self._events.pop(chunk.chunk_id, None)
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)


class PlacementRuntime:
    """Carries out the placer's decisions at every moment; see [Note: placement]."""

    def __init__(self, placer: Placer, tracer: MemoryTracer, mover: ChunkMover, counters: StepCounters,
                 chunks: list[Chunk], movable: set[int]) -> None:
        self.placer, self.tracer, self.mover, self.counters = placer, tracer, mover, counters
        self.chunks = chunks
        self.movable = movable  # owned chunks: the only ones with a host copy
        self.optim_device_bytes = 0
        self.moment = -1
        self.recording = False
        self.tide: list[tuple[int, int, int]] = []  # (moment, model bytes, non-model bytes) this iteration

    # ---- accounting ---------------------------------------------------------------
    def model_bytes_on_device(self) -> int:
        resident = sum(c.nbytes for c in self.chunks if c.is_materialized)
        return resident + self.optim_device_bytes

    def _resident_movable(self, exclude: set[int]) -> dict[int, int]:
        return {c.chunk_id: c.nbytes for c in self.chunks if c.chunk_id in self.movable and c.is_materialized
                and c.movable and c.chunk_id not in exclude}

    def _non_model(self) -> int:
        return self.tracer.non_model_now(self.model_bytes_on_device())

    # ---- moments ------------------------------------------------------------------
    def begin_moment(self, label: str, chunk_ids: tuple[int, ...]) -> None:
        """A training moment advances the trace; a no-grad forward (evaluation) is placed
        greedily without touching the trace or the tide."""
        self.recording = torch.is_grad_enabled() or inside_backward() or label == "step"
        if self.recording:
            self.moment = self.tracer.record(label, chunk_ids, self.model_bytes_on_device())
            if self.moment == 0:
                self.tide = []
        self.placer.touch(chunk_ids)

    def make_room(self, need: int, keep: set[int]) -> None:
        """Evict until ``need`` more bytes of model data fit beside the tide."""
        trace = None if self.tracer.tracing else self.tracer.trace
        headroom = self.placer.headroom(trace, self.moment, self._non_model())
        over = self.model_bytes_on_device() + need - headroom
        if over <= 0:
            return
        try:
            victims = self.placer.victims(trace, self.moment, self._resident_movable(keep), over)
        except DeviceBudgetExceeded as err:
            raise DeviceBudgetExceeded(
                f"the accelerator budget of {self.placer.budget} B cannot hold the chunks needed at moment "
                f"{self.moment}: model data {self.model_bytes_on_device()} B + {need} B more, next to "
                f"{self.placer.budget - headroom} B of non-model memory ({err}; chunks resident: "
                f"{[c.chunk_id for c in self.chunks if c.is_materialized]}, needed now: {sorted(keep)}). Raise "
                f"zero_optimization.device_budget or lower chunk_size.") from None
        for victim in victims:
            self.mover.to_host(self.chunks[victim])
            self.counters.evictions += 1

    def bring(self, chunk: Chunk, keep: set[int]) -> None:
        if chunk.on_host:
            self.make_room(chunk.nbytes, keep | {chunk.chunk_id})
            self.mover.to_device(chunk)
        self.mover.wait(chunk)

    def end_moment(self, in_use: set[int]) -> None:
        """Check the budget (the tide may have risen), record peaks, prefetch the next moment."""
        self.make_room(0, in_use)
        model, non_model = self.model_bytes_on_device(), self._non_model()
        if model + non_model > self.placer.budget:
            raise DeviceBudgetExceeded(f"model data {model} B + non-model {non_model} B exceed the accelerator "
                                       f"budget of {self.placer.budget} B at moment {self.moment}")
        if self.recording:
            self.tide.append((self.moment, model, non_model))
        self.counters.peak_model_bytes_device = max(self.counters.peak_model_bytes_device, model)
        self.counters.peak_non_model_bytes_device = max(self.counters.peak_non_model_bytes_device, non_model)
        trace = None if self.tracer.tracing else self.tracer.trace
        for chunk_id in self.placer.prefetch(trace, self.moment):
            chunk = self.chunks[chunk_id]
            if chunk.on_host and self._fits(chunk.nbytes, trace):
                self.mover.to_device(chunk)
                self.counters.prefetches += 1
                chunk.prefetched = True

    def _fits(self, nbytes: int, trace) -> bool:
        headroom = self.placer.headroom(trace, self.moment + 1, self._non_model())
        return self.model_bytes_on_device() + nbytes <= headroom

    def after_use(self, chunk: Chunk) -> None:
        if chunk.chunk_id in self.movable and self.placer.release_after_use(chunk.chunk_id) and chunk.movable:
            self.mover.to_host(chunk)


def resolve_budget(device_budget: int | float | None, device: torch.device, emulate: bool) -> int:
    """The accelerator budget in bytes: a byte count, or a fraction of the device's memory
    (of the host's memory on the emulated accelerator)."""
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
    else:
        import psutil

        total = psutil.virtual_memory().total
    if device_budget is None:
        if emulate:
            raise ValueError("zero_optimization.emulate_accelerator=true needs zero_optimization.device_budget: "
                             "the emulated accelerator's size in bytes (an integer) or a fraction of host memory")
        device_budget = 0.9
    return int(total * device_budget) if isinstance(device_budget, float) else int(device_budget)


def preflight(manager, budget: int, bytes_per_element_lp: int, accumulate: bool) -> None:
    """Fail at once when the model data cannot fit accelerator budget plus free host memory."""
    import psutil

    per_param = bytes_per_element_lp + 12 + (4 if accumulate else 0)
    owned = sum(c.capacity for c in manager.owned_chunks())
    need = owned * (12 + bytes_per_element_lp) + (4 * sum(c.capacity for c in manager.chunks) if accumulate else 0)
    available = budget + psutil.virtual_memory().available
    if need > available:
        fits = available // per_param * manager.comm.world_size
        raise ValueError(f"the model data needs {need / 2**30:.2f} GiB on this rank ({per_param} bytes per parameter "
                         f"x {owned:,} owned elements) but the accelerator budget ({budget / 2**30:.2f} GiB) plus "
                         f"free host memory give {available / 2**30:.2f} GiB; the largest model that would fit has "
                         f"about {fits / 1e6:,.0f}M parameters at this world size")


def build_placement(options, manager, counters: StepCounters, device: torch.device, dtype: torch.dtype,
                    accumulate: bool) -> PlacementRuntime | None:
    """A :class:`PlacementRuntime` on CUDA or the emulated accelerator; ``None`` on a plain CPU run."""
    from .placement import Placer
    from .tracer import SavedTensorMeter

    emulate = options.emulate_accelerator
    if device.type != "cuda" and not emulate:
        return None
    budget = resolve_budget(options.device_budget, device, emulate)
    preflight(manager, budget, torch.finfo(dtype).bits // 8, accumulate)
    owned = {c.chunk_id for c in manager.owned_chunks()}
    model_storages = {c.payload.untyped_storage()._cdata for c in manager.chunks}
    meter = SavedTensorMeter(lambda s: s._cdata in model_storages) if device.type != "cuda" else None
    placer = Placer(budget, options.placement, options.static_fraction, owned,
                    {c.chunk_id: c.nbytes for c in manager.chunks})
    runtime = PlacementRuntime(placer, MemoryTracer(device, meter), ChunkMover(device, counters), counters,
                               manager.chunks, owned)
    manager.attach_placement(runtime)
    logger.info("ds_patrickstar: %s placement, accelerator budget %.3f GiB%s", options.placement, budget / 2**30,
                " (emulated)" if emulate else "")
    return runtime
