"""The GPU-path defects the strict emulated accelerator exposes, one test each (issue "A GPU run you
can trust before anyone has a GPU"). Each fails on the code before the fix; numbers are
compared with stock ZeRO-3 exactly (fp32 on CPU: every move is an exact copy)."""
import math

import pytest
import torch
from test_placement import BATCH, BUDGET, HIDDEN, LAYERS, _config, _mlp, _run

from ds_patrickstar.memory.ledger import DeviceBudgetExceeded

PARAMS = LAYERS * (HIDDEN * HIDDEN + HIDDEN)


def test_1_a_missing_wait_changes_the_numbers(monkeypatch):
    """Every payload read goes through Chunk.ready(); without its wait, the emulated copies leave
    poison and training diverges from ZeRO-3 (the vs-ZeRO-3 placement tests would catch it)."""
    from ds_patrickstar.chunks.chunk import Chunk

    config = _config("patrickstar", emulate_accelerator=True, device_budget=BUDGET)
    _, ref, _ = _run(_config(3), steps=3)
    _, ours, _ = _run(config, steps=3)
    assert ours == ref
    monkeypatch.setattr(Chunk, "wait_pending", lambda self: None)
    engine, broken, _ = _run(config, steps=3)  # an exception here (a hazard, a wrong call) fails the test
    # the poison reaches every step's forward: each loss is NaN and each step skipped as an overflow
    assert not any(map(math.isfinite, broken)), broken
    assert engine.skipped_steps == 3
    engine.destroy()


