"""Tide-aware placement on the emulated accelerator: Belady, budget, prefetch, re-trace, tracer accuracy."""
import re

import harness
import pytest
import torch
from counter_runs import CASES, train_case
from multiproc import WorkerError, run_ranks

from ds_patrickstar.memory.ledger import DeviceBudgetExceeded
from ds_patrickstar.placement.planner import belady_victims, optimizer_chunks_on_device
from ds_patrickstar.placement.trace import NEVER, Moment, Trace

HIDDEN, LAYERS, BATCH = 160, 8, 4


# ---- the planner on hand-made traces -------------------------------------------------
def _trace(*uses):
    trace = Trace()
    for i, chunks in enumerate(uses):
        trace.add(Moment(f"m{i}", tuple(chunks), 0))
    return trace


def test_next_use_wraps_to_the_next_iteration():
    trace = _trace([0], [1], [2], [0, 1])
    assert trace.next_use(0, 0) == 3
    assert trace.next_use(2, 2) == 2 + 4  # only used at moment 2: next iteration
    assert trace.next_use(7, 0) == NEVER


def test_belady_evicts_the_farthest_next_use():
    trace = _trace([0, 1, 2], [0], [1], [2], [3])
    resident = {0: 10, 1: 10, 2: 10}
    # at moment 0, chunk 3 needs room: chunk 2 is used last (moment 3), so it goes
    assert belady_victims(resident, 10, lambda c: trace.next_use(c, 0)) == [2]
    assert belady_victims(resident, 15, lambda c: trace.next_use(c, 0)) == [2, 1]
    never = _trace([0], [1])
    assert belady_victims({0: 5, 9: 5}, 5, lambda c: never.next_use(c, 0)) == [9]  # never used again
    with pytest.raises(DeviceBudgetExceeded):
        belady_victims({0: 5}, 6, lambda c: trace.next_use(c, 0))


def test_eviction_queue_agrees_with_the_plain_belady_rule():
    """The O(log n) queue the runtime uses picks what the plain rule picks, moment by moment, over
    random traces and two iterations (the trace wraps)."""
    import random

    from ds_patrickstar.placement.policy import Placer

    rng = random.Random(0)
    for _ in range(20):
        n = rng.randint(3, 12)
        trace = _trace(*[rng.sample(range(n), rng.randint(1, 3)) for _ in range(rng.randint(3, 10))])
        placer = Placer(10**9, "auto", 0.0, range(n))
        resident = set()
        for iteration in range(2):
            for moment, m in enumerate(trace.moments):
                placer.touch(m.chunks, trace, moment, new_iteration=moment == 0 and iteration > 0)
                for c in m.chunks:
                    if c not in resident:
                        resident.add(c)
                        placer.arrived(c, 1)
                others = {c: 1 for c in resident if c not in m.chunks}
                if not others:
                    continue
                need = rng.randint(1, len(others))
                expected = belady_victims(others, need, lambda c, trace=trace, moment=moment: trace.next_use(c, moment))
                got = placer.victims(need, lambda c, m=m: None if c in m.chunks else 1)
                assert [trace.next_use(c, moment) for c in got] == [trace.next_use(c, moment) for c in expected]
                for c in got:
                    resident.discard(c)
                    placer.left(c, 1)
                assert placer.resident_bytes == len(resident)  # the running total the several-rank reading uses


def test_eviction_queue_stays_bounded():
    from ds_patrickstar.placement.eviction_queue import EvictionQueue

    queue = EvictionQueue()
    for i in range(100_000):
        queue.push(i % 10, i)  # ten chunks re-keyed over and over
    assert queue.entries <= 2 * 10 + 1024 + 1
    assert queue.take(3, lambda c: 1) == [0, 1, 2]  # lowest priority first: the oldest keys


def test_optimizer_states_fill_what_the_tide_leaves():
    caps = {0: 100, 1: 100, 2: 100}
    assert optimizer_chunks_on_device(2 * 1200 + 5, caps) == {0, 1}


# ---- training on the emulated accelerator ----------------------------------------------
def _mlp(bias=True, act=True):
    torch.manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        layers.append(torch.nn.Linear(HIDDEN, HIDDEN, bias=bias))
        if act:
            layers.append(torch.nn.GELU())
    return torch.nn.Sequential(*layers)


