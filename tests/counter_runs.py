"""A fixed set of small training runs whose per-step counters and losses a structural change must not
move: 1 and 2 ranks, GA 1 and 2, placement with evictions (the strict twin at a tight budget), the disk
tier's spilled optimizer states, frozen chunks on disk, activation offload and recomputation.

``python tests/counter_runs.py`` (from the repository root) writes the golden file
``tests/data/counter_runs.json``; ``tests/test_counter_runs.py`` runs the same cases and compares. The
golden file was written at 8ef8d79 (this module copied there), before the storage tier moved below
placement and the chunk group took over its own life (see docs/architecture.md): those changes keep
every byte moved and every count. Written again where a change of behaviour moved counts on purpose, with
the losses unchanged: the activations offloaded by default (the traced steps), and the optimizer states chosen
by the step-time model (``twin_1rank_device_adam``: 7 of 10 chunks' states on the accelerator instead of 8,
64,640 B moved each way per step instead of 98,304), and the host-updated chunks' gradients sent during
backward (the same bytes at earlier moments: one Belady eviction fewer in ``twin_checkpointed_offload``), and
the traced iteration planned at its own step (the steady state from the second step, not the third; in
``twin_2rank_ga2`` the agreed gather plan keeps no group from then on, 28 all-gathers a step instead of 27).
The prefetch distance's counters were added later (``prefetch_distance``, ``prefetches_beyond_next``: every
case prefetches one moment ahead; nothing else moved), and the stranded bytes released (none). Written again for
clean evictions (a chunk evicted unchanged since it came copies nothing): bytes to the host per steady step
310,400 -> 162,944 in ``twin_1rank_ga1`` and 195,712 -> 162,944 in ``twin_checkpointed_offload``, the kept
host buffers in ``host_bytes_allocated``, and in ``twin_1rank_device_adam`` (the same states on the accelerator)
49,152 B to the host instead of 64,640 and 65,536 B to the device instead of 64,640, with the moves' new
prices; the losses unchanged. The eviction order's counter was added later (``eviction_order``: Belady's in every
case), when the move model learned the memory placement reads beside the tide at a moment (the tide then and the
allocator's stranded pieces): ``twin_1rank_ga1``'s predicted bytes to the device went 294,016 -> 310,400, the
bytes measured. Written again when clean evictions reached several ranks and gradient accumulation: bytes to
the host per steady step 490,624 -> 162,944 in ``twin_1rank_ga2``, 154,560 / 168,384 -> 81,472 per rank in
``twin_2rank_ga1``, 123,712 / 137,536 -> 81,472 in ``twin_2rank_ga2``, and the kept buffers' host bytes; the
losses unchanged. The accumulators' own counters were added later (``accumulator_bytes_to_device`` / ``_to_host``,
nonzero only with gradient accumulation; nothing else moved). Written again when an accumulator went at the
boundary instead of at the step: accumulator bytes to the host per steady step 375,936 -> 212,992 in
``twin_1rank_ga2`` (24 -> 21 evictions) and 109,888 / 123,712 -> 42,240 / 56,064 in ``twin_2rank_ga2``, host
bytes lower; the losses unchanged. Written again when the move model took in gradient accumulation on one rank:
``twin_1rank_ga2`` now predicts (its payloads' and accumulators' bytes, equal to those measured), prefetches by
the step-time model's choice, and sends its 9 host-updated chunks out during the boundary's backward (one
eviction fewer; the same bytes; 61,952 more host bytes allocated); the losses unchanged. Written again when "auto"
activation offload's plan counted a block's activations at the moment they are brought back (before, they were
counted neither in the traced tide, read before the copy back, nor as away): ``twin_1rank_ga1``'s second step no
longer finds the tide above the plan (``tide_replans`` 1 -> 0); nothing else moved. Written again when the
host-updated chunks' gradients left during backward at several ranks too (once their reduce-scatter completed):
the same bytes, one eviction fewer per rank and step in ``twin_2rank_ga1`` (7 / 8 -> 6 / 7), 44,032 more host
bytes allocated in ``twin_2rank_ga2`` (340,480 -> 384,512), and ``bytes_floor`` (0: not predicted at several
ranks) added to those two cases; the losses unchanged. Written again when the bytes floor was taken at several
ranks too (each rank's own chunks, without accumulators): ``bytes_floor`` 155,755 in ``twin_2rank_ga1`` and
75,755 in ``twin_2rank_ga2`` from the second step (0 before); nothing else moved. Written again when the planner
could keep accumulators on the accelerator while their payloads go (see [Note: accumulators kept]):
``twin_1rank_ga2`` now runs that order (``eviction_order`` 0 -> 2), which the step-time model prices within the tie
and moves 896 B fewer per steady step (payloads 490,624 -> 555,264 B to the device, accumulators 212,992 ->
180,224 B each way, as predicted; 20 -> 34 evictions, 27 -> 30 prefetches), and its ``bytes_floor`` (686,592)
joins the file; the losses unchanged. Written again when the bytes floor at several ranks took in the storage of
the groups each moment uses: ``bytes_floor`` 155,755 -> 179,808 in ``twin_2rank_ga1`` and 75,755 -> 94,187 in
``twin_2rank_ga2``; nothing else moved. Written again when offloaded activations took their pinned host memory
from one stack kept across steps (see [Note: activation host stack]): ``host_bytes_allocated`` only (the stack's
slab held between steps, sized to the planned offload), the losses unchanged. Written again when the traced step
planned quickly and the next step thoroughly (see [Note: the planner's cost]): ``twin_1rank_device_adam``'s second
step moves 81,920 B to the device and 65,536 B to the host instead of 65,536 and 49,152 (the check moves one
chunk's states for another's, 7 on the accelerator either way: a local move the traced step's quick search does
not make; the steady third step as before), and ``bytes_floor`` and
``host_pinnings``, counted since, joined every case (the values of ``TIMING_DEPENDENT`` at two ranks kept as they
were: not compared); the losses unchanged. Written again when the traced iteration kept the blocks whose
activations surely fit (see [Note: the traced iteration's offload]): ``twin_1rank_device_adam``'s first step
offloads nothing (215,556 B out and back before, 6 host buffers pinned for them), its activation peaks higher by
those bytes kept; nothing else moved, the later steps and the losses unchanged. Written again when the move model
reached several ranks without gradient accumulation (see [Note: predicted moves]): ``twin_2rank_ga1`` predicts
(176,768 / 81,472 B a step on rank 0, 143,872 / 81,472 on rank 1, against 154,560 / 168,384 to the device and
81,472 to the host measured; not compared: ``TIMING_DEPENDENT``) and prefetches by the step-time model's choice
(``prefetch_distance`` 0 -> 1: one moment ahead, as before); the states, the bytes moved and the losses unchanged.
Written again when it reached several ranks with gradient accumulation: ``twin_2rank_ga2`` places the states by
the step-time model (1 -> 0 on the accelerator per rank, from the traced step on), keeps accumulators on the
accelerator while their payloads go (``eviction_order`` 0 -> 2) and a group gathered (26 all-gathers a step
instead of 28); per steady step and rank 103,744 B to the device instead of 123,712 / 137,536, 81,472 to the host
as before, accumulators 0 each way instead of 42,240 / 56,064, predicted (103,744 / 81,472); ``evictions`` joined
``TIMING_DEPENDENT`` (a host-updated chunk whose collective completes late leaves through an eviction instead of a
release in backward: 2 or 3 a step in that case, the same bytes); the losses unchanged. The counters of host updates
begun in backward joined every case (``host_updates_in_backward``, ``host_updates_redone``, ``spare_bytes_host``: 0,
the cases clip at
1.0 from their first step, so none begins; nothing else moved). Written again when every saved storage of a block
became an entry of its segment, kept or offloaded (see [Note: activations give way]): an entry's arrival updates
``peak_activation_bytes_device`` as it is saved, so the steps after the traced one, which keep every block, count
the bytes saved after a moment's reading too (207,744 -> 216,196 in the five cases with activation offload), and
``activations_gave_way`` joined every case (0); nothing else moved. ``planned_tide_set_aside`` joined every case
later (0: see [Note: a forecast set aside]); nothing else moved.
"""
from __future__ import annotations

