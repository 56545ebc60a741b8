"""The per-step counters and losses of a fixed set of runs (``tests/counter_runs.py``) are those of the golden
file: a change to the package's structure moves no byte and no count (1 and 2 ranks, GA 1 and 2, placement with
evictions on the strict twin, optimizer states on the device and the host, the disk tier's spilled states,
frozen chunks on disk, activation offload with recomputation)."""
import json

import pytest
from counter_runs import CASES, GOLDEN, METER_DEPENDENT, TIMING_DEPENDENT, run_case


@pytest.fixture(scope="module")
def golden():
    return json.loads(GOLDEN.read_text())


def test_the_golden_file_covers_every_case(golden):
    assert set(golden) == set(CASES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_counters_and_losses_as_golden(name, golden):
    got = run_case(name)
    want = golden[name]
    skip = (TIMING_DEPENDENT if CASES[name]["world"] > 1 else set()) | METER_DEPENDENT.get(name, set())
    assert len(got) == len(want)
    for rank, (ours, theirs) in enumerate(zip(got, want)):
        for step, (a, b) in enumerate(zip(ours["steps"], theirs["steps"])):
            assert a["losses"] == b["losses"], (name, rank, step)
            moved = {k: (a["counters"].get(k), v) for k, v in b["counters"].items()
                 if k not in skip and a["counters"].get(k) != v}
            assert not moved, (name, rank, step, moved)


@pytest.mark.parametrize("name", ["twin_1rank_ga1", "twin_1rank_device_adam", "twin_checkpointed_offload",
                                  "frozen_on_disk_twin", "twin_1rank_ga2"])
def test_the_move_model_predicts_the_bytes_measured(name):
    """At steady state (after the traced step) the planner's model of the driver (see [Note: predicted moves])
    predicts the bytes each way that the strict twin moved, exactly; with gradient accumulation the accumulators'
    too; and never fewer than the bytes floor."""
    ours = run_case(name)[0]
    assert ours["steps"][0]["counters"]["predicted_bytes_to_device"] == 0  # the traced iteration: no trace yet
    planned = [step["counters"]["plan_seconds"] for step in ours["steps"]]
    # the traced step plans, the next one checks that plan on its iteration's times, then no step plans (see
    # [Note: the plan checked on steady times])
    assert planned[0] > 0 and planned[1] > 0 and planned[2:] == [0] * (len(planned) - 2), planned
    for step in ours["steps"][2:]:
        counters = step["counters"]
        for way in ("to_device", "to_host"):
            measured, predicted = counters[f"bytes_{way}"], counters[f"predicted_bytes_{way}"]
            assert measured > 0 and predicted == measured, (name, way, predicted, measured)
            measured, predicted = counters[f"accumulator_bytes_{way}"], counters[f"predicted_accumulator_bytes_{way}"]
            assert predicted == measured and (measured > 0) == (CASES[name]["ga"] > 1), (name, way, predicted)
        # no placement of the trace moves fewer bytes (see [Note: the bytes floor])
        moved = sum(counters[f"{kind}bytes_{way}"] for kind in ("", "accumulator_") for way in ("to_device", "to_host"))
        assert 0 < counters["bytes_floor"] <= moved, (name, counters["bytes_floor"], moved)


@pytest.mark.parametrize("name", ["twin_2rank_ga1", "twin_2rank_ga2"])
def test_the_move_model_at_several_ranks_and_the_floor(name):
    """At two ranks the move model predicts (the model data it does not move and the chunks the groups' prefetch
    brought, both noted at each moment, see [Note: predicted moves]), with gradient accumulation the owned
    accumulators' bytes too: within 10% of the bytes each rank moved from the check's plan on (exact in most runs;
    what a hook's end reads follows the collectives' completions, and the notes of several iterations add up: with
    accumulation one chunk more brought, 8% over, in 2 of 6 runs; without the groups' prefetch in the replay 14%
    over and 15% under to the device without accumulation in every run). Each rank's bytes floor (its own chunks,
    see [Note: the bytes floor]) is below what it moved once the trace is planned."""
    for rank in run_case(name):
        for index, step in enumerate(rank["steps"][1:], start=1):
            counters = step["counters"]
            bound = 0.10 if index > 1 else 0.25  # the traced plan's iteration: priced without the notes
            for kind in ("", "accumulator_"):
                for way in ("to_device", "to_host"):
                    predicted, measured = counters[f"predicted_{kind}bytes_{way}"], counters[f"{kind}bytes_{way}"]
                    assert abs(predicted - measured) <= bound * measured, (kind, way, predicted, measured)
            assert counters["predicted_bytes_to_device"] > 0
            moved = sum(counters[f"{kind}bytes_{way}"] for kind in ("", "accumulator_") for way in ("to_device",
                                                                                                 "to_host"))
            assert 0 < counters["bytes_floor"] <= moved, (name, counters["bytes_floor"], moved)


@pytest.mark.parametrize("name", ["twin_1rank_ga2", "twin_2rank_ga1", "twin_2rank_ga2"])
def test_clean_evictions_at_several_ranks_and_with_accumulation(name):
    """A chunk evicted unchanged copies nothing at any number of ranks and between micro-steps (see [Note: clean
    evictions]); the strict twin compared each such payload with its kept buffer, and the golden test holds the
    losses."""
    for rank in run_case(name):
        for step in rank["steps"][1:]:
            counters = step["counters"]
            assert counters["clean_evictions"] > 0 and counters["bytes_to_host"] < counters["bytes_to_device"]
