"""``engine.destroy()`` ends an engine: its memory goes back at once, and once the caller lets go of
it the engine is garbage (several engines in one process: sweeps, tests, HF hyper-parameter search).

Each case trains two steps of the checkpointed TinyGPT of tests/test_activation_offload.py on the
plain host, on the strict emulated accelerator, with activation offload on it, and with the disk tier
of the optimizer states on it.
"""
from __future__ import annotations

import gc
import threading
import weakref

import pytest
import torch

EMULATED = {"emulate_accelerator": True, "device_budget": 10**6}
ZERO = {
    "host": {},
    "emulated": EMULATED,
    "offload": {**EMULATED, "offload_activations": "all"},
    "disk": EMULATED,  # and the disk tier, in the test's tmp_path
}


def _disk_threads(before: frozenset = frozenset()) -> list[str]:
    """The disk tier's I/O threads alive now, less those of ``before`` (threads of engines that another test
    of this process left to the interpreter's exit)."""
    return [t.name for t in threading.enumerate() if t.name.startswith("ds_ps_") and t not in before]


def _trained_engine(kind: str, tmp_path, world_size: int = 1):
    """(engine, the user's model, the batch) after two training steps (after the first, traced, one
    placement brings chunks and optimizer states to the accelerator)."""
    import deepspeed
    from harness import make_config
    from test_activation_offload import build_checkpointed
    from test_disk_tier import disk_zero

    import ds_patrickstar  # noqa: F401

    model, batch = build_checkpointed(0)
    zero = {**ZERO[kind], **(disk_zero(tmp_path, io_backend="threads") if kind == "disk" else {})}
    config = make_config("patrickstar", chunk_size=2048, extra_zero=zero)
    if world_size > 1:
        config.pop("train_batch_size")
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    inputs = batch(0)
    for _ in range(2):
        engine.backward(engine(*inputs))
        engine.step()
    return engine, model, inputs


@pytest.mark.parametrize("kind", list(ZERO))
def test_destroyed_engine_is_garbage(dist, kind, tmp_path):
    """After destroy, with no reference left to the engine, the engine, its optimizer and a chunk
    payload are collected, though the caller keeps the model and the batch (before: a
    post-accumulate-grad hook on every parameter, which torch holds where gc does not look, kept
    the whole engine alive; and DeepSpeed's forward hooks on the module held it through the model).
    The disk tier's I/O threads have stopped and its files are gone."""
    before = frozenset(threading.enumerate())
    engine, model, inputs = _trained_engine(kind, tmp_path)
    if kind == "disk":
        assert engine.get_patrickstar_counters()["model_bytes_disk"] > 0 and _disk_threads(before)
    refs = {
        "engine": weakref.ref(engine),
        "optimizer": weakref.ref(engine.optimizer),
        "chunk payload": weakref.ref(engine.optimizer.chunk_map.chunks[0].payload),
    }
    engine.destroy()
    del engine
    gc.collect()
    assert [name for name, ref in refs.items() if ref() is not None] == []
    assert model is not None and inputs is not None  # kept to the end
    assert _disk_threads(before) == [] and [p for p in tmp_path.rglob("*") if p.is_file()] == []


@pytest.mark.parametrize("kind", ["emulated", "offload", "disk"])
def test_destroy_returns_memory_of_a_kept_engine(dist, kind, tmp_path):
    """Destroy gives back every accelerator byte (chunks, optimizer states) and every pinned host
    buffer at once, even while the caller still holds the engine (before: all of it stayed charged);
    destroying twice is harmless."""
    from ds_patrickstar.memory.emulated import _PINNED

    engine, _, _ = _trained_engine(kind, tmp_path)
    accel, disk = engine.optimizer.accel, engine.optimizer.optim_states.disk
    assert accel.host_pool.allocated > 0 and (disk.buffer_bytes if disk else accel.ledger.total) > 0  # to give back
    engine.destroy()
    assert accel.ledger.total == 0, accel.ledger.by_kind
    assert accel.host_pool.allocated == 0 and accel.host_bytes_allocated() == accel.torch_pinned.allocated
    assert not set(accel._pinned) & set(_PINNED)
    assert disk is None or disk.buffer_bytes == 0
    engine.destroy()
    assert accel.ledger.total == 0


