"""Ranks in lockstep: the data-parallel ranks agree on each chunk-group collective before any issues it (the
message when they do not; the check itself is ``agreement.py``'s).

[Note: ranks in lockstep]
Every rank must issue the chunk groups' collectives in the same order (see [Note: chunk groups]):
which groups are gathered, kept, prefetched and reduced follows from the modules a rank runs, so
ranks that run different modules (a mixture-of-experts block routing each rank's tokens to other
experts, data-dependent control flow) would pair an all-gather of one group with another group's,
or with a reduce-scatter: gloo aborts the process or, with equal sizes, the data is silently mixed;
NCCL hangs. Before each collective (all-gather, reduce-scatter, and the end of every forward and
backward of the root module, where a rank may go on to collectives of its own), :meth:`RankAgreement.check`
all-reduces a checksum of what the rank is about to do (a header of fixed length, ``min`` of ``(h, -h)``:
one collective of six integers, the same on every rank whatever it is about to do, so it always pairs
up). Equal on
every rank: go on. Different: every rank learns it in the same call, the ranks exchange the moments
each ran since their last agreed check and each raises :class:`RanksDiverged` naming the collectives,
the first module that differs and the fix (a leaf module, see [Note: leaf modules]); nothing
mismatches and nothing hangs. What is compared is the collective itself (kind and chunk group), not
the modules: ranks whose modules differ without changing a collective (a module whose group every
rank holds gathered anyway, its gradient zero on the others at the epilogue) compute the right
result and are not stopped.

Cost: one small host-side collective per chunk-group collective and two per iteration; with the
default ``chunk_size`` a group moves tens of megabytes, so the check is small beside it. The check is
one message of :class:`~ds_patrickstar.groups.agreement.RankAgreement` (see [Note: rank agreement]),
on a gloo group of its own: no device synchronization, only the ranks' hosts meet, and they meet in
the collectives anyway. A check at a fixed point of the iteration only (after a forward, at the step)
would come after the collectives it should have prevented. ``zero_optimization.lockstep`` turns the
checks off, or keeps them for the first steps only (see [Note: lockstep modes]).
"""

from __future__ import annotations

from collections.abc import Callable

MOMENTS_KEPT = 256  # moments since the last agreed check, for the message: the first difference is early


class RanksDiverged(RuntimeError):
    """The data-parallel ranks were about to issue different collectives; see [Note: ranks in lockstep]."""


def divergence_message(said: list[tuple[str, list[str]]], advice: Callable[[list[list[str]]], str]) -> str:
    """What every rank raises: what each was about to do, where their moments since their last agreed check
    first differ, and ``advice`` about the modules that differ."""
    doing = "; ".join(f"rank {r}: {what}" for r, (what, _) in enumerate(said))
    moments = [m for _, m in said]
    return (
        f"ds_patrickstar: the data-parallel ranks were about to issue different collectives ({doing}), which "
        f"would mix up their chunk groups or hang. {_first_difference(moments)} Every rank must run the same "
        f"hooked modules in the same order, except inside a leaf module (see docs/hugging-face.md, mixture of "
        f"experts). {advice(moments)}"
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