import gc
import json
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
GOLDEN = REPO / "tests" / "data" / "counter_runs.json"
STEPS = 3
# timings and what the host pool happens to cache are not behaviour
NOT_COMPARED = {"disk_io_seconds", "disk_wait_seconds", "agreement_seconds"}
# priced with the moments' measured times: kept in the results, left out of the golden file
TIMED = {"predicted_step_s", "plan_seconds", "planned_step_s"}
# with several ranks, when gloo completes a reduce-scatter decides when its buffer goes (reaped at the next
# moment or gradient, see memory/reductions.py) and whether a host-updated chunk's gradient leaves during backward,
# through an eviction making room, or at the step (the same bytes): the peaks and those counts differ from run to
# run, nothing moved does; and the model data a hook ends with beside the chunks placement moves (buffers whose
# reduce-scatter completed or not), which the move model reads: its predictions (tests/test_counter_runs.py bounds
# them)
TIMING_DEPENDENT = {"peak_model_bytes_device", "peak_device_bytes", "grads_released_in_backward", "evictions",
                    "predicted_bytes_to_device", "predicted_bytes_to_host"}
# with frozen chunks on disk the strict twin's activation meter counts one more (2, 2, 16, 16) fp32 tensor, the
# attention's size, at every step when the case runs after test_checkpoint.py or test_activation_checkpointing.py
# in the same session (at 8ef8d79 too; not after a lone job of theirs): the meter's peaks depend on the session
METER_DEPENDENT = {"frozen_on_disk_twin": {"peak_activation_bytes_device", "peak_non_model_bytes_device",
                                           "peak_device_bytes"}}

