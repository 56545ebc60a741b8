"""Collectives over chunk groups, on DeepSpeed's data-parallel process group.

[Note: chunk groups]
With ``W`` data-parallel ranks, each param group's chunks come in groups of ``W`` (see
[Note: balanced chunk groups]); chunk ``g*W + r`` of group ``g`` is owned by rank ``r``. A
rank keeps its owned chunk's payload and the fp32 master/momentum/variance of that chunk
only. Before use, a group is all-gathered (every rank receives every chunk of the group);
after the last gradient of the group is in its slots, the group is reduce-scattered (each
slot divided by ``W``, then summed, as ZeRO-3's reduce-scatter pre-divides: a sum of fp16
gradients that would overflow before the division does not) so the owner holds the averaged
gradient, and the other ranks release their copies. With ``W == 1`` every collective is a no-op
and the same code paths run. The ranks are DeepSpeed's data-parallel group, whatever the nodes:
nothing here assumes one node. One group, its state and its collectives are a
:class:`~ds_patrickstar.groups.group.ChunkGroup`; what it takes on the accelerator is
[Note: chunk group bytes].

[Note: asynchronous collectives]
Every collective is issued with ``async_op=True`` and returns a :class:`PendingCollective`
that the chunk manager puts on the ``pending`` list of every member chunk of the group, so
whoever reads or writes a member's values waits through :meth:`Chunk.ready` (the one
accessor, see [Note: ready payload]), and nothing moves or frees a member before the
collective is over. An all-gather receives in place into the group's flat storage (see
[Note: gathered group storage]: no list, no temporary; on gloo see
[Note: in-place collectives on gloo]). On the strict emulated accelerator it
receives into a side buffer of the emulator instead (not charged to the ledger: it stands for
the storage a GPU would write) and copies it into the storage when waited on; the other ranks'
pieces hold NaN from the issue until then, so a read before the wait changes the numbers. A
reduce-scatter divides a flat buffer of the group's gradients (the group's storage, or a
micro-step's gradient buffer, see [Note: flat group buffers]) by ``W`` and sums it into this
rank's piece in place, then, when waited on, runs its ``after`` action (the gradient sink puts
the piece where it belongs).
On CUDA the collectives are issued on a stream of their kind after the work queued on the
compute stream (``Accelerator.collective_stream``); the wait makes the compute stream wait for
the collective, and what follows runs there. On CPU (gloo) the same code runs with gloo's work
handles.

[Note: collective buffers]
A collective's buffers (the group's storage, the owned chunk it sends, a micro-step's gradient
buffer) are held by the collective until it is waited on, and freed only after: the storage a
reduce-scatter reads goes in its ``after`` action, a released group's storage after its members'
pending collectives, a gradient buffer after its reduce-scatter. On CUDA the all-gathers and the
reduce-scatters run on two streams of their own (at high priority, as FSDP2's), so an all-gather
ahead of use is not queued behind a reduce-scatter, nor either behind a copy. No buffer is handed to
torch's record-stream: after the wait the compute stream, on which every buffer was allocated, is
ordered after the collective, so the block the caching allocator gets back at the free is safe to
reuse there, and the ledger releases the bytes exactly when the allocator does (a recorded-stream
block stays reserved until the collective's stream passes it, after the ledger let the bytes go: a
tight budget at several ranks could over-commit). The strict twin holds each collective's buffers
until its wait (:class:`~ds_patrickstar.memory.accelerator.CollectiveIssue`) and raises
:class:`~ds_patrickstar.memory.pending.CopyHazard` on a free before it, so a missing wait fails a
CPU test.

[Note: in-place collectives on gloo]
gloo has no in-place form of the two single-tensor collectives: its reduce-scatter all-reduces a
clone of the whole input, and its all-gather receives into a temporary of the whole output and
copies it out, so each takes a second group's worth of host memory while in flight, beside the
storage (and, for a reduce-scatter, for as long as it is in flight). On CPU tensors of a gloo
group the reduce-scatter is therefore that all-reduce run on the input itself (the same sums:
this rank's piece gets the same values, the other pieces, whose values nothing reads after a
reduce-scatter, get theirs too), and the all-gather is one broadcast per rank, each from its
piece of the output, in place (this rank's input copied into its piece first). Other backends
(NCCL) run torch's collectives, which work in place.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist

from ..counters import StepCounters
from ..memory.accelerator import Accelerator, CollectiveIssue, HostAccelerator
from ..memory.pending import Pending
from .agreement import LockstepMode, RankAgreement

# the names of torch >= 2.13 (gloo and NCCL); the older names before
_torch_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_torch_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class Waitable(Protocol):
    def wait(self) -> Any: ...

    def is_completed(self) -> bool: ...


class _Works:
    """Several works completed as one (an all-gather as one broadcast per rank)."""

    def __init__(self, works: list[Waitable]) -> None:
        self._works = works

    def wait(self) -> None:
        for work in self._works:
            work.wait()

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self._works)


def _on_gloo(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> bool:
    return tensor.device.type == "cpu" and "gloo" in str(dist.get_backend(group))


def _piece(flat: torch.Tensor, rank: int, numel: int) -> torch.Tensor:
    return flat[rank * numel : (rank + 1) * numel]


def _reduce_scatter_single(
    output: torch.Tensor, flat: torch.Tensor, op: Any, group: dist.ProcessGroup | None, async_op: bool
) -> Waitable | None:
    """Reduce ``flat``'s equal pieces into ``output``, this rank's piece of ``flat``; see
    [Note: in-place collectives on gloo]."""
    rank = dist.get_rank(group)
    if _on_gloo(flat, group) and output.data_ptr() == _piece(flat, rank, output.numel()).data_ptr():
        return dist.all_reduce(flat, op=op, group=group, async_op=async_op)
    return _torch_reduce_scatter_single(output, flat, op=op, group=group, async_op=async_op)


def _all_gather_single(
    flat: torch.Tensor, mine: torch.Tensor, group: dist.ProcessGroup | None, async_op: bool
) -> Waitable | None:
    """Every rank's ``mine`` into its piece of ``flat``; see [Note: in-place collectives on gloo]."""
    if not _on_gloo(flat, group):
        return _torch_all_gather_single(flat, mine, group=group, async_op=async_op)
    numel, rank = mine.numel(), dist.get_rank(group)
    landing = _piece(flat, rank, numel)
    if landing.data_ptr() != mine.data_ptr():
        with torch.no_grad():
            landing.copy_(mine)
    ranks = dist.get_process_group_ranks(group) if group is not None else range(dist.get_world_size())
    works = [
        dist.broadcast(_piece(flat, index, numel), src=global_rank, group=group, async_op=async_op)
        for index, global_rank in enumerate(ranks)
    ]
    return _Works([w for w in works if w is not None]) if async_op else None


