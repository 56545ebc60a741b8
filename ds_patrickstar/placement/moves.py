"""The moves placement makes at a moment: room by Belady evictions, a chunk brought or evicted, the next
moment's chunks prefetched, a chunk placed for its Adam update; see [Note: placement].

:class:`ChunkMoves` carries out the planner's answers (see [Note: placement planner]) through the chunk
store, under the budget beside the tide; the runtime (``runtime.py``) says which moment it is and where
it stands in the trace (:attr:`ChunkMoves.at`).

[Note: states give way]
The planner places optimizer states on the accelerator from the traced tide. A later iteration's tide can
stand higher at some moment than the trace said (a longer batch, the allocator's stranded pieces, a step
other than the traced one): the chunks a moment needs may then not fit beside it even after every
evictable chunk went. Refusing there (``DeviceBudgetExceeded``) would stop a run that only needs the states
elsewhere: they are read at the step alone. So where :meth:`ChunkMoves.make_room` cannot find victims for
the whole shortfall, and the activations "auto" keeps did not make the room (see [Note: activations give way]
in activations/give_way.py: :attr:`ChunkMoves.activations`, asked first), it asks
:attr:`ChunkMoves.room_from_states` (the run's
:meth:`OptimizerStates.give_room <ds_patrickstar.optim.states.OptimizerStates.give_room>`, wired at
assembly) to move states to the host until the shortfall is freed, and tries again; those chunks are updated
on the host at the step, and the tide measured above the plan re-plans the states there (see
:func:`~ds_patrickstar.placement.step_plan.raise_tide`). Only when no state is left on the accelerator, and the chunks
do not fit beside the memory reserved now either (see [Note: a forecast set aside] in last_resort.py), does the
error stand, with its remedies. Counter: ``states_gave_way`` (the times states made room so).

[Note: one reading per hook]
The tide and the stranded pieces come from the caching allocator's statistics, and each read of them is a
``torch.cuda.memory_stats_as_nested_dict`` call (some 20 us of host time: an H200 profile of gpt-1.3b at 12 GiB
counted about 1,300 a step, 25-30 ms). Inside one moment's hook (from ``begin_moment`` to the end of
``end_moment``: the chunks brought, room made, the budget checked, the next moments prefetched) nothing but
placement allocates on the accelerator, and placement's own allocations and frees move the allocator's
bytes and the ledger's alike, so the tide (allocated bytes less the ledger's) does not change there: it is read
at the hook's first need and kept until the hook ends. The stranded pieces read then can differ from the
allocator's by what the hook's own frees and allocations do to partly used blocks (a payload freed inside a
block still in use leaves a piece the next payload of the same size fits). The step moment and everything
outside the hooks read every time; a release of the allocator's cache reads again. The tide and the stranded
pieces come from one call (:meth:`~ds_patrickstar.memory.accelerator.Accelerator.memory_reading`): an H200
profile of gpt-1.3b counted two calls per moment (594 a step, 12-17 ms of host time) when each had its own.

[Note: stranded bytes released]
Before states give way, and before any budget error, the allocator gives back what it caches
(:meth:`~ds_patrickstar.memory.accelerator.Accelerator.release_cached`, ``torch.cuda.empty_cache``) and
the stranded pieces are read again (see [Note: stranded allocator bytes] in memory/cuda.py): where that
returned some (PyTorch's ``expandable_segments`` allocator unmaps the free pages inside partly used
segments; the default allocator returns only whole free segments, which are not counted as stranded), the
room is tried again. Counter ``stranded_bytes_released``; an error that still stands names the stranded
bytes among its remedies.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from ..chunks.chunk import Chunk
from ..counters import StepCounters
from ..memory.ledger import DeviceBudgetExceeded
from ..memory.reductions import InFlightReductions
from ..run_state import RunState
from ..store.chunk_store import ChunkStore
from .eviction_queue import accumulator_key
from .interface import ActivationPolicy
from .last_resort import beside_now, offload_state, refusal, room_elsewhere
from .policy import Placer
from .remedies import Shortfall, budget_remedies
from .trace import Trace
from .tracer import MemoryTracer

logger = logging.getLogger(__name__)


class ChunkMoves:
    """Room, bring, evict and prefetch at the current moment; see the module docstring."""

    def __init__(
        self,
        placer: Placer,
        tracer: MemoryTracer,
        store: ChunkStore,
        counters: StepCounters,
        chunks: list[Chunk],
        reductions: InFlightReductions,
        run: RunState,
    ) -> None:
        self.placer, self.tracer, self.store, self.counters = placer, tracer, store, counters
        self.ledger, self.chunks, self.reductions, self.run = store.accel.ledger, chunks, reductions, run
        self.moment = -1  # the current moment (recorded), for the errors
        self.at = -1  # the trace position the current moment is placed at (-1: none)
        self.stranded_peak = 0  # the most stranded allocator bytes at a recorded moment this iteration
        # bytes asked -> bytes freed by moving optimizer states to the host (see [Note: states give way])
        self.room_from_states: Callable[[int], int] | None = None
        self.activations: ActivationPolicy | None = None  # when on (see [Note: activations give way])
        self.chunk_size = 0  # zero_optimization.chunk_size: a larger chunk holds one larger tensor (the remedies)
        self._hook = False  # inside a moment's hook (see [Note: one reading per hook])
        self._reading: tuple[int, int] | None = None  # (tide, stranded bytes) read in this hook

    def _evictable(self, keep: set[int], whole: bool = False) -> Callable[[int], int | None]:
        return evictable_sizes(self.chunks, keep, self.placer.order.keeps_accumulators and not whole)

    def evicts_free(self, chunk_id: int) -> bool:
        """Whether evicting the chunk now copies nothing (see [Note: eviction order] in eviction_queue.py): its payload
        goes without a copy, and its accumulator stays or there is none."""
        chunk = self.chunks[chunk_id]
        payload = chunk.on_disk or self.store.copies.unchanged(chunk)
        return payload and (self.placer.order.keeps_accumulators or chunk.acc is None)

    def to_device(self, chunk: Chunk) -> None:
        self.store.to_device(chunk)
        self.placer.arrived(chunk.chunk_id, chunk.nbytes)

    def evict(self, chunk: Chunk) -> None:
        """``chunk`` to the host with its accumulator (an asynchronous copy; see [Note: chunk locations])."""
        if not chunk.on_host:
            self.store.to_host(chunk)
            self.placer.left(chunk.chunk_id, chunk.nbytes)
        elif chunk.acc is not None:  # its accumulator stayed (see [Note: accumulators kept] in eviction_queue.py)
            self.store.accumulator_to_host(chunk)
            self.placer.accumulator_left(chunk.chunk_id)

    def _evict_victim(self, key: int, whole: bool) -> None:
        """A queue entry goes: an accumulator whose payload is away (a negative key), or a resident chunk's
        payload, with its accumulator unless the order keeps accumulators (``whole``: with it)."""
        if key < 0:
            self.evict(self.chunks[accumulator_key(key)])
            return
        chunk = self.chunks[key]
        stays = self.placer.order.keeps_accumulators and not whole and chunk.acc is not None
        self.store.to_host(chunk, keep_accumulator=stays)
        self.placer.left(key, chunk.nbytes, accumulator_stays=stays)

    def _headroom(self, trace: Trace | None, moment: int, span: int = 1) -> int:
        """Bytes model data may take from ``moment`` over ``span`` moments: the budget less the higher of the
        tide ahead and the memory reserved now (the tide now and the stranded pieces): see [Note: stranded
        allocator bytes]."""
        self.non_model()
        return self.placer.headroom(trace, moment, self.ledger.non_model, span)

    def non_model(self) -> int:
        """The tide now; the ledger's charges must fit beside it and the allocator's stranded pieces
        (reserved memory in use now, see [Note: stranded allocator bytes]); read once per moment's hook
        (see [Note: one reading per hook])."""
        if self._reading is not None:
            non_model, stranded = self._reading
        else:
            non_model, stranded = self.tracer.reading(self.ledger)
            if self.run.records():
                self.stranded_peak = max(self.stranded_peak, stranded)
                self.tracer.note_read(non_model + stranded, late=not self._hook)  # see [Note: predicted moves]
            if self._hook:
                self._reading = (non_model, stranded)
        self.ledger.non_model = non_model + stranded
        return non_model

    def read_again(self) -> None:
        """The tide moved inside a hook (activations gave way): the next need reads the allocator again."""
        self._reading = None

    def hook_begins(self) -> None:
        """A moment's hook begins: the allocator is read once until :meth:`hook_ends` (see [Note: one reading
        per hook])."""
        self._hook, self._reading = True, None

    def hook_ends(self) -> None:
        self._hook, self._reading = False, None

    def plan_trace(self) -> Trace | None:
        """The trace the current moment is placed from (None while tracing or off the trace)."""
        trace = self.tracer.current_trace()
        return trace if self.run.records() or self.at >= 0 else None

    def make_room(self, need: int, keep: set[int]) -> None:
        """Evict until ``need`` more bytes of model data fit beside the tide. Evictions whose copies
        are still in flight count as occupied until they complete (see [Note: deferred frees]):
        new victims are chosen only for what those will not free, then the oldest are waited on."""
        accel = self.store.accel
        accel.reclaim()
        trace = self.plan_trace()
        headroom = self._headroom(trace, self.at)
        over = self.ledger.total + need - headroom
        if over <= 0:
            return
        if self.reductions.drain():  # reduce-scatters in flight hold gradient buffers: done first
            accel.reclaim()
            over = self.ledger.total + need - headroom
            if over <= 0:
                return
        short = over - accel.in_flight_bytes()
        if short > 0:
            try:
                self.evict_all(*self.victims(short, keep))
            except DeviceBudgetExceeded as err:
                if room_elsewhere(self, short):
                    self.make_room(need, keep)
                    return
                if beside_now(self, need, keep):  # see [Note: a forecast set aside] in last_resort.py
                    return
                raise refusal(self, need, keep, self.placer.budget - headroom, err) from None
        accel.reclaim(need_below=headroom - need)

    def recomputes(self) -> bool:
        """Whether this iteration, or the trace, recomputes checkpointed blocks (for the remedies)."""
        trace = self.tracer.current_trace()
        return self.counters.recompute_moments > 0 or (trace is not None and bool(trace.recomputations()))

    def release_stranded(self) -> bool:
        """Whether giving back what the allocator caches freed stranded pieces (see [Note: stranded bytes
        released])."""
        accel = self.store.accel
        before = accel.fragmentation()
        if before <= 0:
            return False
        accel.release_cached()
        self.read_again()
        released = before - accel.fragmentation()
        if released > 0:
            self.counters.stranded_bytes_released += released
            logger.info(
                "ds_patrickstar: %d B of stranded allocator pieces released at moment %d", released, self.moment
            )
        return released > 0

    def check_budget(self) -> int:
        """The tide now, after checking that the chunks on the accelerator fit beside it and the stranded pieces
        (released first where that helps, see [Note: stranded bytes released]); raises with the remedies."""
        non_model = self.non_model()
        over = self.ledger.total + self.ledger.non_model - self.placer.budget
        if over > 0 and self.release_stranded():
            non_model = self.non_model()
            over = self.ledger.total + self.ledger.non_model - self.placer.budget
        if over > 0:
            model, stranded = self.ledger.total, self.ledger.non_model - non_model
            offload = offload_state(self.activations)
            at = Shortfall(over, self.placer.budget, non_model, model, 0, stranded, *offload, self.recomputes())
            remedies = budget_remedies(at)
            raise DeviceBudgetExceeded(
                f"model data {model:,} B + non-model {non_model:,} B + stranded allocator pieces {stranded:,} B "
                f"exceed the accelerator budget of {self.placer.budget:,} B at moment {self.moment}. {remedies}"
            )
        return non_model

    def victims(self, need: int, keep: set[int]) -> tuple[list[int], bool]:
        """Queue entries to evict for ``need`` bytes and whether their payloads take their accumulators along: in
        an order that keeps accumulators, only where payloads and accumulators alone cannot make the room (see
        [Note: accumulators kept] in eviction_queue.py)."""
        try:
            return self.placer.victims(need, self._evictable(keep)), False
        except DeviceBudgetExceeded:
            if not self.placer.order.keeps_accumulators:
                raise
            return self.placer.victims(need, self._evictable(keep, whole=True)), True

    def evict_all(self, victims: list[int], whole: bool = False) -> None:
        for victim in victims:
            self._evict_victim(victim, whole)
            self.counters.evictions += 1

    def bring(self, chunk: Chunk, keep: set[int]) -> None:
        """``chunk`` on the accelerator (room made for it), its copy waited on."""
        if chunk.on_host:
            self.make_room(incoming(chunk), keep | {chunk.chunk_id})
            self.to_device(chunk)
        chunk.wait_pending()

    def _room_for_prefetch(self, nbytes: int, trace: Trace | None, keep: set[int], target: int) -> bool:
        """Whether ``nbytes`` fit at every moment up to ``target`` (the moment they are for), after evicting
        chunks used only after it (see [Note: placement]); nothing is evicted when that would not be enough."""
        headroom = self._headroom(trace, self.at + 1, target - self.at)
        if self.ledger.total + nbytes <= headroom:
            return True
        accel = self.store.accel
        short = self.ledger.total + nbytes - headroom - accel.in_flight_bytes()
        victims = self.placer.victims_used_after(short, self._evictable(keep), target) if short > 0 else []
        if victims is None:
            return False
        self.evict_all(victims)
        accel.reclaim(need_below=headroom - nbytes)
        return True

    def movable_room(self) -> int:
        """The budget less what no moment can move: the optimizer states on the accelerator and the
        allocator's stranded pieces as they are now (a margin for plans: :meth:`make_room` counts them
        only where the tide is lower, see [Note: stranded allocator bytes] in memory/cuda.py); no
        reserve beyond it."""
        return self.placer.budget - self.ledger.by_kind.get("optim", 0) - self.store.accel.fragmentation()

    def after_use(self, chunk: Chunk) -> None:
        if self.placer.release_after_use(chunk.chunk_id) and chunk.movable:
            self.evict(chunk)

    def place_for_update(self, chunk: Chunk, on_device: bool) -> None:
        """Hybrid Adam updates ``chunk`` where its states live (see [Note: optimizer-state placement])."""
        if on_device:
            self.bring(chunk, {chunk.chunk_id})
            self.counters.adam_chunks_device += 1
        else:
            self.evict(chunk)
            self.counters.adam_chunks_host += 1

    def prefetch(self, ahead: tuple[tuple[int, tuple[int, ...]], ...], trace: Trace | None, in_use: set[int]) -> None:
        """Bring the chunks of ``ahead`` (per target moment, nearest first) that are away and fit up to their
        moment; after a moment whose chunks did not all fit, no farther one's (they would take the room its
        chunks need on demand; see [Note: prefetch distance] in state_choice.py)."""
        keep = set(in_use)
        for target, chunk_ids in ahead:
            keep.update(chunk_ids)
            complete = True
            for chunk_id in chunk_ids:
                chunk = self.chunks[chunk_id]
                if not chunk.on_host:
                    continue
                if not self._room_for_prefetch(incoming(chunk), trace, keep, target):
                    complete = False
                    continue
                self.to_device(chunk)
                self.counters.prefetches += 1
                self.counters.prefetches_beyond_next += int(target > self.at + 1)
                chunk.prefetched = True
            if not complete:
                return


def unmoved_bytes(moves: ChunkMoves) -> int:
    """The model data on the accelerator that placement does not move now: with several ranks the gathered groups'
    storage and the gradient and collective buffers (see [Note: predicted moves] in move_model.py): O(1), from
    running totals (the resident chunks' payloads, and the accumulators on the accelerator, which the replay moves
    with their chunks)."""
    kinds, in_flight = moves.ledger.by_kind, moves.store.accel.in_flight_bytes()
    placed = kinds.get("optim", 0) + kinds.get("grad_acc", 0) + moves.placer.resident_bytes
    return max(moves.ledger.total - placed - in_flight, 0)


def incoming(chunk: Chunk) -> int:
    """What bringing the chunk copies to the accelerator: its payload, and its accumulator unless that stayed (see
    [Note: accumulators kept] in eviction_queue.py)."""
    return chunk.nbytes + (chunk.acc_nbytes if chunk.acc_host is not None else 0)


def evictable_sizes(chunks: list[Chunk], keep: set[int], keeps_accumulators: bool) -> Callable[[int], int | None]:
    """What evicting a queue entry frees (None: it cannot go now): a resident chunk's payload, with its accumulator
    unless ``keeps_accumulators``, or an accumulator whose payload is away (see [Note: accumulators kept])."""

    def size(key: int) -> int | None:
        if key < 0:
            chunk = chunks[accumulator_key(key)]
            return None if chunk.chunk_id in keep else chunk.acc_nbytes
        chunk = chunks[key]
        if key in keep or not chunk.movable:
            return None
        return chunk.nbytes + (0 if keeps_accumulators else chunk.acc_nbytes)

    return size
