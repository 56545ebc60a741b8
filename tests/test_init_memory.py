"""Initialize never doubles model memory: with ds_patrickstar.Init, the peak host memory of a
process through construction and ``deepspeed.initialize`` stays within 1.1x of its steady-state
model data plus its baseline (the process after imports), on one rank and with two ranks on the host.

Each rank is a fresh process (``ru_maxrss`` is a lifetime peak). The model has
``DS_PS_MEMTEST_PARAMS`` parameters (default 300M: about 4.2 GB of model data); the two-rank
case runs after the one-rank case, never beside it.
"""
import os
import resource

import pytest
import torch

from multiproc import run_ranks

PARAMS = int(float(os.environ.get("DS_PS_MEMTEST_PARAMS", "3e8")))
WIDTH = 1024


def _rss_peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _measure(rank, world_size, depth):
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    import deepspeed
    import psutil

    import ds_patrickstar
    from gpt_model import GPT, GPTConfig

    cfg = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
           "zero_optimization": {"stage": "patrickstar"}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
    from ds_patrickstar.kernels import get_adam_backend

    get_adam_backend(torch.device("cpu"))  # the JIT kernel's load is start-up cost, not model memory
    baseline = psutil.Process().memory_info().rss
    with ds_patrickstar.Init(config=cfg):
        model = GPT(GPTConfig(n_layer=depth, n_head=16, n_embd=WIDTH, block_size=64, vocab_size=8192))
    engine, *_ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
    return {"baseline": baseline, "peak": _rss_peak(),
            "model_data": engine.get_patrickstar_counters()["model_data_bytes"]}


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2])
def test_initialize_peak_within_1_1x_of_model_data_plus_baseline(world_size):
    depth = max(1, PARAMS // (12 * WIDTH ** 2))
    for r in run_ranks(_measure, world_size, depth, timeout=900):
        bound = 1.1 * (r["model_data"] + r["baseline"])
        assert r["model_data"] >= 14 * PARAMS * 0.9 / world_size
        assert r["peak"] <= bound, (f"peak {r['peak'] / 2**30:.2f} GiB > 1.1 x (model data "
                                    f"{r['model_data'] / 2**30:.2f} GiB + baseline {r['baseline'] / 2**30:.2f} GiB)")
