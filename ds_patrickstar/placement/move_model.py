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
the step the chunks updated on the host leave, those whose last use this iteration is behind already at
the next moment (their gradients leave during backward, see [Note: gradients leave in backward] in
grad_release.py). It starts from the chunks on the accelerator and leaves
there those at the iteration's end, so two calls give a steady state. What it returns, bytes to the
accelerator and back per moment, is what the step-time model weighs against compute (see [Note: step-time
model] in step_time.py), and the
per-step counters ``predicted_bytes_to_device``/``_to_host`` put it beside the bytes measured. With gradient
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
for this rank's chunks under the budget less that as well. That reading is of the plan the trace ran with (another
placement of the states leaves other room for kept groups), so at several ranks the prediction is approximate: on
the twin's mirrors of the H100 sweep within 3% of the bytes each rank moved at 8 and 12 GiB, within 15% from 6 to
14 (``benchmarks/twin_pressure_ranks.py``), on the counter runs' two-rank GPT within 15%. With gradient
accumulation at several ranks a rank's accumulators are its owned chunks' (see [Note: gradient accumulation] in
groups/grads.py), from its group's first micro-step reduce-scatter, and move with their chunks as at one rank (the
reading leaves them out). At the boundary a sum comes with its group's reduce-scatter, which the driver completes
before it evicts the chunk or makes room, so an accumulator goes then, never to the host; the replay drops it so
from the moment after its chunk's last use where the trace noted such a collective for it (``Moment.acc_folding``;
none where the step writes the sums, see [Note: unmanaged gradient accumulation] in groups/grads.py). On the
twin's mirrors at GA 2 the payloads' bytes are predicted within 5% from 6 to 16 GiB.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from collections.abc import Set as AbstractSet

from .chunk_costs import ChunkCosts
from .eviction_queue import EvictionOrder, EvictionQueue, accumulator_key
from .move_plan import MovePlan
from .replay_arrays import ReplayArrays, replay_arrays
from .tracer import Trace

ANY_PRIORITY = 1
"""Above every queue priority (minus a next use, never above 0): :meth:`EvictionQueue.take_below` below it
considers every resident chunk."""


