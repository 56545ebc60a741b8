"""Which chunk groups this rank holds gathered, and the collectives that change it.

A group is gathered (all-gathered asynchronously, see [Note: asynchronous collectives]) at its
use or ahead of it (``prefetch_groups``, in the order of [Note: gather order]), and released
after its use, after its reduce-scatter, or at the step. Whether a group is present is decided
from tensor states, which every rank moves identically, so every rank enters the same
collectives in the same order. Which of the present groups stay *kept* is the
:class:`~ds_patrickstar.groups.keep.KeepPolicy`'s decision; this class holds the record.
"""

from __future__ import annotations

from ..chunks.chunk import Chunk
from ..chunks.chunk_map import ChunkMap
from ..chunks.state import TensorState
from ..memory.pending import Pending
from ..memory.store import ChunkStore
from ..placement.interface import Placement
from .comm import ChunkComm
from .gather_order import GatherOrder
from .gather_plan import GatherPlan
from .straddle import JoinedBuffers


class GroupResidency:
    """Gathers, releases and prefetches chunk groups; see the module docstring."""

    def __init__(
        self,
        chunk_map: ChunkMap,
        comm: ChunkComm,
        store: ChunkStore,
        joined: JoinedBuffers,
        placement: Placement,
        plan: GatherPlan | None,
        prefetch_groups: int,
        accumulate: bool,
    ) -> None:
        self._map, self._comm, self._store = chunk_map, comm, store
        self.joined = joined
        self._placement = placement
        self._plan = plan
        self.prefetch_groups = prefetch_groups
        # what a gathered group takes on the accelerator, accumulators included (see [Note: agreed gather plan])
        self._group_bytes = [chunk_map.group_bytes(g, accumulate) for g in range(chunk_map.num_groups)]
        self.present = {
            g for g in range(chunk_map.num_groups) if all(c.is_materialized for c in chunk_map.group_members(g))
        }
        self.gathered_bytes = sum(self._group_bytes[g] for g in self.present)  # of the present groups
        self.kept: dict[int, int] = {}  # kept group -> bytes of its gathered storage, oldest first
        self._fresh: set[int] = set()  # gathered (maybe still in flight) and not used since
        self._prefetched: set[int] = set()  # gathered ahead of use and not used since
        self.order = GatherOrder()

    def _bring(self, chunk: Chunk, keep: set[int]) -> None:
        self._placement.bring(chunk, keep)

    # ---- gather and release ---------------------------------------------------------
    def gather_bytes(self, group: int) -> int:
        """Accelerator bytes gathering ``group`` takes now: its storage (see [Note: gathered group
        storage]) and the owned chunk, where not there yet."""
        members = self._map.group_members(group)
        owned = self._owned(members)
        missing = owned.nbytes + owned.acc_nbytes if not owned.is_materialized or owned.on_host else 0
        if self._comm.world_size > 1 and not self._store.group_storage(members).untyped_storage().nbytes():
            missing += sum(c.nbytes for c in members)
        return missing + self.joined.missing_bytes(group)

    def _owned(self, members: list[Chunk]) -> Chunk:
        return members[self._comm.rank]

    def gather(self, group: int, fill: bool = True, keep: frozenset[int] = frozenset()) -> None:
        """Issue the all-gather of ``group`` into its storage: its result is on every member's
        pending list, and waited on by whoever uses a member. ``fill=False``: no all-gather, the
        other ranks' slots are zeroed (every slot is about to receive a gradient)."""
        members = self._map.group_members(group)
        owned = self._owned(members)
        needed = set(keep) | {c.chunk_id for c in members}
        self._placement.make_room(self.gather_bytes(group), needed)  # the whole group at once: owned chunk, storage
        self._bring(owned, needed)
        self._store.materialize(owned)
        if self._comm.world_size > 1:
            self._store.materialize_group(members, owned)
            flat = self._store.group_storage(members)
            if fill:
                pending = self._comm.all_gather_async(flat, owned.ready())
                for chunk in members:
                    chunk.pending.append(pending)
                self.joined.charge_gathered(group)  # filled at first use (see JoinedBuffers.join)
            else:
                for chunk in members:
                    if chunk is not owned:
                        chunk.ready().zero_()
        if group not in self.present:
            self.present.add(group)
            self.gathered_bytes += self._group_bytes[group]
        self._fresh.add(group)

    def release(self, group: int, until: Pending | None = None) -> None:
        """The other ranks' chunks of ``group`` go (its storage: now, once the collectives on it
        completed, or with ``until``, a reduce-scatter reading it, when that completes)."""
        if self._comm.world_size == 1 or group not in self.present:
            return
        self.joined.drop(group)
        members = self._map.group_members(group)
        owned = self._owned(members)
        self._store.release_group(members, owned, until)
        # The other ranks' copies of these tensors go FREE and come back HOLD when the group is
        # gathered again; ours must read the same, or a later "all used in this forward" test
        # (after_forward) would differ between ranks and so would the collectives.
        for info in owned.tensors:
            if info.state is TensorState.HOLD_AFTER_FWD:
                info.settle()
        self.present.discard(group)
        self.gathered_bytes -= self._group_bytes[group]
        self.kept.pop(group, None)
        self._fresh.discard(group)
        self._prefetched.discard(group)

    def release_all(self) -> None:
        for group in range(self._map.num_groups):
            self.release(group)

    # ---- use ------------------------------------------------------------------------
    def use(self, chunk: Chunk, keep: frozenset[int], training: bool) -> None:
        """``chunk`` is used now: its group gathered (or brought), counted, and waited on."""
        counters = self._comm.counters
        group = self._map.group_of(chunk)
        if group not in self.present:
            self.gather(group, keep=keep)
        else:
            self._bring(chunk, set(keep))
            if group in self._prefetched:
                self._prefetched.discard(group)
                counters.prefetched_all_gather_hits += 1
        if group in self._fresh:
            self._fresh.discard(group)
            if training:
                self.order.used(group)
        self.kept.pop(group, None)  # in use again: no longer a candidate for release
        if chunk.prefetched:
            chunk.prefetched = False
            counters.prefetch_hits += 1
        self._wait_for_use(chunk)

    @staticmethod
    def _wait_for_use(chunk: Chunk) -> None:
        """The compute that follows reads the payload through the views: every copy and
        collective into the chunk must be complete (see [Note: ready payload])."""
        chunk.wait_pending()

    def prefetch(self, in_use: frozenset[int], reduced: set[int]) -> None:
        """Issue the all-gathers of the next groups in the gather order (see [Note: gather order]);
        with placement only when the agreed plan holds them (see [Note: agreed gather plan])."""
        for group in self.order.ahead(self.prefetch_groups):
            if group in self.present or group in reduced:
                continue
            if self._plan is not None and not self._plan.allows_prefetch(
                self.gathered_bytes + self._group_bytes[group]
            ):
                return
            self.gather(group, keep=in_use)
            self._prefetched.add(group)
            self._comm.counters.prefetched_all_gathers += 1
