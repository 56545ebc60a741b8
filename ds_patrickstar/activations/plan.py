"""Which blocks' activations ``offload_activations: "auto"`` moves to the host.

[Note: auto activation offload]
The plan is made once per trace, at the optimizer step of the iteration that was traced (see
[Note: moments and the trace]), from that iteration (and made again from the same records at the next step,
where the step-time model prices the plans, see [Note: the plan checked on steady times] in
placement/step_planner.py). That iteration offloads the blocks that may not fit (see [Note: the traced
iteration's offload] in traced_keep.py), and the offloader records, for each block's segment in it
(see [Note: activation offload]), the bytes it saved, whether it was offloaded and the moments it spent (or, kept, would
have spent) off the accelerator (from the moment after its copies out were waited on to the moment whose compute
issues its copy back: that moment's tide was read in its hook, before the copy, so it is away
there as the trace counts it). The tide with no offload is then the traced tide plus, at every moment, the bytes of the
offloaded segments away then; offloading block ``k`` takes its segments' bytes off again, over the same
moments. A moment fits when the chunks in use then and the higher tide of the moment and the next
one (what placement plans room from) are within the room placement works in
(:meth:`~ds_patrickstar.placement.runtime.PlacementRuntime.movable_room`: the budget less the
optimizer states on the accelerator, none after a trace, and the allocator's fragmentation). The
chunks in use are the moment's own and those of the modules recomputed before it whose backward
has not come yet (:meth:`~ds_patrickstar.placement.trace.Trace.held_chunks`: a recomputed
module's tensors stay in use until its backward), counted as placement holds them (their groups
gathered, with gradient accumulation the accumulators and gradient buffers that micro-step holds
then, see [Note: chunk bytes per moment] in placement/chunk_needs.py). There is no reserve beyond what
placement keeps: where checkpointing alone fits, nothing is offloaded.

Greedy: while some moment does not fit, take the moment that overflows most; among the blocks
whose offload lowers the tide there, offload the one moving the fewest bytes per iteration that
makes that moment fit, else the one that lowers it most (ties: the earlier block, which stays
away from the accelerator longest). Blocks are kept in full or offloaded in full, every
micro-step alike; the bytes moved are the sum of the chosen blocks' bytes. At the peak, where
every segment is resident, this is the fewest bytes covering the overflow up to one block's
bytes (blocks of a transformer save equal bytes). When offloading every block does not make
every moment fit, every block is offloaded and placement fails, as it would, at the moment that
does not fit. The planned tide replaces the traced one in the trace, so that placement (chunk
headroom, prefetch) and the optimizer-state plan at the next step see the tide the run will have;
planning at the traced step, before the ranks agree from the same trace which groups may stay
gathered or be gathered ahead (see [Note: agreed gather plan]), lets that agreement see it too
(agreed from the traced tide, it would keep and prefetch groups for which the planned tide leaves no
room).

Offloading strands allocator pieces: an activation copied out leaves a free piece in its segment
that only a request fitting it reuses, and placement counts the pieces stranded at a moment beside
that moment's tide (see [Note: stranded allocator bytes] in memory/cuda.py), which the traced tide
does not hold.
So where the plan offloads anything, it is made again with the room less the most bytes the traced
iteration (with the blocks it offloaded) stranded at a moment: without it, the pieces the planned
iteration strands beside its tide take room the plan gave the chunks, and a budget between two that
train can fail. Where checkpointing alone fits the plan offloads nothing and keeps no margin, unless the batches'
shapes vary (see [Note: a risen tide]).

[Note: a risen tide]
The envelope of traced shapes is checked at an iteration's first forward (see [Note: traces across input
shapes] in placement/shapes.py), but with gradient accumulation each micro-step brings its own batch, and a
batch padded to its own longest sequence can make a later micro-step longer than any traced, or than the one
traced at its place: its tide then rises above the plan, and where "auto" had planned to keep the blocks'
activations, its backward could stop with ``DeviceBudgetExceeded`` where offloading them fits. So:

* **The plan covers every micro-step alike.** Where the traced micro-steps' batches differed (a block's
  segments saved unequal bytes), each micro-step's own tide with no block offloaded (its traced tide plus its
  offloaded segments, see [Note: auto activation offload]), less its own segments of the blocks chosen, is
  raised at each moment to the most at its place in every micro-step, where the micro-steps run the same
  moments (:func:`micro_step_places`), and the blocks are chosen by that tide (:func:`plan_offload`); every
  micro-step's inputs widen the envelope while an iteration is traced. (Raising the tides with no offload
  first and taking one micro-step's segments off the most planned a longer micro-batch's tide less a shorter
  one's segments: on the twin, 631 KB at a moment where 274 KB stood, and a run stopped where offloading
  every block trains.)
* **A later micro-step beyond the envelope offloads every block.** Its first forward's inputs are checked
  (:meth:`~ds_patrickstar.placement.tracer.MemoryTracer.micro_step_inputs`; logged): where they lie beyond
  every traced shape, every block's activations it saves are offloaded, as a traced iteration's may be, and
  the envelope widens. The tide it reads is noted with the bytes offloaded beyond the plan and away then
  (:meth:`~.offloader.ActivationOffloader.unplanned_away`) added: the tide the plan's own offload would have
  left.
* **A risen tide chooses the blocks again.** At the step, where the tide rose above the plan (see [Note:
  traces across input shapes]), the tide with no offload is raised at those moments to the reading plus the
  segments of the blocks offloaded then, across the micro-steps as above, and the blocks are chosen again
  from it (room and chunk bytes as at the traced step; logged where they change); the readings, as the new
  choice would have had them, then raise the planned tide, and the optimizer states are placed again beside
  it.
* **Shapes that vary keep room for the pieces they strand.** Batches of changing lengths lay out and split the
  allocator's blocks differently every step, so where the traced micro-steps' batches differed or a tide rose,
  the plan keeps the stranded margin (the most the traced iteration stranded at a moment) even where it
  offloads nothing: on the twin's GPT with two micro-batches of changing lengths, a plan keeping every block
  at 1.2 and 1.26 MB stopped at the third step where 1.15 MB trained.
* **A budget error names "all"** where "auto" keeps some blocks' activations on the accelerator (their bytes
  are in the tide the error reports): offloading every block trained each of those runs.

On the twin with two micro-batches a step, a GPT's second micro-batch four times the first from the second
step on, at budgets below the longer batches' activations beside the chunks: the run trains, with the
losses of a run that keeps every activation bit for bit, where keeping the blocks the traced step chose
stopped at the third step (``tests/test_dynamic_shapes.py``).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass

from ..placement.states_room import StatesRoom, best_tide, with_tide
from ..placement.step_time import ActivationMoves
from ..placement.trace import Trace

__all__ = [
    "SegmentRecord",
    "micro_step_places",
    "away_bytes",
    "bare_tide",
    "plan_for_states",
    "plan_offload",
    "planned_copies",
    "spread",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SegmentRecord:
    """One block's segment in the traced iteration."""

    block: int
    nbytes: int
    away_from: int  # first moment it is off the accelerator when offloaded
    away_to: int  # first moment whose tide (read in its hook) holds it back: the one after its copy back's
    offloaded: bool  # whether it was offloaded in the traced iteration

    def away(self, moments: int) -> range:
        return range(max(self.away_from, 0), min(self.away_to, moments) if self.away_to >= 0 else moments)


