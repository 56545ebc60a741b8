"""Placement on the inputs people feed (issue 31): a sequence length that changes every step, dynamic
padding with "auto" activation offload, and a validation forward under grad mode between steps, on
the strict emulated accelerator with a budget below the model, against stock ZeRO-3 on the same
batches (tolerances: tests/test_vs_zero3.py, fp32). The runs are benchmarks/dynamic_shapes.py's."""
import logging
import os
import sys

import pytest
import torch
from test_vs_zero3 import TOL

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import dynamic_shapes as ds

LENGTHS = [20, 32, 9, 16, 24, 23]  # the longest second: one re-trace, then the trace covers every length
WARMUP = 2


@pytest.fixture(scope="module")
def zero3(dist):
    return ds.gpt_run(ds.gpt_config(3), LENGTHS)


def _losses(ours, ref):
    tol = TOL["fp32"]
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(ref), rtol=tol["loss_rtol"], atol=tol["loss_atol"])


def test_changing_length_prefetches_and_keeps_device_adam_as_a_fixed_length_does(zero3):
    # "fill": the device-side Adam plan is the subject ("time" keeps no state on the accelerator at this budget)
    changing = ds.gpt_run(ds.gpt_config("patrickstar", ds.TWIN_BUDGET, optimizer_placement="fill"), LENGTHS)
    fixed = ds.gpt_run(ds.gpt_config("patrickstar", ds.TWIN_BUDGET, optimizer_placement="fill"),
                       [max(LENGTHS)] * len(LENGTHS))
    _losses(changing["losses"], zero3["losses"])
    after = {name: run["counters"][WARMUP:] for name, run in (("changing", changing), ("fixed", fixed))}
    prefetches = {name: sum(c["prefetches"] for c in counters) for name, counters in after.items()}
    assert prefetches["fixed"] > 0 and prefetches["changing"] >= 0.8 * prefetches["fixed"], prefetches
    device_adam = {name: [c["adam_chunks_device"] for c in counters] for name, counters in after.items()}
    assert min(device_adam["fixed"]) > 0 and device_adam["changing"] == device_adam["fixed"], device_adam
    # one re-trace, for the longer sequence at step 1, with its reason
    assert [c["retraces_shape"] for c in changing["counters"]] == [0, 1, 0, 0, 0, 0]
    assert sum(c["retraces_order"] + c["tide_replans"] for c in changing["counters"]) == 0


def test_dynamic_padding_with_auto_activation_offload_plans_once(zero3):
    """"auto" offloads in a traced iteration only the blocks that may not fit (see [Note: the traced iteration's
    offload]): at 2.5 MB none at the first length, some in the re-trace for the longest, and nothing once the
    trace covers the lengths; at 4 MB a quarter of the budget stays free beside every chunk and activation, and
    nothing moves at all (every block moved in both traced iterations before)."""
    run = ds.gpt_run(ds.gpt_config("patrickstar", 2_500_000, offload_activations="auto"), LENGTHS)
    _losses(run["losses"], zero3["losses"])
    offloaded = [c["activation_bytes_offloaded"] for c in run["counters"]]
    assert offloaded[0] == 0 and offloaded[1] > 0 and offloaded[WARMUP:] == [0] * (len(LENGTHS) - WARMUP), offloaded
    roomy = ds.gpt_run(ds.gpt_config("patrickstar", 4_000_000, offload_activations="auto"), LENGTHS)
    assert roomy["losses"] == run["losses"]
    assert [c["activation_bytes_offloaded"] for c in roomy["counters"]] == [0] * len(LENGTHS)


