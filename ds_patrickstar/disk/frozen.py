"""Frozen chunks on disk: their owned slices written once, read ahead in trace order, never written back.

[Note: frozen chunks on disk]
With the disk tier, the owned slices of the frozen chunks that ``host_budget`` cannot hold (see
[Note: disk tier plan]) live in the swap folder, one record per chunk (``chunk<id>.swap``, the
payload in the training dtype, padded to 4 KiB; see [Note: swap files]), beside the spilled
optimizer states, through the same I/O (see [Note: disk I/O]) and under the same lock. Such a
chunk's home is its record (:attr:`~ds_patrickstar.chunks.chunk.Chunk.on_disk`): away from use it
lives there (:attr:`~ds_patrickstar.chunks.chunk.Home.DISK`, no host buffer), so it takes no RAM.

* **Written once**: at initialize, right after each chunk group is bound (one chunk at a time:
  :meth:`FrozenDisk.put`; a chunk built without values, under ``ds_patrickstar.Init``, is not
  written: its preallocated record reads as zeros), and inside :meth:`FrozenDisk.writing` (the
  values of ``Init``, ``load_pretrained``, ``load_state_dict`` and ``load_checkpoint``), where a
  chunk's values go through a staging buffer of a few chunks that is written back when it is
  evicted or the block ends. Frozen values never change in training: nothing else writes.
* **Read ahead in trace order**: a chunk is brought (placement's move to the accelerator, or a
  chunk group's gather) from one of ``buffer_count`` aligned host buffers (pinned for the
  accelerator's copies where it has any) that a read filled
  (:meth:`FrozenDisk.take`), then the buffer goes back once its copy has completed. The
  sequence of uses of frozen chunks on disk in a step repeats (every rank runs the same modules,
  see [Note: gather order]): :class:`~ds_patrickstar.disk.use_order.UseOrder` records it (see
  [Note: frozen use order]), and each use issues the reads of the next chunks not there, as far as
  free buffers allow, so disk reads overlap compute; the first step reads on demand. A read in
  flight is reached only through :meth:`_Read.ready`, which waits for it; under the strict
  emulated accelerator a read not waited on leaves NaN in the buffer.
* **Let go after use**: where the accelerator is the host (no placement), a frozen chunk on disk
  is dropped (nothing is written) when its group is released, or, with one rank, once its use is
  over and it is not among the chunks used again soonest that fit, with those in use, in
  ``buffer_count`` + :data:`~ds_patrickstar.disk.budget.FROZEN_IN_USE_CHUNKS` (consecutive modules
  often share a chunk, backward starts with the chunks forward ended with, and a checkpointed
  block's backward follows its recomputation), and at the end of backward; with placement it is
  evicted like any chunk, for free.
* **Read outside training** (checkpoints, exports: :meth:`~ds_patrickstar.store.chunk_store.ChunkStore.values`
  of a chunk on disk): through the staging buffers, one record read each, dropped at the next step.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator

import torch

from ..chunks.chunk import Chunk
from ..memory.pending import Pending
from .budget import FROZEN_IN_USE_CHUNKS, FROZEN_STAGING_CHUNKS
from .io import DiskIO, DiskPending
from .swap_files import SwapFiles
from .use_order import UseOrder

logger = logging.getLogger(__name__)

_LOOK_AHEAD = 64  # uses of the recorded order searched for chunks to read ahead


class _Read:
    """A read of one chunk's record into a pool buffer; :meth:`ready` is the one way to its bytes."""

    def __init__(self, buffer: torch.Tensor, pending: DiskPending) -> None:
        self.buffer, self._pending = buffer, pending

    def ready(self) -> torch.Tensor:
        """The buffer, once the read has completed (raises the read's error)."""
        self._pending.wait()
        return self.buffer


