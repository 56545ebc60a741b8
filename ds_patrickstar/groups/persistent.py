"""Persistent chunk groups: gathered between steps, so that their parameters read their full values there.

[Note: persistent chunk groups]
ZeRO-3 keeps a parameter of at most ``stage3_param_persistence_threshold`` elements (1e5 by default) whole on
every rank (``ds_persist``): it is never released, and it is all-gathered again after each step's update. Code
written against ZeRO-3 reads such parameters between steps without a gather (DeepSpeed's own tests read every
parameter of a small model after ``step()``), and a released parameter here reads as an empty tensor (see
[Note: released parameters read as empty]). Chunks mix tensors, so persistence is by chunk group: a group
of trainable tensors that all have at most the threshold's elements is *persistent*, taken in group order while
the elements of the persistent groups stay within ``stage3_model_persistence_threshold``. Frozen groups are not:
their values do not change, and a frozen base is what a rank should not hold whole (LoRA; frozen chunks may
live on disk, see [Note: frozen chunks on disk]). At the end of each step
(:meth:`~ds_patrickstar.groups.manager.ChunkManager.finish_step`, after the update) such a group is all-gathered
again, waited on, and kept (see [Note: kept groups]); its backward's reduce-scatter releases it as any other.
A tensor is persistent (``ds_persist`` True) when every group it has a piece in is. ``empty_partition_cache``
keeps the persistent groups (stock keeps its persistent parameters there: DeepSpeed's checkpoint tests compare a
model after it with a loaded one, reading both directly); a load, or a write inside ``GatheredParameters``,
releases every group and gathers the persistent ones again with the new values.

Scope: data parallelism without a device budget (ranks on the host, no placement), where the groups' bytes are
host memory the ranks share. With a device budget (every GPU run) placement plans the gathered groups (see
[Note: agreed gather plan]) and no group is persistent. In a model whose chunks hold a large tensor each (any
model larger than a few chunks) few groups qualify, and the cost is theirs: their bytes gathered between
steps and an all-gather each step (ZeRO-3 pays the same for its persistent parameters). In a small model every
group may qualify: the whole low-precision model on every rank between steps, as ZeRO-3 keeps it. The planner's
figures (``python -m ds_patrickstar plan``) are of partitioned groups: persistent ones add their gathered bytes.
"""

from __future__ import annotations

from ..chunks.chunk import TensorInfo
from ..chunks.chunk_map import ChunkMap
from .group import ChunkGroup
from .residency import GroupResidency


class PersistentGroups:
    """The persistent groups of a run and their gathers between steps (see [Note: persistent chunk groups])."""

    def __init__(self, residency: GroupResidency, indices: list[int]) -> None:
        self._residency = residency
        self.indices = indices  # in group order
        self._members = frozenset(indices)

    def __contains__(self, group: int) -> bool:
        return group in self._members

    def gather(self) -> None:
        """Those not gathered are gathered (after a step or a load: with the new values); every one is waited on
        and kept whole."""
        residency = self._residency
        for group in self.indices:
            if not residency.is_present(group):
                residency.gather(group)
        for group in self.indices:
            residency.persist(group)  # waits on the all-gather where it joins a straddling tensor
            for chunk in residency.groups[group].members:
                chunk.wait_pending()


def persistent_groups(groups: list[ChunkGroup], param_threshold: int, model_threshold: int) -> list[int]:
    """The persistent groups, in order (see [Note: persistent chunk groups])."""
    chosen, total = [], 0
    for group in groups:
        if not group.owned.trainable or any(info.numel > param_threshold for info in group.tensors):
            continue
        elements = sum(info.numel for info in group.tensors)
        if total + elements > model_threshold:
            continue
        chosen.append(group.index)
        total += elements
    return chosen


def persistent_tensors(chunk_map: ChunkMap, groups: list[int]) -> set[TensorInfo]:
    """The tensors every piece of which lies in one of ``groups``."""
    chosen = set(groups)
    return {
        info
        for info in chunk_map.infos()
        if all(chunk_map.group_of(chunk_map.chunks[piece.chunk_id]) in chosen for piece in info.pieces)
    }