@pytest.mark.parametrize("budget", [BUDGET // 2, 1_500_000, 8 * 2**20], ids=["tight", "partial", "roomy"])
def test_2_model_data_is_14_bytes_per_param_over_device_and_host(budget):
    """At every budget, including one where the optimizer states of only some chunks fit on the
    accelerator (a move that ran out of room once left a state tensor charged twice: 14.50 B/param)."""
    import deepspeed

    config = _config("patrickstar", emulate_accelerator=True, device_budget=budget)
    config["bf16"] = {"enabled": True}
    model = _mlp()
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    for _ in range(3):
        x = torch.randn(BATCH, HIDDEN, dtype=torch.bfloat16)
        engine.backward(engine(x).float().square().mean())
        engine.step()
    last = engine.get_patrickstar_counters()
    capacity = sum(c.capacity for c in engine.optimizer.manager.map.chunks)
    assert last["model_bytes_device"] + last["model_bytes_host"] == 14 * capacity
    assert capacity <= PARAMS * 1.01  # chunks are sized to their contents
    states = engine.optimizer.optim_states
    on_device = sum(states.states[c].nbytes for c in states.on_device)
    assert engine.optimizer.accel.ledger.by_kind.get("optim", 0) == on_device
    if budget == 1_500_000:  # placement is really splitting the states
        assert 0 < len(states.on_device) < len(states.states)
    if budget < 8 * 2**20:
        assert last["model_bytes_host"] > 0  # placement is really splitting them
    engine.destroy()


def test_3_a_model_larger_than_the_device_initializes_and_trains():
    """The chunks are built on the host: the emulated budget (300 KB) is far below the model's
    parameters (822 KB fp32), and the ledger never held more than the budget."""
    engine, ours, counters = _run(_config("patrickstar", emulate_accelerator=True, device_budget=BUDGET), steps=4)
    _, ref, _ = _run(_config(3), steps=4)
    assert ours == ref
    assert engine.dont_change_device
    assert max(c["peak_model_bytes_device"] for c in counters) < BUDGET < PARAMS * 4
    engine.destroy()


def test_4_state_dict_checkpoint_and_export_stream_within_the_budget(tmp_path):
    from ds_patrickstar import gathered_parameters

    budget = 150_000  # about one and a half chunks: a whole-model gather could never fit
    config = _config("patrickstar", emulate_accelerator=True, device_budget=budget, chunk_size=8192)
    engine, _, _ = _run(config, steps=2, model=_mlp())
    ledger = engine.optimizer.accel.ledger
    ledger.reset_peak()
    state = engine.module.state_dict()
    fp32 = engine.get_fp32_state_dict()
    with gathered_parameters(engine):
        first = engine.module[0].weight.detach().clone()
    engine.save_checkpoint(str(tmp_path))
    engine.load_checkpoint(str(tmp_path))
    assert ledger.peak <= budget
    assert torch.equal(first, fp32["0.weight"])
    for name, value in fp32.items():
        assert torch.equal(state[name], value), name
        assert state[name].device.type == "cpu"
    engine.destroy()


def test_5_accumulators_exist_only_while_accumulating_and_follow_their_chunk():
    # a layer's weight and (first-fit) its bias sit in two chunks: both with accumulators must fit
    config = _config("patrickstar", emulate_accelerator=True, device_budget=800_000)
    config["gradient_accumulation_steps"] = 2
    ref_cfg = _config(3)
    ref_cfg["gradient_accumulation_steps"] = 2
    _, ref, _ = _run(ref_cfg, steps=6)
    engine, ours, _ = _run(config, steps=6)
    assert ours == ref
    opt = engine.optimizer
    assert opt.accel.ledger.by_kind.get("grad_acc", 0) == 0
    assert all(c.acc is None and c.acc_host is None for c in opt.manager.map.chunks)  # none between steps
    x = torch.randn(BATCH, HIDDEN)
    engine.backward(engine(x).square().mean())  # a non-boundary micro-step
    for chunk in opt.manager.map.chunks:  # an accumulator still being copied out is charged until then
        chunk.wait_pending()
    opt.accel.reclaim()
    device_acc = opt.accel.ledger.by_kind.get("grad_acc", 0)
    host_acc = sum(c.acc_host.numel() * 4 for c in opt.manager.map.chunks if c.acc_host is not None)
    assert device_acc + host_acc == 4 * sum(c.capacity for c in opt.manager.map.chunks)
    assert host_acc > 0  # the budget is too small: evicted chunks took their accumulators along
    engine.destroy()


def test_6_preflight_refuses_before_allocating_anything(monkeypatch):
    import psutil

    from ds_patrickstar.integration import assembly

    real = psutil.virtual_memory()
    monkeypatch.setattr(psutil, "virtual_memory", lambda: real._replace(available=100_000))
    built = []
    monkeypatch.setattr(assembly, "build_chunk_map", lambda *args, **kwargs: built.append(args))
    with pytest.raises(ValueError, match="largest model that would fit"):
        _run(_config("patrickstar", emulate_accelerator=True, device_budget=BUDGET), steps=1)
    assert built == []


def test_6_preflight_counts_optimizer_state_once(monkeypatch):
    """The model needs 16 B/param (fp32 + 12); with exactly that much budget + host it must start."""
    import psutil

    real = psutil.virtual_memory()
    need = 16 * PARAMS * 1.01
    monkeypatch.setattr(psutil, "virtual_memory", lambda: real._replace(available=int(need) - 2_000_000 + 64))
    engine, _, _ = _run(_config("patrickstar", emulate_accelerator=True, device_budget=2_000_000), steps=1)
    engine.destroy()


def test_7_retrace_with_a_higher_tide_replans_optimizer_states():
    engine, _, counters = _run(_config("patrickstar", emulate_accelerator=True, device_budget=3_000_000),
                               steps=6, batches=[4, 4, 4, 64, 64, 64])
    assert counters[2]["adam_chunks_device"] > counters[-1]["adam_chunks_device"]
    assert engine.optimizer.placement.steps.planned_from is engine.optimizer.placement.tracer.trace
    engine.destroy()


def test_8_the_tracer_never_resets_cuda_peak_statistics(monkeypatch):
    """It reads the allocator's nested statistics (not ``memory_stats``, which flattens and sorts ~120
    of them at every call); the keys are the ones torch flattens to the documented names."""
    from ds_patrickstar.memory.cuda import CudaAccelerator

    stats = {"allocated_bytes": {"all": {"current": 100, "peak": 500}},
             "inactive_split_bytes": {"all": {"current": 7}}}
    monkeypatch.setattr(torch.cuda, "memory_stats_as_nested_dict", lambda device=None: stats)
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda *a, **k: pytest.fail("flattening every statistic"))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a: pytest.fail("reset peak stats"))
    accel = CudaAccelerator.__new__(CudaAccelerator)
    accel.device, accel._peak_seen = torch.device("cuda"), 500
    assert accel.memory_in_use() == (100, 100)  # no new peak since the last look: allocated now
    stats["allocated_bytes"]["all"].update(current=200, peak=900)
    assert accel.memory_in_use() == (200, 900)  # the peak grew in between: that is the highest
    assert accel.memory_in_use() == (200, 200)
    assert accel.fragmentation() == 7
    reads = []
    monkeypatch.setattr(torch.cuda, "memory_stats_as_nested_dict", lambda device=None: reads.append(1) or stats)
    stats["allocated_bytes"]["all"].update(current=300, peak=950)
    assert accel.memory_reading() == (300, 950, 7) and len(reads) == 1  # the tide and the pieces: one read
    stats["allocated_bytes"]["all"].update(current=200)
    monkeypatch.undo()
    monkeypatch.setattr(torch.cuda.memory, "memory_stats_as_nested_dict", lambda device=None: stats)
    flat = torch.cuda.memory.memory_stats()
    assert flat["allocated_bytes.all.current"] == 200 and flat["inactive_split_bytes.all.current"] == 7