def _weights(model) -> dict:
    return {name: value.clone() for name, value in model.state_dict().items()}


@pytest.mark.parametrize("kind", ["host", "offload"])
def test_a_destroyed_engines_model_keeps_its_weights_and_trains_on(dist, kind, tmp_path):
    """Destroy gives every parameter its trained values back as a host tensor of its own (before: the
    parameters stayed views of the freed chunks, and reading one crashed the process): the model
    equals its state_dict taken before destroy, exactly, and a new engine from it trains on (the Hugging
    Face Trainer's second ``train()``), its first loss that of the model's own forward."""
    import deepspeed

    engine, model, inputs = _trained_engine(kind, tmp_path)
    before, config = _weights(engine.module), engine.config
    engine.destroy()
    after = _weights(model)
    assert before.keys() == after.keys()
    assert [name for name in before if not torch.equal(before[name], after[name])] == []
    with torch.no_grad():
        expected = model(*inputs).item()
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    loss = engine(*inputs)
    engine.backward(loss)
    engine.step()
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    engine.destroy()


def test_destroy_between_backward_and_step_keeps_the_weights(dist, tmp_path):
    """Between backward and step the slots hold gradients: the weights come from the fp32 masters."""
    engine, model, inputs = _trained_engine("host", tmp_path)
    before = _weights(engine.module)
    engine.backward(engine(*inputs))
    engine.destroy()
    after = _weights(model)
    assert [name for name in before if not torch.equal(before[name], after[name])] == []


def test_destroy_that_cannot_read_the_weights_back_leaves_empty_parameters(dist, tmp_path, monkeypatch, caplog):
    """Where the values cannot be read back, destroy still frees everything, warns, and leaves each
    parameter empty (never a view of freed memory); a new engine from that model says why it cannot."""
    import deepspeed

    engine, model, _ = _trained_engine("host", tmp_path)
    config = engine.config

    def broken(**_):
        raise RuntimeError("read failed")

    monkeypatch.setattr(engine.optimizer.export, "iter_host_values", broken)
    engine.destroy()
    assert "did not read the weights back" in caplog.text
    assert {p.numel() for p in model.parameters()} == {0}
    with pytest.raises(ValueError, match=r"holds no values: its engine.s destroy\(\) warned"):
        deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())


def _teardown_on_ranks(rank, world_size):
    """(ledger total, pinned bytes of the pool, engine collected, model kept its weights) after destroy
    on each rank."""
    engine, model, _ = _trained_engine("emulated", None, world_size)
    accel, ref = engine.optimizer.accel, weakref.ref(engine)
    assert accel.ledger.total > 0
    before = _weights(engine.module)  # a collective: every rank gets every weight
    engine.destroy()
    del engine
    gc.collect()
    kept = all(torch.equal(value, model.state_dict()[name]) for name, value in before.items())
    return accel.ledger.total, accel.host_pool.allocated, ref() is None, kept


def test_destroy_on_two_ranks():
    """With data parallelism too (gathered groups' flat storages, the landing slots): every rank gives
    back all it held, its engine is garbage, and its model holds every weight (gathered at destroy)."""
    from multiproc import run_ranks

    assert run_ranks(_teardown_on_ranks, 2) == [(0, 0, True, True)] * 2


def _validation_forward_then_destroy(rank, world_size, kind):
    """Two steps, then a validation forward under grad mode whose loss is never backwarded, then
    destroy: the names of the weights destroy did not keep."""
    engine, model, inputs = _trained_engine(kind, None, world_size)
    engine(*inputs)  # a validation loss, computed with grad on and not backwarded
    before = _weights(engine.module)  # a collective: every rank gets every weight
    engine.destroy()
    after = _weights(model)
    return [name for name in before if not torch.equal(before[name], after.get(name, torch.empty(0)))]


def test_destroy_after_a_forward_without_backward_keeps_the_weights_on_two_ranks():
    """A forward without backward opens no iteration (see [Note: run state]): destroy gathers the weights
    on every rank instead of leaving the parameters empty as if a rank had failed mid-iteration."""
    from multiproc import run_ranks

    assert run_ranks(_validation_forward_then_destroy, 2, "emulated") == [[]] * 2