def _config(stage, **zero):
    z = {"stage": stage}
    if stage == "patrickstar":
        z.update({"chunk_size": 32768, **zero})
    return {"train_micro_batch_size_per_gpu": BATCH, "zero_optimization": z, "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}}}


def _run(config, steps=6, batches=None, model=None):
    import deepspeed

    harness.ensure_distributed()
    model = model or _mlp()
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    gen = torch.Generator().manual_seed(1)
    losses, counters = [], []
    try:
        for step in range(steps):
            batch = batches[step] if batches else BATCH
            x, y = torch.randn(batch, HIDDEN, generator=gen), torch.randn(batch, HIDDEN, generator=gen)
            loss = ((engine(x) - y) ** 2).mean()
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            if hasattr(engine, "get_patrickstar_counters"):
                counters.append(engine.get_patrickstar_counters())
    except BaseException:
        engine.destroy()  # a forward that raised: its hooks go with the engine, not into the next test
        raise
    return engine, losses, counters


# param chunks: 8 x (160*160+160) fp32 elements = 8 x ~103 KB = 822 KB of parameters
BUDGET = 300_000


@pytest.mark.parametrize("policy", ["auto", "static"])
def test_budget_smaller_than_model_matches_zero3(policy):
    _, ref, _ = _run(_config(3))
    engine, ours, counters = _run(_config("patrickstar", emulate_accelerator=True, device_budget=BUDGET,
                                          placement=policy, static_fraction=0.125))
    assert ours == ref  # fp32 on CPU: every move is an exact copy
    last = counters[-1]
    assert last["bytes_to_device"] > 0 and last["bytes_to_host"] > 0 and last["evictions"] > 0
    assert last["adam_chunks_host"] == 8 and last["adam_chunks_device"] == 0  # budget too small for fp32 states
    assert last["peak_model_bytes_device"] + last["peak_non_model_bytes_device"] <= BUDGET
    if policy == "auto":
        assert last["prefetches"] > 0 and last["prefetch_hits"] > 0
    engine.destroy()


def test_large_budget_keeps_chunks_and_runs_adam_on_the_accelerator():
    _, ref, _ = _run(_config(3))
    engine, ours, counters = _run(_config("patrickstar", emulate_accelerator=True, device_budget=8 * 2**20))
    assert ours == ref
    assert counters[-1]["adam_chunks_device"] == 8 and counters[-1]["evictions"] == 0
    assert counters[-1]["bytes_to_device"] == 0  # everything stayed on the accelerator after warm-up
    engine.destroy()


def test_budget_is_enforced():
    with pytest.raises(DeviceBudgetExceeded, match="budget"):
        _run(_config("patrickstar", emulate_accelerator=True, device_budget=120_000), steps=1)


def test_a_budget_below_one_chunk_group_is_refused_at_initialize():
    """The pre-flight check: a budget that cannot hold the largest chunk group a moment gathers (here
    one fp32 chunk of ~103 KB) fails at initialize with the key and the bytes, not in the first step."""
    with pytest.raises(ValueError,
                       match=r"device_budget=100,000 B cannot hold the largest chunk group .*10[0-9],[0-9]{3} B"):
        _run(_config("patrickstar", emulate_accelerator=True, device_budget=100_000), steps=1)


def test_a_tensor_larger_than_a_chunk_is_not_offered_a_smaller_chunk_size():
    """A chunk of one tensor larger than chunk_size keeps its size at any chunk_size: the pre-flight error says so
    instead of "lower chunk_size", and a budget error in a step leaves that remedy out where those chunks are all
    it names, and says so beside it where they are part (see ``placement/remedies.py``)."""
    import deepspeed

    from ds_patrickstar.placement.remedies import Shortfall, budget_remedies

    def run(budget: int, batch: int) -> None:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(256, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))  # 16,384
        config = _config("patrickstar", chunk_size=4096, emulate_accelerator=True, device_budget=budget,
                         offload_activations="none")
        engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
        engine.backward(engine(torch.randn(batch, 256)).pow(2).mean())

    with pytest.raises(ValueError, match=r"holds 16,384 elements of one tensor larger than chunk_size=4,096: a "
                                         r"smaller chunk_size does not shrink it"):
        run(40_000, 4)
    with pytest.raises(DeviceBudgetExceeded) as refused:
        run(120_000, 64)
    assert "chunk_size" not in str(refused.value) and "offload_activations" in str(refused.value)
    part = budget_remedies(Shortfall(1000, 10**6, 5000, held=80_000, larger=65_536))
    assert "a smaller zero_optimization.chunk_size (the chunks in use here take 80,000 B; 65,536 B of them" in part


