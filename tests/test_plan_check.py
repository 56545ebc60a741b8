"""The traced step's plan is made again once, at the next step, on that iteration's moment times (see [Note: the
plan checked on steady times] in placement/step_planner.py): the traced iteration's times (no prefetch, every
block offloaded, the one-time costs) hide every transfer and host update, so the plans it prices tie."""
from __future__ import annotations

import dataclasses

import pytest
from counter_runs import CASES, train_case


@pytest.fixture
def clocked(monkeypatch):
    """A slow host Adam and the accelerator's clock made virtual: each moment of the traced iteration takes 100 ms,
    each one after its plan 1 ms; the host's waits for host jobs are not counted (what the twin's host jobs
    take is not the clock's)."""
    from ds_patrickstar.integration import device_profile
    from ds_patrickstar.memory import emulated, host_work
    from ds_patrickstar.placement import step_planner, step_time

    profile = dataclasses.replace(step_time.H100_PROFILE, host_adam_elements_per_s=4e5)
    monkeypatch.setattr(device_profile, "H100_PROFILE", profile)
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
    """Priced beside 100 ms moments, the host Adam of three chunks (30 ms) hides and 7 states go on the
    accelerator (the fewest bytes); beside 1 ms moments it does not, and the check places 8, moving fewer bytes
    from then on, as predicted; the losses are the same (placement never changes a value)."""
    steps = train_case(0, 1, CASES["twin_1rank_device_adam"])["steps"]
    counters = [step["counters"] for step in steps]
    assert [(c["adam_chunks_device"], c["adam_chunks_host"]) for c in counters] == [(7, 3), (8, 2), (8, 2)]
    steady = counters[2]
    assert steady["bytes_to_device"] == steady["predicted_bytes_to_device"] == 32_768
    assert steady["bytes_to_host"] == steady["predicted_bytes_to_host"] == 32_768
    assert counters[0]["planned_step_s"] > 1.0  # the traced step's forecast: beside its own 100 ms moments
    # the check's forecast, with the step's own time as measured, is the step the model prices on these times
    assert steady["planned_step_s"] == pytest.approx(steady["predicted_step_s"], rel=1e-3)
    golden = [[4.198978], [4.146237], [4.170686]]  # tests/data/counter_runs.json, the H100 profile's run
    assert [step["losses"] for step in steps] == golden
