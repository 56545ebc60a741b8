"""How much of the model data the disk tier takes off host memory, from the chunk plan alone.

[Note: disk tier plan]
With the disk tier, the owned chunks' optimizer states fill what ``host_budget`` leaves after the
rest of the model data (low-precision chunks, accumulators) in chunk order; the states of the
remaining chunks are *spilled*: 12 bytes per element on disk (see [Note: swap pieces]), none in
RAM, and they pass through the tier's host buffers (``buffer_count`` step buffers and a one-piece
cache, each one piece of the largest spilled chunk: :func:`disk_buffer_bytes`), which count
against the budget only when something spills. :func:`spilled_chunks` keeps the most chunks in
RAM for which the states kept, the rest of the model data and the buffers the spilled chunks
need fit the budget. The run then fits when model data less the spilled states plus the buffers
is at most budget + available host memory, and the swap folder has room for the spilled records
(checked at initialize, naming the folder and the numbers).
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


def frozen_pool_bytes(sizes: list[int], count: int) -> int:
    """Host bytes of the read-ahead buffers for frozen chunks of ``sizes`` bytes on disk (none when none is)."""
    return count * align_up(max(sizes)) if sizes else 0


def disk_plan(
    states: dict[int, int],
    frozen: dict[int, int],
    other_bytes: int,
    host_budget: int,
    buffers: tuple[int, int, int],
    frozen_first: bool,
) -> tuple[set[int], set[int]]:
    """The owned chunks whose states go to disk (``states``: id -> capacity) and the owned frozen
    chunks that go to disk (``frozen``: id -> payload bytes; ``other_bytes`` counts them in RAM);
    ``buffers``: ``(buffer_count, piece, frozen buffer count)``. See [Note: disk tier plan]."""
    count, piece, frozen_count = buffers
    ids = sorted(frozen)
    all_states = OPTIM_BYTES_PER_ELEMENT * sum(states.values())

    def rest(k: int) -> tuple[set[int], int]:  # the last ``k`` frozen chunks on disk, and what stays in RAM
        out = ids[len(ids) - k :] if k else []
        sizes = [frozen[i] for i in out]
        return set(out), other_bytes - sum(sizes) + frozen_pool_bytes(sizes, frozen_count)

    if frozen_first:
        for k in range(len(ids) + 1):
            on_disk, other = rest(k)
            if other + all_states <= host_budget:
                return set(), on_disk
        on_disk, other = rest(len(ids))
        return spilled_chunks(states, other, host_budget, count, piece), on_disk
    spilled = spilled_chunks(states, other_bytes, host_budget, count, piece)
    if spilled != set(states):
        return spilled, set()
    buffer = disk_buffer_bytes(list(states.values()), count, piece)
    for k in range(len(ids) + 1):
        on_disk, other = rest(k)
        if other + buffer <= host_budget:
            return spilled, on_disk
    return spilled, set(ids)
