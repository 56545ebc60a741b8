"""The step-time model (see [Note: step-time model]) on hand-made traces: on-demand bytes are exposed, bytes
moved behind a moment's compute hide up to that compute, the serial step adds the host Adam, the overlapped
one only what the next forward waits for; and a twin run exports a prediction once two steps were timed."""
import pytest
from counter_runs import run_case

from ds_patrickstar.placement import step_time
from ds_patrickstar.placement.move_model import MovePlan
from ds_patrickstar.placement.step_time import DeviceProfile, HostOverlap, StepTimer, predict_step
from ds_patrickstar.placement.trace import Moment, Trace

# 1 B/s both ways, 1 element/s on the host, 10 on the device: seconds are bytes and elements
PROFILE = DeviceProfile(to_device_bytes_per_s=1.0, to_host_bytes_per_s=1.0, host_adam_elements_per_s=1.0,
                        device_adam_elements_per_s=10.0)


def _trace(*moments: tuple[str, tuple[int, ...]]) -> Trace:
    trace = Trace()
    for label, chunks in moments:
        trace.add(Moment(label, chunks, 0))
    return trace


def _plan(to_device, to_host, demand) -> MovePlan:
    return MovePlan(list(to_device), list(to_host), list(demand))


def test_demand_bytes_are_exposed_and_bytes_behind_compute_hide_up_to_it():
    trace = _trace(("fwd:a", (0,)), ("fwd:b", (1,)), ("step", ()))
    plan = _plan([3, 5, 0], [0, 1, 0], [3, 0, 0])  # moment 0: 3 B on demand; moment 1: 5 B ahead + 1 B back
    step = predict_step(trace, plan, [4.0, 2.0, 0.0], {}, 0, PROFILE, overlap=True)
    assert step.compute_s == 6.0
    assert step.exposed_transfers_s == 3.0 + (6.0 - 2.0)  # the demand, and what moment 1's compute cannot hide
    assert step.optimizer_s == 0.0 and step.total_s == 13.0


def test_the_serial_step_adds_the_host_adam_and_the_overlapped_one_what_the_forward_waits_for():
    trace = _trace(("fwd:a", (0,)), ("fwd:b", (1,)), ("fwd:c", (2,)), ("step", ()))
    plan = _plan([0] * 4, [0] * 4, [0] * 4)
    compute = [1.0, 1.0, 1.0, 0.0]
    host = {0: 2, 1: 2, 2: 2}  # 2 s each on the host
    serial = predict_step(trace, plan, compute, host, 10, PROFILE, overlap=False)
    assert serial.optimizer_s == 1.0 + 6.0  # device Adam 1 s, then the host's 6 s
    overlapped = predict_step(trace, plan, compute, host, 10, PROFILE, overlap=True)
    # chunk 0 is done 2 s after the step began and needed after the device's 1 s: 1 s waited; chunk 1 is done
    # at 4 s, needed at 1 + 1 (waited) + 1 (moment 0) = 3 s: 1 s more; chunk 2 done at 6 s, needed at 5 s: 1 s
    assert overlapped.optimizer_s == pytest.approx(1.0 + 3.0)
    assert overlapped.total_s < serial.total_s