def test_a_later_micro_step_longer_than_any_traced_offloads_and_chooses_the_blocks_again():
    """With gradient accumulation only an iteration's first forward can re-trace: a later micro-batch longer than
    every traced one offloads every block's activations in it, and the step chooses the blocks "auto" offloads
    again from the tide it measured (see [Note: a risen tide]). Two micro-batches a step, the second four times
    the first from the second step on, at 1.2 MB (the longer batches' activations alone peak at 1.09 MB): it
    trains with the losses of a run that keeps every activation (bit for bit), where keeping the traced step's
    blocks (none) stopped with DeviceBudgetExceeded at the third step."""
    lengths = [8, 8, 8, 32, 8, 32, 8, 8]  # two micro-batches a step

    def run(budget, offload):
        config = ds.gpt_config("patrickstar", budget, chunk=4096, offload_activations=offload)
        config["gradient_accumulation_steps"] = 2
        return ds.gpt_run(config, lengths)

    resident = run(10**8, "none")
    ours = run(1_200_000, "auto")
    assert ours["losses"] == resident["losses"]
    steps = ours["counters"][1::2]
    assert [c["tide_replans"] for c in steps] == [0, 1, 0, 0]
    offloaded = [c["activation_bytes_offloaded"] for c in steps]
    # the traced step offloads what may not fit; the longer micro-batch every block; then the blocks chosen again
    assert offloaded[1] > offloaded[0] > 0 and 0 < offloaded[2] < offloaded[1], offloaded
    assert max(c["peak_non_model_bytes_device"] for c in steps) < 1_200_000


def test_padded_micro_batches_keep_room_for_the_pieces_they_strand():
    """Two micro-batches a step of changing lengths: "auto" plans with the margin for the allocator pieces such
    batches strand (see [Note: a risen tide]) and trains at every budget with the losses of a run keeping every
    activation, where planning without it kept every block at 1.2 and 1.26 MB and stopped at the third step
    (1.15 MB trained)."""
    lengths = [14, 8, 24, 31, 9, 13, 15, 8, 9, 29]

    def run(budget, offload):
        config = ds.gpt_config("patrickstar", budget, chunk=2048, offload_activations=offload)
        config["gradient_accumulation_steps"] = 2
        return ds.gpt_run(config, lengths)["losses"]

    resident = run(10**8, "none")
    for budget in (1_150_000, 1_260_000):
        assert run(budget, "auto") == resident, budget


def _two_micro_steps(lengths, chunk, budget, offload):
    """The twin GPT with two micro-batches a step, one length each."""
    config = ds.gpt_config("patrickstar", budget, chunk=chunk, offload_activations=offload)
    config["gradient_accumulation_steps"] = 2
    return ds.gpt_run(config, lengths)


def test_micro_batches_of_other_lengths_plan_each_ones_own_tide_raised_at_its_place():
    """Two micro-batches a step of other lengths (30 then 18 tokens traced) at 700 KB, where "auto" offloads every
    block: the plan covers both micro-steps alike from each one's own tide with its own segments away, raised to the
    most at its place (see [Note: a risen tide]). Raising the tides with no offload first and taking the second
    micro-step's smaller segments off that planned 631 KB where 274 KB stood, and the run stopped at the second
    step where offloading every block by "all" trains; now it trains, bit for bit with a run keeping every
    activation."""
    lengths = [30, 18, 23, 23, 11, 8, 17, 20]
    resident, ours = _two_micro_steps(lengths, 4096, 10**8, "none"), _two_micro_steps(lengths, 4096, 700_000, "auto")
    assert ours["losses"] == resident["losses"]
    assert max(c["peak_device_bytes"] for c in ours["counters"]) <= 700_000


def test_a_forecast_above_the_memory_now_is_set_aside_where_the_chunks_fit_beside_what_stands():
    """Two micro-batches a step of other lengths at 550 KB (``chunk_size`` 2048): from the third step "auto"
    offloads every block, and at the end of a forward, every block on the host already, the tide planned for the
    start of backward (a longer micro-batch's: both its last blocks brought back) left no room for the head's chunk,
    whatever moved: the run stopped where offloading every block by "all" trains. The chunk fits beside what stands,
    so the moment goes on, and the next moment makes room for the tide that came (see [Note: a forecast set
    aside]): it trains, bit for bit with a run keeping every activation, within the budget at every moment."""
    lengths = [10, 17, 17, 31, 13, 21, 26, 16]
    resident, ours = _two_micro_steps(lengths, 2048, 10**8, "none"), _two_micro_steps(lengths, 2048, 550_000, "auto")
    assert ours["losses"] == resident["losses"]
    assert sum(c["planned_tide_set_aside"] for c in ours["counters"]) > 0
    assert max(c["peak_device_bytes"] for c in ours["counters"]) <= 550_000