def test_a_forward_without_backward_does_not_widen_the_traced_shapes():
    """A training-mode forward that gets no backward (a validation loss with grad on) is dropped; its input shapes,
    for which no tide was measured, leave the envelope of traced shapes as it was: a later training batch larger than
    the traced ones is traced anew (before, it followed the trace of the smaller batches)."""
    import deepspeed

    torch.manual_seed(0)
    model = _mlp()
    config = _config("patrickstar", emulate_accelerator=True, device_budget=BUDGET * 2)
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    gen, retraced = torch.Generator().manual_seed(1), []
    for batch, backward in [(4, True), (4, True), (16, False), (4, True), (12, True)]:
        loss = engine(torch.randn(batch, HIDDEN, generator=gen)).pow(2).mean()
        if backward:
            engine.backward(loss)
            engine.step()
            retraced.append(engine.get_patrickstar_counters()["retraces_shape"])
        envelope = engine.optimizer.placement.tracer.signature
    engine.destroy()
    # the dropped 16 began a re-trace (the next batch of 4 traces again: a step's cost, not undone); the batch of
    # 12 lies beyond the traced 4s, not within the dropped 16 (before: [0, 0, 1, 0], the 12 followed the 4s' trace)
    assert retraced == [0, 0, 1, 1], retraced
    assert envelope[0][0][0] == 12


def test_shape_change_retraces(caplog):
    caplog.set_level("INFO", logger="ds_patrickstar.placement.tracer")
    engine, _, _ = _run(_config("patrickstar", emulate_accelerator=True, device_budget=BUDGET * 2), steps=5,
                        batches=[4, 4, 4, 8, 8])
    assert "input shapes changed" in caplog.text and "re-tracing" in caplog.text
    traced_batch = engine.optimizer.placement.tracer.signature[0][0][0]
    assert traced_batch == 8
    engine.destroy()


def test_tracer_non_model_memory_matches_closed_form():
    # bias-free linears, no activation function: layer k saves its input, B*H fp32 values; the layers
    # are the model's blocks, whose inputs count from their pre-forward on (see [Note: held inputs]):
    # at layer k's moment, the inputs of layers 0..k
    engine, _, _ = _run(_config("patrickstar", emulate_accelerator=True, device_budget=8 * 2**20), steps=2,
                        model=_mlp(bias=False, act=False))
    trace = engine.optimizer.placement.tracer.trace
    for k in range(LAYERS):
        moment = next(m for m in trace.moments if m.label == f"fwd:{k}")
        expected = (k + 1) * BATCH * HIDDEN * 4
        assert abs(moment.non_model - expected) <= 0.1 * max(expected, 1), (k, moment.non_model, expected)
    engine.destroy()


def test_tide_plot(tmp_path):
    pytest.importorskip("matplotlib")
    engine, _, _ = _run(_config("patrickstar", emulate_accelerator=True, device_budget=BUDGET), steps=2)
    path = engine.tide_plot(str(tmp_path / "tide.png"))
    assert (tmp_path / "tide.png").stat().st_size > 1000 and path.endswith("tide.png")
    engine.destroy()


def test_preflight_refuses_a_model_that_cannot_fit(monkeypatch):
    import psutil

    real = psutil.virtual_memory()
    monkeypatch.setattr(psutil, "virtual_memory", lambda: real._replace(available=100_000))
    with pytest.raises(ValueError, match="largest model that would fit"):
        _run(_config("patrickstar", emulate_accelerator=True, device_budget=BUDGET), steps=1)