def test_host_updates_begun_in_backward_leave_the_step_the_rest(monkeypatch):
    """[Note: host updates in backward]: a chunk's update begins at the moment after its last use, while the worker
    is idle; what the worker still runs of them when the step starts delays the step's jobs."""
    trace = _trace(("fwd:a", (0,)), ("fwd:b", (1,)), ("fwd:c", (2,)), ("bwd:c", (2,)), ("bwd:b", (1,)),
                   ("bwd:a", (0,)), ("step", ()))
    plan, host = _plan([0] * 7, [0] * 7, [0] * 7), {0: 2, 1: 2, 2: 2}  # 2 s each on the host, device Adam 1 s
    long_backward = [1.0, 1.0, 1.0, 2.0, 2.0, 2.0, 0.0]
    from_step = predict_step(trace, plan, long_backward, host, 10, PROFILE, HostOverlap.FROM_STEP)
    assert from_step.optimizer_s == pytest.approx(1.0 + 3.0)  # as above: 1 s waited per chunk
    # chunk 2 released 4 s before the step, done 2 s before it; chunk 1 released 2 s before, done as it starts;
    # chunk 0 (last used by the last moment) is the step's: done 2 s in, needed after the device's 1 s (an update
    # into spare buffers priced as one in place here)
    monkeypatch.setattr(step_time, "BEGUN_COST", 1.0)
    begun = predict_step(trace, plan, long_backward, host, 10, PROFILE, HostOverlap.FROM_BACKWARD)
    assert begun.optimizer_s == pytest.approx(1.0 + 1.0)
    # a short backward: chunk 2's update runs until the step, so chunk 1's (released while it runs) is the step's
    short = predict_step(trace, plan, [1.0] * 6 + [0.0], host, 10, PROFILE, HostOverlap.FROM_BACKWARD)
    assert short.optimizer_s == pytest.approx(1.0 + 2.0)
    # at twice the cost likewise: a second job begun would run 2 s into the step, in front of chunk 0's
    monkeypatch.setattr(step_time, "BEGUN_COST", 2.0)
    slower = predict_step(trace, plan, long_backward, host, 10, PROFILE, HostOverlap.FROM_BACKWARD)
    assert slower.optimizer_s == pytest.approx(1.0 + 2.0)


def test_the_step_moments_own_time_beyond_the_priced_adam_counts():
    """The step moment's measured time holds the device Adam (and, serially, the host's) the model prices
    itself, and the rest of the step (the norm, bookkeeping, waits), which it takes as measured: on an H200
    0.58 s of a 1.42 s step went unpriced before."""
    trace = _trace(("fwd:a", (0,)), ("fwd:b", (1,)), ("step", ()))
    plan = _plan([0] * 3, [0] * 3, [0] * 3)
    step = predict_step(trace, plan, [1.0, 1.0, 5.0], {}, 10, PROFILE, overlap=True)  # device Adam: 1 s
    assert step.compute_s == 2.0 + (5.0 - 1.0) and step.optimizer_s == 1.0 and step.total_s == 7.0
    serial = predict_step(trace, plan, [1.0, 1.0, 5.0], {0: 3}, 10, PROFILE, overlap=False)
    assert serial.compute_s == 2.0 + (5.0 - 1.0 - 3.0) and serial.total_s == 7.0  # the host's 3 s were in it


def test_host_adam_behind_a_long_forward_is_hidden():
    trace = _trace(("fwd:a", (0,)), ("fwd:b", (1,)), ("step", ()))
    plan = _plan([0] * 3, [0] * 3, [0] * 3)
    step = predict_step(trace, plan, [5.0, 5.0, 0.0], {1: 4}, 0, PROFILE, overlap=True)
    assert step.optimizer_s == 0.0  # chunk 1's update (4 s) is done before moment 1 (after 5 s)


def test_the_timer_predicts_from_the_previous_iterations_times():
    ticks = iter(range(100))
    timer = StepTimer(lambda: float(next(ticks)), lambda a, b: b - a, {0: 1, 1: 1}, PROFILE, overlap=False)
    trace = _trace(("fwd:a", (0,)), ("fwd:b", (1,)), ("step", ()))
    plan = _plan([0] * 3, [0] * 3, [0] * 3)
    for index in range(3):
        timer.begin_moment(index)
    assert timer.end_step(trace, plan, {0}) is None  # nothing timed yet
    for index in range(3):
        timer.begin_moment(index)
    step = timer.end_step(trace, plan, {0})
    assert step is not None and step.compute_s == 2.0  # each moment took one tick
    assert step.optimizer_s == pytest.approx(1 / 10 + 1.0)  # chunk 0 on the device, chunk 1 on the host


