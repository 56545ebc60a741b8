"""Per-step counters: bytes all-gathered / reduce-scattered per step, the engine getter, the monitor.

Model and layout (chunk_size 1024, fp32): Linear(16,32), Linear(32,32), Linear(32,4) are six
tensors of 512, 32, 1024, 32, 128 and 4 elements, 1732 in all. With 2 ranks they are one chunk
group, back to back, cut into two chunks of 866 elements (3464 bytes each; the 1024-element
weight straddles the cut, see [Note: balanced chunk groups]), rank r owning chunk r. Per step:

* forward: the group is gathered at the first layer and kept gathered after the last layer's
  forward (see [Note: kept groups]) for backward: 1 all-gather, receiving the other rank's
  chunk, (W-1)/W of the group = 3464 bytes; with ``keep_gathered: 0`` it is released after the
  forward and gathered again in backward: 2 all-gathers;
* after the last gradient the group is reduce-scattered once: each rank sends the other
  rank's part, 3464 bytes.
"""
import csv
import math
import os

import pytest
import torch
from multiproc import run_ranks

STEPS = 4
CHUNK_BYTES = 866 * 4


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 32), torch.nn.GELU(),
                               torch.nn.Linear(32, 4))


def _config(monitor_dir=None, **zero):
    cfg = {"train_micro_batch_size_per_gpu": 4,
           # the closed forms count partitioned groups (no persistent one: see [Note: persistent chunk groups])
           "zero_optimization": {"stage": "patrickstar", "chunk_size": 1024, "stage3_param_persistence_threshold": 0,
                                 **zero},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    if monitor_dir is not None:
        cfg["csv_monitor"] = {"enabled": True, "output_path": monitor_dir, "job_name": "x"}
    return cfg


def _train(rank, world_size, monitor_dir=None, keep_gathered=None):
    import deepspeed

    import ds_patrickstar  # noqa: F401

    model = _model()
    engine, *_ = deepspeed.initialize(model=model, config=_config(monitor_dir, keep_gathered=keep_gathered),
                                      model_parameters=model.parameters())
    before = engine.get_patrickstar_counters()
    gen = torch.Generator().manual_seed(7)
    per_step = []
    for _ in range(STEPS):
        x, y = torch.randn(4, 16, generator=gen), torch.randn(4, 4, generator=gen)
        engine.backward(((engine(x) - y) ** 2).mean())
        engine.step()
        per_step.append(engine.get_patrickstar_counters())
    manager = engine.optimizer.manager
    layout = {"capacities": [c.capacity for c in manager.map.chunks],
              "element_size": manager.map.chunks[0].payload.element_size(),
              "used": [c.used for c in manager.map.chunks]}
    return {"before": before, "per_step": per_step, "layout": layout, "samples": engine.global_samples}


@pytest.mark.parametrize("keep_gathered,gathers", [(None, 1), (0, 2)])
def test_two_ranks_match_the_closed_form(keep_gathered, gathers):
    # one chunk group; kept gathered from forward to backward (the default) it is gathered once a
    # step, released after its forward use (keep_gathered=0) twice
    results = run_ranks(_train, 2, None, keep_gathered)
    for rank, res in enumerate(results):
        assert res["layout"]["capacities"] == [866, 866], res["layout"]
        assert res["layout"]["used"] == [866, 866], res["layout"]
        assert res["before"]["bytes_all_gathered"] == 0 and res["before"]["bytes_reduce_scattered"] == 0
        assert res["samples"] == STEPS * 4 * 2  # micro-batch 4 on 2 ranks, GA 1: what the monitor rows count
        for step, counters in enumerate(res["per_step"]):
            # per step, not cumulative: the same numbers every step
            assert counters["all_gathers"] == gathers, (rank, step, counters)
            assert counters["reduce_scatters"] == 1, (rank, step, counters)
            assert counters["bytes_all_gathered"] == gathers * CHUNK_BYTES, (rank, step, counters)
            assert counters["bytes_reduce_scattered"] == CHUNK_BYTES, (rank, step, counters)
            assert counters["model_data_bytes"] > 0
            # by hand from the shapes: 16*32 + 32 + 32*32 + 32 + 32*4 + 4 = 1732 fp32 elements, half a
            # rank's: each gather receives 866 * 4 = 3464 B, twice 6928 B; the reduce-scatter sends 3464 B
            assert counters["bytes_all_gathered"] == {1: 3464, 2: 6928}[gathers], (rank, step, counters)
            assert counters["bytes_reduce_scattered"] == 3464, (rank, step, counters)


def test_one_rank_moves_nothing():
    (res,) = run_ranks(_train, 1)
    for counters in res["per_step"]:
        assert {k: v for k, v in counters.items() if k.startswith(("bytes_all", "bytes_reduce", "all_", "reduce_"))} \
            == {"bytes_all_gathered": 0, "bytes_reduce_scattered": 0, "all_gathers": 0, "reduce_scatters": 0}


def test_csv_monitor_gets_the_counters(tmp_path):
    results = run_ranks(_train, 2, str(tmp_path))
    log_dir = tmp_path / "x"
    for name, expected in (("bytes_all_gathered", CHUNK_BYTES), ("bytes_reduce_scattered", CHUNK_BYTES),
                           ("model_data_bytes", None)):
        path = log_dir / f"Train_Samples_patrickstar_{name}.csv"
        assert path.exists(), sorted(os.listdir(log_dir))
        rows = [r for r in csv.reader(path.open()) if r and r[0].replace(".", "").isdigit()]
        assert len(rows) == STEPS, rows
        # (global_samples, value): 2 ranks x micro-batch 4 = 8 samples per step
        assert [int(float(r[0])) for r in rows] == [8 * (i + 1) for i in range(STEPS)]
        values = [float(r[1]) for r in rows]
        assert all(math.isfinite(v) for v in values)
        if expected is not None:
            assert values == [expected] * STEPS
        else:
            assert values == [results[0]["per_step"][i]["model_data_bytes"] for i in range(STEPS)]
