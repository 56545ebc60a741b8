"""Issue 43: what ZeRO-3's clients call on the engine besides the training loop, against stock ZeRO-3 on
the same model and seed (one in-process rank, fp32, tiny models): the stage the engine answers, a load
from a folder without ``latest``, partial loads (``load_optimizer_states=False``, ``load_module_only``),
``coalesce_grad_reduction``; see [Note: the stage clients see]."""
from __future__ import annotations

import contextlib
import logging

import harness
import pytest
import torch
from harness import make_config

STEPS_BEFORE_SAVE, STEPS_AFTER_SAVE = 2, 2


@pytest.fixture(autouse=True)
def _world():
    harness.ensure_distributed()


def _engine(stage, gas=1, **zero):
    import deepspeed

    import ds_patrickstar  # noqa: F401

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 2))
    cfg = make_config(stage, chunk_size=1024, gas=gas, lr=1e-2, extra_zero=zero or None)
    return deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())[0], cfg


def _batches(n, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(4, 8, generator=generator) for _ in range(n)]


def _train(engine, batches):
    for x in batches:
        engine.backward(engine(x).pow(2).mean())
        engine.step()


def _weights(engine, cfg):
    return harness.read_weights(engine, cfg)[0]


def _max_diff(a, b):
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_the_engine_answers_stage_3_and_its_16bit_state_dict_is_the_models():
    engine, cfg = _engine("patrickstar")
    _train(engine, _batches(1))
    assert engine.zero_optimization_stage() == 3  # what clients read to decide whether to gather
    assert not engine.zero_optimization_partition_weights()  # DeepSpeed's own stage-3 paths stay off
    full = engine._zero3_consolidated_16bit_state_dict()
    assert full.keys() == engine.module.state_dict().keys()
    assert _max_diff({k: v.float() for k, v in full.items()}, _weights(engine, cfg)) == 0.0
    assert engine._consolidated_16bit_state_dict().keys() == full.keys()
    engine.destroy()


def test_load_checkpoint_from_a_folder_without_latest_returns_none_none(tmp_path, caplog):
    engine, _ = _engine("patrickstar")
    with caplog.at_level(logging.WARNING, logger="ds_patrickstar.integration.stage_answers"):
        assert engine.load_checkpoint(str(tmp_path)) == (None, None)
    assert f"no 'latest' file at {tmp_path / 'latest'}" in caplog.text
    engine.destroy()


def _partial_load_run(stage, tmp_path, **load_kwargs):
    """Train, save, train on (weights and Adam state move), load the module only, train on."""
    engine, cfg = _engine(stage)
    batches = _batches(STEPS_BEFORE_SAVE + 2 * STEPS_AFTER_SAVE)
    _train(engine, batches[:STEPS_BEFORE_SAVE])
    folder = tmp_path / str(stage)
    engine.save_checkpoint(str(folder), tag="saved")
    saved = _weights(engine, cfg)
    _train(engine, batches[STEPS_BEFORE_SAVE:STEPS_BEFORE_SAVE + STEPS_AFTER_SAVE])
    path, _ = engine.load_checkpoint(str(folder), tag="saved", **load_kwargs)
    assert path is not None
    loaded = _weights(engine, cfg)
    _train(engine, batches[STEPS_BEFORE_SAVE + STEPS_AFTER_SAVE:])
    after = _weights(engine, cfg)
    engine.destroy()
    return saved, loaded, after


# ZeRO-3's model file holds no parameter values (its partitions are in the optimizer files), so its
# load_module_only keeps the weights it has; stage 2's holds them, and is the reference for what the call promises.
@pytest.mark.parametrize("load_kwargs,reference", [
    ({"load_optimizer_states": False}, 3),
    ({"load_module_only": True}, 2),
], ids=["no_optimizer_states", "module_only"])
def test_partial_loads_match_stock(tmp_path, load_kwargs, reference):
    saved, loaded, after = _partial_load_run("patrickstar", tmp_path, **load_kwargs)
    assert _max_diff(saved, loaded) == 0.0  # the module's values, in the chunks and the fp32 masters
    ref_saved, ref_loaded, ref_after = _partial_load_run(reference, tmp_path, **load_kwargs)
    assert _max_diff(saved, ref_saved) < 1e-6 and _max_diff(loaded, ref_loaded) < 1e-6
    assert _max_diff(after, ref_after) < 1e-6  # trained on from the loaded weights with the Adam state kept


def _coalesced_run(stage, coalesce):
    engine, cfg = _engine(stage, gas=2)
    batches = _batches(4)
    for step in range(2):
        with engine.coalesce_grad_reduction() if coalesce else contextlib.nullcontext():
            for i, x in enumerate(batches[2 * step:2 * step + 2]):
                engine.set_gradient_accumulation_boundary(i == 1)
                engine.backward(engine(x).pow(2).mean())
        engine.step()
    out = _weights(engine, cfg)
    engine.destroy()
    return out


def test_coalesce_grad_reduction_trains_as_accumulation_does_in_zero3():
    ours = _coalesced_run("patrickstar", coalesce=True)
    assert _max_diff(ours, _coalesced_run(3, coalesce=False)) < 1e-6


def test_coalesce_grad_reduction_refuses_step_inside():
    engine, _ = _engine("patrickstar", gas=2)
    with pytest.raises(AssertionError), engine.coalesce_grad_reduction():
        engine.step()
    engine.destroy()
