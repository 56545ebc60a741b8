"""The real CUDA placement path (copy stream, events, pinned host buffers, allocator tracer, hybrid
Adam) against stock ZeRO-3 on the same GPU. Skipped without CUDA; the same logic runs on CPU in
test_placement.py, test_gpu_path_defects.py and test_strict_parity.py on the strict emulated
accelerator."""
import pytest
import torch

import harness

pytestmark = pytest.mark.gpu

HIDDEN, LAYERS, BATCH = 4096, 8, 16
LAYER_BYTES = (HIDDEN * HIDDEN + HIDDEN) * 4


def _mlp():
    torch.manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        layers += [torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.GELU()]
    return torch.nn.Sequential(*layers)


def _config(stage, **zero):
    z = {"stage": stage, **zero}
    if stage == "patrickstar":
        z.setdefault("chunk_size", HIDDEN * HIDDEN + 1024)
    return {"train_micro_batch_size_per_gpu": BATCH, "zero_optimization": z, "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}}}


def _train(config, steps=6):
    import deepspeed

    import ds_patrickstar  # noqa: F401

    harness.ensure_distributed()
    model = _mlp()
    peak_before = torch.cuda.max_memory_allocated()
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    gen = torch.Generator().manual_seed(1)
    losses, counters = [], []
    for _ in range(steps):
        x = torch.randn(BATCH, HIDDEN, generator=gen).cuda()
        y = torch.randn(BATCH, HIDDEN, generator=gen).cuda()
        loss = ((engine(x) - y) ** 2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if hasattr(engine, "get_patrickstar_counters"):
            counters.append(engine.get_patrickstar_counters())
    state = engine.module.state_dict()
    engine.destroy()
    return losses, counters, state, peak_before


@pytest.mark.parametrize("budget_layers", [2, 3, 64])
def test_cuda_placement_matches_zero3(budget_layers):
    import gc

    gc.collect()
    torch.cuda.empty_cache()
    # The budget covers everything the process allocates on the device next to our chunks (here:
    # activations, cuBLAS workspace and what earlier tests left), so it is set from what is
    # allocated now plus a margin, plus room for a few layers' chunks.
    budget = torch.cuda.memory_allocated() + budget_layers * LAYER_BYTES + 256 * 2**20
    ours, counters, state, peak_before = _train(_config("patrickstar", device_budget=budget))
    ref, _, _, _ = _train(_config(3, stage3_param_persistence_threshold=0))
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(ref), rtol=1e-4, atol=1e-5)
    last = counters[-1]
    assert last["peak_device_bytes"] <= budget
    assert torch.cuda.max_memory_allocated() >= peak_before  # our tracer never reset the peak statistics
    if budget_layers < LAYERS:
        assert last["evictions"] > 0 and last["adam_chunks_host"] > 0
    else:
        assert last["adam_chunks_host"] == 0 and last["adam_chunks_device"] >= LAYERS and last["evictions"] == 0
    assert all(v.device.type == "cpu" for v in state.values())


def _page_locked(address):
    """Whether CUDA sees ``address`` as page-locked host memory (cudaPointerGetAttributes). torch's
    ``Tensor.is_pinned()`` asks about the start of the tensor's storage, and a pool buffer starts at
    the first page boundary inside its allocation, past the storage's start."""
    runtime = pytest.importorskip("cupy").cuda.runtime
    return runtime.pointerGetAttributes(address).type == getattr(runtime, "memoryTypeHost", 1)


def test_host_pool_buffers_are_registered_exact_and_unregistered_when_freed():
    """[Note: pinned host memory] on CUDA: a pool buffer is page-locked by cudaHostRegister (so its
    copies are asynchronous), spans whole pages of its own, and is unregistered when the pool frees it."""
    from ds_patrickstar.memory.cuda import CudaAccelerator

    accel = CudaAccelerator(torch.device("cuda", torch.cuda.current_device()), 1 << 30)
    pool = accel.host_pool
    pool.cache_at_least(1 << 20)
    buf = accel.host_empty(300_000, torch.bfloat16)  # 600,000 B: torch's allocator would pin 1 MiB
    assert _page_locked(buf.data_ptr()) and buf.data_ptr() % 4096 == 0
    assert _page_locked(buf.data_ptr() + 600_000 - 1)
    assert pool.allocated == -(-600_000 // 4096) * 4096 + 4096 - 64  # the pages it spans + alignment slack
    device = accel.empty(300_000, torch.bfloat16, "chunk", "payload")
    buf.fill_(1.5)
    pending = accel.copy(device, buf)
    accel.host_free(buf, after=pending)
    pending.wait_host()
    again = accel.host_empty(300_000, torch.bfloat16)
    assert again.data_ptr() == buf.data_ptr() and pool.pinnings == 1  # reused, not pinned again
    assert torch.equal(device.cpu(), torch.full((300_000,), 1.5, dtype=torch.bfloat16))
    address = again.data_ptr()
    accel.host_free(again)
    pool.close()
    assert not _page_locked(address)


class _Blocks(torch.nn.Module):
    """Eight checkpointed blocks (torch's reentrant checkpoint): what each keeps for backward is its
    input, 16 MiB at BATCH_TOKENS x 1024 fp32."""

    def __init__(self, width=1024):
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(width, width)  # the blocks' inputs require grad: reentrant checkpoints train
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width))
            for _ in range(8)
        )

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        x = self.inp(x)
        for block in self.blocks:
            x = x + checkpoint(block, x, use_reentrant=True)
        return x


def _train_blocks(mode, steps=4, tokens=4096):
    import deepspeed

    import ds_patrickstar  # noqa: F401

    import gc

    harness.ensure_distributed()
    gc.collect()
    torch.cuda.empty_cache()
    model = _Blocks()
    # what earlier tests left allocated counts as non-model memory: the budget is set above it
    before = torch.cuda.memory_allocated()
    budget = before + (3 << 30)
    config = _config("patrickstar", device_budget=budget, offload_activations=mode, chunk_size=1 << 23)
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x = torch.randn(tokens, 1024, generator=gen).cuda()
        loss = (engine(x) ** 2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    counters = engine.get_patrickstar_counters()
    counters["peak_non_model_bytes_device"] -= before  # this run's, not what earlier ones left allocated
    engine.destroy()
    return losses, counters


def test_activation_offload_on_cuda_moves_bytes_and_keeps_the_numbers():
    """[Note: activation offload] on CUDA (copy stream, events, pinned pool buffers): "all" moves
    every block's checkpointed input out and back, lowers the device's activation peak, and
    trains to the same losses as keeping them ("none"): the copies are byte-exact and waited on."""
    kept, kept_counters = _train_blocks("none")
    moved, counters = _train_blocks("all")
    torch.testing.assert_close(torch.tensor(moved), torch.tensor(kept), rtol=1e-5, atol=0)
    assert counters["activation_bytes_offloaded"] == counters["activation_bytes_restored"] >= 6 * 4096 * 1024 * 4
    assert kept_counters["activation_bytes_offloaded"] == 0
    # On CUDA the allocator's tide (everything allocated that is not model data) shows the saving.
    assert counters["peak_non_model_bytes_device"] < kept_counters["peak_non_model_bytes_device"] - 4 * 4096 * 1024 * 4
