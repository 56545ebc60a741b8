"""One chunk group: its members, its all-gather and release, whether it is kept, its joined buffers,
its reduce-scatter and its bytes.

A chunk group is the unit of the collectives (see [Note: chunk groups] in groups/comm.py): with
``W`` ranks the ``W`` chunks one all-gather fills, each owned by one rank; with one rank, one chunk.
:class:`ChunkGroup` holds what concerns one group; the classes that decide across groups (which are
gathered and in what order, :class:`~ds_patrickstar.groups.residency.GroupResidency`; which stay
kept, :class:`~ds_patrickstar.groups.keep.KeepPolicy`; where gradients go,
:class:`~ds_patrickstar.groups.grads.GradientSink`) hold a list of them. Its bytes are
:class:`~ds_patrickstar.chunks.group_bytes.GroupBytes` (see [Note: chunk group bytes]).

[Note: chunk group states]
``RELEASED``: the other ranks' chunks are not here (with one rank: the chunk has not been on the
accelerator yet; once gathered, a group of one rank stays so, its chunk moved by placement only).
``GATHERED``: all-gathered (the collective maybe still in flight), in use or about to be. ``KEPT``:
gathered, its use over, kept for its next use (see [Note: kept groups]); keeping a kept group again
leaves it kept. A use makes a kept group ``GATHERED``; any gathered group may be released. A group
never goes from ``RELEASED`` to ``KEPT``.

A group's life in an iteration is its own, as FSDP2's parameter group's: a moment's use
(:meth:`ChunkGroup.pre_use`, FSDP2's ``pre_forward``/``pre_backward``: the group gathered, the chunk
brought and waited on), the end of a use (:meth:`ChunkGroup.use_over`, then kept or released by the
residency's keep decision; FSDP2's ``post_forward``), the reduce-scatter once its last gradient is in
(:meth:`ChunkGroup.reduce_scatter`, FSDP2's ``post_backward``) and the end of the step
(:meth:`ChunkGroup.finalize`). The group holds what is in flight on it: its all-gather
(:attr:`ChunkGroup.gathering`, also on every member's pending list, so a reader of a member waits
through :meth:`~ds_patrickstar.chunks.chunk.Chunk.ready`) and the reduce-scatter that still reads its
storage after a release (:attr:`ChunkGroup.reducing`): the storage goes, and its bytes leave the
ledger, when that reduce-scatter completes (its ``after`` action), and a gather into the same storage
waits for it first (see [Note: collective buffers]).
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum

import torch

from ..chunks.chunk import Chunk, Home, TensorInfo
from ..chunks.chunk_map import ChunkMap
from ..chunks.group_bytes import GroupBytes
from ..chunks.state import IllegalTransition, TensorState
from ..memory.pending import Pending
from ..placement.interface import Placement
from ..store.chunk_store import ChunkStore
from .comm import ChunkComm, PendingCollective
from .flat import FlatBuffers
from .straddle import JoinedBuffers


class GroupState(Enum):
    RELEASED = "released"
    GATHERED = "gathered"
    KEPT = "kept"


_S = GroupState
_TRANSITIONS = {
    _S.RELEASED: {_S.GATHERED},
    _S.GATHERED: {_S.RELEASED, _S.KEPT},
    _S.KEPT: {_S.GATHERED, _S.RELEASED, _S.KEPT},
}


class ChunkGroup:
    """One chunk group; see the module docstring."""

    def __init__(
        self,
        index: int,
        members: list[Chunk],
        tensors: list[TensorInfo],
        nbytes: GroupBytes,
        joined: JoinedBuffers,
        comm: ChunkComm,
        store: ChunkStore,
        placement: Placement,
    ) -> None:
        self.index = index
        self.members = members
        self.owned = members[comm.rank]  # this rank's chunk
        self.tensors = tensors  # every tensor with a piece here, once, in layout order
        self.nbytes = nbytes
        self.joined = joined
        self._comm, self._store, self._placement = comm, store, placement
        self._flat = FlatBuffers(store, placement)
        self.state = _S.GATHERED if all(c.is_materialized for c in members) else _S.RELEASED
        self.fresh = False  # gathered (maybe still in flight) and not used since
        self.prefetched = False  # gathered ahead of use and not used since
        # a micro-step's flat gradient buffer (see [Note: flat group buffers])
        self.grad_buffer: torch.Tensor | None = None
        # the reduce-scatter in flight that still reads the released group's storage: the storage goes
        # when it completes (see [Note: chunk group states])
        self.reducing: Pending | None = None
        self.gathering: Pending | None = None  # the all-gather into the storage, until the group is released

    def __repr__(self) -> str:
        return f"ChunkGroup({self.index}, {self.state.value})"

    @property
    def present(self) -> bool:
        return self.state is not _S.RELEASED

    @property
    def kept(self) -> bool:
        return self.state is _S.KEPT

    def _to(self, state: GroupState) -> None:
        if state not in _TRANSITIONS[self.state]:
            raise IllegalTransition(f"chunk group {self.index}: {self.state.value} -> {state.value}")
        self.state = state

    @property
    def chunk_ids(self) -> set[int]:
        return {c.chunk_id for c in self.members}

    # ---- its chunks on the accelerator -----------------------------------------------------
    def bring(self, chunk: Chunk, keep: set[int]) -> None:
        """A member (or its accelerator memory) is needed now: placement brings it, keeping ``keep``."""
        self._placement.bring(chunk, keep)

    def written(self, chunk: Chunk) -> None:
        """A gradient went into a member's payload (see [Note: clean evictions] in store/clean_copies.py)."""
        self._placement.written(chunk.chunk_id)

    def gradient_final(self) -> None:
        """The owned chunk's slot holds its final gradient (see [Note: gradients leave in backward])."""
        self._placement.gradient_final(self.owned.chunk_id)

    def make_room(self, nbytes: int, keep: set[int]) -> None:
        """``nbytes`` more for this group (a buffer, an accumulator, a joined copy), keeping ``keep``."""
        self._placement.make_room(nbytes, keep)

    def accumulator(self, chunk: Chunk) -> torch.Tensor:
        """The fp32 gradient accumulator of a member (created on first use; see [Note: gradient accumulation])."""
        if chunk.acc is None and chunk.acc_host is None:
            self._placement.accumulator(chunk.chunk_id, "acc_born")
        return self._store.accumulator(chunk)

    def accumulator_folding(self) -> None:
        """The boundary's reduce-scatter, whose completion adds the owned chunk's accumulator into its slot, is
        issued (see [Note: predicted moves] in placement/move_model.py)."""
        if self.owned.acc is not None or self.owned.acc_host is not None:
            self._placement.accumulator(self.owned.chunk_id, "acc_folding")

    def flat_buffer(self, keep: set[int]) -> torch.Tensor:
        """A zeroed flat gradient buffer of the group (room made first; see [Note: flat group buffers])."""
        return self._flat.zeros(self.members, keep, self.index)

    def free_flat_buffer(self, buf: torch.Tensor) -> None:
        self._flat.free(buf)

    # ---- gather and release ---------------------------------------------------------
    def gather_bytes(self) -> int:
        """Accelerator bytes gathering the group takes now: its storage (see [Note: gathered group
        storage]), the owned chunk and its joined buffers, where not there yet."""
        owned, nbytes = self.owned, self.nbytes
        away = owned.acc_nbytes if owned.acc_host is not None else 0  # an accumulator may have stayed
        missing = nbytes.owned + away if not owned.is_materialized or owned.on_host else 0
        if self._comm.world_size > 1 and not self._store.group_storage(self.members).untyped_storage().nbytes():
            missing += nbytes.storage
        return missing + self.joined.missing_bytes()

    def gather(self, fill: bool, keep: frozenset[int]) -> None:
        """Issue the all-gather into the group's storage: its result is on every member's pending
        list, and waited on by whoever uses a member. ``fill=False``: no all-gather, the other ranks'
        slots are zeroed (every slot is about to receive a gradient). ``keep``: chunks placement
        must not evict to make room."""
        members, owned = self.members, self.owned
        needed = set(keep) | self.chunk_ids
        self._placement.make_room(self.gather_bytes(), needed)  # the whole group at once: owned chunk, storage
        self._placement.bring(owned, needed)
        self._store.materialize(owned)
        if self._comm.world_size > 1:
            if self.reducing is not None:  # its storage is about to be gathered into again
                self.reducing.wait()
            self._store.materialize_group(members, owned)
            flat = self._store.group_storage(members)
            if fill:
                pending = self._comm.all_gather_async(flat, owned.ready(), f"all-gather of chunk group {self.index}")
                self.gathering = pending
                for chunk in members:
                    chunk.pending.append(pending)
                self.joined.charge_gathered()  # filled at first use (see JoinedBuffers.join)
            else:
                self.gathering = None
                for chunk in members:
                    if chunk is not owned:
                        chunk.ready().zero_()
        if self.state is _S.RELEASED:
            self._to(_S.GATHERED)
        self.fresh = True

    def release(self, until: Pending | None = None) -> None:
        """The other ranks' chunks go (the storage: now, once the collectives on it completed, or
        with ``until``, a reduce-scatter reading it, when that completes)."""
        self.joined.drop()
        self.reducing, self.gathering = until, None
        self._store.release_group(self.members, self.owned, storage_stays=until is not None)
        self.let_go(self.owned)
        # The other ranks' copies of these tensors go FREE and come back HOLD when the group is
        # gathered again; ours must read the same, or a later "all used in this forward" test
        # (after_forward) would differ between ranks and so would the collectives.
        for info in self.owned.tensors:
            if info.state is TensorState.HOLD_AFTER_FWD:
                info.settle()
        self._to(_S.RELEASED)
        self.fresh = self.prefetched = False

    # ---- its life in an iteration (FSDP2's pre_forward/pre_backward, post_forward, post_backward, finalize)
    def pre_use(self, chunk: Chunk, keep: frozenset[int], gathered_now: bool) -> bool:
        """A moment uses ``chunk`` of this gathered group (forward, backward or recomputation): it is
        brought (unless the group was ``gathered_now``, which brought it), counted and waited on; returns
        whether this is the first use since the group was gathered. The caller gathers a released group."""
        counters = self._comm.counters
        if not gathered_now:
            self._placement.bring(chunk, set(keep))
            if self.prefetched:
                self.prefetched = False
                counters.prefetched_all_gather_hits += 1
        self.bring_back(chunk)
        first, self.fresh = self.fresh, False
        self.unkeep()  # in use again: no longer a candidate for release
        if chunk.prefetched:
            chunk.prefetched = False
            counters.prefetch_hits += 1
        self._wait_for_use(chunk)
        return first

    @staticmethod
    def _wait_for_use(chunk: Chunk) -> None:
        """The compute that follows reads the payload through the views: every copy and collective into
        the chunk must be complete (see [Note: ready payload])."""
        chunk.wait_pending()

    def use_over(self) -> bool:
        """Whether every tensor of the group is done for now (``HOLD_AFTER_FWD``): after a forward use, or a
        backward use of a tensor still waiting for its gradient; the group may then be kept or released."""
        return all(t.state is TensorState.HOLD_AFTER_FWD for t in self.tensors)

    def drop_accumulators(self) -> None:
        """The members' gradient accumulators go (their sums are in the slots, or the step is over)."""
        for chunk in self.members:
            if chunk.acc is not None or chunk.acc_host is not None:
                self._placement.accumulator(chunk.chunk_id, "acc_gone")
            self._store.drop_accumulator(chunk)

    def finalize(self) -> None:
        """The step is over: the members' gradient accumulators go and its tensors settle (``HOLD``)."""
        self.drop_accumulators()
        for info in self.tensors:
            if info.state not in (TensorState.HOLD, TensorState.FREE):
                info.settle()

    def bring_back(self, chunk: Chunk) -> None:
        """The group is used: a frozen chunk on disk counts the use (see [Note: frozen use order]), and one
        that was let go after its last use is read back (see [Note: frozen chunks on disk]); with
        placement, bringing the chunk did that already."""
        disk = self._store.disk
        if disk is not None and self.owned.on_disk:
            disk.used(self.owned)
        if chunk.home is Home.DISK:
            self._store.materialize(chunk)

    def let_go(self, chunk: Chunk) -> None:
        """Where the accelerator is the host (no placement), a frozen chunk on disk whose use is over
        goes (nothing is written: its values are on disk); placement evicts it otherwise."""
        if chunk.on_disk and not self._store.movable and chunk.movable and chunk.home is Home.DEVICE:
            self._store.to_host(chunk)

    def keep(self) -> None:
        """The group's use is over and it stays gathered for the next: its pieces stay, their joined
        copies go (see [Note: straddling tensors])."""
        self._to(_S.KEPT)
        self.joined.drop()

    def persist(self) -> None:
        """A persistent group, gathered, stays until its next use, its straddling tensors joined, so that its
        parameters read their values (see [Note: persistent chunk groups])."""
        self._to(_S.KEPT)
        self.joined.join_all()

    def unkeep(self) -> None:
        """The group is used again (or reduced): no longer kept."""
        if self.state is _S.KEPT:
            self._to(_S.GATHERED)

    # ---- reduce-scatter -----------------------------------------------------------------
    def reduce_scatter(self, then: Callable[[Chunk], None]) -> PendingCollective:
        """Launch the reduce-scatter of the group's gradients in place in its storage (the owned
        slot copied into its landing slot first); when it completes the owned slot gets its piece,
        the storage goes and ``then(owned)`` runs (see [Note: gathered group storage] and
        [Note: asynchronous collectives]). The caller releases the group until then."""
        members, owned, rank = self.members, self.owned, self._comm.rank
        self._placement.bring(owned, self.chunk_ids)
        flat = self._store.group_storage(members)
        landing = flat[rank * owned.capacity : (rank + 1) * owned.capacity]
        for chunk in members:  # the all-gather into the storage completed
            chunk.wait_pending()
        with torch.no_grad():
            landing.copy_(owned.ready())

        @torch.no_grad()
        def into_slot() -> None:
            owned.ready().copy_(landing)
            self.reducing = None
            self._store.free_group(members)
            then(owned)

        return self._comm.reduce_scatter_mean_single_async(
            flat, f"reduce-scatter of chunk group {self.index}", after=into_slot
        )


def build_groups(
    chunk_map: ChunkMap, comm: ChunkComm, store: ChunkStore, placement: Placement, accumulate: bool
) -> list[ChunkGroup]:
    """Every chunk group of ``chunk_map``, in order."""
    groups = []
    for index in range(chunk_map.num_groups):
        joined = JoinedBuffers(chunk_map.joined_tensors(index), chunk_map.chunks, store.accel)
        nbytes = chunk_map.group_bytes(index, accumulate)
        members, tensors = chunk_map.group_members(index), chunk_map.group_tensors(index)
        groups.append(ChunkGroup(index, members, tensors, nbytes, joined, comm, store, placement))
    return groups
