"""Settings whose effect depends on the machine: the default accelerator budget, and keys that do
nothing in a run say so (issue 18, items 4 and 9). In-process, one rank."""
from __future__ import annotations

import logging

import harness
import pytest
import torch
from harness import make_config

GIB = 1 << 30


def test_default_cuda_budget_is_free_memory_less_the_reserve(monkeypatch):
    from ds_patrickstar.integration import planning

    # 80 GiB card, 3 GiB already taken (CUDA context, another process): the default is what is free now
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (77 * GIB, 80 * GIB))
    cuda = torch.device("cuda", 0)
    assert planning.resolve_budget(None, cuda, emulate=False) == 77 * GIB - planning.DEVICE_RESERVE
    assert planning.resolve_budget(0.5, cuda, emulate=False) == 40 * GIB  # a fraction is of the total
    assert planning.resolve_budget(5 * GIB, cuda, emulate=False) == 5 * GIB
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (GIB // 2, 80 * GIB))
    assert planning.resolve_budget(None, cuda, emulate=False) == 0  # nothing to give: the pre-flight says so


@pytest.mark.parametrize(
    "keys,placement_runs,idle",
    [
        ({"device_budget": 1 << 20, "placement": "static"}, False, ["placement", "device_budget"]),
        ({"static_fraction": 0.25}, False, ["static_fraction"]),
        ({"static_fraction": 0.25}, True, ["static_fraction"]),  # placement "auto" ignores it
        ({"static_fraction": 0.25, "placement": "static"}, True, []),
        ({"device_budget": 1 << 20, "emulate_accelerator": True}, True, []),
        ({"placement": "auto"}, True, []),
        ({"optimizer_placement": "fill"}, True, []),
        ({"optimizer_placement": "fill", "placement": "static"}, True, ["optimizer_placement"]),
        ({"optimizer_placement": "time"}, False, ["optimizer_placement"]),
        ({"device_profile": {"host_adam_elements_per_s": 1e9}}, False, ["device_profile"]),
        ({"device_profile": {"host_adam_elements_per_s": 1e9}, "placement": "static"}, True, ["device_profile"]),
        ({"device_profile": {"host_adam_elements_per_s": 1e9}}, True, []),
        ({"host_adam_in_backward": 4}, False, ["host_adam_in_backward"]),
        ({"host_adam_in_backward": 4, "overlap_host_adam": False}, True, ["host_adam_in_backward"]),
        ({"host_adam_in_backward": 0}, True, []),
    ],
)
def test_ineffective_keys(keys, placement_runs, idle):
    from ds_patrickstar import PatrickStarConfig

    assert PatrickStarConfig(**keys).ineffective_keys(placement_runs) == idle


def test_a_placement_key_on_a_cpu_run_warns_and_names_it(caplog):
    import deepspeed

    import ds_patrickstar  # noqa: F401

    harness.ensure_distributed()
    config = make_config("patrickstar", chunk_size=1024)
    config["zero_optimization"].update(device_budget=1 << 24, static_fraction=0.25)
    model = torch.nn.Linear(8, 4)
    with caplog.at_level(logging.WARNING, logger="ds_patrickstar.integration.planning"):
        engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    warnings = [r.getMessage() for r in caplog.records if r.name == "ds_patrickstar.integration.planning"]
    assert len(warnings) == 1, warnings
    assert "['static_fraction', 'device_budget'] do nothing in this run" in warnings[0]
    assert "emulate_accelerator=true" in warnings[0]
    from ds_patrickstar.placement.interface import NullPlacement

    assert isinstance(engine.optimizer.placement, NullPlacement)  # and the run goes on without placement
    engine.destroy()


# ---- gradient reduction (issue 18, item 8) ---------------------------------------------------
def _initialize(top_level: dict, dtype: str = "bf16"):
    import deepspeed

    import ds_patrickstar  # noqa: F401

    harness.ensure_distributed()
    config = make_config("patrickstar", dtype, chunk_size=1024)
    config.update(top_level)
    model = torch.nn.Linear(8, 4)
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    return engine


@pytest.mark.parametrize(
    "top_level,message",
    [
        ({"prescale_gradients": True}, r"prescale_gradients=true is not supported .* Remove the key\."),
        ({"gradient_predivide_factor": 2.0}, r"gradient_predivide_factor=2\.0 is not supported .* set it to 1\.0\."),
        ({"communication_data_type": "fp32"}, r"communication_data_type='fp32' is not supported .*\(bf16\)"),
        ({"data_types": {"grad_accum_dtype": "bf16"}}, r"data_types\.grad_accum_dtype='bf16' is not supported"),
    ],
)
def test_a_reduction_setting_that_would_be_ignored_is_refused(top_level, message):
    with pytest.raises(ValueError, match=message):
        _initialize(top_level)


def test_reduction_settings_that_say_what_we_do_are_accepted():
    engine = _initialize({"communication_data_type": "bf16", "data_types": {"grad_accum_dtype": "fp32"},
                          "gradient_predivide_factor": 1.0, "prescale_gradients": False})
    assert engine.optimizer is not None
    engine.destroy()


def _fp16_gradient_near_the_top(rank, world_size):
    import deepspeed

    import ds_patrickstar  # noqa: F401

    model = torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    config = {"train_micro_batch_size_per_gpu": 1, "fp16": {"enabled": True, "loss_scale": 1.0},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": "patrickstar", "chunk_size": 1024}}
    with harness.allow_fp16_on_cpu():
        engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    loss = engine(torch.full((1, 1), 40000.0, dtype=torch.float16)).float().sum()  # d loss / d w = 40000

    engine.backward(loss)
    engine.step()
    return {"skipped": engine.skipped_steps, "weight": engine.get_fp32_state_dict()["weight"].item()}


def test_gradients_are_divided_before_the_sum():
    """Each rank's fp16 gradient is 40,000: their sum (80,000) overflows fp16 (max 65,504), their
    mean does not. Divided after the sum (as before), the step was skipped as an overflow; divided
    before, as ZeRO-3's reduce-scatter does, it is applied."""
    from multiproc import run_ranks

    for result in run_ranks(_fp16_gradient_near_the_top, 2):
        assert result["skipped"] == 0, result
        assert result["weight"] < 1.0, result  # AdamW moved it by about the learning rate
