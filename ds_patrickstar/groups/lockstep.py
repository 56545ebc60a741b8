"""Ranks in lockstep: the data-parallel ranks agree on each chunk-group collective before any issues it.

[Note: ranks in lockstep]
Every rank must issue the chunk groups' collectives in the same order (see [Note: chunk groups]):
which groups are gathered, kept, prefetched and reduced follows from the modules a rank runs, so
ranks that run different modules (a mixture-of-experts block routing each rank's tokens to other
experts, data-dependent control flow) would pair an all-gather of one group with another group's,
or with a reduce-scatter: gloo aborts the process or, with equal sizes, the data is silently mixed;
NCCL hangs. Before each collective (all-gather, reduce-scatter, and the end of every forward and
backward of the root module, where a rank may go on to collectives of its own), :meth:`Lockstep.check`
all-reduces a checksum of what the rank is about to do (``min`` of ``(c, -c)``: one collective of
two integers, the same on every rank whatever it is about to do, so it always pairs up). Equal on
every rank: go on. Different: every rank learns it in the same call, the ranks exchange the moments
each ran since their last agreed check and each raises :class:`RanksDiverged` naming the collectives,
the first module that differs and the fix (a leaf module, see [Note: leaf modules]); nothing
mismatches and nothing hangs. What is compared is the collective itself (kind and chunk group), not
the modules: ranks whose modules differ without changing a collective (a module whose group every
rank holds gathered anyway, its gradient zero on the others at the epilogue) compute the right
result and are not stopped.

Cost: one small host-side collective per chunk-group collective and two per iteration; with the
default ``chunk_size`` a group moves tens of megabytes, so the check is small beside it. It runs
on a gloo group (the data-parallel group itself when that is gloo, else a gloo group of the same
ranks made at initialize): no device synchronization, only the ranks' hosts meet, and they meet
in the collectives anyway. A check at a fixed point of the iteration only (after a forward, at the
step) would come after the collectives it should have prevented.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

import torch
import torch.distributed as dist

from ..counters import StepCounters

_MOMENTS_KEPT = 256  # moments since the last agreed check, for the message: the first difference is early


class RanksDiverged(RuntimeError):
    """The data-parallel ranks were about to issue different collectives; see [Note: ranks in lockstep]."""


def _no_advice(moments: list[list[str]]) -> str:
    return ""


def host_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """A gloo group of ``group``'s ranks: ``group`` itself where its backend runs on CPU tensors."""
    if "gloo" in str(dist.get_backend(group)):
        return group
    ranks = dist.get_process_group_ranks(group) if group is not None else None
    return dist.new_group(ranks=ranks, backend="gloo")


class Lockstep:
    """Agrees each collective among the ranks before it is issued; see [Note: ranks in lockstep]."""

    def __init__(self, group: dist.ProcessGroup | None, world_size: int, rank: int, counters: StepCounters) -> None:
        self.world_size, self.rank = world_size, rank
        self._group = host_group(group) if world_size > 1 else None
        self._counters = counters
        self._moments: list[str] = []  # since the last agreed check
        # what to do about modules that differ, from their moments per rank (set by the integration)
        self.advice: Callable[[list[list[str]]], str] = _no_advice

    def moment(self, label: str) -> None:
        """A moment (a hooked module's use) ran on this rank."""
        if self.world_size > 1:
            self._moments.append(label)
            del self._moments[:-_MOMENTS_KEPT]

    def check(self, what: str) -> None:
        """Before ``what`` (a collective, or the end of a forward or backward): every rank is about to do
        the same, or every rank raises :class:`RanksDiverged`."""
        if self.world_size == 1:
            return
        checksum = zlib.crc32(what.encode())
        both = torch.tensor([checksum, -checksum], dtype=torch.int64)
        dist.all_reduce(both, op=dist.ReduceOp.MIN, group=self._group)
        self._counters.lockstep_checks += 1
        if int(both[0]) == -int(both[1]):
            self._moments.clear()
            return
        said: list[tuple[str, list[str]] | None] = [None] * self.world_size
        dist.all_gather_object(said, (what, list(self._moments)), group=self._group)
        raise RanksDiverged(self._message([s for s in said if s is not None]))

    def _message(self, said: list[tuple[str, list[str]]]) -> str:
        doing = "; ".join(f"rank {r}: {what}" for r, (what, _) in enumerate(said))
        moments = [m for _, m in said]
        return (
            f"ds_patrickstar: the data-parallel ranks were about to issue different collectives ({doing}), which "
            f"would mix up their chunk groups or hang. {_first_difference(moments)} Every rank must run the same "
            f"hooked modules in the same order, except inside a leaf module (see docs/hugging-face.md, mixture of "
            f"experts). {self.advice(moments)}"
        ).rstrip()


def first_difference(moments: list[list[str]]) -> int | None:
    """The first index at which the ranks' moments differ (a rank with none left there differs), or None."""
    for index in range(max((len(m) for m in moments), default=0)):
        if len({m[index] if index < len(m) else None for m in moments}) > 1:
            return index
    return None


def _first_difference(moments: list[list[str]]) -> str:
    """Where the ranks' moments since their last agreed collective first differ, in words."""
    index = first_difference(moments)
    if index is None:
        return (
            "They ran the same modules since their last agreed collective; they differ in what they keep or prefetch."
        )
    seen = [m[index] if index < len(m) else None for m in moments]
    ran = "; ".join(f"rank {r}: {s[4:] + ' (' + s[:3] + ')' if s else 'none'}" for r, s in enumerate(seen))
    return f"The modules they ran first differ after {index} common moments: {ran}."
