"""Pinned host memory (issue "The memory we claim is the memory we use", item 1): the host bytes a
GPU run would really hold equal the host bytes the counters report, within one chunk.

The strict emulated accelerator records the host pool's pinnings at their exact size and models
torch's caching host allocator (blocks rounded up to a power of two, freed blocks cached) for any
other host buffer of a copy (see [Note: pinned host memory]).
"""
import pytest
import torch
from multiproc import run_ranks

from ds_patrickstar.memory.emulated import EmulatedAccelerator


# ---- the model of torch's pinned memory, and the pool ---------------------------------------
def test_torch_pinned_host_memory_is_modelled_rounded_and_cached():
    accel = EmulatedAccelerator(1 << 20)
    device = accel.empty(25_000, torch.float32, "chunk", "payload")
    host = torch.empty(25_000)  # 100,000 B, pinned by torch: a 131,072 B block
    accel.copy(host, device).wait()
    assert accel.host_bytes_allocated() == 131_072
    del host  # freed: the block stays cached ...
    assert accel.host_bytes_allocated() == 131_072
    again = torch.empty(30_000)  # ... and serves the next request of its block size
    accel.copy(again, accel.empty(30_000, torch.float32, "chunk", "payload")).wait()
    assert accel.host_bytes_allocated() == 131_072


def test_pool_buffers_are_exact_pinned_once_and_reused():
    accel = EmulatedAccelerator(1 << 20)
    pool = accel.host_pool
    pool.cache_at_least(2 * 100_032)
    first = accel.host_empty(25_000, torch.float32)
    assert first.numel() == 25_000 and accel.host_bytes_allocated() == 100_032  # 64-byte multiple
    device = accel.empty(25_000, torch.float32, "chunk", "payload")
    pending = accel.copy(device, first)
    accel.host_free(first, after=pending)
    second = accel.host_empty(25_000, torch.float32)  # the copy still reads the first: a new buffer
    assert second.data_ptr() != first.data_ptr() and pool.pinnings == 2
    pending.wait()
    accel.host_free(second)
    third = accel.host_empty(50_000, torch.bfloat16)  # same bytes, other dtype: reused, not pinned again
    assert pool.pinnings == 2 and third.dtype == torch.bfloat16
    assert accel.host_bytes_allocated() == pool.allocated == 2 * 100_032


def test_pool_cache_is_bounded_and_frees_what_it_cannot_keep():
    accel = EmulatedAccelerator(1 << 20)
    pool = accel.host_pool
    pool.cache_at_least(100_032)
    buffers = [accel.host_empty(25_000, torch.float32) for _ in range(3)]
    for buf in buffers:
        accel.host_free(buf)
    assert pool.cached == 100_032 and pool.allocated == 100_032 == accel.host_bytes_allocated()
    with pytest.raises(RuntimeError, match="did not hand out"):
        accel.host_free(torch.empty(4))


def test_a_pool_going_away_unpins_what_it_holds():
    import gc

    from ds_patrickstar.memory import emulated

    accel = EmulatedAccelerator(1 << 20)
    accel.host_pool.cache_at_least(1 << 20)
    kept = accel.host_empty(1000, torch.float32)  # still in use by someone when the pool goes
    accel.host_free(accel.host_empty(2000, torch.float32))  # cached
    pinned = set(accel._pinned)
    assert len(pinned) == 2 and pinned <= set(emulated._PINNED)
    del accel
    gc.collect()
    assert not pinned & set(emulated._PINNED)  # else a later buffer at that address could not be pinned
    assert kept.fill_(1.0).sum().item() == 1000  # the memory itself lives on with its last user


def test_a_buffer_released_after_the_pool_closed_is_let_go_quietly():
    """A saved activation dying after ``engine.destroy()`` hands its host buffer back to a closed pool: close
    let go of it already (it raised "did not hand out" in a finalizer); a buffer never handed out still raises."""
    accel = EmulatedAccelerator(1 << 20)
    buffer = accel.host_empty(1000, torch.float32)
    accel.close()
    accel.host_free(buffer)
    assert accel.host_pool.allocated == 0
    other = EmulatedAccelerator(1 << 20)
    with pytest.raises(RuntimeError, match="did not hand out"):
        other.host_free(torch.empty(4))