class PendingCollective(Pending):
    """A collective in flight; :meth:`wait` completes it and delivers its result (idempotent)."""

    collective = True

    # A completed collective drops its work handle and finish action at once: the handle holds
    # the process group's buffers (NCCL and gloo flatten an all-gather's list of outputs into
    # one), and a member chunk's pending list may keep this object until that chunk is next read.
    def __init__(self, work: Waitable | None, finish: Callable[[], None], issue: CollectiveIssue | None = None) -> None:
        self.work = work
        self._finish: Callable[[], None] | None = finish
        self._issue = issue  # its buffers are held until the wait (see [Note: collective buffers])
        self._done = False

    def wait(self) -> None:
        if self._done:
            return
        self._done = True  # the finish action may wait the member chunks again: no re-entry
        if self.work is not None:
            self.work.wait()
        if self._issue is not None:
            self._issue.complete()
        finish, self.work, self._finish, self._issue = self._finish, None, None, None
        if finish is not None:
            finish()

    def done(self) -> bool:
        return self._done

    def finished(self) -> bool:
        return self._done or self.work is None or self.work.is_completed()


class ChunkComm:
    """The collectives the chunk manager needs; see [Note: chunk groups] and
    [Note: asynchronous collectives]."""

    def __init__(self, group: dist.ProcessGroup | None, counters: StepCounters, lockstep: LockstepMode = "on") -> None:
        self.group = group
        initialized = dist.is_available() and dist.is_initialized()
        self.world_size = dist.get_world_size(group) if initialized else 1
        self.rank = dist.get_rank(group) if initialized else 0
        self.counters = counters
        # the lockstep checks and the agreed values (see [Note: rank agreement])
        self.agreement = RankAgreement(group, self.world_size, self.rank, counters, lockstep)
        self.accel: Accelerator = HostAccelerator()
        self.poison = False
        self._staging: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}  # strict emulation only

    def bind(self, accel: Accelerator, poison: bool) -> None:
        """Collectives on ``accel`` (its stream on CUDA); ``poison`` (the strict emulated accelerator):
        all-gather destinations hold NaN until waited on."""
        self.accel, self.poison = accel, poison
        self.agreement.device = accel.device

    def trim(self) -> None:
        """End of step: the emulator's side buffers go."""
        self._staging.clear()

    # ---- collectives --------------------------------------------------------------
    def all_gather_async(self, flat: torch.Tensor, mine: torch.Tensor, what: str) -> PendingCollective:
        """Every rank's ``mine`` into its piece of ``flat`` (the group's storage: ``W`` pieces of
        ``mine``'s size, see [Note: gathered group storage]), in place, once waited on. ``mine``
        must not change until then. ``what``: the collective in words, the same on every rank (see
        [Note: ranks in lockstep])."""
        if self.world_size == 1:
            return PendingCollective(None, lambda: None)
        self.agreement.check(what)
        numel = mine.numel()
        others = [piece for r, piece in enumerate(flat.split(numel)) if r != self.rank]
        output = flat
        if self.poison:  # strict emulation: received into a side buffer, visible only once waited on
            staging = self._staging.setdefault((flat.numel(), mine.dtype), [])
            output = staging.pop() if staging else torch.empty_like(flat)
        with self.accel.collective_stream("all_gather", flat, mine) as issue:
            work = _all_gather_single(output, mine, group=self.group, async_op=True)

        def finish() -> None:
            if output is not flat:
                with torch.no_grad():
                    flat.copy_(output)
                staging.append(output)

        if self.poison:
            with torch.no_grad():
                for piece in others:
                    piece.fill_(float("nan"))
        self.counters.all_gathers += 1
        self.counters.bytes_all_gathered += (self.world_size - 1) * numel * mine.element_size()
        return PendingCollective(work, finish, issue)

    def reduce_scatter_mean_single_async(
        self, flat: torch.Tensor, what: str, after: Callable[[], None] = lambda: None
    ) -> PendingCollective:
        """Average the ``W`` equal pieces of ``flat`` over ranks into this rank's piece, in place
        (``reduce_scatter_single``: no list, no flattening temporary), when waited on; then
        ``after()``. ``flat`` may not change or be freed until then. ``what``: as for
        :meth:`all_gather_async`."""
        if self.world_size == 1:
            return PendingCollective(None, after)
        self.agreement.check(what)
        numel = flat.numel() // self.world_size
        mine = flat[self.rank * numel : (self.rank + 1) * numel]
        with torch.no_grad():
            flat.div_(self.world_size)
        with self.accel.collective_stream("reduce_scatter", flat) as issue:
            work = _reduce_scatter_single(mine, flat, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        self.counters.reduce_scatters += 1
        self.counters.bytes_reduce_scattered += (self.world_size - 1) * numel * flat.element_size()
        return PendingCollective(work, after, issue)

    def all_reduce_sum(self, value: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            dist.all_reduce(value, op=dist.ReduceOp.SUM, group=self.group)
        return value
