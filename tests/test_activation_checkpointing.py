"""Activation checkpointing with stage "patrickstar" against stock ZeRO-3 running the same checkpointing
(issue 20, item 1): torch.utils.checkpoint (reentrant, non-reentrant) and DeepSpeed's
``deepspeed.checkpointing`` (``configure`` with the user's own config, as Megatron-DeepSpeed calls it,
and its ``activation_checkpointing`` block), over data parallelism, bf16, gradient accumulation and
the strict emulated accelerator with a budget that evicts chunks while blocks are recomputed.

DeepSpeed 0.19.8's ``cpu_checkpointing`` fails on a CPU-only machine by itself (stock ZeRO-3 and stage
0 alike: a 0-d placeholder tensor reaches the recomputed forward), so the CPU cases run it off; the
offload it does is a copy of the block's input, which the strict accelerator covers for our own
chunks. Tolerances are those of tests/test_vs_zero3.py (justified there).
"""
from __future__ import annotations

import importlib.util
import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from harness import deepspeed_checkpointing
from quirk_models import D_IN, HID, N_CLASSES, classification_batches

STEPS = 4
SEED = 1234
LR = 1e-3
N_BLOCKS = 3
# every option of the block that runs on a CPU-only machine (see the module docstring)
DS_BLOCK = {"partition_activations": True, "contiguous_memory_optimization": True, "number_checkpoints": N_BLOCKS}


def _checkpoint_fn(api: str):
    import deepspeed
    from torch.utils.checkpoint import checkpoint

    return {
        "torch_reentrant": lambda f, h: checkpoint(f, h, use_reentrant=True),
        "torch_nonreentrant": lambda f, h: checkpoint(f, h, use_reentrant=False),
        "ds": deepspeed.checkpointing.checkpoint,
        "ds_nonreentrant": deepspeed.checkpointing.non_reentrant_checkpoint,
    }[api]


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(HID, HID)
        self.fc2 = nn.Linear(HID, HID)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.fc2(F.gelu(self.fc1(h)))


class Checkpointed(nn.Module):
    """Three residual blocks, each run through the checkpointing API ``api``."""

    def __init__(self, api: str) -> None:
        super().__init__()
        self.api = api
        self.inp = nn.Linear(D_IN, HID)
        self.blocks = nn.ModuleList([Block() for _ in range(N_BLOCKS)])
        self.out = nn.Linear(HID, N_CLASSES)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        run = _checkpoint_fn(self.api)
        h = self.inp(x)
        for block in self.blocks:
            h = run(block, h)
        return F.cross_entropy(self.out(h).float(), y)


def _builder(api: str):
    def build(seed: int):
        torch.manual_seed(seed)
        return Checkpointed(api), classification_batches(seed)

    build.__name__ = f"build_checkpointed_{api}"
    return build


def _budget(dtype: str, gas: int, world_size: int) -> int:
    """Two fifths of the model data (low-precision parameters, with their fp32 accumulators at GA > 1),
    two chunks in flight and the activations: chunks are evicted and brought back while blocks are
    recomputed. A rank of two owns half the chunks but gathers whole groups: 4/3 of that (at GA 2 the
    run fails for lack of room from 59 kB down, and evicts nothing from 61.7 kB up)."""
    size = 4 if dtype == "fp32" else 2
    per_element = size + (4 if gas > 1 else 0)
    params = sum(p.numel() for p in Checkpointed("ds").parameters())
    one_rank = int(params * per_element * 0.4) + 2 * 1024 * per_element + 6144 * size // 4
    return one_rank if world_size == 1 else one_rank * 4 // 3


def _train(rank, world_size, api, stage, dtype, gas, block, strict):
    """One run on this rank: DeepSpeed's checkpointing configured from the run's own config."""
    import deepspeed
    from harness import make_config, run_training

    import ds_patrickstar  # noqa: F401

    extra = {"emulate_accelerator": True, "device_budget": _budget(dtype, gas, world_size)} if strict else {}
    config = make_config(stage, dtype, gas=gas, lr=LR, chunk_size=1024, extra_zero=extra if stage != 3 else None)
    if world_size > 1:
        config.pop("train_batch_size")  # DeepSpeed derives it from the world size
    if block is not None:
        config["activation_checkpointing"] = dict(block)
    if not api.startswith("ds"):
        return run_training(_builder(api), config, STEPS, SEED)
    deepspeed.init_distributed(dist_backend="gloo")  # configure reads the rank, as after initialize
    with deepspeed_checkpointing(config):
        return run_training(_builder(api), config, STEPS, SEED)


# Stock ZeRO-3 cannot run DeepSpeed's non-reentrant checkpoint (backward fails: "The size of tensor a
# (0) must match the size of tensor b (32)", a partitioned parameter saved by its pack hook comes back
# empty); the reference is then torch's non-reentrant checkpoint, the same computation.
REFERENCE_API = {"ds_nonreentrant": "torch_nonreentrant"}

# api, world size, dtype, GA, DeepSpeed's config block, strict accelerator with evictions
CASES = [
    ("ds", 1, "bf16", 2, DS_BLOCK, True),
    ("ds_nonreentrant", 1, "fp32", 1, {"cpu_checkpointing": False}, True),
    ("torch_reentrant", 2, "fp32", 2, None, True),
    ("torch_nonreentrant", 2, "bf16", 1, None, False),
]


