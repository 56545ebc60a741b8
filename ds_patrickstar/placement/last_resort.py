"""Where evictions cannot make a moment's room: room elsewhere (the stranded pieces released, activations and
optimizer states giving way), the tide planned ahead set aside where the chunks fit beside what stands, and only
then the refusal, with its remedies.

[Note: a forecast set aside]
A moment's headroom (:meth:`ChunkMoves.make_room <.moves.ChunkMoves.make_room>`) is the budget less the higher of
the tide the plan expects over the moment and the one after (what the moment's compute allocates: its outputs, in
backward the activations of the next block brought back ahead) and the memory reserved now. The planned tide is a
forecast, and with micro-batches of other lengths a high one: the most any micro-step of the traced iteration
stood at that place (see [Note: a risen tide] in activations/plan.py), where the micro-step running may be
shorter. Where no eviction, released piece, activation or optimizer state makes room for the forecast, but the
moment's chunks fit beside the memory reserved now (evicting for that alone where needed), the moment goes on
instead of refusing on a forecast: the next moment's hook reads the tide that did stand and makes room for it the
same way (a block brought back ahead of its backward gives way then, see [Note: activations give way] in
activations/give_way.py), and the hook's end checks the budget against what stands
(:meth:`~.moves.ChunkMoves.check_budget`). A refusal stands only where the chunks do not fit beside the memory
reserved now either. Counter ``planned_tide_set_aside``, and a log line. What the moment's compute allocates
then is bounded by the device, not by the budget: where the budget is the whole device and the forecast was
right, the allocator's out-of-memory error stands where the refusal would have (not seen on a GPU yet).

On the twin's GPT with gradient accumulation over two micro-batches of other lengths (``chunk_size`` 2048, 575 KB
and 550 KB), "auto" stopped at the end of a forward whose blocks were all on the host already, the tide planned
for the start of backward being a longer micro-batch's (526 KB where 459 KB came), while offloading every block
trained; it now trains bit for bit with the resident run (``tests/test_dynamic_shapes.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

from ..chunks.chunk import Chunk
from ..counters import StepCounters
from ..memory.ledger import DeviceBudgetExceeded, DeviceLedger
from ..store.chunk_store import ChunkStore
from .interface import ActivationPolicy
from .policy import Placer
from .remedies import Shortfall, budget_remedies

logger = logging.getLogger(__name__)


class ChunkMoves(Protocol):
    """What the last resorts use of :class:`~.moves.ChunkMoves`."""

    placer: Placer
    store: ChunkStore
    ledger: DeviceLedger
    counters: StepCounters
    chunks: list[Chunk]
    chunk_size: int
    moment: int
    activations: ActivationPolicy | None
    room_from_states: Callable[[int], int] | None

    def release_stranded(self) -> bool: ...
    def read_again(self) -> None: ...
    def non_model(self) -> int: ...
    def victims(self, need: int, keep: set[int]) -> tuple[list[int], bool]: ...
    def evict_all(self, victims: list[int], whole: bool = False) -> None: ...
    def recomputes(self) -> bool: ...


def room_elsewhere(moves: ChunkMoves, short: int) -> bool:
    """Whether the stranded pieces released, kept activations sent away or optimizer states moved to the host made
    room (the first that did), where evictions could not make ``short`` bytes."""
    if moves.release_stranded():  # see [Note: stranded bytes released] in moves.py
        return True
    if moves.activations is not None and moves.activations.give_room(short) > 0:
        moves.read_again()  # the tide fell (see [Note: activations give way] in activations/give_way.py)
        return True
    if moves.room_from_states is not None and moves.room_from_states(short) > 0:
        moves.counters.states_gave_way += 1  # see [Note: states give way] in moves.py
        return True
    return False


def beside_now(moves: ChunkMoves, need: int, keep: set[int]) -> bool:
    """Whether ``need`` more bytes fit beside the memory reserved now, chunks evicted for that alone where needed;
    then the forecast is set aside (see [Note: a forecast set aside])."""
    moves.read_again()
    moves.non_model()
    accel, budget = moves.store.accel, moves.placer.budget
    over = moves.ledger.total + need + moves.ledger.non_model - budget - accel.in_flight_bytes()
    if over > 0:
        try:
            victims, whole = moves.victims(over, keep)
        except DeviceBudgetExceeded:
            return False
        moves.evict_all(victims, whole)
    accel.reclaim(need_below=budget - moves.ledger.non_model - need)
    moves.counters.planned_tide_set_aside += 1
    logger.info(
        "ds_patrickstar: the tide planned after moment %d leaves no room for its chunks; they fit beside the "
        "%d B that stand now: going on (see [Note: a forecast set aside])",
        moves.moment,
        moves.ledger.non_model,
    )
    return True


def refusal(moves: ChunkMoves, need: int, keep: set[int], non_model: int, err: Exception) -> DeviceBudgetExceeded:
    """The error when ``need`` more bytes for the chunks ``keep`` cannot fit beside ``non_model`` bytes, with the
    remedies (see ``remedies.py``)."""
    budget, total = moves.placer.budget, moves.ledger.total
    held, accumulators = in_use(moves.chunks, keep)
    larger = [c for c in moves.chunks if c.capacity > moves.chunk_size > 0 and (c.chunk_id in keep or not c.movable)]
    stranded = moves.store.accel.fragmentation()
    at = Shortfall(
        total + need + non_model - budget,
        budget,
        non_model,
        held + need,
        accumulators,
        stranded,
        *offload_state(moves.activations),
        moves.recomputes(),
        sum(chunk.nbytes + chunk.acc_nbytes for chunk in larger),  # on the accelerator or to come
    )
    return DeviceBudgetExceeded(
        f"the accelerator budget of {budget:,} B cannot hold the chunks needed at moment {moves.moment}: the backend "
        f"holds {total:,} B and needs {need:,} B more, next to {non_model:,} B of non-model memory ({err}; needed "
        f"now: {sorted(keep)}). {budget_remedies(at)}"
    )


def in_use(chunks: list[Chunk], keep: set[int]) -> tuple[int, int]:
    """What the chunks that cannot move now (needed now, or in use) take on the accelerator, and of that their
    gradient accumulators."""
    fixed = [chunk for chunk in chunks if chunk.chunk_id in keep or not chunk.movable]
    return sum(on_device(chunk) for chunk in fixed), sum(chunk.acc_nbytes for chunk in fixed if chunk.acc is not None)


def on_device(chunk: Chunk) -> int:
    """What the chunk takes on the accelerator now: its payload where there, and its accumulator where there."""
    return (0 if chunk.on_host else chunk.nbytes) + (chunk.acc_nbytes if chunk.acc is not None else 0)


def offload_state(activations: ActivationPolicy | None) -> tuple[bool, bool]:
    """For the remedies: whether activation offload is on, and whether "auto" keeps some blocks' activations."""
    return activations is not None, activations is not None and activations.keeps_blocks()
