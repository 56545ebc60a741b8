"""The strict emulated accelerator's model of the CUDA caching allocator (memory/caching_allocator.py,
[Note: caching allocator model]): freed activations leave pieces that later ones reuse, and the
pieces they leave in partly used segments are what placement counts as stranded (see
[Note: stranded allocator bytes] in memory/cuda.py)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

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


# ---- placement on the twin with stranded pieces ------------------------------------------------
VOCAB, WIDTH, SEQ, BATCH = 32, 16, 32, 8
MLP = (6, 5, 4, 3, 2, 1)  # each block's MLP width, in WIDTHs: a later block's activations are smaller
STEPS, SEED = 2, 7


class Block(torch.nn.Module):
    def __init__(self, mult: int) -> None:
        super().__init__()
        self.ln = torch.nn.LayerNorm(WIDTH)
        self.fc1, self.fc2 = torch.nn.Linear(WIDTH, mult * WIDTH), torch.nn.Linear(mult * WIDTH, WIDTH)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.fc2(F.gelu(self.fc1(self.ln(h))))


class Tapering(torch.nn.Module):
    """Blocks whose activations shrink block by block: a block's storages are made in the free pieces
    its predecessors' offloaded ones left, split, so that the rests stay stranded beside them."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = torch.nn.Embedding(VOCAB, WIDTH)
        self.blocks = torch.nn.ModuleList([Block(m) for m in MLP])
        self.head = torch.nn.Linear(WIDTH, VOCAB)

    def forward(self, tok: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.wte(tok)
        for block in self.blocks:
            h = block(h)
        return F.cross_entropy(self.head(h).flatten(0, 1), y.flatten())


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * SEED + step)
    tok = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    return tok, torch.roll(tok, -1, 1)


def _stranded_at_backward(mode: str, budget: int) -> tuple[list[int], list[int]]:
    """Per step, the stranded bytes when backward starts and the activation bytes offloaded."""
    import deepspeed

    import ds_patrickstar  # noqa: F401

    torch.manual_seed(SEED)
    model = Tapering()
    zero = {"stage": "patrickstar", "chunk_size": 2048, "emulate_accelerator": True, "device_budget": budget,
            "offload_activations": mode}
    config = {"train_micro_batch_size_per_gpu": BATCH, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": zero}
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    accel = engine.optimizer.accel
    stranded, moved = [], []
    try:
        for step in range(STEPS):
            loss = engine(*_batch(step))
            stranded.append(accel.fragmentation())
            engine.backward(loss)
            engine.step()
            moved.append(engine.get_patrickstar_counters()["activation_bytes_offloaded"])
    finally:
        engine.destroy()
    return stranded, moved


def test_auto_offload_fits_with_the_pieces_it_strands(dist):
    """[Note: stranded allocator bytes]: the pieces that offloaded activations leave in the allocator's
    segments are reserved memory beside the tide now, and where the tide ahead is higher its
    activations are made in them. At 490 kB "auto" (which offloads some blocks after the traced
    iteration) trains; counting the pieces beside the tide ahead too (the rule the H100 found
    wrong) fails it, from 460 to 520 kB (the window checked by reverting the rule)."""
    stranded, moved = _stranded_at_backward("auto", 490_000)
    assert all(s > 0 for s in stranded), stranded
    assert 0 < moved[1] < moved[0], moved


def test_auto_keeps_room_for_the_pieces_its_offload_strands(dist):
    """[Note: auto activation offload]: at 540 kB the plan without a margin offloaded too little (the
    planned iteration stranded 81,920 B beside a planned tide of 450,560 B and placement failed, where
    520 and 560 kB trained); with the traced iteration's most stranded bytes kept free it trains."""
    stranded, moved = _stranded_at_backward("auto", 540_000)
    assert 0 < moved[1] < moved[0], moved
