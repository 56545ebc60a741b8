"""What Hugging Face configs bring that needs no Hugging Face install: "no offload" blocks,
the optimizer block built as a plain torch Adam/AdamW (no DeepSpeed op), and the warning for
a multi-process launch that reached DeepSpeed as one process. Single rank, in-process."""
import logging

import pytest
import torch
from harness import make_config


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 2))


def _init(config):
    import deepspeed

    import ds_patrickstar  # noqa: F401

    model = _model()
    return deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())[0]


def _step(engine):
    loss = engine(torch.randn(8, 8)).pow(2).mean()
    engine.backward(loss)
    engine.step()
    return loss.item()


@pytest.fixture
def no_deepspeed_adam(monkeypatch):
    """Building DeepSpeed's FusedAdam or DeepSpeedCPUAdam (a JIT op build) fails the test."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam

    def refuse(self, *args, **kwargs):
        raise AssertionError(f"{type(self).__name__} was built")

    monkeypatch.setattr(FusedAdam, "__init__", refuse)
    monkeypatch.setattr(DeepSpeedCPUAdam, "__init__", refuse)


# ---- offload blocks ---------------------------------------------------------------------
def test_offload_device_none_is_accepted_with_the_stock_keys_info_line(dist, caplog):
    cfg = make_config("patrickstar", chunk_size=1024)
    cfg["zero_optimization"].update(offload_optimizer={"device": "none", "pin_memory": True},
                                    offload_param={"device": "none", "pin_memory": True}, overlap_comm=True)
    with caplog.at_level(logging.INFO, logger="ds_patrickstar.integration.stock_keys"):
        engine = _init(cfg)
    said = [r.getMessage() for r in caplog.records if r.name == "ds_patrickstar.integration.stock_keys"]
    assert len(said) == 1 and "offload_optimizer, offload_param: no offload" in said[0], said
    assert torch.isfinite(torch.tensor(_step(engine)))


@pytest.mark.parametrize("key", ["offload_optimizer", "offload_param"])
def test_offload_device_cpu_is_accepted_saying_what_it_does(dist, key, caplog):
    cfg = make_config("patrickstar", chunk_size=1024)
    cfg["zero_optimization"][key] = {"device": "cpu", "pin_memory": True}
    with caplog.at_level(logging.INFO, logger="ds_patrickstar.integration.stock_keys"):
        engine = _init(cfg)
    assert f"{key}: placement may keep" in caplog.text
    assert torch.isfinite(torch.tensor(_step(engine)))


# ---- the optimizer block -----------------------------------------------------------------
@pytest.mark.parametrize("kind,extra,expected", [
    ("AdamW", {}, torch.optim.AdamW),
    ("Adam", {}, torch.optim.AdamW),  # DeepSpeed's "Adam" means AdamW unless adam_w_mode is false
    ("Adam", {"adam_w_mode": False}, torch.optim.Adam),
    ("AdamW", {"adam_w_mode": False}, torch.optim.AdamW),
    ("adam", {"torch_adam": True, "adam_w_mode": False}, torch.optim.Adam),
])
def test_optimizer_block_builds_a_torch_adam_and_no_deepspeed_op(dist, no_deepspeed_adam, kind, extra, expected):
    cfg = make_config("patrickstar", chunk_size=1024, optimizer_type=kind)
    cfg["optimizer"]["params"] = {"lr": 3e-3, "betas": [0.8, 0.99], "eps": 1e-6, "weight_decay": 0.05, **extra}
    engine = _init(cfg)
    assert type(engine.basic_optimizer) is expected
    assert engine.optimizer.adam.adamw == (expected is torch.optim.AdamW)
    group = engine.basic_optimizer.param_groups[0]
    assert (group["lr"], tuple(group["betas"]), group["eps"], group["weight_decay"]) == (3e-3, (0.8, 0.99), 1e-6, 0.05)
    assert torch.isfinite(torch.tensor(_step(engine)))


def test_optimizer_block_defaults_are_fusedadams(dist, no_deepspeed_adam):
    """Missing values are FusedAdam's (weight_decay 0), not torch AdamW's (0.01)."""
    cfg = make_config("patrickstar", chunk_size=1024)
    cfg["optimizer"]["params"] = {}
    group = _init(cfg).basic_optimizer.param_groups[0]
    assert (group["lr"], tuple(group["betas"]), group["eps"], group["weight_decay"]) == (1e-3, (0.9, 0.999), 1e-8, 0.0)


@pytest.mark.parametrize("params,message", [
    ({"lr": 1e-3, "momentum": 0.9}, r"optimizer\.params\.momentum=0\.9 is not an Adam option known to stage "
                                    r"'patrickstar'; the options are: adam_w_mode, betas, bias_correction, .*lr"),
    ({"max_grad_norm": 1.0}, r"optimizer\.params\.max_grad_norm is not supported; use the DeepSpeed key "
                             r"\"gradient_clipping\""),
])
def test_optimizer_block_with_a_key_adam_does_not_have(dist, params, message):
    cfg = make_config("patrickstar", chunk_size=1024)
    cfg["optimizer"]["params"] = params
    with pytest.raises(ValueError, match=message):
        _init(cfg)


# ---- one process where several were launched --------------------------------------------
def _world_warnings(caplog):
    _init(make_config("patrickstar", chunk_size=1024))
    return [r.getMessage() for r in caplog.records if r.name == "ds_patrickstar.integration.registration"]


def test_world_size_in_the_environment_but_one_rank_warns_with_the_fix(dist, monkeypatch, caplog):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with caplog.at_level(logging.WARNING, logger="ds_patrickstar.integration.registration"):
        messages = _world_warnings(caplog)
    assert len(messages) == 1, messages
    assert "Hugging Face sees 1 process(es) but DeepSpeed's data-parallel world size is 1 (WORLD_SIZE=2)" in messages[0]
    assert "use_cpu=True" in messages[0] and "PartialState(cpu=True)" in messages[0]


def test_accelerate_seeing_another_process_count_warns(dist, monkeypatch, caplog):
    """accelerate launched on a CPU-only machine without cpu=True: each process believes it is alone
    while DeepSpeed's world has them all (simulated: accelerate says 2, the world here is 1)."""
    import sys
    import types

    state = types.SimpleNamespace(PartialState=types.SimpleNamespace(_shared_state={"num_processes": 2}),
                                  AcceleratorState=types.SimpleNamespace(_shared_state={}))
    monkeypatch.setitem(sys.modules, "accelerate.state", state)
    with caplog.at_level(logging.WARNING, logger="ds_patrickstar.integration.registration"):
        messages = _world_warnings(caplog)
    assert len(messages) == 1 and "Hugging Face sees 2 process(es)" in messages[0], messages


