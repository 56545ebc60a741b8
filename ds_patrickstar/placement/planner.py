"""The placement planner: decisions as pure functions of the trace, the budget and the chunks' sizes.

[Note: placement planner]
Placement is a planner and a driver. The planner (this module) decides from what it is given and
nothing else, holds no state, moves nothing and calls no other layer, so a test calls it with a
hand-made :class:`~ds_patrickstar.placement.trace.Trace`:

* :func:`states_on_device`: which owned chunks' optimizer states live on the accelerator after a
  trace (see [Note: optimizer-state placement]);
* :func:`headroom`: the bytes model data may take at a moment, beside the tide planned there and the
  non-model memory now (see [Note: placement] and [Note: stranded allocator bytes]);
* :func:`prefetch_for`: the chunks brought ahead after a moment (those of the next ``distance`` moments);
* :func:`belady_victims`: what to evict for a number of bytes, farthest next use first (the oracle of
  the driver's :class:`~ds_patrickstar.placement.eviction_queue.EvictionQueue`, which gives the same answer
  in O(log n) per change);
* :func:`update_order`: the order the host worker updates chunks in (see [Note: overlapped host Adam]);
* :func:`gathered_rooms`: per moment, the room gathered chunk groups may take, kept or ahead (the
  agreed gather plan's input, see [Note: agreed gather plan]).

The driver (:class:`~ds_patrickstar.placement.runtime.PlacementRuntime`, at every moment and at the
step) asks the planner and carries the answers out through the chunk store; the step's driver
(the ZeRO-optimizer adapter) moves the optimizer states the planner placed and updates each chunk
where its states live. Nothing calls back: the planner returns, the drivers act.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from ..memory.ledger import DeviceBudgetExceeded
from ..memory.preflight import OPTIM_BYTES_PER_ELEMENT
from .trace import Trace

IN_FLIGHT_CHUNKS = 2
"""Chunks of room kept beside the optimizer states on the accelerator for the moves in flight."""


def states_on_device(
    trace: Trace, budget: int, policy: str, needs: list[int], largest_chunk: int, capacities: Mapping[int, int]
) -> set[int]:
    """The owned chunks (id -> elements: ``capacities``) whose fp32 master, momentum and variance live on
    the accelerator: in chunk order, as many as fit what the tide leaves at its highest, less the busiest
    moment's chunks (``needs``, per moment, see [Note: chunk bytes per moment]) and room for
    :data:`IN_FLIGHT_CHUNKS` chunks of ``largest_chunk`` bytes in flight. None with the ``static`` policy."""
    if policy == "static":
        return set()
    peak_non_model = max((m.non_model for m in trace.moments), default=0)
    free = budget - peak_non_model - max(needs, default=0) - IN_FLIGHT_CHUNKS * largest_chunk
    return optimizer_chunks_on_device(free, capacities)


def optimizer_chunks_on_device(free_bytes: int, capacities: Mapping[int, int]) -> set[int]:
    """Chunks (in id order) whose optimizer states fit ``free_bytes``."""
    chosen, used = set(), 0
    for chunk, capacity in sorted(capacities.items()):
        cost = capacity * OPTIM_BYTES_PER_ELEMENT
        if used + cost > free_bytes:
            break
        chosen.add(chunk)
        used += cost
    return chosen


def headroom(budget: int, trace: Trace | None, moment: int, non_model_now: int, span: int = 1) -> int:
    """Bytes model data may use on the accelerator from ``moment`` over ``span`` moments: the budget less the
    higher of the tide the trace plans over them and the one after, and the non-model memory now."""
    planned = trace.non_model_ahead(moment, span + 1) if trace is not None and 0 <= moment < len(trace) else 0
    return budget - max(planned, non_model_now)


def prefetch_for(
    trace: Trace | None, moment: int, policy: str, distance: int = 1
) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """What to bring ahead after ``moment``: ``(target moment, its chunks)`` for the next ``distance`` moments
    of this iteration, nearest first (none without a trace, at its last moment, or with the ``static``
    policy); see [Note: prefetch distance] in state_choice.py."""
    if trace is None or policy == "static":
        return ()
    last = min(moment + distance, len(trace) - 1)
    return tuple((target, trace.moments[target].chunks) for target in range(moment + 1, last + 1))


def belady_victims(resident: dict[int, int], need: int, next_use: Callable[[int], int]) -> list[int]:
    """Chunks to evict (``resident``: id -> bytes), farthest next use first, until ``need`` bytes are freed:
    the rule in its plain O(n log n) form."""
    chosen, freed = [], 0
    for chunk in sorted(resident, key=lambda c: (-next_use(c), c)):
        if freed >= need:
            break
        chosen.append(chunk)
        freed += resident[chunk]
    if freed < need:
        raise DeviceBudgetExceeded(
            f"cannot free {need} bytes on the accelerator: only {freed} bytes of movable chunks are resident"
        )
    return chosen


def gathered_rooms(tides: list[int], base: int, held: Callable[[int], int]) -> tuple[list[int], list[int]]:
    """Per moment of a trace whose tides are ``tides``: the accelerator bytes gathered chunk groups may
    take on this rank, ``(kept for the rest of the iteration, gathered ahead of the next moments)``:
    ``base`` (the budget less what cannot move: optimizer states on the accelerator, fragmentation),
    less the tide of that moment and, at each later moment, its tide and ``held(later)`` (the groups
    it holds beside the kept ones; up to the next iteration's first moment), whichever is highest,
    resp. less the tide of that moment and the next two (see [Note: agreed gather plan])."""
    keep = [0] * len(tides)
    later = tides[0] + held(0) if tides else 0  # the next iteration's first moment
    for index in range(len(tides) - 1, -1, -1):
        keep[index] = base - max(tides[index], later)
        later = max(later, tides[index] + held(index))
    ahead = [base - max(tides[index : index + 3]) for index in range(len(tides))]
    return keep, ahead


def update_order(trace: Trace | None, chunk_ids: Iterable[int]) -> list[int]:
    """``chunk_ids`` in the order an iteration like ``trace`` first uses them, those it never uses last
    (chunk order without a trace): the order the host worker updates them in, so that the next forward
    waits least (see [Note: overlapped host Adam] in memory/host_work.py)."""
    if trace is None:
        return sorted(chunk_ids)
    return sorted(chunk_ids, key=lambda chunk: (trace.next_use(chunk, -1), chunk))
