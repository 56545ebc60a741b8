"""The gather plan: how many bytes of gathered chunk groups every rank's budget holds at each
moment, agreed across the ranks once per step.

[Note: agreed gather plan]
Whether a group stays gathered after a use (see [Note: kept groups]) and whether a group is
all-gathered ahead of use (see [Note: gather order]) decides which collectives run, so every
rank must decide the same; with placement the decision depends on each rank's memory. Rather
than an all-reduce per decision (a host sync in the middle of forward and backward, two per
chunk group per iteration), the ranks agree on a *plan* at the step, where the gradient norm
has already synchronized the host: per moment of the iteration just traced, the bytes of
gathered groups each rank's budget holds next to its tide
(:meth:`~ds_patrickstar.placement.runtime.PlacementRuntime.gathered_rooms`), the minimum over
the ranks, agreed by :meth:`~ds_patrickstar.groups.agreement.RankAgreement.agree_min` after a
header with the number of moments and a checksum of their labels (so the ranks all-reduce plans of
one length only, see [Note: rank agreement]). A kept group stays to the end of the iteration, so the room to keep
at a moment is the least that any later moment leaves beside its own tide and the groups it
holds (each counted as the largest; a recomputed module's from its recomputation to its
backward, see :meth:`~ds_patrickstar.placement.trace.Trace.held_chunks`). During the next
iteration a decision compares that room with the bytes of the groups gathered then, a figure
every rank has alike, so the decisions agree with no collective. The room to gather ahead is agreed beside the
tides of a moment and the next two (:data:`AHEAD_SPAN`), so a group is gathered ahead only for a use among
them in the planned iteration: the gather order names the next group, not when it is used, and at the turn
from forward to backward that can be several moments later, across the head's higher tides (on the twin's
two-rank mirror of the H100 sweep at 11 GiB a group gathered at the last forward moment for a use six
moments later pushed kept groups out, their gathers changed the next step's order, and one rank's bytes
alternated between steps). The plan and the decisions
count a gathered group alike, with :attr:`~ds_patrickstar.chunks.group_bytes.GroupBytes.gathered`:
its storage, this rank's own chunk, its joined buffers and, with gradient accumulation, the owned
accumulator (see [Note: chunk group bytes] in chunks/group_bytes.py). A rank's own chunks of
groups not gathered can always go to the host, so they do not count. Moments are counted the
same way on every rank (the model runs the same modules everywhere, as the collectives already
require), also while a rank re-traces for other input shapes; where the moments differ from the
plan's (its length or its labels, or a moment beyond it), nothing is kept or prefetched until the
next step agrees a new plan. Before the first step there is no plan: nothing is kept or
prefetched, as while tracing. With gradient accumulation, until the iteration's last backward
moment the rooms also leave the largest group's flat gradient buffer, which a micro-step's
reduce-scatter takes beside the group it reduces (see [Note: flat group buffers]); the
boundary's reduce-scatter runs in the group's own storage and needs no room of its own.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable

from ..chunks.group_bytes import GroupBytes
from ..placement.interface import Placement
from ..placement.trace import Trace
from .comm import ChunkComm

logger = logging.getLogger(__name__)

AHEAD_SPAN = 2
"""The moments after this one whose tides the room to gather ahead is agreed with (see :func:`gathered_rooms
<ds_patrickstar.placement.planner.gathered_rooms>`): a group is gathered ahead only for a use among them."""


class GatherPlan:
    """The room for gathered groups at each moment, agreed by every rank; see [Note: agreed gather plan]."""

    def __init__(self, sizes: list[GroupBytes], comm: ChunkComm, placement: Placement) -> None:
        self._comm, self._placement = comm, placement
        self._labels: list[str] = []
        self._keep: list[int] = []
        self._ahead: list[int] = []
        self._uses: dict[int, list[int]] = {}  # group -> the moments of the planned iteration that use it
        self._said_differ = False  # the ranks' iterations differed once: said, then only at debug level
        self.resize(sizes)

    def resize(self, sizes: list[GroupBytes]) -> None:
        """The groups' sizes changed (see [Note: accumulation begun by the caller]): no plan until the next step
        agrees one with them."""
        # what a gathered group counts, as the keep and prefetch decisions count it (see [Note: chunk group bytes])
        self.group_bytes = max((size.gathered for size in sizes), default=0)
        # a micro-step's gradient buffer (see [Note: flat group buffers]); the boundary reduces in place
        self.buffer_bytes = max((size.grad_buffer for size in sizes), default=0)
        self._labels, self._keep, self._ahead, self._uses = [], [], [], {}

    def agree(self) -> None:
        """At the step, on every rank: agree the plan for the next iteration from the one just done."""
        trace = self._placement.last_iteration()
        labels = [m.label for m in trace.moments] if trace is not None else []
        keep, ahead = self._placement.gathered_rooms(trace, self._held(trace)) if trace is not None else ([], [])
        if trace is not None:  # a group gathered ahead in backward sits beside a flat gradient buffer
            last_backward = _last_backward(trace)
            ahead = [room - self.buffer_bytes * int(i <= last_backward) for i, room in enumerate(ahead)]
        count = len(labels)
        agreed = self._comm.agreement.agree_plan("\n".join(labels), [*keep, *ahead])
        if agreed.values is None:  # the ranks' iterations differ: no plan
            self._labels, self._keep, self._ahead, self._uses = [], [], [], {}
            self._say_differ(count, most=max(agreed.counts) // 2, fewest=min(agreed.counts) // 2)
            return
        self._labels, self._keep, self._ahead = labels, agreed.values[:count], agreed.values[count:]
        self._uses = _group_uses(trace, self._comm.world_size) if trace is not None else {}

    def _say_differ(self, count: int, most: int, fewest: int) -> None:
        log = logger.debug if self._said_differ else logger.warning
        self._said_differ = True
        log(
            "ds_patrickstar: the data-parallel ranks' last iterations differ (this rank %d moments; the ranks "
            "%d to %d, or the same count in another order): no gather plan for the next iteration, so no chunk "
            "group is kept or gathered ahead of its use in it. Ranks differ when they run different modules "
            "or orders (routing, data-dependent control flow); said once, then at debug level",
            count,
            fewest,
            most,
        )

    def _held(self, trace: Trace) -> Callable[[int], int]:
        """Per moment, room for the groups it holds (at least one; a recomputed module's until its
        backward, see :meth:`~ds_patrickstar.placement.trace.Trace.held_chunks`), each counted as the
        largest, and, with gradient accumulation up to the last backward moment, for one flat
        gradient buffer (taken beside the group it reduces; see [Note: flat group buffers])."""
        world = self._comm.world_size
        at_once = [len({chunk_id // world for chunk_id in held}) for held in trace.held_chunks()]
        last_backward = _last_backward(trace)
        group, buffer = self.group_bytes, self.buffer_bytes
        rooms = [group * max(1, n) + buffer * int(i <= last_backward) for i, n in enumerate(at_once)]
        return lambda index: rooms[index]

    def _moment(self) -> int | None:
        """The index of the current moment in the plan, None when the iteration differs from it."""
        recorded = self._placement.recorded_moment()
        if recorded is None or not 0 <= recorded[0] < len(self._labels):
            return None
        return recorded[0] if self._labels[recorded[0]] == recorded[1] else None

    def allows_keep(self, gathered: int) -> bool:
        """Whether ``gathered`` bytes of gathered groups may stay for the rest of the iteration."""
        moment = self._moment()
        return moment is not None and gathered <= self._keep[moment]

    def allows_prefetch(self, gathered: int, group: int) -> bool:
        """Whether ``gathered`` bytes of gathered groups (``group`` gathered ahead of use) fit now, where the plan's
        iteration uses ``group`` within the moments the room is agreed for (this one and the next two)."""
        moment = self._moment()
        if moment is None:
            return False
        uses = self._uses.get(group, [])
        at = bisect.bisect_right(uses, moment)
        soon = at < len(uses) and uses[at] <= moment + AHEAD_SPAN
        return soon and gathered <= self._ahead[moment]


def _group_uses(trace: Trace, world: int) -> dict[int, list[int]]:
    """Per group (a chunk's id over the world size), the moments of ``trace`` that use it, ascending."""
    uses: dict[int, list[int]] = {}
    for index, moment in enumerate(trace.moments):
        for group in dict.fromkeys(chunk_id // world for chunk_id in moment.chunks):
            uses.setdefault(group, []).append(index)
    return uses


def _last_backward(trace: Trace) -> int:
    """The index of the trace's last backward moment (-1 if none): until then a flat gradient
    buffer may be taken (see [Note: flat group buffers])."""
    return max((i for i, m in enumerate(trace.moments) if m.label.startswith("bwd")), default=-1)