@pytest.mark.parametrize("api,world_size,dtype,gas,block,strict", CASES)
def test_checkpointing_matches_zero3(api, world_size, dtype, gas, block, strict, caplog):
    from multiproc import run_ranks
    from test_vs_zero3 import check

    ref = run_ranks(_train, world_size, REFERENCE_API.get(api, api), 3, dtype, gas, block, False, memo=True)
    ours = run_ranks(_train, world_size, api, "patrickstar", dtype, gas, block, strict)
    for rank in range(world_size):
        check(ours[rank], ref[rank], dtype)
    if strict:
        after_warm_up = ours[0].counters[1:]  # one rank: chunks are evicted in every step; two: in some
        evictions = [c["evictions"] for c in after_warm_up]
        assert (min(evictions) if world_size == 1 else sum(evictions)) > 0, after_warm_up
        assert all(c["recompute_moments"] == 2 * N_BLOCKS * gas for c in after_warm_up), after_warm_up


def test_configure_with_a_patrickstar_config(dist, caplog):
    """``deepspeed.checkpointing.configure(mpu, deepspeed_config=cfg)`` with the user's "patrickstar"
    config (a dict or a JSON path) reads its activation_checkpointing block; partition_activations
    without a model-parallel group says what it is for."""
    import json
    import tempfile

    import deepspeed
    from deepspeed.runtime.activation_checkpointing import checkpointing
    from harness import make_config

    import ds_patrickstar  # noqa: F401

    config = make_config("patrickstar", "fp32")
    config["activation_checkpointing"] = dict(DS_BLOCK)
    try:
        with caplog.at_level(logging.WARNING, logger="ds_patrickstar"):
            deepspeed.checkpointing.configure(None, deepspeed_config=config)
        assert checkpointing.CONTIGUOUS_CHECKPOINTING and checkpointing.num_layers == N_BLOCKS
        assert "partition_activations" in caplog.text and "model-parallel" in caplog.text, caplog.text
        config["activation_checkpointing"] = {"number_checkpoints": 7}
        with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
            json.dump(config, f)
            f.flush()
            deepspeed.checkpointing.configure(None, deepspeed_config=f.name)
        assert checkpointing.num_layers == 7 and not checkpointing.PARTITION_ACTIVATIONS
        stock = make_config(3, "fp32")  # another stage: DeepSpeed's function as it is, no warning of ours
        stock["activation_checkpointing"] = dict(DS_BLOCK)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="ds_patrickstar"):
            deepspeed.checkpointing.configure(None, deepspeed_config=stock)
        assert checkpointing.num_layers == N_BLOCKS and "partition_activations" not in caplog.text
    finally:
        deepspeed.checkpointing.reset()
        deepspeed.checkpointing.configure(None)


# --------------------------------------------------------------------------------------
# the trace and placement under recomputation (issue 20, item 2)
# --------------------------------------------------------------------------------------
WIDTH, LAYERS = 64, 4  # one bias-free layer = one chunk of WIDTH * WIDTH fp32 elements (16 KiB)


class Chain(nn.Module):
    """Layer 0, then layers 1..3 each checkpointed (layer 0 gives their input a gradient)."""

    def __init__(self, use_reentrant: bool) -> None:
        super().__init__()
        self.use_reentrant = use_reentrant
        self.layers = nn.ModuleList([nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        h = torch.tanh(self.layers[0](x))
        for layer in self.layers[1:]:
            h = checkpoint(lambda t, layer=layer: torch.tanh(layer(t)), h, use_reentrant=self.use_reentrant)
        return h.square().mean()


# an exception in a finalizer is an error here: a held input's storage dying inside its entry's release freed the
# meter's block twice ("caching allocator model: ... holds no block", swallowed as an unraisable exception)
@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("use_reentrant", [True, False])
def test_recomputation_is_planned(dist, use_reentrant, tmp_path):
    """Chunks used by layers 0..3: forward 0 1 2 3, backward 3 3 2 2 1 1 0 (each checkpointed layer is
    recomputed, then its backward runs; the step uses none: the optimizer states do not fit). With room
    for two chunks, the optimum (Belady over that sequence) brings 6 chunks and evicts 4 per step: at
    layer 2 chunk 0 goes (next use last), at layer 3 chunk 1 (used before chunk 0), and chunks 3 and 2
    once dead (updated on the host, their gradients leave during backward, and so does chunk 1's after its
    last use, where it went at the step before: see [Note: gradients leave in backward]). Any placement that
    does not see the recomputations as next uses does worse. Every chunk
    but the iteration's first comes by prefetch, before the moment using it, recomputations included
    (room taken from chunks used later only), so the one miss is layer 0's chunk at the first moment."""
    import deepspeed

    import ds_patrickstar  # noqa: F401

    chunk = WIDTH * WIDTH * 4
    torch.manual_seed(0)
    model = Chain(use_reentrant)
    config = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": "patrickstar", "chunk_size": WIDTH * WIDTH,
                                    "emulate_accelerator": True, "device_budget": 2 * chunk + 8192}}
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        engine.backward(engine(torch.randn(4, WIDTH, generator=gen)))
        engine.step()
    trace = engine.optimizer.placement.tracer.trace
    uses = [m.chunks[0] for m in trace.moments if m.label != "step"]
    assert uses == [0, 1, 2, 3, 3, 3, 2, 2, 1, 1, 0], [(m.label, m.chunks) for m in trace.moments]
    assert [trace.moments[i].label for i in trace.recomputations()] == [f"rec:layers.{k}" for k in (3, 2, 1)]
    counters = engine.get_patrickstar_counters()
    assert counters["recompute_moments"] == 3
    assert counters["evictions"] == 2 and counters["grads_released_in_backward"] == 3, counters
    assert counters["bytes_to_device"] == 6 * chunk, counters
    assert counters["prefetches"] == counters["prefetch_hits"] == 5, counters
    if importlib.util.find_spec("matplotlib") is not None:  # the plot shades the recomputations
        assert engine.tide_plot(str(tmp_path / "tide.png")).endswith("tide.png")
    engine.destroy()
