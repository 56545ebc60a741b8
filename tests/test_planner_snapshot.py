"""[Note: planner snapshot]: ``engine.planner_snapshot(path)`` writes the inputs of the placement planner's last
thorough plan and what it chose; planned again from the file (``replan``), on this machine or another, the same
inputs give the same choice and prediction, at one rank and as a rank of two with gradient accumulation; another
budget plans differently; a run whose states the step-time model does not choose says why there is no snapshot.
The counter runs' GPT on the strict emulated accelerator (tests/counter_runs.py)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from counter_runs import _GPT, CASES, REPO, _config
from multiproc import run_ranks

from ds_patrickstar.placement.snapshot import PlannerSnapshot, chosen, replan


def _train(rank, world_size, case, path, steps=3):
    import sys

    import deepspeed
    import torch
    from counter_runs import REPO

    import ds_patrickstar  # noqa: F401

    sys.path.insert(0, str(REPO / "benchmarks"))
    from gpt_model import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(**_GPT))
    engine, *_ = deepspeed.initialize(model=model, config=_config(case, ""), model_parameters=model.parameters())
    gen = torch.Generator().manual_seed(1 + rank)
    for _ in range(steps * case["ga"]):
        idx = torch.randint(0, _GPT["vocab_size"], (2, _GPT["block_size"] + 1), generator=gen)
        engine.backward(engine(idx[:, :-1].contiguous(), idx[:, 1:].contiguous())[1])
        engine.step()
    try:
        written = engine.planner_snapshot(f"{path}.{rank}.json")
    except RuntimeError as err:
        written = str(err)
    counters = engine.get_patrickstar_counters()
    engine.destroy()
    return written, counters


@pytest.mark.parametrize("name", ["twin_1rank_device_adam", "twin_2rank_ga2"])
def test_a_snapshot_plans_again_to_the_choice_the_run_made(name, tmp_path):
    case = CASES[name]
    for written, counters in run_ranks(_train, case["world"], case, str(tmp_path / "plan"), fresh=True):
        snapshot = PlannerSnapshot.read(written)
        assert json.loads(open(written).read())["version"] == 1
        # the run's own choice, as the counters show it
        assert len(snapshot.chosen["on_device"]) == counters["adam_chunks_device"]
        assert snapshot.chosen["distance"] == counters["prefetch_distance"]
        assert snapshot.chosen["order"] == counters["eviction_order"]
        again = replan(snapshot)
        assert chosen(again) == snapshot.chosen  # the same states, distance, order, predicted step and bytes
        assert again.step.total_s > 0 and snapshot.moments and snapshot.compute_s
        if case["world"] > 1:  # a rank of several: the readings of the model data it does not move went along
            assert any(m.beside for m in snapshot.moments)
        # a budget with room for every state places every candidate
        roomy = replan(snapshot, budget=10 * snapshot.budget)
        assert roomy.on_device == snapshot.fill and roomy.moved <= again.moved
        # the command line over the same file
        command = [sys.executable, str(REPO / "benchmarks" / "replan.py"), written, "--budget", "1,10",
                   "--compute-scale", "1,0.5"]
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        ran = [line for line in done.stdout.splitlines() if "the run chose" in line]
        planned = [line for line in done.stdout.splitlines() if "planned at" in line]
        assert len(ran) == 1 and len(planned) == 4 and "compute x0.5" in planned[1], done.stdout
        assert f" {len(again.on_device)} of {len(snapshot.fill)} states" in ran[0]
        assert f" {len(again.on_device)} of {len(snapshot.fill)} states" in planned[0]  # again, at its budget
        assert f" {len(snapshot.fill)} of {len(snapshot.fill)} states" in planned[2]  # with ten times the room


def test_no_snapshot_where_the_step_time_model_does_not_choose(tmp_path):
    case = dict(CASES["twin_1rank_ga1"])
    case["zero"] = {**case["zero"], "optimizer_placement": "fill"}
    (written, _), = run_ranks(_train, 1, case, str(tmp_path / "plan"), 2, fresh=True)
    assert "no planner snapshot" in written and 'optimizer_placement: "time"' in written, written