def _dp_worker(rank, world_size, stage):
    import deepspeed

    import ds_patrickstar  # noqa: F401

    # two ranks: a chunk group (2 chunks) must be present at once, and the biases share chunk 0's group
    extra = {"emulate_accelerator": True, "device_budget": 520_000} if stage == "patrickstar" else {}
    model = _mlp()
    engine, *_ = deepspeed.initialize(model=model, config=_config(stage, **extra), model_parameters=model.parameters())
    gen = torch.Generator().manual_seed(10 + rank)
    losses = []
    for _ in range(4):
        x, y = torch.randn(BATCH, HIDDEN, generator=gen), torch.randn(BATCH, HIDDEN, generator=gen)
        loss = ((engine(x) - y) ** 2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    counters = engine.get_patrickstar_counters() if stage == "patrickstar" else {}
    return {"losses": losses, "counters": counters}


def test_data_parallel_with_placement_matches_zero3():
    from multiproc import run_ranks

    ref = run_ranks(_dp_worker, 2, 3)
    ours = run_ranks(_dp_worker, 2, "patrickstar")
    for r in range(2):
        torch.testing.assert_close(torch.tensor(ours[r]["losses"]), torch.tensor(ref[r]["losses"]),
                                   rtol=1e-5, atol=1e-6)
        assert ours[r]["counters"]["evictions"] > 0 and ours[r]["counters"]["bytes_all_gathered"] > 0


def test_state_dict_and_checkpoint_with_chunks_on_the_host(tmp_path):
    from ds_patrickstar import gathered_parameters

    config = _config("patrickstar", emulate_accelerator=True, device_budget=BUDGET)
    _, uninterrupted, _ = _run(config, steps=6)
    engine, first, _ = _run(config, steps=3)
    assert any(c.on_host for c in engine.optimizer.manager.map.chunks)  # some chunks live on the host now
    state = engine.module.state_dict()
    fp32 = engine.get_fp32_state_dict()
    for name, value in fp32.items():
        assert torch.equal(state[name], value), name  # fp32 run: the parameter is its master
    with gathered_parameters(engine):
        assert torch.equal(engine.module[0].weight.detach(), fp32["0.weight"])
    engine.save_checkpoint(str(tmp_path))
    engine.destroy()

    import deepspeed

    model = _mlp()
    resumed, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    resumed.load_checkpoint(str(tmp_path))
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(BATCH, HIDDEN, generator=gen), torch.randn(BATCH, HIDDEN, generator=gen))
               for _ in range(6)]
    second = []
    for x, y in batches[3:]:
        loss = ((resumed(x) - y) ** 2).mean()
        resumed.backward(loss)
        resumed.step()
        second.append(loss.item())
    assert first + second == uninterrupted
    resumed.destroy()


def test_stranded_allocator_pieces_count_once_beside_the_coming_tide():
    """[Note: stranded allocator bytes]: free pieces of the allocator's partly used segments are
    reserved memory now, and where the coming tide is the higher (its allocations go into those
    pieces first) they are not counted a second time; where it is the lower, they are."""
    from types import SimpleNamespace

    from ds_patrickstar.placement.moves import ChunkMoves
    from ds_patrickstar.placement.policy import Placer
    from ds_patrickstar.placement.trace import Moment, Trace

    trace = Trace()
    for non_model in (100, 500, 500, 100):
        trace.add(Moment("m", (), non_model))
    stranded = [300]
    runtime = ChunkMoves.__new__(ChunkMoves)
    runtime.placer = Placer(1000, "auto", 0.5, [])
    runtime.ledger = SimpleNamespace(non_model=0)
    runtime.tracer = SimpleNamespace(reading=lambda ledger: (100, stranded[0]), note_read=lambda nbytes, late: None)
    runtime.store = SimpleNamespace(accel=SimpleNamespace(fragmentation=lambda: stranded[0]))
    runtime.run, runtime.stranded_peak = SimpleNamespace(records=lambda: True), 0
    runtime.hook_ends()
    assert runtime._headroom(trace, 0) == 1000 - 500  # the tide ahead (500) covers now (100) + 300 stranded
    stranded[0] = 450
    assert runtime._headroom(trace, 0) == 1000 - 550
    assert runtime._headroom(trace, 3) == 1000 - 550  # tide ahead 100: now + stranded decide
    assert runtime.stranded_peak == 450  # the auto plan's margin (see [Note: auto activation offload])
    # [Note: one reading per hook]: inside a moment's hook the allocator is read once
    runtime.hook_begins()
    assert runtime._headroom(trace, 3) == 1000 - 550
    stranded[0] = 600
    assert runtime._headroom(trace, 3) == 1000 - 550  # the hook's reading
    runtime.hook_ends()
    assert runtime._headroom(trace, 3) == 1000 - 700  # read again outside it


