"""Frozen parameters in chunks of their own kind (see [Note: frozen chunks]): a LoRA-style stack (frozen base
linears, rank-4 adapters) and a model with layers frozen by hand train like stock ZeRO-3 on the strict twin
at a device budget below the frozen base, at 1 and 2 ranks; their tensors refuse a gradient state; activation
offload does not copy frozen weights. Tolerances are those of tests/test_vs_zero3.py."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from multiproc import run_ranks
from quirk_models import D_IN, N_CLASSES, classification_batches
from torch import nn
from torch.utils.checkpoint import checkpoint

HID, LAYERS, RANK = 128, 6, 4
STEPS = 3
SEED = 11


class LoraLinear(nn.Module):
    """A frozen base linear and a trainable rank-``RANK`` adapter beside it, with a residual."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(HID, HID)
        self.base.requires_grad_(False)
        self.lora_A = nn.Linear(HID, RANK, bias=False)
        self.lora_B = nn.Linear(RANK, HID, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + F.gelu(self.base(h) + self.lora_B(self.lora_A(h)))


class LoraStack(nn.Module):
    """A frozen input projection (no gradient reaches it), LoRA layers, a trainable head."""

    def __init__(self, layers: int = LAYERS) -> None:
        super().__init__()
        self.inp = nn.Linear(D_IN, HID)
        self.inp.requires_grad_(False)
        self.layers = nn.ModuleList([LoraLinear() for _ in range(layers)])
        self.head = nn.Linear(HID, N_CLASSES)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.layers:
            h = self.run_layer(layer, h)
        return F.cross_entropy(self.head(h).float(), y)

    def run_layer(self, layer: nn.Module, h: torch.Tensor) -> torch.Tensor:
        return layer(h)


class CheckpointedLora(LoraStack):
    """Eighteen LoRA layers, each under torch's non-reentrant activation checkpoint: in backward each layer's
    frozen weight is used by its recomputation and then by its backward."""

    def __init__(self) -> None:
        super().__init__(layers=3 * LAYERS)

    def run_layer(self, layer: nn.Module, h: torch.Tensor) -> torch.Tensor:
        return checkpoint(layer, h, use_reentrant=False)


class HandFrozen(nn.Module):
    """An MLP whose middle layers are frozen by hand: the first layer's gradient flows through them."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D_IN, HID)
        self.layers = nn.ModuleList([nn.Linear(HID, HID) for _ in range(LAYERS)])
        for layer in self.layers:
            layer.requires_grad_(False)
        self.head = nn.Linear(HID, N_CLASSES)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.inp(x))
        for layer in self.layers:
            h = h + F.gelu(layer(h))
        return F.cross_entropy(self.head(h).float(), y)


class ReentrantLora(LoraStack):
    """LoraStack with each layer under reentrant activation checkpointing (Hugging Face's default): the
    layers' forward runs without grad and is recomputed in backward; the frozen input projection's output
    is made to require grad, as ``enable_input_require_grads`` does for PEFT models."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        h = self.inp(x).requires_grad_()
        for layer in self.layers:
            h = checkpoint(layer, h, use_reentrant=True)
        return F.cross_entropy(self.head(h).float(), y)


MODELS = {"lora": LoraStack, "hand": HandFrozen, "lora_ckpt": CheckpointedLora, "lora_reentrant": ReentrantLora}


def build(name: str):
    def model_fn(seed: int):
        torch.manual_seed(seed)
        return MODELS[name](), classification_batches(seed)

    return model_fn


def frozen_bytes(name: str, dtype: str) -> int:
    size = 4 if dtype == "fp32" else 2
    return size * sum(p.numel() for p in MODELS[name]().parameters() if not p.requires_grad)


def budget(name: str, dtype: str) -> int:
    """Three quarters of the frozen base's bytes: the base cannot be on the device at once; for the
    checkpointed stack a sixth (three of its eighteen layers)."""
    return frozen_bytes(name, dtype) // 6 if name == "lora_ckpt" else frozen_bytes(name, dtype) * 3 // 4


def _train(rank, world_size, name, dtype, stage, gas, extra=None):
    from harness import make_config, run_training

    import ds_patrickstar  # noqa: F401

    if stage == 3:
        config = make_config(3, dtype, gas=gas)
    else:
        config = make_config("patrickstar", dtype, gas=gas, chunk_size=4096, extra_zero=extra or {})
    if world_size > 1:
        config.pop("train_batch_size")
    return run_training(build(name), config, STEPS, SEED)


def _check(ours, ref, dtype):
    from test_vs_zero3 import check

    check(ours, ref, dtype)
    assert set(ref.frozen) and set(ours.frozen) == set(ref.frozen)


@pytest.mark.parametrize(
    "name,dtype,gas,world_size",
    [
        ("lora", "fp32", 1, 1),
        ("lora", "bf16", 2, 1),
        ("hand", "fp32", 2, 1),
        ("lora", "bf16", 2, 2),
        ("lora_reentrant", "bf16", 1, 2),
        ("lora_ckpt", "fp32", 1, 1),
    ],
)
def test_frozen_base_larger_than_the_budget_matches_zero3(name, dtype, gas, world_size):
    """The strict twin's budget holds three quarters of the frozen base (a sixth for the eighteen-layer
    non-reentrant checkpointed stack): the frozen chunks are evicted and brought back (and, at two ranks,
    gathered) every step, and losses and weights equal ZeRO-3's. Under activation checkpointing (reentrant,
    ``lora_reentrant``, and non-reentrant, ``lora_ckpt``) each recomputed layer's frozen use ends with its
    backward: were the frozen groups held until the end of backward, the base would not fit the budget."""
    extra = {"emulate_accelerator": True, "device_budget": budget(name, dtype)}
    ref = run_ranks(_train, world_size, name, dtype, 3, gas, memo=True)
    ours = run_ranks(_train, world_size, name, dtype, "patrickstar", gas, extra)
    for rank in range(world_size):
        _check(ours[rank], ref[rank], dtype)
        moved = [c["bytes_to_device"] for c in ours[rank].counters[1:]]
        assert all(m > 0 for m in moved), moved
        assert all(c["peak_model_bytes_device"] <= budget(name, dtype) for c in ours[rank].counters)
        frozen = [c["frozen_bytes_device"] + c["frozen_bytes_host"] for c in ours[rank].counters]
        share = frozen_bytes(name, dtype) / world_size  # this rank's frozen chunks: their payload only
        assert all(share <= f <= share * 1.05 for f in frozen), (frozen, share)


def test_frozen_tensor_has_no_gradient_state():
    from ds_patrickstar.chunks.chunk import Piece, TensorInfo
    from ds_patrickstar.chunks.kind import ChunkKind
    from ds_patrickstar.chunks.state import IllegalTransition, TensorState

    param = nn.Parameter(torch.zeros(4), requires_grad=False)
    info = TensorInfo("w", param, [Piece(0, 0, 0, 4)], 4, param.shape, -1, kind=ChunkKind.FROZEN)
    info.start_compute()
    info.end_forward()
    info.start_compute()
    info.end_backward_use()
    with pytest.raises(IllegalTransition, match="frozen"):
        info.grad_written()
    info.settle()
    assert info.state is TensorState.HOLD


def _offloaded(rank, world_size):
    from harness import make_config, run_training

    import ds_patrickstar  # noqa: F401

    extra = {"emulate_accelerator": True, "device_budget": 4 << 20, "offload_activations": "all"}
    config = make_config("patrickstar", "fp32", chunk_size=4096, extra_zero=extra)
    result = run_training(build("lora"), config, 2, SEED)
    return [c["activation_bytes_offloaded"] for c in result.counters]


def test_activation_offload_leaves_frozen_weights_alone():
    """Autograd saves each base linear's weight for backward: a frozen chunk payload is model data, so
    offload copies the layers' activations only (a few kB), never the frozen weights (64 kB per layer)."""
    (offloaded,) = run_ranks(_offloaded, 1)
    weight = HID * HID * 4
    assert all(0 < moved < weight for moved in offloaded), offloaded


def test_planner_counts_frozen_parameters_at_their_payload_bytes(capsys):
    """``python -m ds_patrickstar.plan --frozen-params``: 2 bytes per frozen parameter in bf16 (divided over
    the ranks), 14 per trainable one, said per kind; the largest model it states is the largest trainable
    one beside the frozen base, and the largest frozen base beside the given trainable parameters."""
    from ds_patrickstar.plan import main

    report = main(["--params", "65536", "--frozen-params", "1048576", "--chunk-size", "65536", "--world-size", "2",
                   "--host-mem", "1GiB"])
    assert report["frozen_parameters"] == 1 << 20
    assert report["frozen_bytes_per_rank"] == 2 * (1 << 20) // 2
    assert report["model_data_bytes_per_rank"] == 14 * 65536 // 2 + 2 * (1 << 20) // 2
    out = capsys.readouterr().out
    assert "frozen base: 1.0M parameters, 0.00 GiB per rank" in out
    assert "model data per rank, in memory: 0.00 GiB = trainable 0.00 GiB (14 bytes per owned parameter) + " in out
    # the largest model: trainable parameters beside this rank's frozen bytes, or the frozen base beside the adapters
    trainable = (2**30 - report["frozen_bytes_per_rank"]) // 14 * 2
    frozen = (2**30 - 14 * 65536 // 2) // 2 * 2
    assert (report["largest_fitting_params"], report["largest_frozen_params"]) == (trainable, frozen)
    assert f"the largest trainable model that fits: about {trainable / 1e6:,.0f}M parameters" in out
    assert f"the largest frozen base that fits: about {frozen / 1e6:,.0f}M parameters" in out
    from ds_patrickstar.memory.preflight import check_fits

    with pytest.raises(ValueError, match="M trainable parameters beside this frozen base .or, with these"):
        check_fits(report["plan"], 0, 1 << 20, 2)
    # with the disk tier too, the trainable parameters are the model's (not the frozen bytes on disk)
    with_disk = main(["--params", "65536", "--frozen-params", "1048576", "--chunk-size", "65536", "--world-size",
                      "2", "--host-mem", "1GiB", "--disk"])
    assert with_disk["parameters"] == 65536 and with_disk["frozen_parameters"] == 1 << 20
    parts = ("trainable_bytes_in_memory", "frozen_bytes_in_memory", "disk_buffer_bytes")
    assert sum(with_disk[k] for k in parts) == with_disk["model_data_bytes_per_rank"]  # the line's parts add up


def test_planner_lines_add_up_with_frozen_chunks_on_disk(capsys):
    """A frozen base larger than the host: the model data in memory is its parts (trainable, frozen in memory,
    the disk tier's buffers), and the frozen base's bytes are in memory plus on disk."""
    from ds_patrickstar.plan import main

    report = main(["--params", "65536", "--frozen-params", str(64 * 65536), "--chunk-size", "65536",
                   "--host-mem", "2MiB", "--disk", "3"])
    assert report["frozen_chunks_disk"] > 0
    parts = report["trainable_bytes_in_memory"] + report["frozen_bytes_in_memory"] + report["disk_buffer_bytes"]
    assert parts == report["model_data_bytes_per_rank"]
    assert report["frozen_bytes_in_memory"] + report["frozen_bytes_disk"] == report["frozen_bytes_per_rank"]
    out = capsys.readouterr().out
    assert "model data per rank, in memory: " in out and " + disk tier buffers " in out
    assert "GiB of it on disk" in out and "counted in the model data above" in out


def _lora_engine():
    import deepspeed

    import ds_patrickstar  # noqa: F401

    cfg = {"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": "patrickstar", "chunk_size": 4096},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}}
    model, _ = build("lora")(SEED)
    params = [p for p in model.parameters() if p.requires_grad]
    return deepspeed.initialize(model=model, config=cfg, model_parameters=params)[0]


def _lora_steps(engine, first, count):
    batch_fn = classification_batches(SEED)
    losses = []
    for step in range(first, first + count):
        loss = engine(*batch_fn(step))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _save_resume(rank, world_size, ckpt_dir, exclude):
    from ds_patrickstar.io.checkpoint import consolidate_fp32_state_dict, load_file

    whole = _lora_steps(_lora_engine(), 0, 4)
    engine = _lora_engine()
    first = _lora_steps(engine, 0, 2)
    engine.save_checkpoint(ckpt_dir, tag="t", exclude_frozen_parameters=exclude)
    saved = set(load_file(os.path.join(ckpt_dir, "t", "mp_rank_00_model_states.pt"))["module"])
    consolidated = consolidate_fp32_state_dict(ckpt_dir, "t")
    trainable_only = consolidate_fp32_state_dict(ckpt_dir, "t", exclude_frozen_parameters=True)
    resumed = _lora_engine()
    with torch.no_grad():  # a resume from a checkpoint without frozen values keeps the model's own
        resumed.module.layers[0].base.weight.add_(0.0 if exclude else 1.0)
    resumed.load_checkpoint(ckpt_dir, tag="t")
    after = _lora_steps(resumed, 2, 2)
    return whole, first + after, saved, set(consolidated), set(trainable_only)


@pytest.mark.parametrize("exclude", [True, False])
def test_checkpoint_with_and_without_frozen_parameters_resumes_exactly(tmp_path, exclude):
    """``save_checkpoint(exclude_frozen_parameters=True)`` writes the trainable parameters (and their states)
    only, without it the frozen ones too; either way a resume trains on as if uninterrupted (losses equal
    bit for bit), and ``zero_to_fp32`` gives what was saved."""
    ((whole, resumed, saved, consolidated, trainable_only),) = run_ranks(_save_resume, 1, str(tmp_path), exclude)
    frozen = {n for n, p in LoraStack().named_parameters() if not p.requires_grad}
    trainable = {n for n, p in LoraStack().named_parameters() if p.requires_grad}
    assert resumed == whole
    assert trainable <= saved and trainable <= consolidated
    if exclude:
        assert not frozen & saved and not frozen & consolidated
    else:
        assert frozen <= saved and frozen <= consolidated
    # zero_to_fp32's --exclude_frozen_parameters: the trainable parameters (and any buffers) only
    assert trainable <= trainable_only and not frozen & trainable_only


def _init_and_load(rank, world_size, path):
    import deepspeed

    import ds_patrickstar

    cfg = {"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": "patrickstar", "chunk_size": 4096},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    with ds_patrickstar.Init(config=cfg):
        model = LoraStack()
    engine = deepspeed.initialize(model=model, config=cfg,
                                  model_parameters=[p for p in model.parameters() if p.requires_grad])[0]
    ds_patrickstar.load_pretrained(engine, path)
    chunk_map = engine.optimizer.chunk_map
    frozen = [p for p in model.parameters() if not p.requires_grad]
    in_chunks = all(chunk_map.info(p) is not None and not chunk_map.info(p).trainable for p in frozen)
    owned = sum(c.nbytes for c in chunk_map.owned_chunks() if not c.trainable)
    return in_chunks, owned, engine.get_fp32_state_dict()


def test_init_and_load_pretrained_fill_the_owned_frozen_slices_only(tmp_path):
    """Built under ``ds_patrickstar.Init`` and loaded with ``load_pretrained`` at two ranks, each rank holds
    half of the frozen base in its own frozen chunks (no whole copy), and the gathered values are the file's."""
    torch.manual_seed(3)
    values = LoraStack().state_dict()
    torch.save(values, tmp_path / "weights.pt")
    results = run_ranks(_init_and_load, 2, str(tmp_path / "weights.pt"))
    base = frozen_bytes("lora", "fp32")
    for in_chunks, owned, fp32 in results:
        assert in_chunks
        assert base / 2 <= owned <= base / 2 * 1.05, (owned, base)
        for name, value in values.items():
            torch.testing.assert_close(fp32[name], value, rtol=0, atol=0)
