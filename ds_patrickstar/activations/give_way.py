"""Saved activations the "auto" plan keeps on the accelerator (and offloaded ones still there), sent to the host at
once where a moment's chunks find no room beside them.

[Note: activations give way]
The margin the plan keeps for stranded allocator pieces is what the traced iteration stranded; a later batch
of another length can strand more beside the blocks "auto" keeps, at a moment whose chunks then do not fit
even after every evictable chunk went. Such a tide rises in the middle of an iteration, where no plan can
change, so before optimizer states give way (see [Note: states give way] in placement/moves.py) and before any
budget error :meth:`ChunkMoves.make_room <ds_patrickstar.placement.moves.ChunkMoves.make_room>` asks
:meth:`ActivationOffloader.give_room <.offloader.ActivationOffloader.give_room>` (:func:`give_way`):

* **What leaves.** The saved activations the plan keeps of this forward's finished blocks whose backward has
  not begun (in forward, every finished block but the running one; in backward, the blocks still to come), the
  earliest block's first (its backward comes last), until the shortfall left: each storage is copied to the
  host and waited on at once (the moment waits: a stall, not overlapped). Every saved storage of a block is an
  entry of its segment from its first saved tensor, kept or not, so that it can leave later; a held input the
  plan keeps stays (see [Note: held inputs] in storages.py). In forward, the rest of it offloads every block
  (as a micro-step beyond the traced shapes does). Those storages come back as planned ones do, when their
  block's backward begins (the first unpack, the wait before use): the values are unchanged.
* **Offloaded blocks too.** In the same order, an offloaded block's copies out still in flight (the one block
  of overlap in forward) are waited on and its storages dropped at once, and a block brought back ahead of its
  backward (the prefetch) goes back to the host: each copy back not used yet is waited on, its accelerator
  storage dropped (a held input emptied again) and the host copy kept
  (:meth:`StorageCopies.call_back <.copies.StorageCopies.call_back>`), to be brought back at its own backward
  (those bytes cross twice: the counters count both). Such a block comes back at its own backward from then on
  (:attr:`Segment.ahead <.storages.Segment.ahead>`; a log line): one copy, waited on there, where the prefetch
  would give way again and again (twice the bytes, and a re-plan every step).
* **The step learns.** The plan keeps from then on the most the allocator stranded at a moment in that
  iteration (never less than before) and chooses the blocks again from the readings (the blocks that gave way
  counted as kept, as [Note: a risen tide] reads a micro-step beyond the traced shapes), so later batches
  offload by plan, their copies overlapped, instead.
* **Then states, then the error.** Only where nothing kept is left to move, or it was not enough, do
  optimizer states give way, and then the tide planned ahead is set aside where the chunks fit beside what
  stands (see [Note: a forecast set aside] in placement/last_resort.py); an error that still stands no longer
  names ``offload_activations: "all"`` once the forward offloads every block. Counter ``activations_gave_way``,
  and a log line.

On the twin's GPT with one batch a step of changing lengths at 1.15 MB, the fifth batch gives way once and the
rest of the run offloads one block by plan, with the losses of a run keeping every activation bit for bit, where
it stopped with ``DeviceBudgetExceeded``; at 625 KB (``chunk_size`` 2048; offloading every block trains from
about 612 KB), a kept block gives way in backward, where "auto" stopped and "all" trained
(``tests/test_dynamic_shapes.py``); at 650 KB (``chunk_size`` 4096) nothing is kept before the block in
backward, and the block prefetched for the next backward gives way.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

from ..counters import StepCounters
from .copies import StorageCopies
from .storages import Segment, State

logger = logging.getLogger(__name__)


class GaveWay(NamedTuple):
    """The segments that gave way: kept ones sent to the host, offloaded ones whose copies out were waited on, and
    those brought back ahead whose copies back were undone."""

    kept: list[Segment]
    hurried: list[Segment]
    called_back: list[Segment]


def give_way(
    forward: list[Segment], current: Segment | None, copies: StorageCopies, moment: int, nbytes: int
) -> GaveWay:
    """The segments of ``forward`` (finished: not ``current``; their block's backward not begun) give way now, the
    earliest first, until ``nbytes`` left (see [Note: activations give way])."""
    before, way = copies.meter.bytes, GaveWay([], [], [])
    for segment in forward:
        if before - copies.meter.bytes >= nbytes:
            break
        if segment is current or segment.begun:
            continue
        if segment.offload:
            _hurry(segment, copies, way)
            continue
        leaving = [e for e in segment.entries if e.state in (State.ON_DEVICE, State.BACK) and e.refs and not e.pinned]
        for entry in leaving:
            copies.copy_out(entry)
        segment.offload, segment.drop_at, segment.restore_at = True, moment, -1  # back at its backward
        for entry in leaving:
            copies.leave(entry)  # waits on the copy: the moment needs the room now (held elsewhere: it stays)
        way.kept.append(segment)
    return way


def _hurry(segment: Segment, copies: StorageCopies, way: GaveWay) -> None:
    """An offloaded segment's copies out still in flight are waited on now, its copies back not used yet undone
    (brought back again at its backward)."""
    leaving = [e for e in segment.entries if e.state is State.TO_HOST]
    for entry in leaving:
        copies.leave(entry)
    if leaving:
        way.hurried.append(segment)
    called = [entry for entry in segment.entries if copies.call_back(entry)]
    if called:
        segment.restore_at = -1  # back at its backward (the first unpack, or the hook before it)
        way.called_back.append(segment)


def report_give_way(counters: StepCounters, freed: int, way: GaveWay) -> None:
    """Counts and says that the segments of ``way`` gave way, ``freed`` bytes of the accelerator's."""
    counters.activations_gave_way += 1
    logger.info(
        "ds_patrickstar: the tide stands above the plan: the activations of blocks %s (kept), %s (offloaded, still "
        "leaving) and %s (brought back ahead) left for the host now (%d B) to make room "
        "(see [Note: activations give way])",
        *([segment.block for segment in segments] for segments in way),
        freed,
    )