def test_no_warning_when_the_world_sizes_agree(dist, caplog):
    with caplog.at_level(logging.WARNING, logger="ds_patrickstar.integration.registration"):
        _init(make_config("patrickstar", chunk_size=1024))
    assert not [r for r in caplog.records if r.name == "ds_patrickstar.integration.registration"]


# ---- accelerate's copy of the stage (see [Note: accelerate's zero_stage]) ----------------
def test_stage_name_orders_as_stage_3_and_equals_only_its_name():
    from ds_patrickstar.integration.hf_compat import StageName

    stage = StageName("patrickstar")
    assert not stage < 2 and stage >= 2 and stage > 2 and stage <= 3  # accelerate: ZeRO >= 2, no DDP no_sync
    assert stage != 3 and stage == "patrickstar" and str(stage) == "patrickstar"  # Hugging Face: not zero3
    assert {"patrickstar": 1}[stage] == 1 and stage < "z"


def test_adapt_accelerate_changes_only_patrickstar_plugins(monkeypatch):
    import sys
    import types

    from ds_patrickstar.integration.hf_compat import StageName, adapt_accelerate

    ours, stock = types.SimpleNamespace(zero_stage="patrickstar"), types.SimpleNamespace(zero_stage=3)
    state = types.SimpleNamespace(AcceleratorState=types.SimpleNamespace(
        _shared_state={"deepspeed_plugins": {"a": ours, "b": stock}}))
    monkeypatch.setitem(sys.modules, "accelerate.state", state)
    assert adapt_accelerate() == 1
    assert type(ours.zero_stage) is StageName and stock.zero_stage == 3 and type(stock.zero_stage) is int
    assert adapt_accelerate() == 0  # once
    monkeypatch.delitem(sys.modules, "accelerate.state")
    assert adapt_accelerate() == 0  # accelerate never imported: nothing to do
