"""The real CUDA placement path (copy stream, events, pinned host buffers, allocator tracer, hybrid
Adam) against stock ZeRO-3 on the same GPU: losses and fp32 master weights. The GPU tests are
skipped without CUDA; the comparison with ZeRO-3 also runs on CPU here on the strict emulated
accelerator (the same training loop, model and check), and the rest of the placement logic in
test_placement.py, test_gpu_path_defects.py and test_strict_parity.py."""
import harness
import pytest
import torch

HIDDEN, LAYERS, BATCH = 4096, 8, 16
LAYER_BYTES = (HIDDEN * HIDDEN + 3 * HIDDEN) * 4  # a block: LayerNorm (2 x HIDDEN) and Linear (HIDDEN^2 + HIDDEN)
STEPS, LR = 6, 1e-3

# Tolerances against stock ZeRO-3. Losses (and global grad norms): rtol 1e-4, atol 1e-5. fp32
# masters, elementwise: the same (atol is a hundredth of one Adam step of LR: an element that missed
# an update, or took one twice, is a whole step off); per parameter, the update-norm check of
# tests/test_vs_zero3.py (fp32: update_rtol 1e-3, chosen there from the noise floor), which also
# catches updates gone astray by less than atol in every element of a tensor.
TOLERANCE = dict(loss_rtol=1e-4, loss_atol=1e-5, rtol=1e-4, atol=1e-5, update_rtol=1e-3)


class _Block(torch.nn.Module):
    """Pre-norm residual: ``x + GELU(Linear(LayerNorm(x)))``."""

    def __init__(self, width):
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.linear = torch.nn.Linear(width, width)

    def forward(self, x):
        return x + torch.nn.functional.gelu(self.linear(self.norm(x)))


def _model(width, blocks):
    torch.manual_seed(0)
    return torch.nn.Sequential(*(_Block(width) for _ in range(blocks)))


def _config(stage, width=HIDDEN, **zero):
    z = {"stage": stage, **zero}
    if stage == "patrickstar":
        z.setdefault("chunk_size", width * width + 4 * width)  # a block a chunk
    elif stage == 3:
        z.setdefault("stage3_param_persistence_threshold", 0)
    return {"train_micro_batch_size_per_gpu": BATCH, "zero_optimization": z, "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}}}


def _train(config, width=HIDDEN, blocks=LAYERS, device="cuda"):
    """(a :class:`harness.RunResult` with losses, grad norms, skipped steps and fp32 masters, the
    module's state dict as ``engine.module.state_dict()`` returned it)."""
    import deepspeed

    import ds_patrickstar  # noqa: F401

    harness.ensure_distributed()
    model = _model(width, blocks)
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    gen = torch.Generator().manual_seed(1)
    result = harness.RunResult(losses=[], fp32_weights={}, lp_weights={}, init_weights=init,
                               stage=config["zero_optimization"]["stage"])
    for _ in range(STEPS):
        x = torch.randn(BATCH, width, generator=gen).to(device)
        y = torch.randn(BATCH, width, generator=gen).to(device)
        loss = ((engine(x) - y) ** 2).mean()
        engine.backward(loss)
        engine.step()
        result.losses.append(loss.item())
        norm = engine.get_global_grad_norm()
        result.grad_norms.append(None if norm is None else float(norm))
        if hasattr(engine, "get_patrickstar_counters"):
            result.counters.append(engine.get_patrickstar_counters())
    result.skipped_steps = int(engine.skipped_steps)
    result.fp32_weights, _ = harness.read_weights(engine, config)
    state = engine.module.state_dict()
    engine.destroy()
    return result, state


def _check_against_zero3(ours, ref):
    harness.compare(ours, ref, **TOLERANCE)


@pytest.mark.gpu
@pytest.mark.parametrize("budget_layers", [2, 3, 64])
def test_cuda_placement_matches_zero3(budget_layers):
    import gc

    gc.collect()
    torch.cuda.empty_cache()
    # The budget covers everything the process allocates on the device next to our chunks (here:
    # activations, cuBLAS workspace and what earlier tests left), so it is set from what is
    # allocated now plus a margin, plus room for a few layers' chunks.
    budget = torch.cuda.memory_allocated() + budget_layers * LAYER_BYTES + 256 * 2**20
    peak_before = torch.cuda.max_memory_allocated()
    ours, state = _train(_config("patrickstar", device_budget=budget))
    ref, _ = _train(_config(3))
    _check_against_zero3(ours, ref)
    last = ours.counters[-1]
    assert last["peak_device_bytes"] <= budget
    assert torch.cuda.max_memory_allocated() >= peak_before  # our tracer never reset the peak statistics
    if budget_layers < LAYERS:
        assert last["evictions"] > 0 and last["adam_chunks_host"] > 0
    else:
        assert last["adam_chunks_host"] == 0 and last["adam_chunks_device"] >= LAYERS and last["evictions"] == 0
    assert all(v.device.type == "cpu" for v in state.values())


TWIN_WIDTH = 64
TWIN_BLOCK_BYTES = (TWIN_WIDTH * TWIN_WIDTH + 4 * TWIN_WIDTH) * 4  # one chunk: a block
TWIN_ACTIVATIONS = LAYERS * 3 * BATCH * TWIN_WIDTH * 4  # a block saves three BATCH x TWIN_WIDTH fp32 tensors


def test_twin_placement_matches_zero3():
    """The CUDA test's comparison on the strict emulated accelerator: room for three blocks' chunks
    beside the activations, so chunks are evicted and every Adam update runs on the host."""
    budget = 3 * TWIN_BLOCK_BYTES + TWIN_ACTIVATIONS
    config = _config("patrickstar", TWIN_WIDTH, emulate_accelerator=True, device_budget=budget)
    ours, _ = _train(config, TWIN_WIDTH, device="cpu")
    ref, _ = _train(_config(3), TWIN_WIDTH, device="cpu")
    assert min(ref.grad_norms) > 1.0  # gradient clipping scales every step
    _check_against_zero3(ours, ref)
    last = ours.counters[-1]
    assert last["evictions"] > 0 and last["adam_chunks_host"] > 0


def _page_locked(address):
    """Whether CUDA sees ``address`` as page-locked host memory, asked of the driver that every CUDA machine
    has (``cuPointerGetAttribute``, ``CU_POINTER_ATTRIBUTE_MEMORY_TYPE``: ``CU_MEMORYTYPE_HOST`` for
    registered or pinned host memory, an error for pageable memory), in the context torch made current.
    torch's ``Tensor.is_pinned()`` asks about the start of the tensor's storage, and a pool buffer starts at
    the first page boundary inside its allocation, past the storage's start."""
    import ctypes

    driver = ctypes.CDLL("libcuda.so.1")
    driver.cuPointerGetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64]
    driver.cuPointerGetAttribute.restype = ctypes.c_int
    memory_type = ctypes.c_uint(0)
    result = driver.cuPointerGetAttribute(ctypes.byref(memory_type), 2, address)  # CU_POINTER_ATTRIBUTE_MEMORY_TYPE
    return result == 0 and memory_type.value == 1  # CUDA_SUCCESS, CU_MEMORYTYPE_HOST


