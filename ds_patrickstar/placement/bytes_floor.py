"""The fewest bytes any placement of a trace can move in a steady iteration: the floor the planner's choice is
measured against.

[Note: the bytes floor]
Where the optimizer states do not all fit beside the tide, some chunks are updated on the host, and each of
those makes a round trip every iteration whatever the plan: its payload comes to the accelerator for its first
use, and its gradient (in the payload's slot, see [Note: gradient in the param slot]) goes back for the host
update; 2 + 2 B per element (the way out only for a chunk a gradient was written into, where clean evictions
keep the copy it came from). Keeping a chunk's states on the accelerator spares that round trip and takes
12 B per element of room for the whole iteration. At every moment the accelerator holds the tide, the states
kept there and the payloads resident; a payload the moment does not hold costs at least its bytes once more to
bring back before its next use, unless it is a host-updated chunk outside the span from its first use to its
last (its round trip already brings it). With gradient accumulation a chunk's fp32 accumulator comes into being
beside it at its first gradient and is needed there again at its gradients up to the boundary's sum (see
[Note: predicted moves] in move_model.py); it keeps no copy on the host, so one not held at a moment went out
and comes back: twice its bytes. So at moment ``m``, with ``base(m)`` the tide plus every frozen chunk's
payload plus the payloads of the trainable chunks whose span contains ``m`` and the accumulators that exist
at ``m``, and ``P(m)`` the payloads of ``base(m)`` the moment does not use, a set ``S`` of chunks with states
kept on the accelerator moves at least::

    2 * payload(host-updated chunks)  +  cost(base(m) + 12 * elements(S) - budget)

bytes, where ``cost(x)`` is 0 for ``x <= 0``, ``x`` up to ``P(m)`` (payloads away, each brought back once) and
two bytes per byte beyond (accumulators away: out and back). A state spares at most 4 B of round trip per 12 B
of room, less than the byte a shortfall costs, so ``S`` only fills room the busiest moment leaves:
:func:`bytes_floor` takes the highest ``base(m)`` and minimises over ``S`` in the fractional relaxation (a
knapsack of the room the tide leaves, filled by the chunks that spare the most round-trip bytes per byte of
state), and adds the costliest moment's shortfall: a lower bound for every plan that keeps states where they
are for the iteration, at any prefetch distance and eviction order. Moving states out and back within the
iteration only adds bytes (12 B per element each way against the round trip's 4), and so does moving
activations to make room (their bytes out and back for a third of them saved); recomputing activations instead
(checkpointing) moves no bytes and is outside it: it is the user's choice of model, not placement's. The bound
counts one moment's shortfall once and leaves out what a plan also needs (the chunks in flight, room at the
step), so it can sit below every plan. The planner logs it with its choice; the counter ``bytes_floor`` exports
it beside the bytes measured (accumulators included) at one rank and, without the accumulators (a rank's may
come into being on the host there), at several: there ``base(m)`` also holds the gathered storage of the chunk
groups the moment uses (each used group is all-gathered at its use, see [Note: gathered group storage] in
store/chunk_store.py), not that of groups kept or gathered ahead, which a plan may do without; leaving those
out only lowers the bound. ``benchmarks/twin_pressure.py`` reports it per budget.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from ..memory.preflight import OPTIM_BYTES_PER_ELEMENT
from .chunk_costs import ChunkCosts
from .trace import Moment, Trace

Gathered = Callable[[Moment], int]
"""With several ranks, the bytes of gathered group storage a moment's use needs (see [Note: the bytes floor])."""


