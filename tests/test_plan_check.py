"""The traced step's plan is made again once, at the next step, on that iteration's moment times (see [Note: the
plan checked on steady times] in placement/step_planner.py): the traced iteration's times (no prefetch, every
block offloaded, the one-time costs) hide every transfer and host update, so the plans it prices tie."""
from __future__ import annotations

import pytest
from counter_runs import CASES, train_case


@pytest.fixture
def clocked(monkeypatch):
    """The accelerator's clock made virtual: each moment of the traced iteration takes 100 ms, each one after its
    plan 1 ms; the host's waits for host jobs are not counted (what the twin's host jobs take is not the
    clock's)."""
    from ds_patrickstar.memory import emulated, host_work
    from ds_patrickstar.placement import step_planner

    now = {"t": 0.0, "dt": 0.1}

    def clock(self):
        now["t"] += now["dt"]
        return now["t"]

    traced = step_planner.StepPlanner._traced

    def then_steady(self, *args):
        decided = traced(self, *args)
        now["dt"] = 0.001
        return decided

    monkeypatch.setattr(emulated.EmulatedAccelerator, "clock", clock)
    monkeypatch.setattr(host_work.HostWaits, "timed", lambda self, wait: wait())
    monkeypatch.setattr(step_planner.StepPlanner, "_traced", then_steady)


def test_the_next_step_places_the_states_the_steady_times_pay_for(clocked):
    """With a host Adam of 4e5 elements/s (``device_profile``): priced beside 100 ms moments, the host Adam of
    three chunks (30 ms) hides and 7 states go on the accelerator (the fewest bytes); beside 1 ms moments it does
    not, and the check places 9, moving the bytes predicted from then on; the losses are the same (placement
    never changes a value)."""
    case = CASES["twin_1rank_device_adam"]
    slow = {**case, "zero": {**case["zero"], "device_profile": {"host_adam_elements_per_s": 4e5}}}
    steps = train_case(0, 1, slow)["steps"]
    counters = [step["counters"] for step in steps]
    assert [(c["adam_chunks_device"], c["adam_chunks_host"]) for c in counters] == [(7, 3), (9, 1), (9, 1)]
    steady = counters[2]
    assert steady["bytes_to_device"] == steady["predicted_bytes_to_device"] == 65_536
    assert steady["bytes_to_host"] == steady["predicted_bytes_to_host"] == 65_536
    assert counters[0]["planned_step_s"] > 1.0  # the traced step's forecast: beside its own 100 ms moments
    # the check's forecast is the step the model prices on these times (the check's own reading of the clock
    # is one more 1 ms tick in the step it was made in)
    assert steady["planned_step_s"] == pytest.approx(steady["predicted_step_s"], rel=0.05)
    assert steady["planned_step_s"] < 0.05  # the traced plan's 7 states, priced so: 0.056 s
    golden = [[4.198978], [4.146237], [4.170686]]  # tests/data/counter_runs.json, the H100 profile's run
    assert [step["losses"] for step in steps] == golden


def test_the_traced_step_plans_quickly_and_the_check_thoroughly(monkeypatch):
    """[Note: the planner's cost]: the traced step's own times cannot steer, so it searches the prefixes in each
    eviction order without local moves; the check adds local moves on the activation plan it keeps."""
    from ds_patrickstar.placement import state_choice, step_planner

    phase, searched = [""], []  # the plan under way; (plan, eviction order, with local moves) per search
    for name in ("_traced", "_checked"):
        real = getattr(step_planner.StepPlanner, name)
        monkeypatch.setattr(step_planner.StepPlanner, name,
                            lambda self, *a, real=real, name=name: phase.__setitem__(0, name) or real(self, *a))
    search = state_choice.search_states

    def recorded(fill, of, local):
        chosen = search(fill, of, local)
        searched.append((phase[0], chosen.order, local))
        return chosen

    monkeypatch.setattr(state_choice, "search_states", recorded)
    train_case(0, 1, CASES["twin_1rank_device_adam"])
    traced = {(order, local) for plan, order, local in searched if plan == "_traced"}
    checked = {(order, local) for plan, order, local in searched if plan == "_checked"}
    assert traced == {(0, False), (1, False)}  # Belady's and free-first (clean evictions)
    # local moves in each order; the activation plans it weighs, the quick way
    assert checked == {(0, True), (1, True), (0, False), (1, False)}


def test_the_step_needs_its_largest_chunk_not_all_of_them():
    """[Note: chunk bytes per moment]: the chunks updated on the accelerator come one at a time at the step, and no
    group is gathered for the update; a forward moment holds its groups gathered (at two ranks: storage too)."""
    from types import SimpleNamespace

    from ds_patrickstar.chunks.group_bytes import GroupBytes
    from ds_patrickstar.placement.chunk_needs import chunk_needs
    from ds_patrickstar.placement.trace import Moment, Trace

    sizes = [GroupBytes(storage=200, owned=100, joined=0, accumulator=0, grad_buffer=0),
             GroupBytes(storage=400, owned=200, joined=0, accumulator=0, grad_buffer=0)]
    chunk_map = SimpleNamespace(world_size=2, num_groups=2, group_bytes=lambda g, accumulate: sizes[g])
    trace = Trace()
    for label, chunks in [("fwd:a", (0, 1, 2, 3)), ("bwd:a", (0, 1, 2, 3)), ("step", (0, 2))]:
        trace.add(Moment(label, chunks, 0))
    assert chunk_needs(trace, chunk_map, accumulate=False) == [900, 900, 200]


def test_the_check_offloads_more_activations_where_the_steady_times_pay_for_the_states(clocked, dist):
    """A checkpointed GPT at 260 kB with a host Adam of 1e5 elements/s: beside the traced iteration's 100 ms
    moments every activation plan ties and none is offloaded; beside 1 ms moments, offloading three blocks so that
    the fill rule places two more states is priced faster (0.12 s against 0.14 s), so the check offloads them from
    the third step on; the moves are those predicted, and the losses those of the run that offloads nothing."""
    slow, slow_counters = _checkpointed_run({"host_adam_elements_per_s": 1e5})
    plain, _ = _checkpointed_run(None)
    assert slow == plain
    assert [c["activation_bytes_offloaded"] > 0 for c in slow_counters] == [True, False, True, True]
    assert slow_counters[0]["adam_chunks_device"] < slow_counters[1]["adam_chunks_device"] == 5
    for counters in slow_counters[2:]:
        assert counters["activation_bytes_offloaded"] == counters["activation_bytes_restored"] == 49_152
        assert counters["bytes_to_device"] == counters["predicted_bytes_to_device"] > 0
        assert counters["bytes_to_host"] == counters["predicted_bytes_to_host"] > 0


def _checkpointed_run(profile: dict | None) -> tuple[list[float], list[dict]]:
    import deepspeed
    from test_activation_offload import BATCH, SEED, build_checkpointed

    import ds_patrickstar  # noqa: F401

    model, batch = build_checkpointed(SEED)
    # the host Adam priced from the step (no update begins in backward, see [Note: host updates in backward])
    zero = {"stage": "patrickstar", "chunk_size": 2048, "emulate_accelerator": True, "device_budget": 260_000,
            "host_adam_in_backward": 0}
    if profile is not None:
        zero["device_profile"] = profile
    config = {"train_micro_batch_size_per_gpu": BATCH, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": zero}
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    losses, counters = [], []
    for step in range(4):
        loss = engine(*batch(step))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        counters.append(engine.get_patrickstar_counters())
    engine.destroy()
    return losses, counters
