"""Settings whose effect depends on the machine: the default accelerator budget, and keys that do
nothing in a run say so (issue 18, items 4 and 9). In-process, one rank."""
from __future__ import annotations

import logging

import pytest
import torch

import harness
from harness import make_config

GIB = 1 << 30


def test_default_cuda_budget_is_free_memory_less_the_reserve(monkeypatch):
    from ds_patrickstar.integration import assembly

    # 80 GiB card, 3 GiB already taken (CUDA context, another process): the default is what is free now
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (77 * GIB, 80 * GIB))
    cuda = torch.device("cuda", 0)
    assert assembly.resolve_budget(None, cuda, emulate=False) == 77 * GIB - assembly.DEVICE_RESERVE
    assert assembly.resolve_budget(0.5, cuda, emulate=False) == 40 * GIB  # a fraction is of the total
    assert assembly.resolve_budget(5 * GIB, cuda, emulate=False) == 5 * GIB
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (GIB // 2, 80 * GIB))
    assert assembly.resolve_budget(None, cuda, emulate=False) == 0  # nothing to give: the pre-flight says so


@pytest.mark.parametrize(
    "keys,placement_runs,idle",
    [
        ({"device_budget": 1 << 20, "placement": "static"}, False, ["placement", "device_budget"]),
        ({"static_fraction": 0.25}, False, ["static_fraction"]),
        ({"static_fraction": 0.25}, True, ["static_fraction"]),  # placement "auto" ignores it
        ({"static_fraction": 0.25, "placement": "static"}, True, []),
        ({"device_budget": 1 << 20, "emulate_accelerator": True}, True, []),
        ({"placement": "auto"}, True, []),
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
    with caplog.at_level(logging.WARNING, logger="ds_patrickstar.integration.assembly"):
        engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    warnings = [r.getMessage() for r in caplog.records if r.name == "ds_patrickstar.integration.assembly"]
    assert len(warnings) == 1, warnings
    assert "['static_fraction', 'device_budget'] do nothing in this run" in warnings[0]
    assert "emulate_accelerator=true" in warnings[0]
    assert engine.optimizer.placement is None  # and the run goes on without placement
    engine.destroy()
