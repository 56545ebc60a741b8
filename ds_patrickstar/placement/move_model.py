"""The bytes a placement moves in an iteration, predicted from the trace alone (the planner's model of the
driver, see [Note: placement planner]).

[Note: predicted moves]
:func:`simulate_moves` replays one iteration of a trace as the per-moment driver places it (see
[Note: placement]): at each moment the chunks it uses come to the accelerator, room made by evicting the
resident chunk used again farthest ahead (or in the order chosen, see [Note: eviction order] in
eviction_queue.py), under the budget less the bytes that do not move (optimizer states on the accelerator) and
the higher of the tide planned for this moment and the next and what the driver read beside model data at the
moment (``Moment.read``: the tide then and the allocator's stranded pieces, the most of the readings with this
trace; the tide of a steady iteration can stand above the traced one); after the moment the next
``distance`` moments' chunks are brought ahead where they fit up to their moment, if need be after evicting
chunks used only after it (see [Note: prefetch distance] in state_choice.py); at
the step the chunks updated on the host leave, those whose last use this iteration is behind and whose
gradient went into their payload (``Moment.written``; not where the step writes the sums) already at the next
moment (their gradients leave during backward, see [Note: gradients leave in backward] in grad_release.py).
It starts from the chunks on the accelerator and leaves there those at the iteration's end, so two calls give a
steady state. What it returns, bytes to the accelerator and back per moment, is what the step-time model weighs
against compute (see [Note: step-time model] in step_time.py), and the per-step counters
``predicted_bytes_to_device``/``_to_host`` put it beside the bytes measured. With gradient
accumulation a trainable chunk's fp32 accumulator comes into being and goes at the moments the traced iteration
recorded (``Moment.acc_born``, ``acc_gone``: its first gradient, and the boundary's sum in its slot), during
the moment, after its hook (room made beside what the driver read then, ``Moment.read_late``); from then on it
takes room beside its chunk and moves with it (``predicted_accumulator_bytes_to_device``/``_to_host``), or, in
the orders that keep accumulators, stays when its payload goes, goes after every payload that could go and comes
back with its payload (see [Note: accumulators kept] in eviction_queue.py).

With several ranks a rank's placement moves its own chunks; the other ranks' chunks of a group in use, kept or
gathered ahead sit in the group's gathered storage, beside the flat gradient buffers and the collectives' buffers,
none of which it moves. Which groups are gathered then follows the ranks' agreed gather plan and when a buffer goes
follows the collectives' completions, so the replay does not derive them: the driver notes, at the end of each
moment's hook, the model data on the accelerator that is not its own chunks' payloads, optimizer states or copies
in flight (``Moment.beside``, the most of its readings with this trace, like ``read``), and the replay makes room
for this rank's chunks under the budget less that as well. The groups' own prefetch all-gathers the next groups
of the previous step's gather order (see [Note: gather order] in groups/gather_order.py), a distance in groups and
not in moments, and an all-gather brings this rank's chunk of the group then: the driver notes those chunks at the
moment (``Moment.gathered_ahead``, the union of its readings with this trace) and the replay brings them there,
room made as for a chunk in use, for their next use. Both readings are of the plan the trace ran with (another
placement of the states leaves other room for kept and prefetched groups), so at several ranks the prediction is
approximate: on the twin's mirrors of the H100 sweep within 2% of the bytes each rank moved from 6 to 14 GiB
(``benchmarks/twin_pressure_ranks.py``), on the counter runs' two-rank GPT exact in most runs (without the
groups' prefetch 14% over on one rank and 15% under on the other). With gradient
accumulation at several ranks a rank's accumulators are its owned chunks' (see [Note: gradient accumulation] in
groups/grads.py), from its group's first micro-step reduce-scatter, and move with their chunks as at one rank (the
reading leaves them out). At the boundary a sum comes with its group's reduce-scatter, which the driver completes
before it evicts the chunk or makes room, so an accumulator goes then, never to the host; the replay drops it so
from the moment after its chunk's last use where the trace noted such a collective for it (``Moment.acc_folding``;
none where the step writes the sums, see [Note: unmanaged gradient accumulation] in groups/grads.py). On the
twin's mirrors at GA 2 the payloads' bytes are predicted within 5% from 6 to 16 GiB.
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Set as AbstractSet

from .chunk_costs import ChunkCosts
from .eviction_queue import EvictionOrder
from .move_plan import MovePlan
from .replay import Replay
from .replay_arrays import ReplayArrays, replay_arrays
from .trace import Trace


def simulate_moves(
    trace: Trace,
    budget: int,
    sizes: Mapping[int, int],
    fixed: int,
    resident: set[int],
    host_updated: set[int],
    uncopied: AbstractSet[int] = frozenset(),
    distance: int = 1,
    keeps_copies: bool = False,
    frozen: AbstractSet[int] = frozenset(),
    order: EvictionOrder = EvictionOrder.BELADY,
    accumulators: Mapping[int, int] | None = None,
    arrays: ReplayArrays | None = None,
) -> MovePlan:
    """Replay one iteration of ``trace`` (see [Note: predicted moves]): ``sizes``, the movable chunks' bytes
    on the accelerator; ``fixed``, bytes that do not move; ``resident``, the chunks on the accelerator at
    its start (left as those at its end); ``host_updated``, the chunks Adam updates on the host;
    ``uncopied``, chunks whose eviction copies nothing (frozen chunks whose home is their disk record);
    ``distance``, the moments prefetched ahead (see [Note: prefetch distance] in state_choice.py);
    ``keeps_copies``, whether a chunk brought keeps the host buffer it came from, so that its eviction copies
    nothing until a moment's gradients went into it (the trace's ``written``), and ``frozen``, the chunks that
    keep it across the step (see [Note: clean evictions] in store/clean_copies.py); ``order``, the eviction
    order (see [Note: eviction order] in eviction_queue.py); ``accumulators``, with gradient accumulation, each
    trainable chunk's accumulator bytes; ``arrays``, what the replay reads of ``trace`` (:func:`replay_arrays`,
    built here where not given)."""
    replay = Replay(trace, budget, sizes, fixed, resident, set(uncopied), order, accumulators, arrays)
    movable = replay.arrays.movable
    accumulating = set(accumulators or ())
    for index, moment in enumerate(trace.moments):
        replay.at = index
        replay.keeps_copies = keeps_copies and moment.label != "step"
        if index and replay.acc:  # their last gradient is in and a boundary collective brings their sums
            replay.folding.update(replay.acc.intersection(replay.arrays.last_uses[index - 1], replay.arrays.folds))
        if moment.label == "step":  # the step gives back the trainable chunks' kept copies
            replay.clean &= set(frozen)
        else:
            replay.release_finished(host_updated)
        used = set(movable[index])
        replay.used(used)
        for chunk in movable[index] if moment.label != "step" else ():
            if chunk not in resident:
                replay.make_room(replay.incoming(chunk), used)
                replay.bring(chunk)
        if moment.label == "step":  # Adam in chunk order, each chunk where its states live
            for chunk in sorted(used | host_updated):
                if chunk in host_updated:
                    if chunk in resident:
                        replay.evict(chunk)
                elif chunk not in resident:
                    replay.make_room(sizes[chunk], {chunk})
                    replay.bring(chunk)
        else:
            replay.gather_ahead(used)
            replay.make_room(0, used)
            replay.prefetch(used, distance)
            replay.clean.difference_update(moment.written)  # its gradients went into those payloads
        if accumulators:  # during the moment, after its hook (see [Note: gradient accumulation] in groups/grads.py)
            replay.late = True
            for chunk in sorted(moment.acc_born & accumulating):
                replay.grow(chunk, used)
            for chunk in sorted(moment.acc_gone):
                replay.shrink(chunk)
            replay.late = False
    return MovePlan(
        replay.to_device,
        replay.to_host,
        replay.demand,
        replay.ahead,
        replay.acc_to_device if accumulators else None,
        replay.acc_to_host if accumulators else None,
        replay.over_budget,
    )


def steady_moves(
    trace: Trace,
    budget: int,
    costs: ChunkCosts,
    fixed: int,
    resident: AbstractSet[int],
    on_device: AbstractSet[int],
    distance: int = 1,
    order: EvictionOrder = EvictionOrder.BELADY,
) -> MovePlan:
    """The moves of a steady-state iteration of ``trace`` with the optimizer states of ``on_device`` (``fixed``
    bytes that do not move) on the accelerator, prefetching ``distance`` moments ahead, evicting in ``order``:
    the second of two replays from the chunks ``resident`` there now (see [Note: predicted moves]), or the first
    where it ends with the chunks it began with (the second would be the same)."""
    replay, host_updated = set(resident), set(costs.elements) - set(on_device)
    frozen, arrays = set(costs.sizes) - set(costs.elements), replay_arrays(trace, costs.sizes)
    for _ in range(2):
        start = set(replay)
        plan = simulate_moves(
            trace,
            budget,
            costs.sizes,
            fixed,
            replay,
            host_updated,
            costs.uncopied,
            distance,
            costs.clean_copies,
            frozen,
            order,
            costs.accumulators,
            arrays,
        )
        if replay == start:
            break
    return plan


class MovePredictor:
    """The moves of one steady-state iteration of the current trace, predicted once per trace and placement
    of the optimizer states (see [Note: predicted moves])."""

    def __init__(self, budget: int, costs: ChunkCosts) -> None:
        self._budget, self._costs = budget, costs
        self._key: tuple[int, int, frozenset[int], int, EvictionOrder] | None = None
        self.plan: MovePlan | None = None

    def update(
        self,
        trace: Trace,
        fixed: int,
        resident: set[int],
        on_device: set[int],
        distance: int = 1,
        order: EvictionOrder = EvictionOrder.BELADY,
    ) -> MovePlan:
        """The prediction for ``trace`` (:func:`steady_moves`), made again when the trace, its readings or planned
        tide, the states on the accelerator, the distance or the order change."""
        key = (id(trace), trace.revision, frozenset(on_device), distance, order)
        if self.plan is None or key != self._key:
            self._key = key
            self.plan = steady_moves(trace, self._budget, self._costs, fixed, resident, on_device, distance, order)
        return self.plan