def _overflow(tide: list[int], need: list[int], budget: int) -> list[int]:
    last = len(tide) - 1
    return [need[m] + max(tide[m], tide[min(m + 1, last)]) - budget for m in range(len(tide))]


def plan_offload(
    tide: list[int],
    need: list[int],
    budget: int,
    records: list[SegmentRecord],
    places: list[list[int]] | None = None,
) -> tuple[set[int], list[int]]:
    """``(blocks to offload, the tide with them offloaded)`` from the traced ``tide`` and the chunk
    bytes ``need`` at each moment; see [Note: auto activation offload]. ``places``: the moments at the same place in
    every micro-step, where the plan covers every micro-step alike (see [Note: a risen tide]): each micro-step's own
    tide, with the chosen blocks' segments of that micro-step away, raised to the most at its place."""
    moments = len(tide)
    own = bare_tide(tide, records)
    place_of = {index: same for same in places or () for index in same}
    by_block: dict[int, list[SegmentRecord]] = {}
    for record in records:
        by_block.setdefault(record.block, []).append(record)
    chosen: set[int] = set()
    planned = spread(own, places)
    while moments:
        over = _overflow(planned, need, budget)
        worst = max(range(moments), key=lambda m: over[m])
        if over[worst] <= 0:
            break
        window = {worst, min(worst + 1, moments - 1)}
        gains = {}
        for block, segments in by_block.items():
            if block not in chosen:
                gains[block] = max(planned[m] - _without(own, segments, place_of.get(m, [m]), moments) for m in window)
        candidates = [b for b, g in gains.items() if g > 0]
        if not candidates:
            break
        moved = {b: sum(s.nbytes for s in by_block[b]) for b in candidates}
        covering = [b for b in candidates if gains[b] >= over[worst]]
        block = (
            min(covering, key=lambda b: (moved[b], b)) if covering else max(candidates, key=lambda b: (gains[b], -b))
        )
        chosen.add(block)
        for segment in by_block[block]:
            for m in segment.away(moments):
                own[m] -= segment.nbytes
        planned = spread(own, places)
    return chosen, planned


def _without(own: list[int], segments: list[SegmentRecord], place: list[int], moments: int) -> int:
    """The tide at ``place`` (moments at the same place in every micro-step) with ``segments`` away too."""
    return max(own[p] - sum(s.nbytes for s in segments if p in s.away(moments)) for p in place)


def bare_tide(tide: list[int], records: list[SegmentRecord]) -> list[int]:
    """The tide with no block offloaded, from ``tide``, read in an iteration like the one ``records`` come from:
    plus, at each moment, the bytes of the segments it offloaded that were away then."""
    return [n + b for n, b in zip(tide, away_bytes([r for r in records if r.offloaded], None, len(tide)))]


