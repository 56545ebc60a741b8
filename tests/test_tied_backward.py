"""A tied weight between its backward uses (see [Note: tied weights between backward uses]).

GPT's token embedding is also its LM head; its gradient arrives only after the embedding's
backward, at the very end. With ``keep_gathered: 0`` its group must not stay gathered for the
whole backward pass: it is released when the LM head's backward is over, and the embedding's
backward (which reads no weight values) gathers nothing, so the weight is all-gathered three
times per step (embedding and LM head forward, LM head backward). Parity with stock ZeRO-3
(tolerances of tests/test_vs_zero3.py) on the GPT and the tied quirk model, with and without
gradient accumulation.
"""
import os
import sys

import pytest
from multiproc import run_ranks

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

# every group released after use (no persistent group either: see [Note: persistent chunk groups])
RELEASE = {"keep_gathered": 0, "prefetch_groups": 0, "stage3_param_persistence_threshold": 0}


@pytest.mark.parametrize("model,dtype,gas", [("gpt", "fp32", 1), ("gpt", "fp32", 2), ("tied", "fp32", 1)])
def test_released_between_backward_uses_matches_zero3(model, dtype, gas):
    from test_dp_overlap import _quirk
    from test_vs_zero3 import check

    ref = run_ranks(_quirk, 2, model, dtype, 3, gas, memo=True)
    ours = run_ranks(_quirk, 2, model, dtype, "patrickstar", gas, RELEASE)
    for rank in range(2):
        check(ours[rank], ref[rank], dtype)


def _watch_embedding_group(rank, world_size):
    """Train two steps with ``keep_gathered: 0``; return, per step, whether the embedding's group
    was gathered during each block's backward, and the step's all-gathers and chunk groups."""
    import deepspeed
    from harness import ensure_distributed, make_config
    from test_dp_overlap import build_gpt

    import ds_patrickstar  # noqa: F401

    ensure_distributed()
    model, batch_fn = build_gpt(0)
    config = make_config("patrickstar", "fp32", lr=1e-3, chunk_size=1024, extra_zero=RELEASE)
    config.pop("train_batch_size", None)
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    manager = engine.optimizer.manager
    wte = manager.map.info(model.gpt.wte.weight)
    assert wte is manager.map.info(model.gpt.lm_head.weight)
    others = [manager.map.chunks[cid] for cid in wte.chunk_ids if not manager.map.is_owned(manager.map.chunks[cid])]
    seen: list[bool] = []
    for block in model.gpt.blocks:
        block.register_full_backward_pre_hook(lambda *_: seen.append(any(c.is_materialized for c in others)))
    steps = []
    for step in range(2):
        seen.clear()
        loss = engine(*batch_fn(step))
        engine.backward(loss)
        engine.step()
        counters = engine.get_patrickstar_counters()
        steps.append((list(seen), counters["all_gathers"], manager.map.num_groups, wte.straddles))
    return steps


def test_the_embedding_group_is_released_between_backward_uses():
    results = run_ranks(_watch_embedding_group, 2)
    for steps in results:
        for seen, all_gathers, groups, straddles in steps:
            assert straddles  # its joined buffer goes with the group too
            assert seen and not any(seen), seen  # not gathered while the blocks' backward runs
            # every group gathered for forward and again for backward, the tied weight once more
            # for the LM head's forward; none for the embedding's backward
            assert all_gathers == 2 * groups + 1, (all_gathers, groups)