def test_the_timer_takes_the_hosts_waits_for_host_jobs_out_of_the_moments():
    """[Note: host waits]: a moment that blocked on a host update is not that long in compute; the model prices
    the wait (here: the serial host Adam, 1 s) instead of finding it in the moment's time too."""
    ticks, waited = iter(range(0, 100, 2)), [0.0]
    timer = StepTimer(lambda: float(next(ticks)), lambda a, b: b - a, {0: 1, 1: 1}, PROFILE, overlap=False,
                      waited=lambda: waited[0])
    trace = _trace(("fwd:a", (0,)), ("fwd:b", (1,)), ("step", ()))
    plan = _plan([0] * 3, [0] * 3, [0] * 3)
    for _ in range(2):
        for index in range(3):
            timer.begin_moment(index)
            waited[0] += 1.5 if index == 1 else 0.0  # moment 1 waits 1.5 s of its 2
        step = timer.end_step(trace, plan, {0})
    assert step is not None and step.compute_s == pytest.approx(2.0 + 0.5 + (2.0 - 1.1))  # step: less its Adam
    for index in range(2):  # a third iteration, up to its second moment
        timer.begin_moment(index)
        waited[0] += 1.5 if index == 1 else 0.0
    assert timer.traced_times(3) == pytest.approx([2.0, 0.5, 0.0])  # the moment under way up to now, then 0


def test_the_timer_sets_a_plans_host_time_aside():
    """[Note: the planner's cost]: the search a step makes once is not the step moment's compute, which the next
    iteration's prediction prices again (the twin's third step read the check's 0.6-1.5 s as step time)."""
    ticks = iter(range(0, 100, 2))
    timer = StepTimer(lambda: float(next(ticks)), lambda a, b: b - a, {0: 1}, PROFILE, overlap=False)
    trace = _trace(("fwd:a", (0,)), ("step", ()))
    plan = _plan([0] * 2, [0] * 2, [0] * 2)
    for _ in range(2):
        for index in range(2):
            timer.begin_moment(index)
            if index == 1:
                timer.set_aside(1.5)  # the step planned for 1.5 s of its 2
        step = timer.end_step(trace, plan, {0})
    assert step is not None and step.compute_s == pytest.approx(2.0 + 0.5 - 0.1)  # step: less its Adam


def test_a_plan_waits_for_the_accelerator_to_reach_now_before_reading_the_moments():
    """On CUDA a mark the accelerator has not run reads NaN (0 in the times): the backward's last moments would be
    priced as free; the timer waits for the mark of now first."""
    ticks, reached = iter(range(100)), set()
    seconds = lambda a, b: float(b - a) if b in reached else float("nan")
    timer = StepTimer(lambda: next(ticks), seconds, {0: 1}, PROFILE, overlap=False, reach=reached.add)
    for index in range(3):
        timer.begin_moment(index)
        reached.add(index)  # the marks of the moments begun so far have run
    assert timer.traced_times(3) == [1.0, 1.0, 1.0]  # the last moment up to now: read once now was reached


def test_a_twin_run_exports_its_predicted_step_once_two_steps_were_timed():
    steps = run_case("twin_1rank_ga1")[0]["steps"]
    assert [s["counters"]["predicted_step_s"] > 0 for s in steps] == [False, False, True]


def test_the_profile_is_measured_on_a_gpu_and_the_h100s_figures_price_the_twin():
    """[Note: device profile]: the twin prices with the H100's figures; the measuring arithmetic (best of the
    timed runs after an untimed one) and the host Adam kernel's rate, on this CPU."""
    import torch

    from ds_patrickstar.integration import device_profile as dp
    from ds_patrickstar.memory.emulated import EmulatedAccelerator
    from ds_patrickstar.placement.step_time import H100_PROFILE

    assert dp.device_profile(EmulatedAccelerator(1 << 20)) is H100_PROFILE
    calls, times = [], iter([4.0, 2.0, 8.0])
    assert dp.rate(100, lambda: calls.append(1), lambda work: (work(), next(times))[1]) == 50.0
    assert len(calls) == 1 + dp.REPEATS  # one untimed, then the timed ones
    host = dp.adam_rate(torch.device("cpu"), dp.host_clock)
    assert 1e6 < host < 1e12  # elements per second of the kernel the host step runs
