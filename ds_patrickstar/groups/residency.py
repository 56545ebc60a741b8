"""Which chunk groups this rank holds gathered, and the collectives that change it.

A group is gathered (all-gathered asynchronously, see [Note: asynchronous collectives]) at its
use or ahead of it (``prefetch_groups``, in the order of [Note: gather order]), and released
after its use, after its reduce-scatter, or at the step. Whether a group is present is decided
from tensor states, which every rank moves identically, so every rank enters the same
collectives in the same order. Each group's state and its collectives are its
:class:`~ds_patrickstar.groups.group.ChunkGroup`'s; this class holds the groups, decides which are
gathered when, and keeps the bytes of those gathered (see [Note: chunk group bytes]) and the order
of the kept ones, and keeps or releases a group whose use is over as the
:class:`~ds_patrickstar.groups.keep.KeepPolicy` decides (see [Note: kept groups]).
"""

from __future__ import annotations

from ..chunks.chunk import Chunk
from ..chunks.chunk_map import ChunkMap
from ..memory.pending import Pending
from ..placement.interface import Placement
from .comm import ChunkComm
from .gather_order import GatherOrder
from .gather_plan import GatherPlan
from .group import ChunkGroup
from .keep import KeepPolicy


class GroupResidency:
    """Gathers, releases and prefetches chunk groups; see the module docstring."""

    def __init__(
        self,
        chunk_map: ChunkMap,
        comm: ChunkComm,
        groups: list[ChunkGroup],
        placement: Placement,
        plan: GatherPlan | None,
        prefetch_groups: int,
        keep_gathered: int | None,
    ) -> None:
        self._map, self._comm = chunk_map, comm
        self.groups = groups
        self._placement = placement
        self._plan = plan
        self.prefetch_groups = prefetch_groups
        # what the present groups take on the accelerator (see [Note: chunk group bytes])
        self.gathered_bytes = sum(g.nbytes.gathered for g in groups if g.present)
        self.kept: dict[int, int] = {}  # kept group -> bytes of its chunks, oldest first
        self.order = GatherOrder()
        self.policy = KeepPolicy(plan, keep_gathered)

    def is_present(self, group: int) -> bool:
        return self.groups[group].present

    def present(self) -> list[int]:
        """The groups gathered now, in order."""
        return [g.index for g in self.groups if g.present]

    # ---- gather and release ---------------------------------------------------------
    def gather(self, group: int, fill: bool = True, keep: frozenset[int] = frozenset()) -> None:
        """Issue the all-gather of ``group`` (see :meth:`ChunkGroup.gather`)."""
        chunk_group = self.groups[group]
        was_present = chunk_group.present
        chunk_group.gather(fill, keep)
        if not was_present:
            self.gathered_bytes += chunk_group.nbytes.gathered

    def release(self, group: int, until: Pending | None = None) -> None:
        """The other ranks' chunks of ``group`` go (see :meth:`ChunkGroup.release`)."""
        chunk_group = self.groups[group]
        if self._comm.world_size == 1 or not chunk_group.present:
            return
        chunk_group.release(until)
        self.gathered_bytes -= chunk_group.nbytes.gathered
        self.kept.pop(group, None)

    def release_all(self) -> None:
        for group in range(len(self.groups)):
            self.release(group)

    def keep(self, group: int) -> None:
        """``group`` stays gathered for its next use, the newest of the kept groups."""
        self.groups[group].keep()
        self.kept[group] = self.groups[group].nbytes.members

    def persist(self, group: int) -> None:
        """``group`` was gathered after the step and stays, whole (see [Note: persistent chunk groups])."""
        self.groups[group].persist()
        self.kept[group] = self.groups[group].nbytes.members

    def keep_or_release(self, group: int) -> None:
        """``group``'s use is over: kept gathered for its next use, releasing the oldest kept groups over the
        limit, or released (see [Note: kept groups]). With one rank nothing is gathered (a group is its one
        chunk, which placement moves): nothing to keep."""
        if self._comm.world_size == 1:
            return
        if not self.policy.keeps(self.groups[group].nbytes.members, self.gathered_bytes):
            self.release(group)
            return
        self.keep(group)
        while self.policy.over(sum(self.kept.values())):
            self.release(next(iter(self.kept)))
        counters = self._comm.counters
        counters.peak_kept_gathered_bytes = max(counters.peak_kept_gathered_bytes, sum(self.kept.values()))

    def unkeep(self, group: int) -> None:
        """``group`` is no longer kept (used again, or reduced)."""
        self.groups[group].unkeep()
        self.kept.pop(group, None)

    # ---- use ------------------------------------------------------------------------
    def use(self, chunk: Chunk, keep: frozenset[int], training: bool) -> None:
        """``chunk`` is used now: its group gathered if released, then used (:meth:`ChunkGroup.pre_use`);
        a training moment's first use of a group is its place in the gather order."""
        chunk_group = self.groups[self._map.group_of(chunk)]
        gathered_now = not chunk_group.present
        if gathered_now:
            self.gather(chunk_group.index, keep=keep)
        if chunk_group.pre_use(chunk, keep, gathered_now) and training:
            self.order.used(chunk_group.index)
        self.kept.pop(chunk_group.index, None)  # in use again: no longer kept

    def prefetch(self, in_use: frozenset[int], reduced: set[int]) -> None:
        """Issue the all-gathers of the next groups in the gather order (see [Note: gather order]);
        with placement only when the agreed plan holds them (see [Note: agreed gather plan])."""
        for group in self.order.ahead(self.prefetch_groups):
            chunk_group = self.groups[group]
            if chunk_group.present or group in reduced:
                continue
            if self._plan is not None and not self._plan.allows_prefetch(
                self.gathered_bytes + chunk_group.nbytes.gathered, group
            ):
                return
            self.gather(group, keep=in_use)
            self._placement.gathered_ahead(chunk_group.owned.chunk_id)
            chunk_group.prefetched = True
            self._comm.counters.prefetched_all_gathers += 1
