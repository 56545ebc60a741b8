"""Chunk buffers on the accelerator and the host: created, freed and moved, with running totals.

[Note: chunk locations]
A parameter is always a view of its chunk's accelerator payload. An owned chunk is in one
place at a time: on the accelerator (payload backed; no host buffer, or, with tide-aware placement,
the one it came from, kept until its eviction, a trainable chunk's until the step: see [Note: clean
evictions] in clean_copies.py) or on the host
(values in a buffer of the host pool, see [Note: pinned host memory]; payload storage
resized to zero so the views stay valid and come back to life when the chunk returns,
see [Note: storage resize]).
A frozen chunk on disk (see [Note: frozen chunks on disk]) has a third place: away from use it
is on the host with no host buffer, its values only in its disk record, from which it is brought
(:meth:`ChunkStore.to_device`) and to which it goes back without a copy (:meth:`ChunkStore.to_host`).
Model data therefore costs 14 bytes per parameter over device and host together (at most 16 while
chunks keep their host buffer on the accelerator; the peak is initialize's, every chunk on the host). Chunks
are built on the host (initialize never needs the model on the accelerator) and placement
brings them in when used. A chunk owned by another rank exists only while its group is
gathered: with ``W`` ranks the other ranks' chunks of a group are views of one flat storage
of the whole group (see [Note: gathered group storage]). With gradient accumulation a chunk's
fp32 accumulator follows the payload: on the accelerator while the chunk is there, on the host
otherwise; placement may leave it on the accelerator when the payload goes (it then goes alone, or comes
back with the payload; see [Note: accumulators kept] in placement/eviction_queue.py).

[Note: gathered group storage]
A collective on a list of tensors is not what the process group runs: NCCL and gloo flatten
the list into a temporary of the whole group and copy in and out, memory no budget sees. So
with ``W > 1`` ranks each chunk group has one flat storage of its ``W`` chunks (one allocation,
charged to the ledger as ``chunk`` while it has memory, resized to zero bytes otherwise), and
the other ranks' members are views of it: the all-gather receives into it in place
(``all_gather_single``), and the reduce-scatter reduces it in place
(``reduce_scatter_single``, see groups/comm.py; on gloo, which has no in-place form of either, see
[Note: in-place collectives on gloo] there). This rank's own chunk has its own storage, since
it lives on while the group is released and moves to the host and back; its place in the
flat storage is a *landing slot*: the all-gather writes this rank's values there too, and the
boundary reduce-scatter copies the owned gradient slot into it and the reduced piece back out.
A gathered group therefore takes ``W + 1`` chunks (the owned chunk beside the ``W`` of the
flat storage), as FSDP2 (sharded and unsharded parameters) and ZeRO-3 (partition and full
parameter) do, against ``2 W`` at the moment of a list collective; and the whole of it is
counted.

Every move is an asynchronous copy (:mod:`ds_patrickstar.memory.accelerator`): evictions and
prefetches run on the copy stream, and the consumer waits through :meth:`Chunk.ready`.
"""

from __future__ import annotations

import logging

import torch

from ..chunks.chunk import Chunk, Home
from ..counters import StepCounters
from ..disk.frozen import FrozenDisk
from ..memory.accelerator import Accelerator
from ..memory.pending import Pending
from .clean_copies import CleanCopies

logger = logging.getLogger(__name__)