def test_9_host_adam_chunks_are_not_brought_to_the_device_for_the_step():
    engine, _, counters = _run(_config("patrickstar", emulate_accelerator=True, device_budget=BUDGET), steps=4)
    trace = engine.optimizer.placement.tracer.trace
    step = next(m for m in trace.moments if m.label == "step")
    assert step.chunks == () and counters[-1]["adam_chunks_host"] == 8
    last_backward = [m for m in trace.moments if m.label.startswith("bwd:")][-1]
    assert last_backward is trace.moments[-2]  # nothing is prefetched into the step
    engine.destroy()


def test_11_every_adam_kernel_is_built_at_initialize(monkeypatch):
    from ds_patrickstar.optim import chunk_adam

    built = []
    monkeypatch.setattr(chunk_adam, "adam_backend", lambda device: built.append(torch.device(device).type)
                        or chunk_adam.adam_step_reference)
    engine, _, _ = _run(_config("patrickstar", emulate_accelerator=True, device_budget=BUDGET), steps=0)
    assert built == ["cpu"]  # the host kernel (hybrid Adam), before any step; on CUDA the device's too
    engine.destroy()


def test_hybrid_adam_with_a_real_mix_matches_zero3():
    _, ref, _ = _run(_config(3), steps=6)
    engine, ours, counters = _run(_config("patrickstar", emulate_accelerator=True, device_budget=2_400_000), steps=6)
    assert ours == ref
    last = counters[-1]
    assert 0 < last["adam_chunks_device"] < 8 and last["adam_chunks_host"] == 8 - last["adam_chunks_device"]
    assert last["evictions"] + last["grads_released_in_backward"] > 0  # chunks left the accelerator, for room or early
    engine.destroy()


def test_budget_error_names_what_was_allocated():
    with pytest.raises(DeviceBudgetExceeded, match="budget"):
        _run(_config("patrickstar", emulate_accelerator=True, device_budget=120_000), steps=1)


def test_8_a_chunk_that_came_and_went_between_moments_is_not_tide():
    """CUDA tracer: the allocator's peak since the previous moment, less the backend's own peak in
    the same interval; an eviction after a peak must not read as activation memory."""
    from ds_patrickstar.memory.ledger import DeviceLedger
    from ds_patrickstar.placement.tracer import MemoryTracer

    class FakeAccel:
        reading = (0, 0)

        def memory_in_use(self):
            return self.reading

    accel, ledger = FakeAccel(), DeviceLedger(10**9)
    tracer = MemoryTracer(accel, meter=None)
    ledger.charge(64, "chunk", "chunk 0")  # a chunk arrives ...
    ledger.charge(64, "chunk", "chunk 1")
    ledger.release(64, "chunk")  # ... and another leaves before the next moment
    accel.reading = (64 + 10, 128 + 10)  # allocated now, peak since last: 10 B of activations throughout
    assert tracer.non_model_now(ledger) == 10
    accel.reading = (64 + 30, 64 + 50)  # activations peaked at 50 between moments, 30 now
    assert tracer.non_model_now(ledger) == 50


