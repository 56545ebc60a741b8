"""What one chunk group takes on the accelerator: the one formula that the planner, the pre-flight
check, the plans made from a trace, the gather plan and the keep and prefetch decisions use.

[Note: chunk group bytes]
A chunk group (see [Note: chunk groups] in groups/comm.py) of ``W`` chunks of ``capacity``
elements of ``lp_bytes`` bytes takes, on one rank's accelerator, these parts:

* ``storage``: with ``W > 1``, the flat storage of its ``W`` chunks while it is gathered (see
  [Note: gathered group storage] in store/chunk_store.py); with one rank the group is the owned chunk
  and there is none;
* ``owned``: this rank's own chunk (with ``W > 1`` beside the storage, where its landing slot is);
* ``joined``: with ``W > 1``, the joined buffers of the trainable tensors that straddle its chunks
  (see [Note: straddling tensors] in groups/straddle.py; a frozen one is a view of the storage);
* ``accumulator``: with gradient accumulation, the owned chunk's fp32 accumulator (see
  [Note: gradient accumulation] in groups/grads.py);
* ``grad_buffer``: with gradient accumulation and ``W > 1``, a micro-step's flat gradient buffer
  of the ``W`` chunks, taken while the group's gradients are reduce-scattered before the boundary
  (see [Note: flat group buffers] in groups/flat.py).

A gathered group, in use, kept or gathered ahead of use, counts :attr:`GroupBytes.gathered`:
storage, owned chunk, joined buffers and accumulator. A kept group gives its joined buffers back
until its next use, which takes them again; it is kept *for* that use, so it counts what the use
takes. The most a moment using the group takes is :attr:`GroupBytes.peak`, the gathered group and a
gradient buffer. ``keep_gathered`` limits :attr:`GroupBytes.members`, the bytes of the group's
``W`` chunks (see [Note: kept groups] in groups/keep.py). A group of frozen chunks (see
[Note: frozen chunks] in chunks/kind.py) never has an accumulator or a gradient buffer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .layout import ChunkSpec

ACC_BYTES_PER_ELEMENT = 4  # an fp32 gradient accumulator


@dataclass(frozen=True)
class GroupBytes:
    """The accelerator bytes of one chunk group, part by part; see [Note: chunk group bytes]."""

    storage: int
    owned: int
    joined: int
    accumulator: int
    grad_buffer: int

    @property
    def gathered(self) -> int:
        """What the group takes gathered: in use, kept for its next use, or gathered ahead of use."""
        return self.storage + self.owned + self.joined + self.accumulator

    @property
    def peak(self) -> int:
        """The most a moment using the group takes: gathered, beside a micro-step's gradient buffer."""
        return self.gathered + self.grad_buffer

    @property
    def members(self) -> int:
        """The bytes of the group's ``W`` chunks (with one rank, the owned chunk)."""
        return self.storage or self.owned


def group_bytes(
    capacity: int, lp_bytes: int, world_size: int, accumulate: bool, joined_elements: int = 0
) -> GroupBytes:
    """The bytes of a group of ``world_size`` chunks of ``capacity`` elements, ``joined_elements``
    of them in tensors that straddle its chunks; see [Note: chunk group bytes]."""
    chunk = capacity * lp_bytes
    parallel = world_size > 1
    return GroupBytes(
        storage=world_size * chunk if parallel else 0,
        owned=chunk,
        joined=joined_elements * lp_bytes if parallel else 0,
        accumulator=ACC_BYTES_PER_ELEMENT * capacity if accumulate else 0,
        grad_buffer=world_size * chunk if accumulate and parallel else 0,
    )


def planned_group_bytes(specs: list[ChunkSpec], lp_bytes: int, world_size: int, accumulate: bool) -> list[GroupBytes]:
    """The bytes of every chunk group of a chunk plan (``world_size`` consecutive specs per group),
    before anything is built; ``lp_bytes``: the bytes of an element of every chunk (the training dtype's)."""
    sizes = []
    for first in range(0, len(specs), world_size):
        members = specs[first : first + world_size]
        holders: dict[torch.nn.Parameter, int] = {}  # parameter -> how many members hold a piece of it
        for spec in members:
            for param in dict.fromkeys(p for _, p, _, _, _ in spec.members):
                holders[param] = holders.get(param, 0) + 1
        trainable = members[0].kind.trainable  # a frozen straddling tensor has no joined buffer
        joined = sum(param.numel() for param, count in holders.items() if count > 1) if trainable else 0
        grads = accumulate and trainable
        sizes.append(group_bytes(members[0].capacity, lp_bytes, world_size, grads, joined))
    return sizes