class FrozenDisk:
    """The frozen chunks of this rank that live on disk; see [Note: frozen chunks on disk]."""

    def __init__(self, files: SwapFiles, io: DiskIO, nbytes: dict[int, int], buffer_count: int) -> None:
        self.files, self.io = files, io
        self.chunks: dict[int, Chunk] = {}
        self.nbytes = dict(nbytes)  # chunk id -> bytes of its record
        self._slot, sizes = _read_buffer_sizes(list(nbytes.values()), buffer_count)
        self._free: list[tuple[torch.Tensor, Pending | None]] = [(io.empty(size), None) for size in sizes]
        self.buffer_bytes = sum(buffer.numel() for buffer, _ in self._free)
        self._reads: dict[int, _Read] = {}
        self._staging: OrderedDict[int, torch.Tensor] = OrderedDict()
        self._spare: list[torch.Tensor] = []  # staging buffers not in use (at most FROZEN_STAGING_CHUNKS exist)
        self._dirty: set[int] = set()
        self._blank: set[int] = set()  # never written: the preallocated record reads as zeros
        self._writing = 0
        self.order = UseOrder()
        self.keep = buffer_count + FROZEN_IN_USE_CHUNKS  # brought from disk and there (kept, in use): host accelerator
        self._brought: OrderedDict[int, None] = OrderedDict()  # brought and not let go, least recently first
        self.bytes_read = self.bytes_read_ahead = 0  # records read (also outside training); of them, ahead of use
        self._counted: tuple[int, int, float, float] = (0, 0, 0.0, 0.0)
        self._pinned: list[int] = []  # addresses of read buffers pinned for the accelerator
        self._unpin: Callable[[int], None] | None = None
        weakref.finalize(self, _close, io, files)

    def pin_buffers(self, pin: Callable[[int, int], None], unpin: Callable[[int], None]) -> None:
        """Pin the read buffers for asynchronous copies to the accelerator (unpinned at :meth:`close`)."""
        for buffer, _ in self._free:
            pin(buffer.data_ptr(), buffer.numel())
            self._pinned.append(buffer.data_ptr())
        self._unpin = unpin

    def adopt(self, chunk: Chunk) -> bool:
        """Whether ``chunk`` lives on disk (the plan put it there); if so it is this tier's from now on."""
        if chunk.chunk_id not in self.nbytes:
            return False
        self.chunks[chunk.chunk_id] = chunk
        return True

    @property
    def bytes_on_disk(self) -> int:
        return sum(self.nbytes.values())

    # ---- written once ----------------------------------------------------------------
    @torch.no_grad()
    def put(self, chunk: Chunk, values: torch.Tensor | None) -> None:
        """The chunk's first values (``None``: built without values, left as the zeros of its record)."""
        if values is None:
            self._blank.add(chunk.chunk_id)
            return
        buffer = self._buffer(chunk.chunk_id)
        self._as(chunk, buffer).copy_(values.reshape(-1)[: chunk.capacity])
        self._write(chunk.chunk_id, buffer).wait()
        self._free.append((buffer, None))

    @contextlib.contextmanager
    def writing(self) -> Iterator[None]:
        """Writes through :meth:`values` inside the block reach the records (when a staged chunk is
        evicted, and at the end); chunks on the accelerator now are written from there."""
        self._writing += 1
        try:
            yield
        finally:
            self._writing -= 1
            if not self._writing:
                self._write_resident()
                self.drop_staging()

    def _write_resident(self) -> None:
        for cid, chunk in self.chunks.items():
            if not chunk.on_host:
                buffer = self._buffer(cid)
                self._as(chunk, buffer).copy_(chunk.ready())
                self._write(cid, buffer).wait()
                self._free.append((buffer, None))
                self._blank.discard(cid)

    def drop_staging(self) -> None:
        """Write back what was changed and let the staging buffers go."""
        while self._staging:
            self._evict()
        self._spare.clear()

    # ---- outside training: staging -------------------------------------------------------
    def values(self, chunk: Chunk) -> torch.Tensor:
        """The chunk's values in a staging buffer (read on first use; inside :meth:`writing`, changes
        are written back); valid until :data:`FROZEN_STAGING_CHUNKS` other chunks are staged (the buffers are
        reused)."""
        cid = chunk.chunk_id
        if cid not in self._staging:
            while len(self._staging) >= FROZEN_STAGING_CHUNKS:
                self._evict()
            buffer = self._spare.pop() if self._spare else self.io.empty(max(self.nbytes.values()))
            if cid in self._blank:
                buffer.zero_()
            else:
                self._read_into(cid, buffer)
            self._staging[cid] = buffer
        self._staging.move_to_end(cid)
        if self._writing:
            self._dirty.add(cid)
            self._blank.discard(cid)
        return self._as(chunk, self._staging[cid])

    def _read_into(self, cid: int, buffer: torch.Tensor) -> None:
        read = self._reads.pop(cid, None)
        if read is not None:
            nbytes = self.nbytes[cid]
            buffer[:nbytes].copy_(read.ready()[:nbytes])
            self._free.append((read.buffer, None))
            return
        self._read(cid, buffer).wait()

    def _evict(self) -> None:
        cid, buffer = self._staging.popitem(last=False)
        if cid in self._dirty:
            self._dirty.discard(cid)
            self._write(cid, buffer).wait()
        self._spare.append(buffer)

    # ---- training: read ahead ------------------------------------------------------------
    def used(self, chunk: Chunk) -> None:
        """``chunk`` is used now (brought or still there): recorded in the step's order; the next reads go out."""
        self.order.used(chunk.chunk_id)
        if chunk.chunk_id in self._brought:
            self._brought.move_to_end(chunk.chunk_id)
        self.read_ahead()

    def take(self, chunk: Chunk) -> tuple[torch.Tensor, Callable[[Pending], None]]:
        """The chunk's values in a host buffer, to be copied to the accelerator; call the second with
        that copy: the buffer goes back to the pool once it has completed. Issues the next reads."""
        cid = chunk.chunk_id
        self._brought[cid] = None
        self._brought.move_to_end(cid)
        if cid in self._staging:
            buffer = self._staging.pop(cid)  # the staged values (a checkpoint read them): copied, then spare
            done: Callable[[Pending], None] = self._sparer(buffer)
        else:
            read = self._reads.pop(cid, None) or _Read(*self._read_fresh(cid))
            buffer = read.ready()
            done = self._giver(buffer)
        self.read_ahead()
        return self._as(chunk, buffer), done

    def surplus(self, keep: int | None = None) -> list[Chunk]:
        """Chunks brought from disk, still there and not in use, beyond those used again soonest (see
        [Note: frozen use order]; where the order tells nothing, the most recently used) that fit with the
        chunks in use in ``keep`` (default: :attr:`keep`): those to let go."""
        for cid in [c for c in self._brought if self.chunks[c].on_host]:
            del self._brought[cid]
        idle = [c for c in self._brought if self.chunks[c].movable]
        room = max(0, (self.keep if keep is None else keep) - (len(self._brought) - len(idle)))
        recency = {c: i for i, c in enumerate(idle)}
        ranked = sorted(idle, key=lambda c: (self.order.next_use(c), -recency[c]))
        return [self.chunks[c] for c in ranked[room:]]

    def read_ahead(self) -> None:
        """Issue the reads of the next frozen chunks of the recorded order, as far as buffers allow."""
        for cid in dict.fromkeys(self.order.ahead(_LOOK_AHEAD)):
            if cid in self._reads or cid in self._staging or not self.chunks[cid].on_host:
                continue
            if not any(self._fits(cid, buffer) for buffer, _ in self._free):
                return
            self._reads[cid] = _Read(*self._read_fresh(cid))
            self.bytes_read_ahead += self.nbytes[cid]

    def next_step(self) -> None:
        """A step is over: the recorded order is the next step's; reads the order no longer expects go."""
        self.order.next_step()
        self.drop_staging()
        expected = set(self.order.ahead(_LOOK_AHEAD))
        for cid in [c for c in self._reads if c not in expected]:
            self._free.append((self._reads.pop(cid).ready(), None))
        self.read_ahead()

    def take_counts(self) -> tuple[int, int, float, float]:
        """Since the last call: bytes of frozen records read, of them read ahead, seconds of the I/O threads,
        seconds waited."""
        now = (self.bytes_read, self.bytes_read_ahead, self.io.io_seconds, self.io.wait_seconds)
        before, self._counted = self._counted, now
        return now[0] - before[0], now[1] - before[1], now[2] - before[2], now[3] - before[3]

    # ---- buffers and requests ------------------------------------------------------------
    def _sparer(self, buffer: torch.Tensor) -> Callable[[Pending], None]:
        def spare(after: Pending) -> None:
            after.wait_host()
            self._spare.append(buffer)

        return spare

    def _giver(self, buffer: torch.Tensor) -> Callable[[Pending], None]:
        return lambda after: self._free.append((buffer, after))

    def _fits(self, cid: int, buffer: torch.Tensor) -> bool:  # the largest record only into the large buffer
        return (self.nbytes[cid] > self._slot) == (buffer.numel() > self._slot)

    def _buffer(self, cid: int) -> torch.Tensor:
        """A free pool buffer for chunk ``cid`` (its last copy completed); the pending read used last gives its
        own when none is."""
        free = [i for i, (buffer, _) in enumerate(self._free) if self._fits(cid, buffer)]
        if not free:
            last = max((c for c, read in self._reads.items() if self._fits(cid, read.buffer)), key=self.order.next_use)
            self._free.append((self._reads.pop(last).ready(), None))
            free = [len(self._free) - 1]
        buffer, after = self._free.pop(free[0])
        if after is not None:
            after.wait_host()
        return buffer

    def _read_fresh(self, cid: int) -> tuple[torch.Tensor, DiskPending]:
        buffer = self._buffer(cid)
        return buffer, self._read(cid, buffer)

    def _read(self, cid: int, buffer: torch.Tensor) -> DiskPending:
        nbytes = self.nbytes[cid]
        self.bytes_read += nbytes
        return self.io.read(self.files.fds[cid], 0, buffer[:nbytes]).of_file(self.files.path(cid))

    def _write(self, cid: int, buffer: torch.Tensor) -> DiskPending:
        nbytes = self.nbytes[cid]
        return self.io.write(self.files.fds[cid], 0, buffer[:nbytes]).of_file(self.files.path(cid))

    @staticmethod
    def _as(chunk: Chunk, buffer: torch.Tensor) -> torch.Tensor:
        return buffer[: chunk.capacity * chunk.dtype.itemsize].view(chunk.dtype)

    def close(self) -> None:
        """Pending reads complete, the staging and buffers go; the files go with the tier."""
        for read in self._reads.values():
            with contextlib.suppress(OSError):
                read.ready()
        self._reads.clear()
        for after in [a for _, a in self._free if a is not None]:
            with contextlib.suppress(Exception):
                after.wait_host()  # a copy still reading a buffer completes before it is unpinned
        self._unpin_all()
        self._staging.clear()
        self._free = []
        _close(self.io, self.files)

    def _unpin_all(self) -> None:
        pinned, self._pinned = self._pinned, []
        if self._unpin is not None:
            for address in pinned:
                self._unpin(address)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # never closed: the read buffers go with it, unpinned first
            self._unpin_all()


def _read_buffer_sizes(records: list[int], count: int) -> tuple[int, list[int]]:
    """The read buffers for records of ``records`` bytes: ``count`` of the second largest record, and one of the
    largest where it is larger (see [Note: disk tier plan]); and the first size."""
    ordered = sorted(records, reverse=True)
    slot = ordered[min(1, len(ordered) - 1)] if ordered else 0
    return slot, [slot] * count + ([ordered[0]] if ordered and ordered[0] > slot else [])


def _close(io: DiskIO, files: SwapFiles) -> None:
    io.close()
    files.close(remove=True)
