"""[Note: clean evictions] on the strict twin: a chunk evicted unchanged since it came copies nothing (frozen
layers always, trainable ones in forward), the move model predicts the bytes that do move, a write between
steps is not lost, and a write that bypasses the payload's version counter fails at the eviction."""
import harness
import pytest
import torch
from test_placement import BATCH, HIDDEN, _config, _mlp

BUDGET = 300_000  # below the MLP's 822 KB of chunks: evictions every step


def _train(stage, steps, frozen=0, write_at=None, **zero):
    """Losses and per-step counters of the MLP with its first ``frozen`` linear layers frozen; at step
    ``write_at`` the first layer's weight is halved through ``GatheredParameters`` between steps."""
    import deepspeed

    harness.ensure_distributed()
    model = _mlp()
    for layer in list(model)[: 2 * frozen]:
        for param in layer.parameters():
            param.requires_grad_(False)
    config = _config(stage, **zero)
    engine, *_ = deepspeed.initialize(model=model, config=config,
                                      model_parameters=[p for p in model.parameters() if p.requires_grad])
    gen, losses, counters = torch.Generator().manual_seed(1), [], []
    for step in range(steps):
        if step == write_at:
            with deepspeed.zero.GatheredParameters(model[0].weight, modifier_rank=0), torch.no_grad():
                model[0].weight.mul_(0.5)
        x, y = torch.randn(BATCH, HIDDEN, generator=gen), torch.randn(BATCH, HIDDEN, generator=gen)
        loss = ((engine(x) - y) ** 2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if hasattr(engine, "get_patrickstar_counters"):
            counters.append(engine.get_patrickstar_counters())
    return engine, losses, counters


def test_frozen_layers_and_forward_evictions_copy_nothing_and_the_rest_is_predicted(monkeypatch):
    from ds_patrickstar.integration import assembly

    ref = _train(3, 4, frozen=3)[1]
    engine, ours, counters = _train("patrickstar", 4, frozen=3, emulate_accelerator=True, device_budget=BUDGET)
    engine.destroy()
    monkeypatch.setattr(assembly, "_keeps_copies", lambda *args: False)  # every eviction copies, as before
    engine, copied, before = _train("patrickstar", 4, frozen=3, emulate_accelerator=True, device_budget=BUDGET)
    engine.destroy()
    assert ours == copied == ref
    for c, b in zip(counters[1:], before[1:]):  # steady steps
        assert c["clean_evictions"] > 0 and b["clean_evictions"] == 0
        assert c["bytes_to_device"] == b["bytes_to_device"] and c["bytes_to_host"] < b["bytes_to_host"]
        assert (c["predicted_bytes_to_device"], c["predicted_bytes_to_host"]) == (c["bytes_to_device"],
                                                                                 c["bytes_to_host"])


def test_a_write_between_steps_is_copied_back_not_dropped(monkeypatch):
    """The written chunk's payload moved its version: its eviction copies the write out. The oracle is the same
    run with every eviction copying (stock ZeRO-3 leaves its fp32 master out of such a write, 4e-6 apart)."""
    from ds_patrickstar.integration import assembly

    twin = {"emulate_accelerator": True, "device_budget": BUDGET}
    engine, ours, counters = _train("patrickstar", 5, write_at=2, **twin)
    engine.destroy()
    unwritten = _train("patrickstar", 5, **twin)
    unwritten[0].destroy()
    monkeypatch.setattr(assembly, "_keeps_copies", lambda *args: False)
    engine, copied, _ = _train("patrickstar", 5, write_at=2, **twin)
    engine.destroy()
    assert ours == copied and counters[-1]["clean_evictions"] > 0
    assert ours[:2] == unwritten[1][:2] and ours[2] != unwritten[1][2]  # the write took effect (before step 2)


def test_a_write_no_version_counted_fails_at_the_eviction():
    from ds_patrickstar.memory.emulated import CopyHazard

    engine, _, _ = _train("patrickstar", 2, emulate_accelerator=True, device_budget=BUDGET)
    manager = engine.optimizer.manager
    x = torch.randn(BATCH, HIDDEN, generator=torch.Generator().manual_seed(3))
    engine(x)  # a forward brings chunks in, each keeping its host buffer
    kept = [c for c in manager.map.chunks if c.clean is not None]
    assert kept, "a forward at this budget brings chunks that keep their host buffer"
    kept[0].payload.data.add_(1.0)  # through .data: the payload's version counter does not move
    with pytest.raises(CopyHazard, match="did not change its version"):
        manager.placement.evict(kept[0])
    engine.destroy()


def test_the_step_gives_back_the_trainable_chunks_buffers_and_frozen_ones_keep_theirs():
    from ds_patrickstar.chunks.chunk import Chunk
    from ds_patrickstar.chunks.kind import ChunkKind
    from ds_patrickstar.counters import StepCounters
    from ds_patrickstar.store.clean_copies import CleanCopies

    copies = CleanCopies(accel=None, counters=StepCounters())  # keeping and giving back touch no accelerator
    copies.enabled = True
    trainable = Chunk(0, 4, torch.float32, 0, payload=torch.zeros(4))
    frozen = Chunk(1, 4, torch.float32, 0, payload=torch.zeros(4), kind=ChunkKind.FROZEN)
    assert copies.keep(trainable, torch.zeros(4)) and copies.keep(frozen, torch.zeros(4))
    given_back = copies.step_begins()
    assert [chunk for chunk, _ in given_back] == [trainable] and trainable.clean is None
    assert frozen.clean is not None  # the step does not write a frozen chunk
    assert not copies.keep(trainable, torch.zeros(4))  # nothing is kept while the step runs
    copies.step_ends()
    assert copies.keep(trainable, torch.zeros(4))