def bytes_floor(trace: Trace, budget: int, costs: ChunkCosts, gathered: Gathered | None = None) -> int:
    """The fewest bytes a steady iteration of ``trace`` can move under ``budget`` (see [Note: the bytes floor]):
    ``costs`` of the owned chunks, ``gathered`` with several ranks; a trainable chunk the trace never uses makes no
    round trip. O(moments + chunks used)."""
    spans = _spans(trace)
    trainable = [c for c in costs.elements if c in spans]
    frozen = sum(size for c, size in costs.sizes.items() if c not in costs.elements and c in spans)
    payloads = [0] * (len(trace) + 1)  # the payloads whose span begins (+) or has ended (-) at each moment
    for chunk in trainable:
        first, last = spans[chunk]
        payloads[first] += costs.sizes[chunk]
        payloads[last + 1] -= costs.sizes[chunk]
    accumulators = costs.accumulators or {}
    grown = [0] * (len(trace) + 1)  # the same for the accumulators
    for chunk, (born, gone) in _accumulator_spans(trace, accumulators).items():
        grown[born] += accumulators[chunk]
        grown[gone + 1] -= accumulators[chunk]
    base, short_cost, payload, accumulated = 0, 0, frozen, 0
    for index, moment in enumerate(trace.moments):
        payload += payloads[index]
        accumulated += grown[index]
        if moment.label != "step":
            held = moment.non_model + payload + accumulated + (gathered(moment) if gathered is not None else 0)
            base = max(base, held)
            in_use = sum(costs.sizes.get(c, 0) for c in set(moment.chunks))
            short_cost = max(short_cost, _shortfall_cost(held - budget, payload - in_use))
    written = set().union(*(m.written for m in trace.moments))
    trip = {c: costs.sizes[c] * (1 + int(not costs.clean_copies or c in written)) for c in trainable}
    room = budget - base
    spared = _knapsack(trip, {c: OPTIM_BYTES_PER_ELEMENT * costs.capacities[c] for c in trainable}, max(room, 0))
    return sum(trip.values()) - spared + short_cost


class FloorMeter:
    """The bytes floor of the current trace (see [Note: the bytes floor]), taken again only when the trace or its
    planned tide changed (its revision)."""

    def __init__(self, budget: int, costs: ChunkCosts, gathered: Gathered | None = None) -> None:
        self._budget, self._costs, self._gathered = budget, costs, gathered
        self._key: tuple[int, int] | None = None
        self.value = 0

    def update(self, trace: Trace) -> int:
        key = (id(trace), trace.revision)
        if key != self._key:
            self._key, self.value = key, bytes_floor(trace, self._budget, self._costs, self._gathered)
        return self.value


def _shortfall_cost(short: int, payloads: int) -> int:
    """The fewest bytes moved to have ``short`` bytes away at a moment with ``payloads`` bytes of payloads it does
    not use: those first (each brought back), the rest accumulators (out and back)."""
    if short <= 0:
        return 0
    return min(short, payloads) + 2 * max(0, short - payloads)


def _spans(trace: Trace) -> dict[int, tuple[int, int]]:
    """Chunk -> (first, last) moment of the iteration using it, the step left out."""
    spans: dict[int, tuple[int, int]] = {}
    for index, moment in enumerate(trace.moments):
        if moment.label == "step":
            continue
        for chunk in moment.chunks:
            first, _ = spans.get(chunk, (index, index))
            spans[chunk] = (first, index)
    return spans


def _accumulator_spans(trace: Trace, accumulators: Mapping[int, int]) -> dict[int, tuple[int, int]]:
    """With gradient accumulation, chunk -> (first, last) moment whose hook finds its accumulator there: from the
    moment after the one it came into being in, to the one it went in (or the last)."""
    born: dict[int, int] = {}
    gone: dict[int, int] = {}
    for index, moment in enumerate(trace.moments):
        for chunk in moment.acc_born & accumulators.keys():
            born.setdefault(chunk, index + 1)
        for chunk in moment.acc_gone:
            if chunk in born and chunk not in gone and born[chunk] <= index:
                gone[chunk] = index
    last = len(trace) - 1
    return {chunk: (first, gone.get(chunk, last)) for chunk, first in born.items() if first <= last}


def _knapsack(value: dict[int, int], weight: dict[int, int], room: int) -> int:
    """The most ``value`` items of ``weight`` fit in ``room``, items taken in part (a bound on taking them whole)."""
    gained = 0.0
    for item in sorted(value, key=lambda i: (-value[i] / max(weight[i], 1), i)):
        take = min(1.0, room / weight[item]) if weight[item] else 1.0
        gained += take * value[item]
        room -= int(take * weight[item])
        if room <= 0:
            break
    return int(gained)
