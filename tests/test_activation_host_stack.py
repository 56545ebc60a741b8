"""Pinned host memory of offloaded activations (issue 42, measured on an H200: gpt2-medium's forward took
0.58-1.04 s where its offloaded 2.8 GB a step were pinned anew each step): one stack of slabs, pinned once
and kept across steps, also where batches are padded per step (see [Note: activation host stack])."""
from __future__ import annotations

import torch

from ds_patrickstar.activations.host_stack import BLOCK_ALIGNMENT, HostStack
from ds_patrickstar.memory.emulated import EmulatedAccelerator


def _stack() -> tuple[EmulatedAccelerator, HostStack]:
    accel = EmulatedAccelerator(1 << 20)
    return accel, HostStack(accel)


def _step(stack: HostStack, sizes: list[int]) -> None:
    """A forward's takes and a backward's gives, newest first."""
    blocks = [stack.take(n) for n in sizes]
    for block in reversed(blocks):
        stack.give(block)


def test_a_step_pins_once_then_the_stack_is_one_slab_that_later_steps_reuse():
    accel, stack = _stack()
    sizes = [3000, 5000, 1000, 7000]
    _step(stack, sizes)
    assert stack.slabs_taken > 1  # grown during the first step ...
    laid_out = stack.slabs_taken
    assert stack.slab_bytes == sum(-(-n // BLOCK_ALIGNMENT) * BLOCK_ALIGNMENT for n in sizes)  # ... then one slab
    pinnings = accel.host_pool.pinnings
    for shorter in (sizes, [n // 2 for n in sizes], [16_000], sizes):
        _step(stack, shorter)
    assert stack.slabs_taken == laid_out and accel.host_pool.pinnings == pinnings
    assert accel.host_bytes_allocated() == stack.slab_bytes  # counted where every pinned byte is


def test_a_block_given_back_below_the_top_waits_for_the_blocks_above_it():
    _, stack = _stack()
    low, mid, top = stack.take(512), stack.take(512), stack.take(512)
    stack.give(mid)
    assert stack.extent == 3 * 512
    stack.give(top)
    assert stack.extent == 512  # the top popped through the free middle block
    again = stack.take(512)
    assert again.data_ptr() == mid.data_ptr()
    stack.give(again)
    stack.give(low)
    assert stack.extent == 0


def test_bytes_a_copy_still_reads_are_not_handed_out_before_it_has_run():
    """The strict accelerator's copy back reads the block when it runs: reusing the bytes before would
    restore what the next copy out wrote there."""
    accel, stack = _stack()
    host = stack.take(4096)
    accel.copy(host, torch.full((4096,), 7, dtype=torch.uint8)).wait()
    device = torch.empty(4096, dtype=torch.uint8)
    back = accel.copy(device, host)  # enqueued, not run
    stack.give(host, after=back)
    assert stack.extent > 0  # held for the copy
    reused = stack.take(4096)
    assert back.done() and reused.data_ptr() == host.data_ptr()  # waited on, then handed out again
    back.wait()
    assert bool((device == 7).all())


def test_reset_lays_out_the_planned_bytes_and_nothing_for_none():
    accel, stack = _stack()
    _step(stack, [4096, 4096])
    stack.reset(4096)
    assert stack.slab_bytes == 4096
    stack.reset(0)
    assert stack.slab_bytes == 0 and accel.host_bytes_allocated() == 0


def test_padded_batches_pin_nothing_after_the_first_step_and_train_as_without_offload(dist):
    """Offload "all" of a checkpointed GPT, each step's batch a different length (none longer than the
    first): the host pool pins nothing after the first step (each step pinned its activations anew before),
    and the losses are those of the same run keeping its activations."""
    import deepspeed
    from test_activation_offload import SEED, build_checkpointed

    import ds_patrickstar  # noqa: F401

    lengths = [32, 24, 32, 16, 28]
    runs: dict[str, tuple[list[float], list[int]]] = {}
    for mode in ("none", "all"):
        model, batch = build_checkpointed(SEED)
        zero = {"stage": "patrickstar", "chunk_size": 2048, "emulate_accelerator": True, "device_budget": 10**6,
                "offload_activations": mode}
        config = {"train_micro_batch_size_per_gpu": 8, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                  "zero_optimization": zero}
        engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
        pool = engine.optimizer.accel.host_pool
        losses, pinnings, counted = [], [], []
        for step, length in enumerate(lengths):
            tok, target = batch(step)
            loss = engine(tok[:, :length], target[:, :length])
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            pinnings.append(pool.pinnings)
            counted.append(engine.get_patrickstar_counters()["host_pinnings"])
        runs[mode] = losses, pinnings
        assert counted[1:] == [0] * (len(lengths) - 1) and (counted[0] > 0) == (mode == "all"), counted  # the counter
        engine.destroy()
    losses, pinnings = runs["all"]
    assert losses == runs["none"][0]
    assert pinnings[0] > runs["none"][1][0]  # the first step pinned the stack ...
    assert pinnings[1:] == [pinnings[0]] * (len(lengths) - 1), pinnings  # ... and no step after it pinned