_GPT = {"n_layer": 3, "n_head": 2, "n_embd": 32, "block_size": 16, "vocab_size": 64}
CASES: dict[str, dict] = {
    # name: world size, GA, model overrides, zero_optimization extras ("{swap}": a fresh folder)
    "twin_1rank_ga1": {"world": 1, "ga": 1, "zero": {"device_budget": 260_000}},
    "twin_1rank_device_adam": {"world": 1, "ga": 1, "zero": {"device_budget": 700_000}},
    "twin_1rank_ga2": {"world": 1, "ga": 2, "zero": {"device_budget": 280_000}},
    "twin_2rank_ga1": {"world": 2, "ga": 1, "zero": {"device_budget": 300_000}},
    "twin_2rank_ga2": {"world": 2, "ga": 2, "zero": {"device_budget": 420_000}},
    "twin_checkpointed_offload": {
        "world": 1, "ga": 1, "model": {"activation_checkpointing": True},
        "zero": {"device_budget": 160_000, "offload_activations": "all"},
    },
    "disk_states": {
        "world": 1, "ga": 1, "emulate": False,
        "zero": {"offload_optimizer": {"device": "nvme", "nvme_path": "{swap}", "buffer_count": 4,
                                       "buffer_size": 1024}, "host_budget": 40_000},
    },
    "frozen_on_disk_twin": {
        "world": 1, "ga": 1, "frozen": True,
        "zero": {"device_budget": 150_000, "offload_param": {"device": "nvme", "nvme_path": "{swap}"},
                 "host_budget": 30_000},
    },
    "frozen_on_disk_2rank": {
        "world": 2, "ga": 1, "frozen": True, "emulate": False,
        "zero": {"offload_param": {"device": "nvme", "nvme_path": "{swap}"}, "host_budget": 30_000},
    },
}


def _config(case: dict, swap: str) -> dict:
    zero = json.loads(json.dumps(case["zero"]).replace("{swap}", swap))
    if case.get("emulate", True):
        zero["emulate_accelerator"] = True
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": case["ga"],
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1}},
        "zero_optimization": {"stage": "patrickstar", "chunk_size": 4096, **zero},
    }


def train_case(rank: int, world_size: int, case: dict) -> dict:
    """Train ``case`` (one of :data:`CASES`) for :data:`STEPS` steps; per step: the loss and the counters.
    No collection runs meanwhile: when the garbage collector frees a cycle holding an activation depends on
    the process's history (a kept worker), and the activation meter's peaks with it."""
    gc.collect()
    gc.disable()
    try:
        return _train(rank, case)
    finally:
        gc.enable()


def _train(rank: int, case: dict) -> dict:
    import deepspeed
    import torch

    import ds_patrickstar  # noqa: F401

    sys.path.insert(0, str(REPO / "benchmarks"))
    from gpt_model import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(**_GPT, **case.get("model", {})))
    if case.get("frozen"):
        for pname, param in model.named_parameters():
            param.requires_grad_(pname.startswith("blocks.2") or "ln_f" in pname)
    with tempfile.TemporaryDirectory() as swap:
        engine, *_ = deepspeed.initialize(model=model, config=_config(case, swap),
                                          model_parameters=[p for p in model.parameters() if p.requires_grad])
        gen = torch.Generator().manual_seed(1 + rank)
        steps = []
        for _ in range(STEPS):
            losses = []
            for _ in range(case["ga"]):
                idx = torch.randint(0, _GPT["vocab_size"], (2, _GPT["block_size"] + 1), generator=gen)
                loss = engine(idx[:, :-1].contiguous(), idx[:, 1:].contiguous())[1]
                engine.backward(loss)
                engine.step()
                losses.append(round(float(loss), 6))
            counters = {k: v for k, v in engine.get_patrickstar_counters().items() if k not in NOT_COMPARED}
            steps.append({"losses": losses, "counters": counters})
        engine.destroy()
    return {"rank": rank, "steps": steps}


def run_case(name: str) -> list[dict]:
    sys.path.insert(0, str(REPO / "tests"))
    from multiproc import run_ranks

    # frozen chunks on disk: on processes of their own (the bytes written at initialize and the activation meter's
    # counts depend on what a kept worker ran before)
    fresh = bool(CASES[name].get("frozen"))
    return run_ranks(train_case, CASES[name]["world"], CASES[name], timeout=240.0, memo=True, fresh=fresh)


def main() -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    golden = {name: run_case(name) for name in CASES}
    for ranks in golden.values():
        for result in ranks:
            for step in result["steps"]:
                step["counters"] = {k: v for k, v in step["counters"].items() if k not in TIMED}
    GOLDEN.parent.mkdir(exist_ok=True)
    GOLDEN.write_text(json.dumps(golden, indent=1, sort_keys=True) + "\n")
    print(f"wrote {GOLDEN}")


if __name__ == "__main__":
    main()
