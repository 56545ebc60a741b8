"""The per-step counters and losses of a fixed set of runs (``tests/counter_runs.py``) are those of the golden
file: a change to the package's structure moves no byte and no count (1 and 2 ranks, GA 1 and 2, placement with
evictions on the strict twin, optimizer states on the device and the host, the disk tier's spilled states,
frozen chunks on disk, activation offload with recomputation)."""
import json

import pytest
from counter_runs import CASES, GOLDEN, TIMING_DEPENDENT, run_case


@pytest.fixture(scope="module")
def golden():
    return json.loads(GOLDEN.read_text())


def test_the_golden_file_covers_every_case(golden):
    assert set(golden) == set(CASES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_counters_and_losses_as_golden(name, golden):
    got = run_case(name)
    want = golden[name]
    skip = TIMING_DEPENDENT if CASES[name]["world"] > 1 else set()
    assert len(got) == len(want)
    for rank, (ours, theirs) in enumerate(zip(got, want)):
        for step, (a, b) in enumerate(zip(ours["steps"], theirs["steps"])):
            assert a["losses"] == b["losses"], (name, rank, step)
            moved = {k: (a["counters"].get(k), v) for k, v in b["counters"].items()
                 if k not in skip and a["counters"].get(k) != v}
            assert not moved, (name, rank, step, moved)