def test_a_steady_step_reads_the_allocator_about_once_a_moment(monkeypatch):
    """[Note: one reading per hook]: on the twin at a budget with evictions, a steady step reads the stranded
    pieces (on a GPU, with the tide: one allocator statistics call each) about once a moment, not once per
    chunk brought, room made and prefetch; the training is stock ZeRO-3's."""
    from ds_patrickstar.memory.emulated import EmulatedAccelerator

    reads = [0]
    measured = EmulatedAccelerator.fragmentation

    def counted(self):
        reads[0] += 1
        return measured(self)

    monkeypatch.setattr(EmulatedAccelerator, "fragmentation", counted)
    config = _config("patrickstar", emulate_accelerator=True, device_budget=BUDGET)
    engine, ours, _ = _run(config, steps=3)  # a step more below, its reads counted
    ref = _run(_config(3), steps=3)[1]
    moments = len(engine.optimizer.manager.placement.tracer.current_trace())
    gen = torch.Generator().manual_seed(7)
    x, y = torch.randn(BATCH, HIDDEN, generator=gen), torch.randn(BATCH, HIDDEN, generator=gen)
    reads[0] = 0
    engine.backward(((engine(x) - y) ** 2).mean())
    engine.step()
    counters = engine.get_patrickstar_counters()
    engine.destroy()
    assert ours[:3] == ref
    assert counters["evictions"] > 0 and counters["prefetches"] > 0
    step_moves = counters["adam_chunks_device"] + counters["adam_chunks_host"]  # the step moment reads per chunk
    assert reads[0] <= moments + step_moves, (reads, moments, step_moves)


def test_a_budget_below_the_activations_names_what_would_fit():
    """The error that stops a run below its activations names each remedy with its bytes (issue 42); the
    forward that raised leaves no saved-tensor hook behind once the engine is destroyed."""
    import deepspeed

    from ds_patrickstar.memory.ledger import DeviceBudgetExceeded as Exceeded

    harness.ensure_distributed()
    hooks_before = torch._C._autograd._top_saved_tensors_default_hooks(False)  # another test's may be left
    model = _mlp()
    # "none": the refusal and its remedies (left out, this budget offloads: see [Note: activations by default])
    config = _config("patrickstar", emulate_accelerator=True, device_budget=BUDGET, offload_activations="none")
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    x = torch.randn(2048, HIDDEN, generator=torch.Generator().manual_seed(1))
    with pytest.raises(Exceeded) as err:
        engine(x)
    engine.destroy()
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) == hooks_before  # ours are gone
    text = str(err.value)
    short = re.search(r"device_budget of at least ([\d,]+) B \(([\d,]+) B more\)", text)
    assert short is not None and int(short.group(2).replace(",", "")) > 0, text
    for remedy in ('offload_activations "auto"', "activation checkpointing", "train_micro_batch_size_per_gpu"):
        assert remedy in text, (remedy, text)


def test_a_refusal_with_accumulation_names_the_accumulators_and_the_checkpointing_already_on():
    """The counter runs' checkpointed GPT with GA 2 at its GA 1 budget: the blocks a recomputation holds in use and
    their fp32 accumulators do not fit. The error says how much of what the chunks in use take is accumulators,
    and asks for more of the blocks checkpointed (some are already), not for checkpointing."""
    case = {**CASES["twin_checkpointed_offload"], "ga": 2}
    with pytest.raises(WorkerError) as err:
        run_ranks(train_case, 1, case, timeout=240.0)
    text = str(err.value)
    pattern = r"the chunks in use here take ([\d,]+) B, ([\d,]+) B of them their fp32 gradient accumulators"
    held = re.search(pattern, text)
    assert held is not None, text
    in_use, accumulators = (int(group.replace(",", "")) for group in held.groups())
    assert 0 < accumulators < in_use, text
    assert "activation checkpointing of more of the model's blocks" in text, text
