"""The step's accounts: where this rank's model data is at the end of a step, and the disk tier's counts,
written into the per-step counters (``counters.py``) when the step closes."""

from __future__ import annotations

from ..chunks.chunk import Home
from .assembly import ChunkedModel


class StepAccounts:
    """Reads what one run holds where, for its counters; see the module docstring."""

    def __init__(self, parts: ChunkedModel) -> None:
        self.parts = parts
        self.counters, self.accel = parts.counters, parts.accel
        self._pinnings = self.accel.host_pool.pinnings  # the pool's count when the step began

    def close_step(self) -> dict[str, int | float]:
        """Write the holdings and the disk tier's counts into the counters, return them and start again."""
        counters = self.counters
        counters.model_bytes_device, counters.model_bytes_host = self.model_data_bytes_split()
        counters.frozen_bytes_device, counters.frozen_bytes_host, counters.frozen_bytes_disk = self.frozen_bytes_split()
        counters.host_bytes_allocated = self.accel.host_pool.allocated
        counters.spare_bytes_host = self.parts.early.spare_bytes
        pinnings = self.accel.host_pool.pinnings
        counters.host_pinnings, self._pinnings = pinnings - self._pinnings, pinnings
        self._disk_counts()
        closed = counters.as_dict()
        counters.reset()
        self.accel.ledger.reset_peak()
        return closed

    def _disk_counts(self) -> None:
        counters, disk, frozen = self.counters, self.parts.disk, self.parts.frozen_disk
        if disk is not None:
            counts = disk.take_counts()
            counters.disk_bytes_read, counters.disk_bytes_written = counts.bytes_read, counts.bytes_written
            counters.disk_io_seconds, counters.disk_wait_seconds = counts.io_seconds, counts.wait_seconds
            counters.disk_bytes_read_ahead = counts.bytes_read_ahead
            counters.model_bytes_disk, counters.disk_buffer_bytes = disk.bytes_on_disk, disk.buffer_bytes
        if frozen is not None:  # its reads go through the same I/O, counted by the states' counts when they exist
            read, ahead, io_seconds, wait_seconds = frozen.take_counts()
            counters.disk_bytes_read_ahead += ahead
            if disk is None:
                counters.disk_bytes_read, counters.disk_io_seconds = read, io_seconds
                counters.disk_wait_seconds = wait_seconds
            counters.disk_buffer_bytes += frozen.buffer_bytes

    def model_data_bytes_split(self) -> tuple[int, int]:
        """Model data this rank holds now, ``(on the accelerator, on the host)``: chunks, gradient
        accumulators and optimizer states (gathered temporaries excluded; an evicted buffer still
        being copied out counts where its values now live, see [Note: deferred frees])."""
        self.accel.reclaim()
        kinds = self.accel.ledger.by_kind
        # buffers whose copy to the host is still in flight hold values that live on the host already
        device = sum(kinds.get(k, 0) for k in ("chunk", "grad_acc", "optim")) - self.accel.in_flight_bytes()
        host = self.parts.store.host_bytes + self.parts.optim_states.bytes_on_host()
        return self._split(device, host)

    def frozen_bytes_split(self) -> tuple[int, int, int]:
        """This rank's frozen chunks (see [Note: frozen chunks]), ``(on the accelerator, on the host, only on
        disk)``: a frozen chunk on disk away from use is on disk only (see [Note: frozen chunks on disk])."""
        chunk_map = self.parts.chunk_map
        owned = [c for c in chunk_map.chunks if not c.trainable and chunk_map.is_owned(c)]
        disk = sum(c.nbytes for c in owned if c.home is Home.DISK)
        host = sum(c.nbytes for c in owned if c.home is Home.HOST)
        on_device = sum(c.nbytes for c in owned) - host - disk
        return (*self._split(on_device, host), disk)

    def _split(self, on_accelerator: int, on_host: int) -> tuple[int, int]:
        """``(on the accelerator, on the host)``; without placement there is one memory, the host (see
        [Note: null placement])."""
        return (on_accelerator, on_host) if self.parts.placement.budgeted() else (0, on_accelerator + on_host)