class ChunkStore:
    """Creates, frees and moves chunk buffers; keeps running totals of what is where."""

    def __init__(
        self, accel: Accelerator, counters: StepCounters, movable: bool, disk: FrozenDisk | None = None
    ) -> None:
        self.accel = accel
        self.counters = counters
        self.movable = movable  # chunks have a host home (placement); else they stay put
        self.host_bytes = 0  # model data on the host: host buffers and accumulators
        self._flats: dict[int, torch.Tensor] = {}  # a group's first chunk id -> its flat storage
        self.disk = disk  # frozen chunks on disk (see [Note: frozen chunks on disk])
        self.copies = CleanCopies(accel, counters)  # see [Note: clean evictions] in clean_copies.py

    def values(self, chunk: Chunk) -> torch.Tensor:
        """The chunk's values where they live, waited on (:meth:`Chunk.ready`); a frozen chunk in its disk
        record is read into a staging buffer of the disk tier (see [Note: frozen chunks on disk])."""
        if chunk.home is Home.DISK and self.disk is not None:
            chunk.wait_pending()
            return self.disk.values(chunk)
        return chunk.ready()

    # ---- creation -----------------------------------------------------------------
    def create(self, chunk: Chunk, owned: bool) -> None:
        """Give ``chunk`` its payload, backed for now so that parameter views can be made of it
        (:meth:`settle` follows). An owned chunk's values go to the host with placement."""
        if owned and self.disk is not None:
            chunk.on_disk = self.disk.adopt(chunk)
        chunk.payload = self.accel.empty(chunk.capacity, chunk.dtype, "chunk", f"chunk {chunk.chunk_id}")
        # the pool may cache one chunk's host buffers: payload, accumulator, three optimizer states
        self.accel.host_pool.cache_at_least(chunk.capacity * (chunk.dtype.itemsize + 16))
        if owned and self.movable:
            chunk.host = self._host_zeros(chunk.capacity, chunk.dtype)
            chunk.home = Home.HOST
        elif owned:
            chunk.payload.zero_()

    def settle(self, chunk: Chunk, has_values: bool = True) -> None:
        """After the views were made: an owned chunk's payload keeps memory only if it lives there; a
        frozen chunk on disk goes there (see [Note: frozen chunks on disk]; ``has_values``: False when
        nothing was written into it)."""
        if chunk.on_disk and self.disk is not None:
            self.disk.put(chunk, chunk.ready() if has_values else None)
            if chunk.host is not None:
                self._drop_host(chunk.host)
                chunk.host = None
            if chunk.is_materialized:
                self.accel.free(chunk.payload, "chunk")
            chunk.home = Home.DISK
            return
        if chunk.on_host:
            self.accel.free(chunk.payload, "chunk")

    def _host_zeros(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        buf = self.accel.host_empty(numel, dtype)
        buf.zero_()
        self.host_bytes += buf.numel() * buf.element_size()
        return buf

    def _drop_host(self, buf: torch.Tensor, after: Pending | None = None) -> None:
        """Give ``buf`` back to the host pool (once ``after``, a copy reading it, has completed)."""
        self.host_bytes -= buf.numel() * buf.element_size()
        self.accel.host_free(buf, after)

    # ---- gathered groups: one flat storage (see [Note: gathered group storage]) -------
    def create_group(self, members: list[Chunk], owned: Chunk) -> None:
        """Give ``members`` (a group of ``W > 1`` equal chunks) their payloads: the owned chunk its
        own, the others views of the group's flat storage (backed for now, see :meth:`settle`)."""
        capacity, dtype = members[0].capacity, members[0].dtype
        flat = self.accel.empty(
            capacity * len(members), dtype, "chunk", f"the gathered group of chunk {members[0].chunk_id}"
        )
        self._flats[members[0].chunk_id] = flat
        for index, chunk in enumerate(members):
            if chunk is owned:
                self.create(chunk, True)
            else:
                chunk.payload = flat[index * capacity : (index + 1) * capacity]

    def group_storage(self, members: list[Chunk]) -> torch.Tensor:
        """The flat storage of the group of ``members`` (views of it are the other ranks' payloads)."""
        return self._flats[members[0].chunk_id]

    def materialize_group(self, members: list[Chunk], owned: Chunk) -> None:
        """The group's flat storage gets memory (its values come from the all-gather; the group has
        completed a reduce-scatter still reading it first, see [Note: chunk group states])."""
        key = members[0].chunk_id
        flat = self._flats[key]
        if flat.untyped_storage().nbytes() == 0:
            self.accel.materialize(flat, "chunk", f"the gathered group of chunk {key}")
        for chunk in members:
            if chunk is not owned:
                chunk.mark_present()

    def release_group(self, members: list[Chunk], owned: Chunk, storage_stays: bool = False) -> None:
        """The other ranks' members are released; the flat storage goes now (once the collectives on
        it completed) or, with ``storage_stays``, when :meth:`free_group` is called (a reduce-scatter
        still reads it: the group frees it when that completes)."""
        others = [c for c in members if c is not owned]
        for chunk in others:
            chunk.mark_released()
        flat = self._flats[members[0].chunk_id]
        if flat.untyped_storage().nbytes() == 0 or storage_stays:
            return
        for chunk in others:
            chunk.wait_pending()
        self.accel.free(flat, "chunk")

    def free_group(self, members: list[Chunk]) -> None:
        """The reduce-scatter that read the released group's storage completed: the storage goes."""
        flat = self._flats[members[0].chunk_id]
        if flat.untyped_storage().nbytes():
            self.accel.free(flat, "chunk")

    # ---- this rank's chunk: present with a gathered group (W == 1) -------------------
    def materialize(self, chunk: Chunk) -> None:
        if chunk.home is Home.DISK:  # a frozen chunk on disk, let go after its last use
            self.to_device(chunk)
        if not chunk.is_materialized:
            self.accel.materialize(chunk.payload, "chunk", f"chunk {chunk.chunk_id}")
            self._acc_to_device(chunk)
        chunk.mark_present()

    # ---- owned chunks: between the accelerator and the host -------------------------
    @staticmethod
    def _wait_collectives(chunk: Chunk) -> None:
        """A collective reading or writing the chunk, and a host job holding its values (see [Note:
        overlapped host Adam] in memory/host_work.py), complete before the chunk moves."""
        chunk.wait_host_work()
        for pending in [p for p in chunk.pending if p.collective]:
            pending.wait()
        chunk.pending = [p for p in chunk.pending if not p.collective]

    def to_host(self, chunk: Chunk, keep_accumulator: bool = False) -> None:
        """The chunk's values to the host, and its accumulator unless ``keep_accumulator``."""
        if chunk.on_host:
            return
        self._wait_collectives(chunk)
        if chunk.on_disk:  # its values are on disk already: nothing is copied
            chunk.wait_pending()
            self.accel.free(chunk.payload, "chunk")
            chunk.home, chunk.prefetched = Home.DISK, False
            return
        if self.copies.evict(chunk):  # unchanged since it came: nothing is copied
            if not keep_accumulator:
                self._acc_to_host(chunk)
            return
        kept = self.copies.take(chunk)  # written since it came: its kept buffer goes (the copy in may read it still)
        if kept is not None:
            self._drop_host(kept, after=chunk.pending[-1] if chunk.pending else None)
        host = self.accel.host_empty(chunk.capacity, chunk.dtype)
        self.host_bytes += chunk.nbytes
        pending = self.accel.copy(host, chunk.payload)  # ordered after every earlier copy of the chunk
        self.accel.free(chunk.payload, "chunk", after=pending)
        chunk.host, chunk.home, chunk.pending = host, Home.HOST, [pending]
        if not keep_accumulator:
            self._acc_to_host(chunk)
        chunk.prefetched = False
        self.counters.bytes_to_host += chunk.nbytes

    def to_device(self, chunk: Chunk) -> None:
        if not chunk.on_host:
            return
        self._wait_collectives(chunk)
        self.accel.materialize(chunk.payload, "chunk", f"chunk {chunk.chunk_id}")
        if chunk.home is Home.DISK and self.disk is not None:
            host, done = self.disk.take(chunk)  # a read buffer of the disk tier
            pending = self.accel.copy(chunk.payload, host)
            done(pending)
        else:
            host = chunk.host_buffer()
            pending = self.accel.copy(chunk.payload, host)
            if not self.copies.keep(chunk, host):
                self._drop_host(host, after=pending)
        chunk.host, chunk.home, chunk.pending = None, Home.DEVICE, [pending]
        self._acc_to_device(chunk)
        self.counters.bytes_to_device += chunk.nbytes

    def step_begins(self) -> None:
        """The trainable chunks' kept host buffers go back to the pool, and none is kept until :meth:`step_ends`
        (see [Note: clean evictions] in clean_copies.py)."""
        for chunk, host in self.copies.step_begins():
            self._drop_host(host, after=chunk.pending[-1] if chunk.pending else None)

    def step_ends(self) -> None:
        self.copies.step_ends()

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
        chunk.wait_copies()  # a host job does not read the accumulators (see [Note: overlapped host Adam])
        if chunk.acc is not None:
            self.accel.free(chunk.acc, "grad_acc")
            chunk.acc = None
        if chunk.acc_host is not None:
            self._drop_host(chunk.acc_host)
            chunk.acc_host = None

    def accumulator_to_host(self, chunk: Chunk) -> None:
        """An accumulator left on the accelerator when its payload went follows it (see [Note: accumulators kept]
        in placement/eviction_queue.py)."""
        self._acc_to_host(chunk)

    def _acc_to_host(self, chunk: Chunk) -> None:
        if chunk.acc is None:
            return
        host = self.accel.host_empty(chunk.capacity, torch.float32)
        self.host_bytes += chunk.acc_nbytes
        self.counters.accumulator_bytes_to_host += chunk.acc_nbytes
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
        self.counters.accumulator_bytes_to_device += chunk.acc_nbytes
        chunk.pending.append(pending)
        self._drop_host(chunk.acc_host, after=pending)
        chunk.acc, chunk.acc_host = acc, None
