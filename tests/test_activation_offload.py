"""Activation offload (issue 20, items 3 and 4): ``zero_optimization.offload_activations`` "all" and
"auto" against stock ZeRO-3 running the same checkpointing, the budget a plan makes fit, the wait
before use, what the counters and the tide say. A GPT-like model of thin checkpointed blocks, so
that what the checkpoints keep (each block's input) is most of the tide. Tolerances are those of
tests/test_vs_zero3.py (justified there): offload moves bytes, it changes no arithmetic.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

VOCAB, WIDTH, LAYERS, SEQ, BATCH = 32, 16, 6, 32, 8
STEPS = 3
SEED = 7


class Layer(nn.Module):
    """A pre-norm transformer layer: causal self-attention and an MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH, bias=False)  # a key bias has no gradient but noise (Adam scales it)
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.fc1, self.fc2 = nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, t, c = h.shape
        q, k, v = self.qkv(self.ln1(h)).view(b, t, 3, 2, c // 2).transpose(1, 3).unbind(2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        h = h + self.proj(a)
        return h + self.fc2(F.gelu(self.fc1(self.ln2(h))))


class TinyGPT(nn.Module):
    def __init__(self, checkpointed: bool) -> None:
        super().__init__()
        self.checkpointed = checkpointed
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList([Layer() for _ in range(LAYERS)])
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tok: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.wte(tok)
        for layer in self.layers:
            h = checkpoint(layer, h, use_reentrant=True) if self.checkpointed else layer(h)
        return F.cross_entropy(self.head(h).float().flatten(0, 1), y.flatten())


def _batches(seed: int):
    def batch(step: int):
        gen = torch.Generator().manual_seed(1000 * seed + step)
        tok = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
        return tok, torch.roll(tok, -1, 1)

    return batch


def build_checkpointed(seed: int):
    torch.manual_seed(seed)
    return TinyGPT(True), _batches(seed)


def build_plain(seed: int):
    torch.manual_seed(seed)
    return TinyGPT(False), _batches(seed)


BUDGET = 100_000  # fp32, one rank: checkpointing alone needs 117 kB of tide beside the chunks (fails)


def _train(rank, world_size, stage, dtype, mode, budget, gas=1, build=build_checkpointed):
    from harness import make_config, run_training

    import ds_patrickstar  # noqa: F401

    extra = None
    if stage == "patrickstar":
        extra = {"emulate_accelerator": True, "device_budget": budget}
        if mode is not None:  # None: the key left out (see [Note: activations by default])
            extra["offload_activations"] = mode
    config = make_config(stage, dtype, gas=gas, chunk_size=2048, extra_zero=extra)
    if world_size > 1:
        config.pop("train_batch_size")
    return run_training(build, config, STEPS, SEED)


# mode, world size, dtype, budget (bf16 on two ranks: half the tide, whole groups gathered; near the
# limit there, see tests/test_activation_plan_dp.py)
CASES = [("all", 1, "fp32", BUDGET), ("auto", 1, "fp32", BUDGET), ("auto", 2, "bf16", 90_000)]


@pytest.mark.parametrize("mode,world_size,dtype,budget", CASES)
def test_offload_matches_zero3(mode, world_size, dtype, budget):
    """Losses and fp32 weights equal stock ZeRO-3's with the same checkpointing; every byte copied out
    comes back; "auto" offloads some blocks after the traced iteration (which offloads all), not all."""
    from multiproc import run_ranks
    from test_vs_zero3 import check

    ref = run_ranks(_train, world_size, 3, dtype, "none", 0, memo=True)
    ours = run_ranks(_train, world_size, "patrickstar", dtype, mode, budget)
    for rank in range(world_size):
        check(ours[rank], ref[rank], dtype)
        counters = ours[rank].counters
        traced, after = counters[0]["activation_bytes_offloaded"], [c["activation_bytes_offloaded"] for c in counters]
        assert all(c["activation_bytes_offloaded"] == c["activation_bytes_restored"] for c in counters), counters
        if mode == "all":
            assert after == [traced] * STEPS and traced > 0, after
        elif world_size == 1:
            assert all(0 < moved < traced for moved in after[1:]), after
        else:  # at 90 kB checkpointing alone fits on two ranks: nothing moves
            assert after[1:] == [0] * (STEPS - 1), after


def test_auto_fits_where_checkpointing_alone_does_not():
    """The same budget without offload fails at the moment the tide leaves no room for the chunks."""
    from multiproc import WorkerError, run_ranks

    with pytest.raises(WorkerError, match="DeviceBudgetExceeded"):
        run_ranks(_train, 1, "patrickstar", "fp32", "none", BUDGET)


def test_left_out_the_run_offloads_instead_of_refusing():
    """Without the key, a model larger than the budget offloads where the chunks would not fit beside the
    tide (the budget "none" refuses above), and trains as stock ZeRO-3 does."""
    from multiproc import run_ranks
    from test_vs_zero3 import check

    ref = run_ranks(_train, 1, 3, "fp32", "none", 0, memo=True)
    ours = run_ranks(_train, 1, "patrickstar", "fp32", None, BUDGET, timeout=600.0)[0]
    check(ours, ref[0], "fp32")
    after = [c["activation_bytes_offloaded"] for c in ours.counters]
    assert all(0 < moved < after[0] for moved in after[1:]), after


FITS = 600_000  # fp32, one rank, no checkpointing: 235 kB of model data fit, 1.23 MB of activations do not


def test_left_out_a_model_that_fits_offloads_the_activations_that_do_not():
    """Model data below the budget, activations above it beside the chunks: without the key the run offloads
    (it was refused: "none" below), and trains as stock ZeRO-3 does (see [Note: activations by default])."""
    from multiproc import WorkerError, run_ranks
    from test_vs_zero3 import check

    with pytest.raises(WorkerError, match="DeviceBudgetExceeded"):
        run_ranks(_train, 1, "patrickstar", "fp32", "none", FITS, 1, build_plain)
    ref = run_ranks(_train, 1, 3, "fp32", "none", 0, 1, build_plain)
    ours = run_ranks(_train, 1, "patrickstar", "fp32", None, FITS, 1, build_plain)[0]
    check(ours, ref[0], "fp32")
    after = [c["activation_bytes_offloaded"] for c in ours.counters]
    assert all(0 < moved < after[0] for moved in after[1:]), after


def _losses(mode: str, wait: bool) -> list[float]:
    import deepspeed

    import ds_patrickstar  # noqa: F401
    from ds_patrickstar.activations.copies import StorageCopies

    class NoWait(StorageCopies):
        """Reads an offloaded activation as soon as its copy back is issued (test only)."""

        def wait_before_use(self, entry) -> None:
            self.back_home(entry)

    model, batch = build_checkpointed(SEED)
    zero = {"stage": "patrickstar", "chunk_size": 2048, "emulate_accelerator": True, "device_budget": 10**6,
            "offload_activations": mode}
    config = {"train_micro_batch_size_per_gpu": BATCH, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": zero}
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    if not wait:
        engine.optimizer.placement.activations.copies.__class__ = NoWait
    losses = steps_then_eval(engine, batch)
    engine.destroy()
    return losses


def steps_then_eval(engine, batch, steps: int = 2) -> list[float]:
    """The losses of ``steps`` training steps and of a forward after them (batches 0 to ``steps``)."""
    losses = []
    for step in range(steps):
        loss = engine(*batch(step))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    losses.append(engine(*batch(steps)).item())
    return losses


def test_read_before_the_copy_back_completes_changes_the_numbers(dist):
    """The strict accelerator poisons a copy's destination until it is waited on (NaN, or -1 in an
    integer tensor): without the wait before use, backward reads poison (NaN gradients: the step is
    skipped as an overflow, and the next losses change); with it, offload changes nothing. (The head's
    saved targets stay: the caller's batch holds them, so offloading them would free nothing.)"""
    stay = _losses("none", wait=True)
    assert _losses("all", wait=True) == stay
    broken = _losses("all", wait=False)
    assert broken[0] == stay[0] and broken[1] != stay[1] and broken[2] != stay[2], (broken, stay)


def test_bad_value_names_the_key_and_the_choices():
    from ds_patrickstar.integration.config import parse_patrickstar_options

    with pytest.raises(ValueError, match=r"offload_activations='cpu'.*'none', 'all' or 'auto'"):
        parse_patrickstar_options({"stage": "patrickstar", "offload_activations": "cpu"})


def test_tide_series_tells_resident_from_offloaded():
    from ds_patrickstar.placement.tide_plot import tide_series

    mib = 2**20
    series = tide_series([(0, mib, 2 * mib, 0), (1, mib, mib, 3 * mib)])
    assert series == {"moments": [0.0, 1.0], "model": [1.0, 1.0], "resident": [2.0, 1.0], "offloaded": [0.0, 3.0]}


def test_plan_offloads_the_fewest_bytes_that_fit():
    """Traced with every block offloaded: blocks 0, 1, 2 (10, 30, 20 B) away over moments 1..5, 2..4,
    3..3. With no offload moment 3 holds all 60 B beside 5 B of tide and 10 B of chunks; at a budget
    of 55 B, 20 B must go: block 2 (20 B) suffices at moment 3, but then moment 2 (block 0 and 1 and
    what the next moment's tide adds) still holds 45 + 10 = 55: it fits. The tide returned is the
    planned one."""
    from ds_patrickstar.activations.plan import SegmentRecord, plan_offload

    tide, need = [5] * 7, [10] * 7
    records = [SegmentRecord(0, 10, 1, 6, True), SegmentRecord(1, 30, 2, 5, True), SegmentRecord(2, 20, 3, 4, True)]
    chosen, planned = plan_offload(tide, need, 55, records)
    assert chosen == {2}
    assert planned == [5, 15, 45, 45, 45, 15, 5]
    assert plan_offload(tide, need, 200, records)[0] == set()
    assert plan_offload(tide, need, 20, records)[0] == {0, 1, 2}  # nothing fits: every block goes


def test_the_plan_covers_every_micro_step_alike():
    """A micro-step's tide is planned, at each moment, as the most at its place in every micro-step where the
    micro-steps run the same moments (see [Note: a risen tide]); a step moment is left as it is, and micro-steps
    running other moments are not matched."""
    from ds_patrickstar.activations.plan import micro_step_places, spread
    from ds_patrickstar.placement.trace import Moment, Trace

    def across_micro_steps(tide, trace):
        return spread(tide, micro_step_places(trace, len(tide)))

    def trace(labels):
        built = Trace()
        for label in labels:
            built.add(Moment(label, (), 0))
        return built

    same = trace(["fwd:a", "fwd:b", "bwd:b", "bwd:a", "fwd:a", "fwd:b", "bwd:b", "bwd:a", "step"])
    assert across_micro_steps([1, 5, 7, 2, 3, 4, 9, 1, 6], same) == [3, 5, 9, 2, 3, 5, 9, 2, 6]
    other = trace(["fwd:a", "fwd:b", "bwd:b", "bwd:a", "fwd:a", "bwd:a", "step"])
    assert across_micro_steps([1, 5, 7, 2, 3, 4, 6], other) == [1, 5, 7, 2, 3, 4, 6]


def _tide_over_plan(rank, world_size):
    """After three steps of the plain model at a budget every activation fits beside (the key left out: "auto",
    the traced iteration offloads every block, the plan none): per training moment of the last iteration, the most
    placement read beside model data less the tide planned there; and the highest planned tide."""
    import deepspeed
    from harness import ensure_distributed, make_config

    import ds_patrickstar  # noqa: F401

    ensure_distributed()
    model, batch = build_plain(SEED)
    extra = {"emulate_accelerator": True, "device_budget": 10**7}
    config = make_config("patrickstar", "fp32", chunk_size=2048, extra_zero=extra)
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    for step in range(3):
        engine.backward(engine(*batch(step)))
        engine.step()
    trace = engine.optimizer.placement.tracer.last_iteration()
    moments = [m for m in trace.moments if m.label != "step"]
    engine.destroy()
    return [max(m.read, m.read_late) - m.non_model for m in moments], max(m.non_model for m in moments)


def test_the_planned_tide_counts_a_block_at_the_moment_it_is_brought_back():
    """The traced iteration reads a moment's tide before the moment's compute brings a block's activations back;
    the plan counts them at that moment (they were counted nowhere: one block's activations above the plan
    there, and the next step re-planned, see [Note: auto activation offload])."""
    from multiproc import run_ranks

    over, peak = run_ranks(_tide_over_plan, 1)[0]
    assert max(over) < 0.05 * peak, (max(over), peak)


def test_the_traced_iteration_keeps_the_blocks_that_surely_fit():
    """[Note: the traced iteration's offload]: a segment stays when the tide now, the segment once more and the
    blocks after it (each as the largest segment so far) fit in three quarters of the budget beside every
    chunk; so the earliest blocks go where some must, and everything stays where a quarter stays free."""
    from ds_patrickstar.activations.traced_keep import TracedKeep

    tide = [0]
    keep = TracedKeep(budget=400, model_bytes=100, tide_now=lambda: tide[0])  # room 200 for the tide
    keep.blocks = 4
    keep.start_forward()
    decisions = []
    for block in range(4):  # each block saves 40; an offloaded one leaves the tide
        kept = keep.keeps(block, 40)
        decisions.append(kept)
        tide[0] += 40 if kept else 0
    # 40 + 40 * 3 = 160 <= 200 at block 0: everything stays
    assert decisions == [True] * 4
    tide[0] = 0
    keep = TracedKeep(budget=400, model_bytes=180, tide_now=lambda: tide[0])  # room 120
    keep.blocks = 4
    keep.start_forward()
    decisions = []
    for block in range(4):
        kept = keep.keeps(block, 40)
        decisions.append(kept)
        tide[0] += 40 if kept else 0
    # block 0: 40 + 120 > 120; block 1: 40 + 80 <= 120, kept (tide 40); block 2: 40 + 40 + 40 <= 120; block 3: 120
    assert decisions == [False, True, True, True], decisions
    keep.start_forward()  # the next forward starts over; a larger segment raises the estimate of those after it
    tide[0] = 0
    assert keep.keeps(2, 10) and not keep.keeps(2, 70)


def _host_and_moves(mode, budget):
    from multiproc import run_ranks

    result = run_ranks(_train, 1, "patrickstar", "fp32", mode, budget, 1, build_plain)[0]
    counters = result.counters
    return result.losses, [c["activation_bytes_offloaded"] for c in counters], counters[0]["host_bytes_allocated"]


def test_left_out_a_roomy_budget_moves_no_activation_even_in_the_traced_iteration():
    """With the key left out and a quarter of the budget free beside every chunk and activation, the traced
    iteration offloads nothing (it offloaded every block: 1.23 MB out and back and a pinned slab for them, at the
    first step), and the run is "none"'s bit for bit, host memory included; at 1 MB, where the activations do not
    fit beside the chunks, the traced iteration offloads some blocks, not all (1,013,760 B of 1,265,668)."""
    roomy = 4_000_000
    none = _host_and_moves("none", roomy)
    assert _host_and_moves(None, roomy) == (none[0], [0] * STEPS, none[2])
    everything = _host_and_moves("all", 1_000_000)
    losses, moved, _ = _host_and_moves(None, 1_000_000)
    assert losses == everything[0]
    assert 0 < moved[0] < everything[1][0] and moved[1:] == [moved[1]] * (STEPS - 1), (moved, everything[1])
