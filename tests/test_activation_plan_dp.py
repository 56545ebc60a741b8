"""``offload_activations: "auto"`` near the budget's limit (issue 20): where offloading every block
fits, "auto" fits too, with data parallelism and gradient accumulation; where checkpointing alone
fits, "auto" offloads nothing. Model, runs and oracle (stock ZeRO-3 with the same checkpointing)
are those of tests/test_activation_offload.py; its two-rank case covers the budget without
accumulation (70 kB: the gather plan agreed at the traced step must see the planned tide).
"""
from __future__ import annotations

from multiproc import run_ranks
from test_activation_offload import STEPS, _train
from test_vs_zero3 import check


def _moved(result) -> list[int]:
    return [c["activation_bytes_offloaded"] for c in result.counters]


def test_auto_fits_where_all_fits_with_accumulation_on_two_ranks():
    """bf16, two ranks, two micro-steps a step, 68 kB: offloading every block fits (checkpointing
    alone fails from 90 kB down); "auto" fits too, offloading some blocks, with stock ZeRO-3's
    losses. A micro-step's reduce-scatter makes room for its owner's new fp32 accumulator after
    bringing the owned chunk back, not before (the room went to the chunk)."""
    ref = run_ranks(_train, 2, 3, "bf16", "none", 0, 2, memo=True)
    moved = {}
    for mode in ("all", "auto"):
        ours = run_ranks(_train, 2, "patrickstar", "bf16", mode, 68_000, 2)
        for rank in range(2):
            check(ours[rank], ref[rank], "bf16")
        moved[mode] = _moved(ours[0])
    traced = moved["all"][0]
    assert moved["all"] == [traced] * STEPS and moved["auto"][0] == traced, moved
    assert all(0 < m < traced for m in moved["auto"][1:]), moved