class _Replay:
    """One iteration's residency, moment by moment (see :func:`simulate_moves`). The resident chunks sit in an
    :class:`~ds_patrickstar.placement.eviction_queue.EvictionQueue` keyed by next use, re-keyed when used, as the
    driver's (O(log n) per change, not a sort of every resident chunk per moment)."""

    def __init__(
        self,
        trace: Trace,
        budget: int,
        sizes: Mapping[int, int],
        fixed: int,
        resident: set[int],
        uncopied: set[int],
        order: EvictionOrder = EvictionOrder.BELADY,
        accumulators: Mapping[int, int] | None = None,
        arrays: ReplayArrays | None = None,
    ) -> None:
        self.trace, self.budget, self.sizes, self.resident = trace, budget, sizes, resident
        self.arrays = arrays if arrays is not None else replay_arrays(trace, sizes)
        self.acc_sizes = accumulators or {}  # chunk -> its accumulator's bytes (gradient accumulation)
        self.acc: set[int] = set()  # chunks whose accumulator exists now
        self.keeps_accumulators = order.keeps_accumulators  # see [Note: accumulators kept] in eviction_queue.py
        self.orphans: set[int] = set()  # chunks whose accumulator is on the accelerator and payload away
        self.folding: set[int] = set()  # accumulators whose boundary sum is on its way (``Moment.acc_folding``)
        self.late = False  # after the moment's hook: a gradient's room (see [Note: predicted moves])
        self.uncopied = uncopied
        self.keeps_copies = False  # brought chunks keep their host buffer (see [Note: clean evictions])
        self.clean: set[int] = set()  # resident chunks whose payload is as it came
        self.held = fixed + sum(sizes[c] for c in resident)  # what the accelerator holds now, a running total
        self.to_device = [0] * len(trace)
        self.to_host = [0] * len(trace)
        self.acc_to_device = [0] * len(trace)
        self.acc_to_host = [0] * len(trace)
        self.demand = [0] * len(trace)
        self.ahead: list[list[tuple[int, int]]] = [[] for _ in range(len(trace))]
        self.at = 0
        self.over_budget = False
        self.queue = EvictionQueue(self.free if order.free_first else None)  # see [Note: eviction order]
        for chunk in resident:
            self.queue.push(chunk, -trace.next_use(chunk, -1))

    def total(self) -> int:
        return self.held

    def size(self, chunk: int, whole: bool = False) -> int:
        """What evicting resident ``chunk`` frees: its payload, and its accumulator unless that stays."""
        stays = (self.keeps_accumulators and not whole) or chunk not in self.acc
        return self.sizes[chunk] + (0 if stays else self.acc_sizes[chunk])

    def incoming(self, chunk: int) -> int:
        """What bringing ``chunk`` copies to the accelerator: its payload, and its accumulator where that is away."""
        away = chunk in self.acc and chunk not in self.orphans
        return self.sizes[chunk] + (self.acc_sizes[chunk] if away else 0)

    def free(self, chunk: int) -> bool:
        """Whether evicting ``chunk`` now copies nothing (an accumulator that would go with it copies)."""
        payload = chunk in self.clean or chunk in self.uncopied
        return payload and (self.keeps_accumulators or chunk not in self.acc)

    def headroom(self, moment: int, span: int = 1) -> int:
        """The budget less the tide planned from ``moment`` over ``span`` moments and the one after, and the
        memory beside model data now, the tide and the stranded pieces as read at the moment being replayed when
        it was traced (the planner's :func:`~.planner.headroom`)."""
        now = (self.arrays.read_late if self.late else self.arrays.read)[self.at]
        return (
            self.budget
            - self.arrays.beside[self.at]
            - max(self.arrays.tide_ahead(span + 1)[moment % len(self.trace)], now)
        )

    def used(self, chunks: set[int]) -> None:
        """The moment used ``chunks``: their next uses move on."""
        for chunk in chunks & self.resident:
            self.queue.push(chunk, -self.trace.next_use(chunk, self.at))

    def bring(self, chunk: int, target: int | None = None) -> None:
        """``chunk`` to the accelerator for ``target`` (None: for this moment, on demand)."""
        self.resident.add(chunk)
        if self.keeps_copies:
            self.clean.add(chunk)
        self.queue.push(chunk, -self.trace.next_use(chunk, self.at))
        nbytes = self.incoming(chunk)
        self._rejoin(chunk)  # an accumulator that stayed is the chunk's again
        self.held += nbytes
        self.to_device[self.at] += self.sizes[chunk]
        self.acc_to_device[self.at] += nbytes - self.sizes[chunk]
        if target is None:
            self.demand[self.at] += nbytes
        else:
            self.ahead[self.at].append((target, nbytes))

    def evict(self, chunk: int, whole: bool = False) -> None:
        """A queue entry goes: a resident chunk's payload (with its accumulator unless that stays; ``whole``: with
        it) or, for :func:`accumulator_key`, an accumulator whose payload is away."""
        if chunk < 0:
            chunk = accumulator_key(chunk)
            self._rejoin(chunk)
            self.held -= self.acc_sizes[chunk]
            self.acc_to_host[self.at] += self.acc_sizes[chunk]
            return
        if chunk in self.folding:  # waiting for the chunk's collective folds its accumulator first
            self.shrink(chunk)
        self.resident.discard(chunk)
        self.queue.drop(chunk)
        freed = self.size(chunk, whole)
        self.held -= freed
        self.acc_to_host[self.at] += freed - self.sizes[chunk]
        if chunk in self.acc and self.keeps_accumulators and not whole:
            self.orphans.add(chunk)
            self.queue.push(accumulator_key(chunk), -self.trace.next_use(chunk, self.at))
        if chunk in self.clean:
            self.clean.discard(chunk)
        elif chunk not in self.uncopied:
            self.to_host[self.at] += self.sizes[chunk]

    def release_finished(self, host_updated: set[int]) -> None:
        """Chunks updated on the host whose last use this iteration was the moment before go (see
        [Note: gradients leave in backward] in grad_release.py)."""
        if self.at < 1:
            return
        for chunk in self.arrays.last_uses[self.at - 1]:
            if chunk in self.resident and chunk in host_updated:
                self.evict(chunk)

    def _rejoin(self, chunk: int) -> None:
        """``chunk``'s accumulator is no longer one that stayed while its payload was away: it went, or the payload
        came back."""
        if chunk in self.orphans:
            self.orphans.discard(chunk)
            self.queue.drop(accumulator_key(chunk))

    def _size_unless(self, keep: AbstractSet[int], whole: bool = False) -> Callable[[int], int | None]:
        def size(key: int) -> int | None:
            if key < 0:
                return None if accumulator_key(key) in keep else self.acc_sizes[accumulator_key(key)]
            return None if key in keep else self.size(key, whole)

        return size

    def grow(self, chunk: int, in_use: set[int]) -> None:
        """``chunk``'s first gradient this iteration: its accumulator comes into being beside it, room made after
        the moment's hook (see [Note: predicted moves])."""
        if chunk not in self.resident:
            self.make_room(self.sizes[chunk], in_use | {chunk})
            self.bring(chunk)
        self.make_room(self.acc_sizes[chunk], in_use | {chunk})
        self.acc.add(chunk)
        self.held += self.acc_sizes[chunk]

    def shrink(self, chunk: int) -> None:
        """The boundary put ``chunk``'s sum into its slot: its accumulator goes, wherever it is."""
        self.folding.discard(chunk)
        if chunk in self.acc:
            self.acc.discard(chunk)
            if chunk in self.orphans or chunk in self.resident:
                self.held -= self.acc_sizes[chunk]
            self._rejoin(chunk)

    def make_room(self, need: int, keep: set[int]) -> None:
        """Farthest next use first, until ``need`` more bytes fit (or nothing else can go)."""
        over = self.total() + need - self.headroom(self.at)
        if over > 0 and self.folding:  # the driver completes the reduce-scatters in flight first
            for chunk in sorted(self.folding):
                self.shrink(chunk)
            over = self.total() + need - self.headroom(self.at)
        if over <= 0:
            return
        victims, whole = self.queue.take_below(over, self._size_unless(keep), ANY_PRIORITY), False
        if victims is None and self.keeps_accumulators:  # the payloads take their accumulators along after all
            victims, whole = self.queue.take_below(over, self._size_unless(keep, True), ANY_PRIORITY), True
        if victims is None:  # the model goes over the budget here: every chunk (and accumulator) that can go goes
            orphans = [accumulator_key(c) for c in sorted(self.orphans - keep)]
            victims, self.over_budget = sorted(self.resident - keep) + orphans, True
        for victim in victims:
            self.evict(victim, whole)

    def prefetch(self, in_use: set[int], distance: int) -> None:
        """The next ``distance`` moments' chunks ahead, nearest first, where they fit up to their moment after
        evicting chunks used only after it; none of a farther moment after one whose chunks did not all fit."""
        keep = set(in_use)
        for target in range(self.at + 1, min(self.at + distance, len(self.trace) - 1) + 1):
            keep.update(self.trace.moments[target].chunks)
            room, complete = None, True
            for chunk in self.arrays.movable[target]:
                if chunk in self.resident:
                    continue
                if room is None:
                    room = self.headroom(self.at + 1, target - self.at)
                short = self.total() + self.incoming(chunk) - room
                if short > 0:
                    chosen = self.queue.take_below(short, self._size_unless(keep), -target)
                    if chosen is None:
                        complete = False
                        continue
                    for victim in chosen:
                        self.evict(victim)
                self.bring(chunk, target)
            if not complete:
                return


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
    replay = _Replay(trace, budget, sizes, fixed, resident, set(uncopied), order, accumulators, arrays)
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