# ---- a training run: host bytes allocated == host bytes counted -----------------------------
def _host_bytes(rank, world_size, budget, runs):
    import deepspeed
    import harness  # noqa: F401  (the distributed environment of the pool's workers)
    from test_placement import BATCH, HIDDEN, _config, _mlp

    results = []
    for dtype, ga in runs:
        config = _config("patrickstar", emulate_accelerator=True, device_budget=budget)
        config.update(gradient_accumulation_steps=ga, train_batch_size=BATCH * ga * world_size)
        if dtype == "bf16":
            config["bf16"] = {"enabled": True}
        model = _mlp()
        engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
        optimizer = engine.optimizer
        owned = [optimizer.manager.map.chunks[c] for c in optimizer.optim_states.states]
        # one chunk's host buffers: payload, fp32 accumulator, fp32 master, momentum, variance
        one_chunk = max(c.capacity for c in owned) * (owned[0].dtype.itemsize + 4 + 12)
        gen = torch.Generator().manual_seed(rank)
        for micro in range(3 * ga):
            x = torch.randn(BATCH, HIDDEN, generator=gen).to(torch.bfloat16 if dtype == "bf16" else torch.float32)
            engine.backward(engine(x).float().square().mean())
            engine.step()
            if (micro + 1) % ga == 0:
                last = optimizer.last_step_counters
                counted = last["model_bytes_host"] + last["spare_bytes_host"]  # [Note: host updates in backward]
                results.append((dtype, ga, optimizer.accel.host_bytes_allocated(), counted,
                                last["host_bytes_allocated"], one_chunk))
        engine.destroy()
    return results


# budgets on 2 ranks: tight (chunks and states evicted between uses; the least that holds a group
# in use beside the flat gradient buffer of its reduce-scatter, [Note: flat group buffers]),
# partial (some optimizer states on the accelerator; GA 2 at 2 ranks needs this much room), roomy
# (everything on it)
@pytest.mark.parametrize("budget, runs", [
    (450_000, [("fp32", 1), ("bf16", 1)]),
    (1_000_000, [("bf16", 2)]),
    (8 * 2**20, [("fp32", 1), ("bf16", 2)]),
], ids=["tight", "partial", "roomy"])
def test_host_bytes_allocated_equal_the_counters_within_one_chunk(budget, runs):
    for per_rank in run_ranks(_host_bytes, 2, budget, runs, timeout=300):
        assert len(per_rank) == 3 * len(runs)
        for dtype, ga, allocated, counted, pinned, one_chunk in per_rank:
            what = f"{dtype} GA {ga}: allocated {allocated:,} B, counted {counted:,} B"
            assert counted <= allocated <= counted + one_chunk, what
            assert pinned == allocated, what  # the counter is what is pinned: nothing pinned the torch way
            if budget < 8 * 2**20:
                assert counted > 0, what  # placement really keeps model data on the host


# ---- building a model leaves the C heap as it found it (see [Note: host heap]) -----------------
def _heap_growth(rank, world_size):
    import ctypes

    import deepspeed

    import ds_patrickstar

    class MallInfo(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

    mallinfo = ctypes.CDLL(None).mallinfo2
    mallinfo.restype = MallInfo
    risen = torch.empty(64 << 20, dtype=torch.uint8)
    del risen  # a freed large block: glibc's threshold has risen to its ceiling, as in any real run
    cfg = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
           "zero_optimization": {"stage": "patrickstar", "chunk_size": 1 << 20},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
    heap = [mallinfo().arena]
    with ds_patrickstar.Init(config=cfg):
        model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(12)])
    heap.append(mallinfo().arena)
    engine, *_ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
    heap.append(mallinfo().arena)
    engine.destroy()
    return heap[1] - heap[0], heap[2] - heap[1]


@pytest.mark.skipif(not hasattr(__import__("ctypes").CDLL(None), "mallinfo2"), reason="needs glibc >= 2.33")
def test_building_under_init_and_initialize_do_not_grow_the_heap():
    """Under ``Init`` every parameter is a full-size tensor for a moment, and ``initialize`` allocates and
    frees full-size scratch; served from the C heap between small long-lived allocations they would grow it
    by about the model's bytes (a 12.6M-parameter model in 2 MiB chunks: 40 MiB at construction and 152 MiB
    at initialize without the build windows, 0 and 2 MiB with them). Mapped on their own, the heap grows by
    small objects only."""
    ((construction, initialize),) = run_ranks(_heap_growth, 1, fresh=True, timeout=120)
    fp32_bytes = 12 * 1024 * 1025 * 4
    assert construction < fp32_bytes // 16, construction
    assert initialize < fp32_bytes // 4, initialize
