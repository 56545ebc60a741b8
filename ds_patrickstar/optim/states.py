"""fp32 master, momentum and variance of the owned chunks, and where they live (hybrid Adam).

[Note: optimizer-state placement]
Every owned chunk has three fp32 tensors of its capacity and layout. They start on the
host when placement is active (on the only device otherwise). After each trace (the
warm-up iteration, and every re-trace when shapes or control flow change) the memory
the tide leaves at its highest, less the chunks the busiest moment holds (a recomputed module's
until its backward, see [Note: chunk bytes per moment]), decides which chunks' states live on the accelerator,
in chunk order (the planner's :func:`~ds_patrickstar.placement.planner.states_on_device`, see
[Note: placement planner]), and the states move to match the new decision
(:meth:`OptimizerStates.place`): a re-trace with a higher tide sends states back to the host, a
lower one brings more in. A chunk is updated by
Adam where its states live; the others are updated on the host by the CPU kernel, and
their chunks are not brought to the accelerator for the step. With the disk tier, the states of
the *spilled* chunks live on disk instead (see [Note: disk tier]); they are updated on the host
and never move to the accelerator.

A chunk updated on the host may still be in its host job (see [Note: overlapped host Adam] in
memory/host_work.py): every read, write or move of its states waits for that job first
(:meth:`OptimizerStates.state` is the one accessor).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import torch

from ..chunks.chunk import Chunk
from ..disk.states import DiskStates
from ..memory.accelerator import Accelerator
from ..memory.ledger import DeviceBudgetExceeded
from ..memory.optimizer_chunk import OptimizerChunk

logger = logging.getLogger(__name__)

STATE_KEYS = ("master", "exp_avg", "exp_avg_sq")


class OptimizerStates:
    """Creates the states of the owned chunks and moves them; see [Note: optimizer-state placement]."""

    def __init__(
        self, chunks: list[Chunk], accel: Accelerator, start_on_device: bool, disk: DiskStates | None = None
    ) -> None:
        self.accel = accel
        self.chunks = {c.chunk_id: c for c in chunks}
        self._pool_base = accel.host_pool.cache_limit  # one chunk's host buffers (see [Note: pinned host memory])
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
    def capacities(self) -> dict[int, int]:
        """Elements of each owned chunk whose states may live on the accelerator (not the spilled ones)."""
        return {cid: c.capacity for cid, c in self.chunks.items() if cid not in self.spilled}

    def place(self, wanted: set[int]) -> None:
        """The states of the chunks in ``wanted`` on the accelerator, the others' on the host, as the
        placement planner decided (see [Note: placement planner]): those leaving first, then those
        coming in chunk order; where the budget holds fewer than planned now (the tide is higher than
        traced), the rest stay on the host."""
        for chunk_id in sorted(self.on_device - wanted):
            self._move(chunk_id, to_device=False)
        for chunk_id in sorted(wanted - self.on_device):
            try:
                self._move(chunk_id, to_device=True)
            except DeviceBudgetExceeded as err:
                logger.info("ds_patrickstar: optimizer states stay on the host from chunk %d on (%s)", chunk_id, err)
                break
        logger.info(
            "ds_patrickstar: optimizer states of %d of %d chunks on the accelerator",
            len(self.on_device),
            len(self.capacities()),
        )
        # the payloads of the chunks updated on the host leave it in forward and come back in backward, every
        # step: the pool keeps their buffers cached in between (see [Note: pinned host memory])
        moving = sum(c.capacity * c.dtype.itemsize for cid, c in self.chunks.items() if cid not in self.on_device)
        self.accel.host_pool.cache_at_least(self._pool_base + moving)

    def give_room(self, nbytes: int) -> int:
        """Accelerator bytes freed by moving optimizer states to the host, the highest chunks' first, until
        ``nbytes`` are (see [Note: states give way] in placement/moves.py); 0 where none is on the accelerator."""
        freed, moved = 0, []
        for chunk_id in sorted(self.on_device, reverse=True):
            if freed >= nbytes:
                break
            freed += sum(t.nbytes for t in self.state(chunk_id).tensors())
            self._move(chunk_id, to_device=False)
            moved.append(chunk_id)
        if moved:
            logger.info(
                "ds_patrickstar: the tide stands above the plan: optimizer states of chunks %s moved to the host "
                "(%d B) to make room (see [Note: states give way])",
                moved,
                freed,
            )
        return freed

    def all_to_host(self) -> None:
        """Before a (re-)trace: every state on the host, so the new tide is measured without them."""
        for chunk_id in sorted(self.on_device):
            self._move(chunk_id, to_device=False)

    def state(self, chunk_id: int) -> OptimizerChunk:
        """The states of an owned chunk in memory, once a host job updating them has run (see [Note:
        overlapped host Adam] in memory/host_work.py): the one accessor for reading, writing or moving them."""
        self.chunks[chunk_id].wait_host_work()
        return self.states[chunk_id]

    def adopt(self, chunk_id: int, states: OptimizerChunk) -> OptimizerChunk:
        """``states`` (host tensors of the same sizes, written by a host job in the chunk's pending list)
        become the chunk's, which lives on the host; the ones they replace are returned, not waited on (see
        [Note: host updates in backward] in optim/early_updates.py)."""
        if chunk_id in self.on_device or chunk_id in self.spilled:
            raise RuntimeError(f"chunk {chunk_id}: only states in host memory are swapped")
        old, self.states[chunk_id] = self.states[chunk_id], states
        return old

    def settle(self) -> None:
        """Every host job of the step has run (a checkpoint load replaces the states)."""
        for chunk in self.chunks.values():
            chunk.wait_host_work()

    def _move(self, chunk_id: int, to_device: bool) -> None:
        old = self.state(chunk_id)
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

    # ---- values ----------------------------------------------------------------------
    def slices(
        self, chunk_id: int, start: int = 0, stop: int | None = None, write: bool = False
    ) -> Iterator[tuple[int, OptimizerChunk]]:
        """``(element, states of elements element ..)`` covering elements ``start .. stop`` of an owned
        chunk's states wherever they live: one slice of the states in memory, or a spilled chunk's
        pieces one at a time through the disk tier's one-piece cache (``write``: changes are kept on
        :meth:`flush`; each slice is valid until the next is asked for)."""
        if chunk_id in self.spilled and self.disk is not None:
            yield from self.disk.slices(chunk_id, start, stop, write)
            return
        state = self.state(chunk_id)
        yield start, state.sliced(start, state.master.numel() if stop is None else stop)

    def master_values(self, chunk_id: int) -> torch.Tensor:
        """An owned chunk's fp32 master: the tensor itself when it is in memory, else a new host copy."""
        if chunk_id not in self.spilled:
            return self.state(chunk_id).master
        return self.spilled_copy(chunk_id, ("master",))["master"]

    def spilled_copy(self, chunk_id: int, keys: tuple[str, ...] = STATE_KEYS) -> dict[str, torch.Tensor]:
        """A spilled chunk's ``keys`` states as new host tensors, filled piece by piece."""
        copy = {key: torch.empty(self.chunks[chunk_id].capacity, dtype=torch.float32) for key in keys}
        for start, state in self.slices(chunk_id):
            for key, values in copy.items():
                piece = getattr(state, key)
                values[start : start + piece.numel()].copy_(piece)
        return copy

    def write_values(self, chunk_id: int, key: str, start: int, values: torch.Tensor) -> None:
        """``values`` into elements ``start ..`` of the chunk's ``key`` state (``master``, ``exp_avg``,
        ``exp_avg_sq``); spilled ones reach disk on :meth:`flush`."""
        for lo, state in self.slices(chunk_id, start, start + values.numel(), write=True):
            target = getattr(state, key)
            target.copy_(values[lo - start : lo - start + target.numel()])

    def flush(self) -> None:
        """Spilled states changed through :meth:`slices` go back to disk."""
        if self.disk is not None:
            self.disk.flush()

    @torch.no_grad()
    def params_to_master(self) -> None:
        """After the parameters were overwritten (a module state_dict load): masters follow them."""
        for chunk_id, chunk in self.chunks.items():
            self.write_values(chunk_id, "master", 0, chunk.ready()[: chunk.used])
        self.flush()

    @torch.no_grad()
    def master_to_params(self) -> None:
        """After the masters were loaded (or an overflow): the owned slots get their values."""
        for chunk_id, chunk in self.chunks.items():
            values = chunk.ready()
            for start, state in self.slices(chunk_id, 0, chunk.used):
                values[start : start + state.master.numel()].copy_(state.master)
        self.flush()

    # ---- the disk tier's step (see [Note: disk tier]) ------------------------------------
    def spilled_extents(self) -> dict[int, int]:
        """Elements used of each spilled chunk that has any: what a step updates."""
        return {cid: self.chunks[cid].used for cid in sorted(self.spilled) if self.chunks[cid].used}

    def read_ahead(self) -> None:
        """Start the next step's reads of spilled states (the boundary micro-step's backward began)."""
        if self.disk is not None and self.spilled and not self.disk.reading_ahead:
            self.disk.read_ahead(self.spilled_extents())

    def cancel_read_ahead(self) -> None:
        """The step is skipped (an overflow): wait for the reads :meth:`read_ahead` issued and drop them."""
        if self.disk is not None:
            self.disk.cancel_read_ahead()

    def bytes_on_host(self) -> int:
        """States in host memory (spilled states and the disk tier's buffers not included)."""
        return sum(s.nbytes for c, s in self.states.items() if c not in self.on_device)

    def bytes_on_disk(self) -> int:
        return self.disk.bytes_on_disk if self.disk is not None else 0
