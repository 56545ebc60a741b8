"""Where a spilled chunk's optimizer states lie in its swap file: pieces of a bounded number of elements.

[Note: swap pieces]
A spilled chunk's fp32 master, momentum and variance are cut into *pieces* of at most
``piece_elements`` elements (``offload_optimizer.buffer_size``, default :data:`PIECE_ELEMENTS`),
and a piece's three states are one contiguous region of the file: its master, momentum and
variance back to back, each padded to :data:`~ds_patrickstar.disk.io.ALIGNMENT`; the
pieces follow each other in element order. A piece is therefore one read and one write, and
the disk tier's host buffers each hold one piece, whatever the chunk's size: a 103M-element
embedding chunk streams through the same buffers as a 1M-element one. Pieces are a multiple
of 1024 elements (4 KiB of fp32), so only a chunk's last piece is padded and a record takes
``3 * align_up(4 * capacity)`` bytes whatever the piece size; piece boundaries fall on SIMD
boundaries of the fused Adam, which is elementwise and runs piece by piece with the same
results as on the whole chunk.

A frozen chunk on disk (see [Note: frozen chunks on disk]) has a record of another kind: its
owned slice's payload in the training dtype, in one piece, padded to ``ALIGNMENT``
(:func:`frozen_record_bytes`): it is only ever read whole, into a buffer of one chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

from .io import ALIGNMENT, align_up

PIECE_ELEMENTS = 4 * 2**20
"""Default elements of one piece: 48 MiB of master, momentum and variance, one request large
enough for a disk's full bandwidth, and ``(buffer_count + 1)`` such buffers (240 MiB with four)
instead of as many whole chunks (6.2 GiB for GPT width 2048's embedding chunk)."""
PIECE_MULTIPLE = ALIGNMENT // 4  # elements: a piece's fp32 states start on aligned offsets


def piece_elements(requested: int) -> int:
    """``requested`` rounded up to a multiple of :data:`PIECE_MULTIPLE` (at least one)."""
    return max(1, -(-requested // PIECE_MULTIPLE)) * PIECE_MULTIPLE


@dataclass(frozen=True)
class SwapPiece:
    """Elements ``start .. start + numel`` of a chunk, at byte ``offset`` of its swap file."""

    start: int
    numel: int
    offset: int

    @property
    def stride(self) -> int:
        """Bytes of each of the piece's three states in the file (padded)."""
        return align_up(self.numel * 4)

    @property
    def nbytes(self) -> int:
        return 3 * self.stride

    @property
    def stop(self) -> int:
        return self.start + self.numel


def swap_pieces(capacity: int, piece: int) -> list[SwapPiece]:
    """The pieces of a ``capacity``-element chunk's record; see [Note: swap pieces]."""
    pieces, offset = [], 0
    for start in range(0, capacity, piece):
        numel = min(piece, capacity - start)
        pieces.append(SwapPiece(start, numel, offset))
        offset += pieces[-1].nbytes
    return pieces


def record_bytes(capacity: int) -> int:
    """Bytes of one chunk's swap record (the same for every piece size, see [Note: swap pieces])."""
    return 3 * align_up(capacity * 4)


def piece_buffer_bytes(capacities: list[int], piece: int) -> int:
    """Bytes of one host buffer of the disk tier: the largest piece of these chunks."""
    return record_bytes(min(piece, max(capacities, default=0)))


def frozen_record_bytes(capacity: int, itemsize: int) -> int:
    """Bytes of a frozen chunk's record: its payload, padded (see [Note: swap pieces])."""
    return align_up(capacity * itemsize)