def away_bytes(records: list[SegmentRecord], blocks: set[int] | None, moments: int) -> list[int]:
    """Per moment, the bytes of the segments of ``records`` off the accelerator then, of ``blocks`` (None: all)."""
    away = [0] * moments
    for record in records:
        if blocks is None or record.block in blocks:
            for m in record.away(moments):
                away[m] += record.nbytes
    return away


def micro_step_places(trace: Trace, moments: int) -> list[list[int]] | None:
    """The moments of ``trace`` (of its first ``moments``) at the same place in every micro-step, where the
    micro-steps run the same moments (None where there is one, or they differ; see [Note: a risen tide])."""
    places: dict[int, list[int]] = {}
    for index, micro in enumerate(trace.micro_steps()[:moments]):
        if trace.moments[index].label != "step":
            places.setdefault(micro, []).append(index)
    steps = list(places.values())
    labels = [[trace.moments[i].label for i in step] for step in steps]
    if len(steps) < 2 or any(other != labels[0] for other in labels):
        return None
    return [list(same) for same in zip(*steps)]


def spread(tide: list[int], places: list[list[int]] | None) -> list[int]:
    """``tide`` with each moment of ``places`` raised to the most at its place."""
    raised = list(tide)
    for same in places or ():
        top = max(tide[i] for i in same)
        for index in same:
            raised[index] = top
    return raised


def planned_copies(records: list[SegmentRecord], blocks: set[int] | None) -> ActivationMoves:
    """The copies of the segments of ``blocks`` (None: every block) in an iteration like the one ``records`` come
    from, as the step-time model prices them (see [Note: step-time model] in placement/step_time.py). A
    segment's copy out is issued at the pre-forward of the block after it: where the block before it was
    dropped (its ``away_from`` less one; the first block's, one moment before its own drop); its copy back
    where the traced iteration issued it (``away_to`` less one), for the moment that issued the copy back of
    the block before it (that block's backward begins there and prefetches it: see [Note: activation
    offload]); the first block's for as many moments after its issue as the second block's was before it,
    the last block's for its own moment (nothing prefetched it)."""
    out: dict[int, int] = defaultdict(int)
    demand: dict[int, int] = defaultdict(int)
    ahead: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for index, record in enumerate(records):
        if (blocks is not None and record.block not in blocks) or record.away_to < 0:
            continue
        before = _neighbour(records, index, -1)
        after = _neighbour(records, index, 1)
        out[max((before.away_from if before is not None else record.away_from) - 1, 0)] += record.nbytes
        issued = record.away_to - 1
        if before is not None and before.away_to > record.away_to:
            needed = before.away_to - 1
        elif before is None and after is not None and after.away_to < record.away_to:
            needed = issued + (record.away_to - after.away_to)
        else:
            needed = issued
        if needed > issued:
            ahead[issued].append((needed, record.nbytes))
        else:
            demand[issued] += record.nbytes
    return ActivationMoves(dict(out), dict(demand), {k: tuple(v) for k, v in ahead.items()})


def _neighbour(records: list[SegmentRecord], index: int, step: int) -> SegmentRecord | None:
    """The segment of the block ``step`` after ``records[index]``'s in the same forward, if it is the next record."""
    at = index + step
    if 0 <= at < len(records) and records[at].block == records[index].block + step:
        return records[at]
    return None


def plan_for_states(
    trace: Trace,
    need: list[int],
    room: int,
    records: list[SegmentRecord],
    base: tuple[set[int], list[int]],
    states: StatesRoom,
    places: list[list[int]] | None = None,
) -> tuple[set[int], list[int]]:
    """Of ``base`` (the blocks :func:`plan_offload` chose for the traced ``trace`` and the tide planned with them)
    and plans offloading more blocks so that the fill rule places more optimizer states, the one the step-time
    model prices fastest (see [Note: activations offloaded for optimizer states] in placement/states_room.py).
    ``room``: what the chunks and the tide share at a moment; ``need``, per moment planned (``trace`` may hold a step
    moment after them, priced as it stands)."""
    tide = [m.non_model for m in trace.moments[: len(need)]]
    options = [base]
    for cap in states.caps(with_tide(trace, base[1])):
        blocks, planned = plan_offload(tide, [max(n, room - cap) for n in need], room, records, places)
        if all(blocks != known for known, _ in options):
            options.append((blocks, planned))
    if len(options) == 1:
        return base
    priced = [
        states.price(with_tide(trace, planned), planned_copies(records, blocks), len(blocks))
        for blocks, planned in options
    ]
    best = best_tide(priced)
    logger.info(
        "ds_patrickstar: activation offload for optimizer states: %d plan(s) priced (blocks offloaded: %s; predicted "
        "steps: %s s); blocks %s kept",
        len(options),
        [len(blocks) for blocks, _ in options],
        [round(p.step_s, 4) for p in priced],
        sorted(options[best][0]),
    )
    return options[best]
