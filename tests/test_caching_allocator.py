"""The strict emulated accelerator's model of the CUDA caching allocator (memory/caching_allocator.py,
[Note: caching allocator model]): freed activations leave pieces that later ones reuse, and the
pieces they leave in partly used segments are what placement counts as stranded (see
[Note: stranded allocator bytes] in memory/cuda.py)."""
from __future__ import annotations

import pytest

from ds_patrickstar.memory.caching_allocator import TWIN_GEOMETRY, CachingAllocatorModel

KIB = 1024


def test_pieces_are_reused_best_fit_and_split_and_a_free_segment_is_not_stranded():
    model = CachingAllocatorModel(TWIN_GEOMETRY)
    model.malloc("a", 16 * KIB)  # large: a segment of its own
    model.malloc("b", 8 * KIB)
    assert (model.reserved, model.allocated, model.stranded) == (24 * KIB, 24 * KIB, 0)
    model.free("a")
    model.free("b")  # both segments hold nothing: free memory, not stranded
    assert (model.reserved, model.busy, model.allocated, model.stranded) == (24 * KIB, 0, 0, 0)
    model.malloc("c", 5 * KIB)  # best fit: b's 8 kB segment, split; its 3 kB rest is stranded
    assert (model.reserved, model.allocated, model.stranded) == (24 * KIB, 5 * KIB, 3 * KIB)
    model.malloc("d", 3 * KIB - 100)  # the rest, rounded to 512 B, fits it exactly: no new segment
    assert (model.reserved, model.allocated, model.stranded) == (24 * KIB, 8 * KIB, 0)
    model.malloc("e", 10 * KIB)  # in a's segment: 6 kB stranded beside it
    assert (model.reserved, model.stranded) == (24 * KIB, 6 * KIB)
    model.malloc("f", 7 * KIB)  # fits no piece: a new segment, the 6 kB piece stays stranded
    assert (model.reserved, model.allocated, model.stranded) == (31 * KIB, 25 * KIB, 6 * KIB)
    model.free("e")  # a's segment is whole again
    assert (model.busy, model.stranded) == (15 * KIB, 0)
    model.free("c")  # merged with nothing (d is in use): stranded until d goes
    assert model.stranded == 5 * KIB
    model.free("d")  # c's and d's pieces merge: the segment holds nothing
    assert (model.busy, model.allocated, model.stranded) == (7 * KIB, 7 * KIB, 0)
    model.malloc("g", 8 * KIB)  # the merged 8 kB piece, not a's 16 kB one (best fit)
    assert (model.reserved, model.stranded) == (31 * KIB, 0)


def test_small_requests_share_small_segments_and_free_segments_are_released():
    model = CachingAllocatorModel(TWIN_GEOMETRY)
    model.malloc(1, 4)  # rounded to 512 B in a 2 kB small segment
    assert (model.reserved, model.allocated, model.stranded) == (2 * KIB, 512, 1536)
    model.malloc(2, KIB)
    assert (model.reserved, model.stranded) == (2 * KIB, 512)
    model.malloc(3, 2 * KIB)  # large (over 1 kB): never in a small segment
    assert (model.reserved, model.stranded) == (4 * KIB, 512)
    for key in (1, 2, 3):
        model.free(key)
    model.release_free()  # torch.cuda.empty_cache: segments holding nothing go back
    assert (model.reserved, model.busy, model.stranded) == (0, 0, 0)
    model.malloc(4, 2 * KIB)
    assert model.reserved == 2 * KIB


def test_a_key_holds_one_block():
    model = CachingAllocatorModel(TWIN_GEOMETRY)
    model.malloc("a", 100)
    with pytest.raises(RuntimeError, match="holds a block already"):
        model.malloc("a", 100)
    model.free("a")
    with pytest.raises(RuntimeError, match="holds no block"):
        model.free("a")

