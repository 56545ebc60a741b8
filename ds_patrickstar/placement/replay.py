"""One iteration's residency replayed moment by moment: the planner's model of the driver (see [Note: predicted
moves] in move_model.py, which drives it)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from collections.abc import Set as AbstractSet

from .eviction_queue import EvictionOrder, EvictionQueue, accumulator_key
from .replay_arrays import ReplayArrays, replay_arrays
from .trace import Trace

ANY_PRIORITY = 1
"""Above every queue priority (minus a next use, never above 0): :meth:`EvictionQueue.take_below` below it
considers every resident chunk."""


class Replay:
    """One iteration's residency, moment by moment (see :func:`~.move_model.simulate_moves`). The resident chunks
    sit in an :class:`~ds_patrickstar.placement.eviction_queue.EvictionQueue` keyed by next use, re-keyed when used,
    as the driver's (O(log n) per change, not a sort of every resident chunk per moment)."""

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
        self.late = False  # after the moment's hook: a gradient's room (see [Note: predicted moves] in move_model.py)
        self.uncopied = uncopied
        # chunks brought keep their host buffer ([Note: clean evictions] in store/clean_copies.py)
        self.keeps_copies = False
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
        self.queue = EvictionQueue(
            self.free if order.free_first else None
        )  # see [Note: eviction order] in eviction_queue.py
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

    def gather_ahead(self, in_use: set[int]) -> None:
        """With several ranks, the chunks whose groups the moment's hook all-gathered ahead of use come, for their
        next use (``Moment.gathered_ahead``), room made as for a chunk used now."""
        for chunk in self.arrays.gathered_ahead[self.at]:
            if chunk not in self.resident:
                self.make_room(self.incoming(chunk), in_use | {chunk})
                self.bring(chunk, self.trace.next_use(chunk, self.at))

    def release_finished(self, host_updated: set[int]) -> None:
        """Chunks updated on the host whose last use this iteration was the moment before go, where their gradient
        went into their payload during backward (see [Note: gradients leave in backward] in grad_release.py)."""
        if self.at < 1:
            return
        for chunk in self.arrays.last_uses[self.at - 1]:
            if chunk in self.resident and chunk in host_updated and chunk in self.arrays.written:
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
        the moment's hook (see [Note: predicted moves] in move_model.py)."""
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