@pytest.mark.gpu
def test_host_pool_buffers_are_registered_exact_and_unregistered_when_freed():
    """[Note: pinned host memory] on CUDA: a pool buffer is page-locked by cudaHostRegister (so its
    copies are asynchronous), spans whole pages of its own, and is unregistered when the pool frees it."""
    from ds_patrickstar.memory.cuda import CudaAccelerator

    accel = CudaAccelerator(torch.device("cuda", torch.cuda.current_device()), 1 << 30)
    pinned, pageable = torch.empty(4096, pin_memory=True), torch.empty(1 << 20)  # the question itself, asked right
    assert _page_locked(pinned.data_ptr()) and not _page_locked(pageable.data_ptr() + 8192)
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


def _train_blocks(mode, steps=4, tokens=4096, pinnings=None):
    import gc

    import deepspeed

    import ds_patrickstar  # noqa: F401

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
    lengths = tokens if isinstance(tokens, list) else [tokens] * steps
    for length in lengths:
        x = torch.randn(length, 1024, generator=gen).cuda()
        loss = (engine(x) ** 2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if pinnings is not None:
            pinnings.append(engine.get_patrickstar_counters()["host_pinnings"])
    counters = engine.get_patrickstar_counters()
    counters["peak_non_model_bytes_device"] -= before  # this run's, not what earlier ones left allocated
    engine.destroy()
    return losses, counters


@pytest.mark.gpu
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


@pytest.mark.gpu
def test_offloaded_activations_of_changing_lengths_pin_nothing_after_the_first_step():
    """[Note: activation host stack] on CUDA (``cudaHostRegister`` of the slabs): batches of changing lengths, none
    longer than the first, register no host memory after the first step, and train as keeping them does."""
    lengths, pinned = [4096, 3072, 4096, 2048, 3584], []
    kept, _ = _train_blocks("none", tokens=lengths)
    moved, counters = _train_blocks("all", tokens=lengths, pinnings=pinned)
    torch.testing.assert_close(torch.tensor(moved), torch.tensor(kept), rtol=1e-5, atol=0)
    assert pinned[0] > 0 and pinned[1:] == [0] * (len(lengths) - 1), pinned
    assert counters["activation_bytes_offloaded"] > 0


@pytest.mark.gpu
def test_all_gathers_and_reduce_scatters_run_on_streams_of_their_own():
    """[Note: collective buffers]: two collective streams beside the copy stream, each entered by its kind."""
    from ds_patrickstar.memory.cuda import CudaAccelerator

    accel = CudaAccelerator(torch.device("cuda", torch.cuda.current_device()), 1 << 30)
    streams = accel.collective_streams
    assert len({s.cuda_stream for s in (*streams.values(), accel.copy_stream)}) == 3
    for kind, stream in streams.items():
        with accel.collective_stream(kind) as issue:
            assert torch.cuda.current_stream() == stream and issue.kind == kind


@pytest.mark.gpu
def test_the_device_profile_is_measured_at_initialize():
    """[Note: device profile] on CUDA: pinned copies each way and both Adam kernels, in plausible ranges."""
    from ds_patrickstar.integration.device_profile import device_profile
    from ds_patrickstar.memory.cuda import CudaAccelerator

    profile = device_profile(CudaAccelerator(torch.device("cuda", torch.cuda.current_device()), 1 << 30))
    assert 1e9 < profile.to_device_bytes_per_s < 1e12 and 1e9 < profile.to_host_bytes_per_s < 1e12
    assert profile.device_adam_elements_per_s > profile.host_adam_elements_per_s > 1e6
