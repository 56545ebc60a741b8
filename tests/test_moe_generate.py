"""Models whose modules differ by rank, and generation with data parallelism (issue 31, items 2 and 3).

A tiny Hugging Face Mixtral with one module per expert (tests/moe_workers.py), each rank's tokens routed
to other experts, on 2 real processes: with DeepSpeed's leaf modules it trains as stock ZeRO-3 does with
the same leaves (losses and fp32 weights at tests/test_data_parallel.py's tolerances), also with
placement on the strict emulated accelerator under a budget that evicts and with gradient accumulation;
without a leaf every rank raises the error that names the module and the fix, in time. ``generate``
with a different number of new tokens on each rank completes with ZeRO-3's tokens.
"""
import pytest
import torch

pytest.importorskip("transformers")

from moe_workers import ExpertList, generate_after_step, train_moe
from multiproc import WorkerError, run_ranks

RTOL, ATOL = 1e-5, 1e-6  # fp32 on CPU, as tests/test_data_parallel.py
BUDGET = 500_000  # bytes of the strict emulated accelerator: chunks are evicted every step (400 kB cannot run)


def _assert_same(ours, ref):
    assert ref[0]["experts_run"] != ref[1]["experts_run"], "the ranks' tokens should run different experts"
    for rank, (mine, theirs) in enumerate(zip(ours, ref)):
        assert mine["experts_run"] == theirs["experts_run"]
        torch.testing.assert_close(torch.tensor(mine["losses"]), torch.tensor(theirs["losses"]), rtol=RTOL, atol=ATOL)
        for name, value in theirs["weights"].items():
            torch.testing.assert_close(mine["weights"][name], value, rtol=RTOL, atol=ATOL,
                                       msg=lambda m, rank=rank, name=name: f"rank {rank}, {name}: {m}")


def test_leaf_modules_match_zero3_with_placement_and_accumulation():
    """set_z3_leaf_modules(model, [ExpertList]), gradient accumulation 2, placement under a budget that evicts."""
    ref = run_ranks(train_moe, 2, 3, 2, None, True, memo=True)
    ours = run_ranks(train_moe, 2, "patrickstar", 2, None, True, BUDGET)
    assert any(r["evictions"] > 0 for r in ours), [r["evictions"] for r in ours]
    _assert_same(ours, ref)


def test_leaf_module_config_key_matches_zero3():
    """``zero_optimization.leaf_module.classes`` marks the same leaves as set_z3_leaf_modules."""
    ref = run_ranks(train_moe, 2, 3, 2, None, True, memo=True)
    ours = run_ranks(train_moe, 2, "patrickstar", 2, [ExpertList.__name__])
    _assert_same(ours, ref)


def test_ranks_running_different_modules_without_a_leaf_raise_in_time():
    """Without a leaf (``classes: []`` turns DeepSpeed's defaults off) the ranks stop before their
    collectives mismatch: every rank raises, naming the modules and the leaf to set; no abort, no hang."""
    with pytest.raises(WorkerError) as caught:
        run_ranks(train_moe, 2, "patrickstar", 1, [], timeout=180)
    message = str(caught.value)
    assert "RanksDiverged" in message and "did not finish" not in message and "died" not in message, message
    assert "model.layers.0.mlp.experts.experts." in message, message
    assert "set_z3_leaf_modules(model, [ExpertList])" in message and '"classes": ["ExpertList"]' in message, message


def test_generate_with_different_lengths_on_two_ranks_matches_zero3():
    """After a training step, rank 0 generates 3 tokens and rank 1 seven (with placement): the rank done
    first keeps running forwards until both are (synced_gpus), and the tokens are ZeRO-3's."""
    ref = run_ranks(generate_after_step, 2, 3, timeout=300)
    ours = run_ranks(generate_after_step, 2, "patrickstar", 2 * BUDGET, timeout=300)
    assert [r["tokens"].shape[1] for r in ref] == [4 + 3, 4 + 7]
    for mine, theirs in zip(ours, ref):
        assert torch.equal(mine["tokens"], theirs["tokens"]), (mine["tokens"], theirs["tokens"])
        assert (mine["marked"], mine["marked_after_destroy"], theirs["marked"]) == (True, False, False)


def test_leaf_module_key_is_handed_to_deepspeed():
    from ds_patrickstar.integration.config import split_config

    block = {"classes": ["ExpertList"], "names": "model.layers.0.mlp"}
    options, sanitized = split_config({"zero_optimization": {"stage": "patrickstar", "leaf_module": block}})
    assert sanitized["zero_optimization"] == {"stage": 0, "leaf_module": block}
    with pytest.raises(ValueError, match=r"zero_optimization\.leaf_module=.*clases: Extra inputs are not permitted"):
        split_config({"zero_optimization": {"stage": "patrickstar", "leaf_module": {"clases": ["ExpertList"]}}})
