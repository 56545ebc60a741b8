"""The CUDA accelerator: a copy stream, an all-gather and a reduce-scatter stream, the caching
allocator's statistics.

On CUDA (:class:`CudaAccelerator`) a copy runs on a dedicated copy stream after the work
already queued on the compute stream, and records an event; waiting is
``current_stream.wait_event`` for a consumer on the device and ``event.synchronize()`` for
one on the host. Host buffers come from the host pool, each registered once with
``cudaHostRegister`` (page-aligned, exact size) and held by the pool until the copies that
use them have completed (see [Note: pinned host memory]).

[Note: stranded allocator bytes]
The caching allocator keeps freed blocks inside the segments it reserved; a segment partly in use
cannot be returned, and its free pieces (``inactive_split_bytes``, :meth:`CudaAccelerator.fragmentation`)
serve only requests that fit them. Reserved memory in use now is therefore the allocated bytes plus
those pieces. Placement (``placement/runtime.py``) gives model data the budget less the higher of
(a) the non-model memory now plus the stranded pieces and (b) the tide the trace plans ahead: the
tide's coming allocations are made first in the free pieces (freed activations are the size of the
next iteration's activations), so counting the pieces beside the coming tide would count the same
bytes twice and make every freed activation look lost: with activation offload, placement would
fail where keeping the activations fits. Where a coming allocation fits no piece, reserved memory
exceeds the budget by at most the pieces; the default budget keeps 1 GiB of the device out of it for
such slack. The strict emulated accelerator models the pieces its activations leave (see [Note:
caching allocator model] in ``caching_allocator.py``), so a CPU test fails with the double count.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from .accelerator import COLLECTIVE_KINDS, Accelerator, CollectiveIssue
from .pending import Pending


class _CudaPending(Pending):
    def __init__(self, event: torch.cuda.Event, to_host: bool) -> None:
        self.event = event
        self.to_host = to_host

    def wait(self) -> None:
        if self.to_host:
            self.event.synchronize()  # the consumer is the host
        else:
            torch.cuda.current_stream().wait_event(self.event)  # the consumer is the compute stream

    def wait_host(self) -> None:
        self.event.synchronize()

    def done(self) -> bool:
        return self.event.query()


_PAGE = 4096  # cudaHostRegister pins whole pages: a buffer owns the pages it spans


class CudaAccelerator(Accelerator):
    host_alignment = _PAGE

    def __init__(self, device: torch.device, budget: int) -> None:
        super().__init__(budget)
        self.device = device
        self.copy_stream = torch.cuda.Stream(device)
        # as FSDP2's: the collectives of the next groups are not queued behind the copies, nor
        # all-gathers behind reduce-scatters (see [Note: collective buffers] in groups/comm.py)
        self.collective_streams = {kind: torch.cuda.Stream(device, priority=-1) for kind in COLLECTIVE_KINDS}
        self._peak_seen = self._allocator_stats().get("allocated_bytes", {}).get("all", {}).get("peak", 0)

    def clock(self) -> torch.cuda.Event:
        mark = torch.cuda.Event(enable_timing=True)
        mark.record(torch.cuda.current_stream(self.device))
        return mark

    def seconds_between(self, start: Any, end: Any) -> float:
        return start.elapsed_time(end) / 1000.0 if end.query() else float("nan")

    def reach(self, mark: Any) -> None:
        mark.synchronize()

    def _drain(self) -> None:
        """Copies and collectives still queued on our streams complete before their buffers are freed."""
        self.copy_stream.synchronize()
        for stream in self.collective_streams.values():
            stream.synchronize()
        torch.cuda.current_stream(self.device).synchronize()

    def _pin_host(self, address: int, nbytes: int) -> None:
        torch.cuda.check_error(int(torch.cuda.cudart().cudaHostRegister(address, nbytes, 0)))

    def _unpin_host(self, address: int) -> None:
        torch.cuda.check_error(int(torch.cuda.cudart().cudaHostUnregister(address)))

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Pending:
        self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.copy_stream):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.copy_stream)
        return _CudaPending(event, to_host=not dst.is_cuda)

    @contextlib.contextmanager
    def collective_stream(self, kind: str, *buffers: torch.Tensor) -> Iterator[CollectiveIssue]:
        """Issue on the stream of ``kind``, after the work queued on the compute stream (as FSDP2's
        all-gather and reduce-scatter streams). Its work handle's ``wait()`` makes the compute stream
        wait for it; the buffers are freed only after that (see [Note: collective buffers] in
        groups/comm.py), so nothing keeps a block reserved behind the allocator's back."""
        stream = self.collective_streams[kind]
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            yield CollectiveIssue(kind)

    def memory_in_use(self) -> tuple[int, int]:
        """Peak since the previous call from deltas of the process-wide peak: never resets torch's
        statistics (the user's, and ZeRO-3's "max allocated", stay intact). When the process-wide
        peak did not grow, the highest value in between is unknown and ``allocated now`` stands in."""
        return self._in_use(self._allocator_stats())

    def memory_reading(self) -> tuple[int, int, int]:
        stats = self._allocator_stats()
        return (*self._in_use(stats), self._stranded(stats))

    def _in_use(self, stats: dict) -> tuple[int, int]:
        allocated = stats.get("allocated_bytes", {}).get("all", {})
        now, peak = allocated.get("current", 0), allocated.get("peak", 0)
        highest = peak if peak > self._peak_seen else now
        self._peak_seen = peak
        return now, max(now, highest)

    def fragmentation(self) -> int:
        """Free bytes stranded inside partly used allocator blocks (``inactive_split_bytes``): reserved
        memory only requests that fit them can use (see [Note: stranded allocator bytes]). Whole
        cached blocks are not counted: the allocator returns them when it needs room."""
        return self._stranded(self._allocator_stats())

    @staticmethod
    def _stranded(stats: dict) -> int:
        return stats.get("inactive_split_bytes", {}).get("all", {}).get("current", 0)

    def _allocator_stats(self) -> dict:
        """The caching allocator's statistics, nested as torch keeps them: placement reads them at every moment,
        and ``torch.cuda.memory_stats`` flattens and sorts all ~120 of them on each call (~0.1-0.2 ms of host
        time, a thousand times a step on a large model, in the step's host time)."""
        return torch.cuda.memory_stats_as_nested_dict(self.device)

    def release_cached(self) -> None:
        torch.cuda.empty_cache()