class _IndexOnly(list):
    """The chunk list as placement may use it per moment: by index, never scanned whole."""

    def __iter__(self):
        raise AssertionError("placement scanned every chunk at a moment")

    def __len__(self):
        raise AssertionError("placement scanned every chunk at a moment")


def test_10_placement_bookkeeping_never_scans_every_chunk(monkeypatch):
    """Per-moment accounting is running totals (ledger, eviction queue): training under eviction
    pressure with a chunk list that raises when scanned still matches ZeRO-3. The cost per
    iteration at 1,000-20,000 chunks is measured by benchmarks/bench_placement_overhead.py."""
    from ds_patrickstar.integration import assembly

    make_placement = assembly.make_placement

    def index_only(*args):
        runtime = make_placement(*args)
        runtime.moves.chunks = _IndexOnly(runtime.moves.chunks)
        return runtime

    monkeypatch.setattr(assembly, "make_placement", index_only)
    engine, ours, counters = _run(_config("patrickstar", emulate_accelerator=True, device_budget=BUDGET), steps=4)
    runtime = engine.optimizer.manager.placement
    assert isinstance(runtime.moves.chunks, _IndexOnly)
    assert counters[-1]["evictions"] > 0
    assert runtime.model_bytes_on_device() == runtime.ledger.total
    _, ref, _ = _run(_config(3), steps=4)
    assert ours == ref
    engine.destroy()


def test_12_a_prefetch_evicted_before_use_is_not_a_hit():
    engine, _, _ = _run(_config("patrickstar", emulate_accelerator=True, device_budget=BUDGET), steps=1)
    runtime = engine.optimizer.manager.placement
    chunk = engine.optimizer.manager.map.chunks[0]
    runtime.bring(chunk, set())
    chunk.prefetched = True  # as end_moment marks a chunk it brought ahead of use
    assert not chunk.on_host
    runtime.evict(chunk)
    assert chunk.on_host and not chunk.prefetched  # the next access brings it again: a miss, not a hit
    engine.destroy()


def test_12_states_give_way_where_the_tide_stands_above_the_plan(monkeypatch):
    """[Note: states give way]: a step whose tide stands above the traced one everywhere (as the stranded
    pieces or a longer batch do on a GPU) fits its chunks by moving optimizer states to the host instead of
    raising DeviceBudgetExceeded; training goes on as stock ZeRO-3's, and the next step plans for the tide."""
    import deepspeed
    import harness

    from ds_patrickstar.placement.tracer import MemoryTracer

    budget = 3_000_000
    _, ref, _ = _run(_config(3), steps=6)
    extra = {"bytes": 0}
    measured = MemoryTracer.non_model_now
    monkeypatch.setattr(MemoryTracer, "non_model_now", lambda self, ledger: measured(self, ledger) + extra["bytes"])
    read = MemoryTracer.reading
    monkeypatch.setattr(MemoryTracer, "reading",
                        lambda self, ledger: (lambda r: (r[0] + extra["bytes"], r[1]))(read(self, ledger)))
    harness.ensure_distributed()
    model = _mlp()
    config = _config("patrickstar", emulate_accelerator=True, device_budget=budget)
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    gen, losses, counters = torch.Generator().manual_seed(1), [], []
    for step in range(6):
        if step == 3:  # room for half a chunk beside the optimizer states
            optim = engine.optimizer.accel.ledger.by_kind["optim"]
            assert optim > 0, "the plan keeps optimizer states on the accelerator"
            extra["bytes"] = budget - optim - 32768 * 4 // 2
        x, y = torch.randn(BATCH, HIDDEN, generator=gen), torch.randn(BATCH, HIDDEN, generator=gen)
        loss = ((engine(x) - y) ** 2).mean()
        engine.backward(loss)
        engine.step()
        extra["bytes"] = 0
        losses.append(loss.item())
        counters.append(engine.get_patrickstar_counters())
    engine.destroy()
    assert [c["states_gave_way"] for c in counters] == [0, 0, 0, 1, 0, 0]
    assert counters[2]["adam_chunks_device"] > counters[3]["adam_chunks_device"]  # those moved update on the host
    assert losses == ref


