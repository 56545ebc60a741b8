"""The decisions of [Note: gradients leave in backward] on a hand-made trace: a host-updated chunk leaves once its
last use is behind, it is movable, its gradient is final and no collective into it is in flight (with several
ranks its reduce-scatter completes after its last use, when the backend has run it). The whole path, with real
reduce-scatters on two ranks, is in tests/test_grad_norm.py and tests/test_counter_runs.py."""
from dataclasses import dataclass, field

from ds_patrickstar.counters import StepCounters
from ds_patrickstar.placement.grad_release import GradientRelease
from ds_patrickstar.placement.trace import Moment, Trace


class _Collective:
    collective = True

    def __init__(self) -> None:
        self.waited = False

    def done(self) -> bool:
        return self.waited

    def wait(self) -> None:  # an eviction through an unfinished collective would block on it
        raise AssertionError("a gradient was sent out through a wait on its reduce-scatter")


@dataclass
class _Chunk:
    chunk_id: int
    on_host: bool = False
    movable: bool = True
    pending: list = field(default_factory=list)


class _Moves:
    def __init__(self, n: int) -> None:
        self.chunks = [_Chunk(i) for i in range(n)]
        self.sent: list[int] = []

    def evict(self, chunk: _Chunk) -> None:
        self.sent.append(chunk.chunk_id)
        chunk.on_host = True


def _trace() -> Trace:
    trace = Trace()  # forward uses 0 then 1, backward 1 then 0, then the step
    for label, chunks in (("fwd:a", (0,)), ("fwd:b", (1,)), ("bwd:b", (1,)), ("bwd:a", (0,)), ("step", ())):
        trace.add(Moment(label, chunks, 0))
    return trace


def test_a_chunk_leaves_only_once_its_gradient_is_final():
    moves, counters = _Moves(2), StepCounters()
    release = GradientRelease(moves, counters, {0, 1})  # type: ignore[arg-type]
    trace = _trace()
    for moment in range(3):
        release.after_moment(trace, moment, on_device=set())
    release.after_moment(trace, 3, on_device=set())  # chunk 1's last use (moment 2) is behind...
    assert moves.sent == []  # ...but its reduce-scatter has not even been issued
    release.gradient_final(1)
    release.after_moment(trace, 4, on_device=set())
    assert moves.sent == [1] and counters.grads_released_in_backward == 1


def test_a_chunk_waits_for_its_collective_in_flight_and_for_its_tensors():
    moves, counters = _Moves(2), StepCounters()
    release = GradientRelease(moves, counters, {0, 1})  # type: ignore[arg-type]
    trace = _trace()
    reduction = _Collective()
    moves.chunks[1].pending.append(reduction)
    moves.chunks[1].movable = False
    for moment in range(3):
        release.after_moment(trace, moment, on_device=set())
    release.gradient_final(1)
    release.after_moment(trace, 3, on_device=set())
    assert moves.sent == []  # a tensor of it still in use
    moves.chunks[1].movable = True
    release.after_moment(trace, 4, on_device=set())
    assert moves.sent == []  # its collective still in flight: no wait on it
    reduction.waited = True
    release.after_moment(trace, 4, on_device=set())
    assert moves.sent == [1]


def test_chunks_updated_on_the_accelerator_and_a_new_iteration_stay():
    moves, counters = _Moves(2), StepCounters()
    release = GradientRelease(moves, counters, {0, 1})  # type: ignore[arg-type]
    trace = _trace()
    for moment in range(4):
        release.after_moment(trace, moment, on_device={1})
    release.gradient_final(1)
    release.after_moment(trace, 4, on_device={1})
    assert moves.sent == []  # its Adam runs on the accelerator
    release.gradient_final(0)
    release.after_moment(trace, 0, on_device=set())  # the next iteration: last iteration's finality is gone
    for moment in range(1, 5):
        release.after_moment(trace, moment, on_device=set())
    assert moves.sent == []
