"""What the placement models need of the owned chunks (see [Note: predicted moves] in move_model.py and [Note: the
bytes floor] in bytes_floor.py)."""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass


@dataclass(frozen=True)
class ChunkCosts:
    """What the models need of the owned chunks: bytes on the accelerator (movable chunks), elements Adam
    updates and elements its states take (trainable chunks), the chunks whose eviction copies nothing (a disk
    record is their home)."""

    sizes: Mapping[int, int]
    elements: Mapping[int, int]
    capacities: Mapping[int, int]
    uncopied: AbstractSet[int] = frozenset()
    clean_copies: bool = False  # chunks keep the host buffer they came from (see [Note: clean evictions])
    accumulators: Mapping[int, int] | None = None  # with gradient accumulation: chunk -> accumulator bytes
