"""The disk tier of the optimizer states (offload_optimizer: {"device": "nvme"}): a run with most
states on disk equals the same run with every state in RAM, bit for bit; the step counts its I/O."""
from __future__ import annotations

import os

import pytest
import torch

from harness import make_config, run_training
from quirk_models import QUIRK_MODELS


def disk_zero(path, host_budget=4096, **extra):
    return {"offload_optimizer": {"device": "nvme", "nvme_path": str(path), **extra}, "host_budget": host_budget}


def assert_same(a, b):
    assert a.losses == b.losses
    for name in b.fp32_weights:
        assert torch.equal(a.fp32_weights[name], b.fp32_weights[name]), name
        assert torch.equal(a.lp_weights[name], b.lp_weights[name]), name


@pytest.mark.parametrize("model,dtype,gas", [("tied", "fp32", 1), ("reused", "bf16", 2)])
def test_states_on_disk_equal_states_in_ram(tmp_path, model, dtype, gas):
    ram = run_training(QUIRK_MODELS[model], make_config("patrickstar", dtype, gas=gas, chunk_size=1024), steps=3, seed=0)
    disk = run_training(
        QUIRK_MODELS[model],
        make_config("patrickstar", dtype, gas=gas, chunk_size=1024, extra_zero=disk_zero(tmp_path)),
        steps=3,
        seed=0,
    )
    assert_same(disk, ram)
    last = disk.counters[-1]
    assert last["disk_bytes_read"] > 0 and last["disk_bytes_read"] == last["disk_bytes_written"]
    assert last["model_bytes_disk"] > 0
    assert not os.path.exists(tmp_path / "ds_patrickstar_swap" / "rank0"), "swap files are scratch: removed at the end"
