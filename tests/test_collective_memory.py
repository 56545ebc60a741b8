"""The chunk-group collectives take no host memory of their own (issue 32, item 8).

gloo's reduce-scatter all-reduces a clone of its whole input and its all-gather receives into a
temporary of its whole output: a second group's worth of host memory per collective in flight (see
[Note: in-place collectives on gloo]). Each rank's peak resident memory (VmHWM, reset through
``/proc/self/clear_refs`` just before the collective) over a flat group of 64 MiB, more than glibc
ever serves from freed heap (its mmap threshold tops out at 32 MiB), must rise by less than a
quarter of the group; the results are those of the collectives' definitions. A reduce-scatter that
has run gives its group's buffer back at the next backward moment, not at the end of backward.
"""
import os
import re

import pytest
import torch
from multiproc import run_ranks

from ds_patrickstar.memory.pending import Pending
from ds_patrickstar.memory.reductions import InFlightReductions

NUMEL = 1 << 24  # elements per rank: a 2-rank bf16 group of 64 MiB


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"{key}:\s+(\d+) kB", f.read()).group(1)) * 1024


def _extra_peak(run) -> int:
    """Resident bytes above the current ones at the peak of ``run()``."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    before = _status("VmRSS")
    run()
    return _status("VmHWM") - before


def _collectives(rank, world_size):
    from ds_patrickstar.counters import StepCounters
    from ds_patrickstar.groups.comm import ChunkComm

    comm = ChunkComm(None, StepCounters())
    base = torch.arange(NUMEL) % 32  # small integers: every sum and half below is exact in bf16
    pieces = [(base * (p + 1)).to(torch.bfloat16) for p in range(world_size)]
    flat = torch.cat(pieces) * (rank + 1)  # rank r's gradients: (r + 1) x the pieces
    reduce_extra = _extra_peak(lambda: comm.reduce_scatter_mean_single_async(flat, "reduce-scatter").wait())
    mean = pieces[rank].float() * sum(r + 1 for r in range(world_size)) / world_size
    reduced = torch.equal(flat[rank * NUMEL : (rank + 1) * NUMEL], mean.to(torch.bfloat16))
    flat.fill_(float("nan"))
    gather_extra = _extra_peak(lambda: comm.all_gather_async(flat, pieces[rank], "all-gather").wait())
    return {"reduce": reduce_extra, "gather": gather_extra, "reduced": reduced,
            "gathered": torch.equal(flat, torch.cat(pieces)), "bytes": flat.numel() * flat.element_size()}


def test_gloo_reduce_scatter_and_all_gather_run_in_place():
    if not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("needs Linux /proc/self/clear_refs to reset the peak resident memory")
    for rank, r in enumerate(run_ranks(_collectives, 2)):
        assert r["reduced"] and r["gathered"], r
        assert r["reduce"] < r["bytes"] / 4, f"rank {rank}: the reduce-scatter took {r['reduce']} B beside {r}"
        assert r["gather"] < r["bytes"] / 4, f"rank {rank}: the all-gather took {r['gather']} B beside {r}"


class _Reduction(Pending):
    """A reduce-scatter in flight whose collective finishes when the test says so."""

    collective = True

    def __init__(self, finished: bool) -> None:
        self.ran, self.waited = finished, False

    def wait(self) -> None:
        self.waited = True

    def done(self) -> bool:
        return self.waited

    def finished(self) -> bool:
        return self.ran or self.waited


def test_finished_reduce_scatters_give_their_buffers_back_without_waiting_for_the_limit():
    """A reduce-scatter whose collective has run is completed (its buffer freed) at the next issue or
    backward moment, oldest first, never blocking on one still running (see memory/reductions.py)."""
    reductions = InFlightReductions(limit=2)
    first, second, third = _Reduction(True), _Reduction(False), _Reduction(True)
    reductions.add(first)
    reductions.add(second)
    assert first.waited  # finished: completed at the next issue, below the limit
    reductions.add(third)
    reductions.reap()
    assert not second.waited and not third.waited  # oldest first: the third waits behind the second
    second.ran = True
    reductions.reap()
    assert second.waited and third.waited