def test_12_stranded_pieces_are_released_before_states_give_way(monkeypatch):
    """[Note: stranded bytes released]: where the shortfall is stranded allocator pieces that giving back the
    allocator's cache returns (as PyTorch's expandable segments do), they are released and counted, and
    neither optimizer states move nor does the run stop; where they stay (the default allocator), the error
    that stands names them with the setting that can return them."""
    import deepspeed
    import harness

    from ds_patrickstar.memory.emulated import EmulatedAccelerator
    from ds_patrickstar.placement.remedies import Shortfall, budget_remedies

    budget = 3_000_000
    _, ref, _ = _run(_config(3), steps=5)
    stranded = {"bytes": 0}
    measured, release = EmulatedAccelerator.fragmentation, EmulatedAccelerator.release_cached
    monkeypatch.setattr(EmulatedAccelerator, "fragmentation", lambda self: measured(self) + stranded["bytes"])

    def release_cached(self):
        stranded["bytes"] = 0  # the pages of the stranded pieces are given back
        release(self)

    monkeypatch.setattr(EmulatedAccelerator, "release_cached", release_cached)
    harness.ensure_distributed()
    model = _mlp()
    config = _config("patrickstar", emulate_accelerator=True, device_budget=budget)
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    gen, losses, counters, pieces = torch.Generator().manual_seed(1), [], [], 0
    for step in range(5):
        if step == 3:  # as in the give-way test: room for half a chunk beside the optimizer states
            pieces = stranded["bytes"] = budget - engine.optimizer.accel.ledger.by_kind["optim"] - 32768 * 4 // 2
        x, y = torch.randn(BATCH, HIDDEN, generator=gen), torch.randn(BATCH, HIDDEN, generator=gen)
        loss = ((engine(x) - y) ** 2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        counters.append(engine.get_patrickstar_counters())
    engine.destroy()
    assert [c["stranded_bytes_released"] for c in counters] == [0, 0, 0, pieces, 0] and pieces > 0
    assert [c["states_gave_way"] for c in counters] == [0] * 5
    assert losses == ref
    text = budget_remedies(Shortfall(1000, budget, 5000, 4000, stranded=777, offloading=True))
    assert "expandable_segments" in text and "777 B stranded" in text
    assert "expandable_segments" not in budget_remedies(Shortfall(1000, budget, 5000, 4000, offloading=True))


def test_13_steady_steps_pin_no_host_memory_anew():
    """[Note: pinned host memory]: the payloads of chunks updated on the host leave the host in forward and
    their gradients come back in backward, every step; their buffers stay in the pool in between, so a steady
    step registers no host memory (before: one chunk's worth cached, and on the mirror of the H100 sweep at
    12 GiB 16 of the 27 host-updated chunks' buffers unpinned and pinned again every step, milliseconds of
    ``cudaHostRegister`` each on a GPU)."""
    import sys
    from pathlib import Path

    import deepspeed

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import twin_pressure
    from gpt_model import GPT, GPTConfig

    budget = int(twin_pressure.model_data_bytes() * 12 * 2**30 / twin_pressure.H100_MODEL_DATA)
    torch.manual_seed(0)
    model = GPT(GPTConfig(**twin_pressure.MODEL))
    config = twin_pressure.config("patrickstar", budget)
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    pool, gen, pinnings, spare_sets = engine.optimizer.accel.host_pool, torch.Generator().manual_seed(1), [], []
    shape = (twin_pressure.BATCH, twin_pressure.MODEL["block_size"] + 1)
    for _ in range(5):
        tokens = torch.randint(0, twin_pressure.VOCAB, shape, generator=gen)
        logits = engine(tokens[:, :-1])
        engine.backward(torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten()))
        engine.step()
        pinnings.append(pool.pinnings)
        spare_sets.append(engine.optimizer.early.spare_sets)
    counters = engine.get_patrickstar_counters()
    engine.destroy()
    assert counters["adam_chunks_host"] > 10 and counters["prefetches"] > 10  # payloads move every step
    # beside the spare sets of host updates begun in backward, made once (four buffers each; see [Note: host updates
    # in backward]): here at the fifth step, the first whose predecessor did not clip
    assert 0 <= pinnings[-1] - pinnings[2] <= 4 * (spare_sets[-1] - spare_sets[2]), (pinnings, spare_sets)
    assert pinnings[2] == pinnings[-2], pinnings
