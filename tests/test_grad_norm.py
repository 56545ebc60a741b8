"""The gradient norm is taken chunk by chunk as each owned gradient slot becomes final, on the accelerator, during
backward (see [Note: the norm as gradients become final]): never at the step from the host, where gradients of
host-updated chunks have gone by then. Strict twin, 1 rank and 2 ranks (the norm at the reduce-scatter's
completion); at both, host-updated chunks' gradients leave during backward, after their norm. The norm the engine
reports is that of the full gradients read through DeepSpeed's ``safe_get_full_grad``."""
import math
import sys
from pathlib import Path

import torch
from harness import ensure_distributed
from multiproc import run_ranks

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

_GPT = {"n_layer": 3, "n_head": 2, "n_embd": 32, "block_size": 16, "vocab_size": 64}


def _train(rank: int, world: int, budget: int) -> dict:
    import deepspeed
    from deepspeed.utils import safe_get_full_grad
    from gpt_model import GPT, GPTConfig

    import ds_patrickstar  # noqa: F401

    ensure_distributed()
    torch.manual_seed(0)
    model = GPT(GPTConfig(**_GPT))
    config = {
        "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.05, "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "bf16": {"enabled": True},
        "zero_optimization": {"stage": "patrickstar", "chunk_size": 4096, "emulate_accelerator": True,
                              "device_budget": budget},
    }
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    norms = engine.optimizer.manager.grads.norms
    phase, records = ["forward"], []
    record = norms.record
    norms.record = lambda chunk: records.append((phase[0], chunk.chunk_id, chunk.on_host)) or record(chunk)
    owned = sorted(c.chunk_id for c in engine.optimizer.manager.map.trainable_owned())
    gen = torch.Generator().manual_seed(1 + rank)
    steps = []
    for _ in range(3):
        records.clear()
        idx = torch.randint(0, _GPT["vocab_size"], (2, _GPT["block_size"] + 1), generator=gen)
        phase[0] = "backward"
        engine.backward(engine(idx[:, :-1].contiguous(), idx[:, 1:].contiguous())[1])
        full = math.sqrt(sum(float(safe_get_full_grad(p).float().square().sum()) for p in model.parameters()))
        phase[0] = "step"
        engine.step()
        counters = engine.get_patrickstar_counters()
        steps.append({"records": list(records), "full": full, "reported": float(engine.get_global_grad_norm()),
                      "released": counters["grads_released_in_backward"], "owned": owned})
    engine.destroy()
    return {"steps": steps}


def _check(steps: list[dict]) -> None:
    for step in steps[1:]:  # the first step traces; placement acts from the second
        records = step["records"]
        assert sorted(c for _, c, _ in records) == step["owned"], records  # each owned chunk once
        assert {phase for phase, _, _ in records} == {"backward"}, records
        assert not any(on_host for _, _, on_host in records), records
        assert math.isclose(step["reported"], step["full"], rel_tol=1e-5), step


def test_one_rank_norms_are_taken_on_the_accelerator_before_gradients_leave():
    result = _train(0, 1, 260_000)  # every optimizer state on the host (tests/counter_runs.py's budget)
    assert result["steps"][-1]["released"] > 0  # host-updated chunks' gradients left during backward
    _check(result["steps"])


def test_two_ranks_norms_are_taken_when_the_reduce_scatter_completes():
    for result in run_ranks(_train, 2, 300_000, timeout=240.0):
        # the first reduce-scatters complete before backward ends (at most two stay in flight): those chunks'
        # gradients leave during backward, after their norm was taken on the accelerator
        assert result["steps"][-1]["released"] > 0
        _check(result["steps"])
