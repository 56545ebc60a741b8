"""The planner (python -m ds_patrickstar.plan): the pre-flight arithmetic against real runs' counters."""
import json
import os
import sys

import pytest
import torch
from multiproc import run_ranks

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

from gpt_model import GPT, GPTConfig

TINY = GPTConfig(n_layer=3, n_head=2, n_embd=64, block_size=32, vocab_size=128)
CHUNK = 4096


def _train_and_count(rank, world_size, dtype):
    import deepspeed

    import ds_patrickstar

    # the planner's figures are of partitioned groups (persistent ones add theirs: see [Note: persistent chunk groups])
    cfg = {"train_micro_batch_size_per_gpu": 2,
           "zero_optimization": {"stage": "patrickstar", "chunk_size": CHUNK, "stage3_param_persistence_threshold": 0},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    with ds_patrickstar.Init(config=cfg):
        model = GPT(TINY)
    engine, *_ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
    x = torch.randint(0, TINY.vocab_size, (2, 16))
    _, loss = engine(x, x)
    engine.backward(loss)
    engine.step()
    return engine.get_patrickstar_counters()["model_data_bytes"]


def test_gpt_shape_sizes_match_the_model():
    from ds_patrickstar.plan import sizes_from_gpt

    assert sizes_from_gpt("64x3x128x32") == [p.numel() for p in GPT(TINY).parameters()]


@pytest.mark.parametrize("world_size,dtype", [(1, "bf16"), (1, "fp32"), (2, "bf16")])
def test_planner_equals_a_real_runs_counters(world_size, dtype):
    from ds_patrickstar.memory.preflight import plan_for_rank
    from ds_patrickstar.plan import capacities_for, plan_report, sizes_from_gpt

    counted = run_ranks(_train_and_count, world_size, dtype)
    sizes = sizes_from_gpt("64x3x128x32")
    lp = 2 if dtype == "bf16" else 4
    capacities = capacities_for(sizes, CHUNK, world_size)
    owners = [i % world_size for i in range(len(capacities))]
    for rank, value in enumerate(counted):
        assert plan_for_rank(capacities, owners, rank, lp, False).model_data_bytes == value
    report = plan_report(sizes, CHUNK, world_size, lp, False, 0, 2**40)
    assert report["model_data_bytes_per_rank"] == max(counted)


def test_largest_fitting_model_and_the_preflight_message_agree():
    from ds_patrickstar.memory.preflight import check_fits, largest_fitting_params, plan_for_rank

    plan = plan_for_rank([1 << 20] * 8, [0, 1] * 4, 0, 2, False)
    assert plan.model_data_bytes == 4 * (1 << 20) * 14
    assert largest_fitting_params(plan, 14 * 1000, 2) == 2000
    check_fits(plan, 0, plan.model_data_bytes, 2)
    with pytest.raises(ValueError, match="the largest model that would fit has about 4M parameters"):
        check_fits(plan, 0, 14 * 2 * 10**6, 2)
    with_acc = plan_for_rank([1 << 20] * 8, [0, 1] * 4, 0, 2, True)
    # an fp32 accumulator per owned element: a rank of two accumulates only what it owns
    assert with_acc.model_data_bytes == 4 * (1 << 20) * (14 + 4)
    assert largest_fitting_params(with_acc, 18 * 1000, 2) == 2000


def test_cli_on_a_parameter_count(capsys):
    from ds_patrickstar.plan import main

    report = main(["--params", "1.3e9", "--host-mem", "22GiB"])
    out = capsys.readouterr().out
    assert report["model_data_bytes_per_rank"] == 14 * report["plan"].total_elements  # one rank owns everything
    assert report["fits"] and "fits: yes" in out
    assert report["largest_fitting_params"] == 22 * 2**30 // 14
    two = main(["--params", "1.3e9", "--world-size", "2", "--host-mem", "7GiB", "--device-mem", "1GiB"])
    assert not two["fits"] and "fits: NO" in capsys.readouterr().out
    assert two["on_accelerator_bytes"] == 2**30
    with pytest.raises(SystemExit):
        main(["--params", "1e6", "--host-mem", "1GiB", "--world-size", "0"])


def test_cli_on_a_hugging_face_config(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    from ds_patrickstar.plan import main

    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=32)
    config.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["n_layer"] == 2
    report = main(["--hf-config", str(tmp_path), "--host-mem", "1GiB"])
    expected = sum(p.numel() for p in transformers.GPT2LMHeadModel(config).parameters())
    assert report["parameters"] == expected


def test_planner_counts_the_largest_chunk_group_with_its_joined_buffer():
    """Two ranks, bf16, gradient accumulation: a 5,000-element tensor is a group of its own, two chunks
    of 2,500 it straddles. A moment using it takes its storage (10,000 B), this rank's chunk (5,000 B),
    the joined buffer (10,000 B), the accumulator (10,000 B) and a micro-step's gradient buffer
    (10,000 B); a device budget must hold that."""
    from ds_patrickstar.plan import plan_report

    sizes = [100, 5000, 100]
    report = plan_report(sizes, 1024, 2, 2, True, 10**9, 10**9)
    assert report["largest_group_bytes"] == 45_000 and report["fits"]
    assert not plan_report(sizes, 1024, 2, 2, True, 44_999, 10**9)["fits"]
