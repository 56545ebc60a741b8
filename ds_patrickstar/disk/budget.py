"""How much of the model data the disk tier takes off host memory, from the chunk plan alone.

[Note: disk tier plan]
With the disk tier, the owned chunks' optimizer states fill what ``host_budget`` leaves after the
rest of the model data (low-precision chunks, accumulators) in chunk order; the states of the
remaining chunks are *spilled*: 12 bytes per element on disk (see [Note: swap pieces]), none in
RAM, and they pass through the tier's host buffers (``buffer_count`` step buffers and a one-piece
cache, each one piece of the largest spilled chunk: :func:`disk_buffer_bytes`), which count
against the budget only when something spills. :func:`spilled_chunks` keeps the most chunks in
RAM for which the states kept, the rest of the model data and the buffers the spilled chunks
need fit the budget. Frozen chunks on disk (see [Note: frozen chunks on disk]) take record-sized host
buffers (:func:`frozen_host_slots`, :func:`frozen_pool_bytes`): the read buffers, each the size of the
second largest record on disk, and one more of the largest where it is larger (an embedding's chunk
is larger than the rest: only its reads use it), and the staging buffers (outside training, each the
largest) or, where the host is the accelerator, the chunks brought from disk in a step (kept and in
use, at most one of them the largest); they count against the budget whenever a frozen chunk is on
disk. The run then
fits when model data less the spilled states plus the buffers is at most budget + available host
memory, and the swap folder has room for the spilled records (checked at initialize, naming the
folder and the numbers); a run whose RAM share exceeds the budget even so is warned at initialize.
"""

from __future__ import annotations

from ..memory.preflight import OPTIM_BYTES_PER_ELEMENT
from .io import align_up
from .swap_layout import piece_buffer_bytes
from .swap_layout import record_bytes as record_bytes  # re-exported: the planner and the tier use it from here

MIN_DISK_BUFFERS = 3  # read-ahead, compute, write-behind


def disk_buffer_bytes(capacities: list[int], buffer_count: int, piece: int) -> int:
    """Host bytes of the disk tier's buffers for spilled chunks of ``capacities``: ``buffer_count``
    step buffers and the one-piece cache, each one piece (none when nothing spills)."""
    if not capacities:
        return 0
    return (max(buffer_count, MIN_DISK_BUFFERS) + 1) * piece_buffer_bytes(capacities, piece)


def spilled_chunks(
    owned: dict[int, int], other_bytes: int, host_budget: int, buffer_count: int, piece: int
) -> set[int]:
    """The owned chunks (id -> capacity) whose states go to disk: the fewest last ones in chunk
    order for which the rest fits ``host_budget``; see [Note: disk tier plan]."""
    ids = sorted(owned)
    kept = OPTIM_BYTES_PER_ELEMENT * sum(owned.values())
    for keep in range(len(ids), -1, -1):  # keep the first ``keep`` chunks' states in RAM
        rest = [owned[i] for i in ids[keep:]]
        if keep < len(ids):
            kept -= OPTIM_BYTES_PER_ELEMENT * owned[ids[keep]]
        if other_bytes + kept + disk_buffer_bytes(rest, buffer_count, piece) <= host_budget:
            return set(ids[keep:])
    return set(ids)


FROZEN_STAGING_CHUNKS = 2
"""Staging buffers of the frozen chunks on disk (their reads and writes outside training), each one record."""
FROZEN_IN_USE_CHUNKS = 2
"""Frozen chunks brought from disk that a module uses at once (a weight may straddle two chunks)."""


def frozen_host_slots(buffer_count: int, host_accelerator: bool) -> int:
    """Record-sized host buffers the frozen chunks on disk take at once (see [Note: disk tier plan]): the
    ``buffer_count`` read buffers, and the staging buffers (outside training) or, where the host is the
    accelerator, the chunks brought from disk in a step (the ``buffer_count`` kept after use and those
    in use), whichever is more."""
    brought = buffer_count + FROZEN_IN_USE_CHUNKS if host_accelerator else 0
    return buffer_count + max(FROZEN_STAGING_CHUNKS, brought)


def frozen_pool_bytes(sizes: list[int], slots: int, reads: int) -> int:
    """Host bytes of the ``slots`` buffers (:func:`frozen_host_slots`, ``reads`` of them read buffers) for frozen
    chunks of ``sizes`` bytes on disk (none when none is): the read buffers each the second largest record, one
    more of the largest where it is larger, and the others each the largest (staging) or, chunks brought from
    disk, at most one the largest (see [Note: disk tier plan])."""
    if not sizes:
        return 0
    ordered = sorted((align_up(size) for size in sizes), reverse=True)
    first, second = ordered[0], ordered[min(1, len(ordered) - 1)]
    others = slots - reads
    others = max(min(others, FROZEN_STAGING_CHUNKS) * first, first + (others - 1) * second) if others else 0
    return reads * second + (first if first > second else 0) + others


def disk_plan(
    states: dict[int, int],
    frozen: dict[int, int],
    other_bytes: int,
    host_budget: int,
    buffers: tuple[int, int, int, int],
    frozen_first: bool,
) -> tuple[set[int], set[int]]:
    """The owned chunks whose states go to disk (``states``: id -> capacity) and the owned frozen
    chunks that go to disk (``frozen``: id -> payload bytes; ``other_bytes`` counts them in RAM);
    ``buffers``: ``(buffer_count, piece, frozen host slots, frozen read buffers)``. See [Note: disk tier plan]."""
    count, piece, frozen_slots, frozen_reads = buffers
    ids = sorted(frozen)
    all_states = OPTIM_BYTES_PER_ELEMENT * sum(states.values())
    # the bytes and the two largest records of the last ``k`` frozen chunks, for every ``k`` (one pass)
    tail_bytes, tail_largest = [0], [[0, 0]]
    for cid in reversed(ids):
        tail_bytes.append(tail_bytes[-1] + frozen[cid])
        tail_largest.append(sorted([*tail_largest[-1], frozen[cid]])[1:])

    def ram(k: int) -> int:  # what stays in RAM with the last ``k`` frozen chunks on disk
        largest = tail_largest[k][-min(k, 2) :]
        return other_bytes - tail_bytes[k] + (frozen_pool_bytes(largest, frozen_slots, frozen_reads) if k else 0)

    def tail(k: int) -> set[int]:  # the last ``k`` frozen chunks
        return set(ids[len(ids) - k :]) if k else set()

    if frozen_first:
        for k in range(len(ids) + 1):
            if ram(k) + all_states <= host_budget:
                return set(), tail(k)
        return spilled_chunks(states, ram(len(ids)), host_budget, count, piece), set(ids)
    spilled = spilled_chunks(states, other_bytes, host_budget, count, piece)
    if spilled != set(states):
        return spilled, set()
    buffer = disk_buffer_bytes(list(states.values()), count, piece)
    for k in range(len(ids) + 1):
        if ram(k) + buffer <= host_budget:
            return spilled, tail(k)
    return spilled, set(ids)