def test_kept_activations_give_way_where_the_pieces_stranded_rise_above_the_plan():
    """One batch a step of changing lengths at 1.15 MB: the fifth batch (28 tokens, a length traced) finds more
    allocator pieces stranded beside the blocks "auto" keeps than the plan's margin: the finished blocks' kept
    activations leave for the host there, the rest of that forward offloads every block, and the step plans with
    the higher margin, so no later batch needs it (see [Note: activations give way]). It trains with the losses
    of a run keeping every activation, bit for bit, where it stopped with DeviceBudgetExceeded naming "all"
    (and, without the higher margin, gave way again at two of the next three steps)."""
    lengths = [25, 28, 11, 13, 28, 26, 27, 28]

    def run(budget, offload):
        return ds.gpt_run(ds.gpt_config("patrickstar", budget, chunk=2048, offload_activations=offload), lengths)

    resident, ours = run(10**8, "none"), run(1_150_000, "auto")
    assert ours["losses"] == resident["losses"]
    assert [c["activations_gave_way"] for c in ours["counters"]] == [0, 0, 0, 0, 1, 0, 0, 0]
    offloaded = [c["activation_bytes_offloaded"] for c in ours["counters"]]
    assert offloaded[2:4] == [0, 0] and min(offloaded[4:]) > 0, offloaded  # kept before, one block planned after
    assert max(c["peak_device_bytes"] for c in ours["counters"]) <= 1_150_000


@pytest.mark.parametrize("chunk, budget, called_back", [(2048, 625_000, 0), (4096, 650_000, 247_296)])
def test_a_block_gives_way_in_backward_where_offloading_every_block_trains(chunk, budget, called_back):
    """"auto" keeps one block, and in the third step's backward the chunks of the block in backward do not fit
    beside the activations and the allocator's pieces (see [Note: activations give way]). At 625 KB (``chunk_size``
    2048; offloading every block trains from about 612 KB) the kept block, whose backward comes later, leaves for
    the host; at 650 KB (4096) nothing is kept before the block in backward, and the block prefetched for the next
    backward goes back to the host (its copy back undone, so the step brings 247,296 B back twice). Both come back
    at their own backward. The runs train with the losses of a run keeping every activation, bit for bit, where
    "auto" stopped with DeviceBudgetExceeded."""
    lengths = [32, 24, 32, 30]

    def run(budget, offload):
        return ds.gpt_run(ds.gpt_config("patrickstar", budget, chunk=chunk, offload_activations=offload), lengths)

    resident, ours = run(10**8, "none"), run(budget, "auto")
    assert ours["losses"] == resident["losses"]
    assert [c["activations_gave_way"] for c in ours["counters"]] == [0, 0, 1, 0]
    third = ours["counters"][2]
    assert third["activation_bytes_restored"] - third["activation_bytes_offloaded"] == called_back
    assert max(c["peak_device_bytes"] for c in ours["counters"]) <= budget


def test_a_block_whose_prefetch_gave_way_comes_back_at_its_own_backward_from_then_on(caplog):
    """At 650 KB (``chunk_size`` 4096) over eight batches of changing lengths, blocks brought back ahead of their
    backward give way (their copies back undone); each comes back at its own backward from then on, so none is
    called back twice (see [Note: activations give way]): before, the same blocks gave way again in the next step,
    their bytes crossing twice (1.83 MB brought back in the seventh step, against 1.09 MB offloaded)."""
    lengths = [32, 24, 32, 30, 28, 32, 32, 26]
    config = ds.gpt_config("patrickstar", 650_000, chunk=4096, offload_activations="auto")
    with caplog.at_level(logging.INFO, logger="ds_patrickstar"):
        ours = ds.gpt_run(config, lengths)
    called_back = [block for r in caplog.records if r.msg.startswith("ds_patrickstar: the tide stands above")
                   for block in r.args[2]]
    assert called_back and len(called_back) == len(set(called_back)), called_back
    seventh = ours["counters"][6]
    assert seventh["activation_bytes_restored"] == seventh["activation_bytes_offloaded"] == 1_088_000


