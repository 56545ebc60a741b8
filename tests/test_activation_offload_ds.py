"""DeepSpeed's activation checkpointing and ``offload_activations`` (issue 20): ``deepspeed.checkpointing``
keeps a checkpointed block's inputs as attributes of its autograd context (``checkpoint``) or in its own
closure (``non_reentrant_checkpoint``), not as saved tensors. The strict emulated accelerator counts them
on the device for as long as they are held, and ``offload_activations`` moves them to the host between
the block's forward and its recomputation (see [Note: activation offload]). The model and the budget are
tests/test_activation_offload.py's; DeepSpeed's ``cpu_checkpointing`` stays off (it fails on a CPU-only
machine by itself, see tests/test_activation_checkpointing.py).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from harness import deepspeed_checkpointing
from test_activation_offload import (
    BATCH,
    BUDGET,
    LAYERS,
    SEED,
    SEQ,
    STEPS,
    WIDTH,
    Layer,
    TinyGPT,
    _batches,
    steps_then_eval,
)

INPUT_BYTES = BATCH * SEQ * WIDTH * 4  # one block's input, fp32


def _checkpoint(api: str):
    import deepspeed
    from torch.utils.checkpoint import checkpoint

    return {
        "ds": deepspeed.checkpointing.checkpoint,
        "ds_nonreentrant": deepspeed.checkpointing.non_reentrant_checkpoint,
        "torch_reentrant": lambda f, h: checkpoint(f, h, use_reentrant=True),
        "torch_nonreentrant": lambda f, h: checkpoint(f, h, use_reentrant=False),
    }[api]


class GatedLayer(Layer):
    """A layer that also takes a gate, one tensor given to every layer (as a mask would be)."""

    def forward(self, h, gate):
        return h + gate * (super().forward(h) - h)


class DsGPT(TinyGPT):
    """tests/test_activation_offload.py's GPT with each layer run through the checkpoint API ``api``;
    ``gated``: with a gate given to every layer (by keyword)."""

    def __init__(self, api: str, gated: bool = False) -> None:
        super().__init__(True)
        self.api, self.gated = api, gated
        if gated:
            self.layers = nn.ModuleList([GatedLayer() for _ in range(LAYERS)])

    def forward(self, tok, y):
        run = _checkpoint(self.api)
        h = self.wte(tok)
        gate = h[..., :1] * 0.5 + 0.5  # saved by no autograd node: only the blocks hold it
        for layer in self.layers:
            h = run(layer, h, gate=gate) if self.gated else run(layer, h)
        return F.cross_entropy(self.head(h).float().flatten(0, 1), y.flatten())


def _builder(api: str, gated: bool = False):
    def build(seed: int):
        torch.manual_seed(seed)
        return DsGPT(api, gated), _batches(seed)

    build.__name__ = f"build_ds_gpt_{api}{'_gated' if gated else ''}"
    return build


def _train(rank, world_size, api, stage, mode, budget, steps=STEPS, gas=1):
    """One run with DeepSpeed's checkpointing configured from the run's config (cpu_checkpointing off)."""
    from harness import ensure_distributed, make_config, run_training

    import ds_patrickstar  # noqa: F401

    extra = None
    if stage == "patrickstar":
        extra = {"emulate_accelerator": True, "device_budget": budget, "offload_activations": mode}
    config = make_config(stage, "fp32", gas=gas, chunk_size=2048, extra_zero=extra)
    ensure_distributed()
    with deepspeed_checkpointing(config):
        return run_training(_builder(api), config, steps, SEED)


@pytest.mark.parametrize("api", ["ds", "ds_nonreentrant"])
def test_held_inputs_count_on_the_device(api):
    """DeepSpeed's checkpoints hold each block's input outside autograd's saved tensors: the meter
    counts it all the same, so the budget at which torch's reentrant checkpoint does not fit (see
    tests/test_activation_offload.py) does not fit DeepSpeed's either, and the peak of activation
    bytes is the same at a budget where both fit."""
    from multiproc import WorkerError, run_ranks

    with pytest.raises(WorkerError, match="DeviceBudgetExceeded"):
        run_ranks(_train, 1, api, "patrickstar", "none", BUDGET, 1)
    ours = run_ranks(_train, 1, api, "patrickstar", "none", 10**6, 1)[0].counters[0]
    torch_ = run_ranks(_train, 1, "torch_reentrant", "patrickstar", "none", 10**6, 1, memo=True)[0].counters[0]
    assert ours["peak_activation_bytes_device"] == torch_["peak_activation_bytes_device"] > 0


# Stock ZeRO-3 cannot run DeepSpeed's non-reentrant checkpoint (see tests/test_activation_checkpointing.py):
# the reference is then torch's non-reentrant checkpoint, the same computation.
REFERENCE_API = {"ds_nonreentrant": "torch_nonreentrant"}


@pytest.mark.parametrize("api,mode,gas", [("ds", "all", 1), ("ds", "auto", 1), ("ds_nonreentrant", "all", 1),
                                          ("ds", "all", 2)])
def test_offload_matches_zero3(api, mode, gas):
    """At the budget that DeepSpeed's checkpointing alone does not fit, offloading its held inputs makes
    it fit: losses and fp32 weights equal stock ZeRO-3's with the same checkpointing (and gradient
    accumulation), every byte copied out comes back, "all" moves every block's input but the last
    one's (no hook tells when its backward comes: it stays) in every micro-step, "auto" moves some
    after the traced iteration, not all."""
    from multiproc import run_ranks
    from test_vs_zero3 import check

    ref = run_ranks(_train, 1, REFERENCE_API.get(api, api), 3, "none", 0, STEPS, gas, memo=True)[0]
    ours = run_ranks(_train, 1, api, "patrickstar", mode, BUDGET, STEPS, gas)[0]
    check(ours, ref, "fp32")
    moved = [c["activation_bytes_offloaded"] for c in ours.counters]
    assert moved == [c["activation_bytes_restored"] for c in ours.counters], ours.counters
    assert moved[0] >= gas * (LAYERS - 1) * INPUT_BYTES, moved
    if mode == "all":
        assert moved == [moved[0]] * STEPS, moved
    else:
        assert all(0 < m < moved[0] for m in moved[1:]), moved


def _losses(api: str, mode: str, wait: bool, gated: bool = False, copies: type | None = None) -> list[float]:
    import deepspeed

    import ds_patrickstar  # noqa: F401
    from ds_patrickstar.activations.copies import StorageCopies

    class NoWaitForHeld(StorageCopies):
        """Reads a held input as soon as its copy back is issued (test only); saved tensors are waited on."""

        def wait_before_use(self, entry) -> None:
            if entry.held is None:
                super().wait_before_use(entry)
            else:
                self.back_home(entry)

    model, batch = _builder(api, gated)(SEED)
    zero = {"stage": "patrickstar", "chunk_size": 2048, "emulate_accelerator": True, "device_budget": 10**6,
            "offload_activations": mode}
    config = {"train_micro_batch_size_per_gpu": BATCH, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": zero}
    with deepspeed_checkpointing(config):
        engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
        if not wait:
            engine.optimizer.placement.activations.copies.__class__ = NoWaitForHeld
        if copies is not None:
            engine.optimizer.placement.activations.copies.__class__ = copies
        try:
            return steps_then_eval(engine, batch)
        finally:
            engine.destroy()


def test_read_before_the_copy_back_completes_changes_the_numbers(dist):
    """The strict accelerator poisons a copy's destination (NaN) until it is waited on: a held input
    read by the recomputation without the wait in the hook before its block's backward gives NaN
    gradients (the step is skipped as an overflow), and the next losses change; with it, offload
    changes nothing."""
    stay = _losses("ds", "none", wait=True)
    assert _losses("ds", "all", wait=True) == stay
    broken = _losses("ds", "all", wait=False)
    assert broken[0] == stay[0] and broken[1] != stay[1] and broken[2] != stay[2], (broken, stay)


def test_a_held_input_brought_back_ahead_goes_back_and_comes_again_at_its_own_backward(dist):
    """Every segment brought back ahead (a DeepSpeed checkpoint's held input among its storages) has its copy back
    undone at once, as a give-way does (see [Note: activations give way] in activations/give_way.py): the held input
    is emptied again and the hook before its block's backward brings it back and waits. The losses are those of
    the run keeping every activation, and held inputs were among the storages called back."""
    from ds_patrickstar.activations.copies import StorageCopies
    from ds_patrickstar.activations.give_way import give_way
    from ds_patrickstar.activations.storages import State

    held_called: list[object] = []

    class CallBackEveryPrefetch(StorageCopies):
        def needed_in_backward(self, segment) -> None:
            super().needed_in_backward(segment)
            previous = segment.previous
            if previous is not None and previous.restore_at >= 0 and not previous.begun:
                held = [e for e in previous.entries if e.held is not None and e.state is State.TO_DEVICE]
                assert give_way([previous], None, self, self._clock(), 1 << 40).called_back == [previous]
                held_called.extend(e for e in held if e.state is State.ON_HOST)

    stay = _losses("ds", "none", wait=True)
    assert _losses("ds", "all", wait=True, copies=CallBackEveryPrefetch) == stay
    assert held_called


def test_an_input_of_every_block_stays(dist):
    """A tensor given to every block (by keyword, through DeepSpeed's checkpoint) is a held input of the
    first block and the input of the next: it stays on the accelerator (emptied, the second block's
    forward would fail), and offload changes nothing."""
    assert _losses("ds", "all", wait=True, gated=True) == _losses("ds", "none", wait=True, gated=True)


def _cuda_run(mode: str) -> tuple[list[float], list[dict]]:
    import deepspeed
    import harness

    import ds_patrickstar  # noqa: F401

    harness.ensure_distributed()
    model, batch = _builder("ds")(SEED)
    zero = {"stage": "patrickstar", "chunk_size": 2048, "offload_activations": mode}
    config = {"train_micro_batch_size_per_gpu": BATCH, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": zero}
    losses, counters = [], []
    with harness.deepspeed_checkpointing(config):
        engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
        try:
            for step in range(STEPS):
                loss = engine(*(t.cuda() for t in batch(step)))
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
                counters.append(engine.get_patrickstar_counters())
        finally:
            engine.destroy()
    return losses, counters


@pytest.mark.gpu
def test_cuda_held_inputs_move_and_come_back():
    """On CUDA (copy stream, events, the stream wait in the hook before a block's backward): DeepSpeed's
    checkpoint with every block's input offloaded trains as without offload, and every byte comes back."""
    stay, _ = _cuda_run("none")
    moved, counters = _cuda_run("all")
    assert moved == pytest.approx(stay, rel=1e-5), (moved, stay)
    out = [c["activation_bytes_offloaded"] for c in counters]
    assert out == [c["activation_bytes_restored"] for c in counters], counters
    assert all(o >= (LAYERS - 1) * INPUT_BYTES for o in out), out