def test_a_budget_error_names_offloading_every_block_where_auto_keeps_some():
    from ds_patrickstar.activations.offloader import ActivationOffloader
    from ds_patrickstar.counters import StepCounters
    from ds_patrickstar.memory.emulated import EmulatedAccelerator
    from ds_patrickstar.placement.remedies import Shortfall, budget_remedies
    from ds_patrickstar.placement.saved_meter import SavedTensorMeter

    kept = budget_remedies(Shortfall(1000, 10**6, 5000, 4000, offloading=True, kept=True))
    assert 'offload_activations "all"' in kept and "of the 5,000 B of non-model memory" in kept
    assert '"all"' not in budget_remedies(Shortfall(1000, 10**6, 5000, 4000, offloading=True))
    offloader = ActivationOffloader(EmulatedAccelerator(10**6), SavedTensorMeter(lambda s: False), "auto",
                                    StepCounters(), lambda: 0)
    offloader.blocks_found(4)
    assert not offloader.keeps_blocks()  # a traced iteration: every block may go
    offloader.chosen = {0, 1}
    assert offloader.keeps_blocks()
    offloader.chosen = {0, 1, 2, 3}
    assert not offloader.keeps_blocks()


def _validate(engine, step, tokens):
    """A validation loss under grad mode (no backward) after steps 1 and 3, and a no_grad one after 4."""
    if step not in (1, 3, 4):
        return None
    with torch.set_grad_enabled(step != 4):
        logits = engine(tokens[:, :-1])
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, ds.VOCAB), tokens[:, 1:].reshape(-1)).item()


def test_validation_forwards_between_steps_leave_the_trace_and_the_budget_alone(dist):
    fixed = [max(LENGTHS)] * len(LENGTHS)
    ref = ds.gpt_run(ds.gpt_config(3), fixed, between=_validate)
    ours = ds.gpt_run(ds.gpt_config("patrickstar", ds.TWIN_BUDGET), fixed, between=_validate)
    _losses(ours["losses"], ref["losses"])
    _losses([v for v in ours["between"] if v is not None], [v for v in ref["between"] if v is not None])
    assert sum(c["retraces_shape"] + c["retraces_order"] + c["tide_replans"] for c in ours["counters"]) == 0
    plain = ds.gpt_run(ds.gpt_config("patrickstar", ds.TWIN_BUDGET), fixed)
    # the training moments are placed as without the validations: the same device Adam every step
    assert [c["adam_chunks_device"] for c in ours["counters"]] == [c["adam_chunks_device"] for c in plain["counters"]]


def test_the_envelope_and_the_warning_when_re_traces_repeat(caplog):
    import logging

    import torch as t

    from ds_patrickstar.placement.shapes import RETRACE_LIMIT, RetraceLog, RetraceReason, covers, widen

    a, b = (((2, 20), t.int64),), (((4, 9), t.int64),)
    envelope = widen(a, b)
    assert envelope == (((4, 20), t.int64),) and covers(envelope, a) and covers(envelope, b)
    assert not covers(envelope, (((2, 21), t.int64),)) and not covers(envelope, (((2, 20), t.float32),))
    log = RetraceLog(logging.getLogger("ds_patrickstar.placement.tracer"))
    with caplog.at_level(logging.INFO, logger="ds_patrickstar.placement.tracer"):
        for _ in range(RETRACE_LIMIT + 2):
            log.new_iteration()
            log.retraced(RetraceReason.SHAPE, "input shapes changed")
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "re-traces in the last" in warnings[0].getMessage(), caplog.text
    assert "inputs larger than every traced shape" in warnings[0].getMessage()
    assert log.caption().startswith(f"re-traced {RETRACE_LIMIT + 2}x")
