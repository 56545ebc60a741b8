"""The keep policy: whether a chunk group whose use is over stays gathered.

[Note: kept groups]
Releasing a chunk group after its last forward use and gathering it again for backward doubles the
all-gather volume. A group whose forward use is over is therefore *kept* gathered (its tensors stay
``HOLD_AFTER_FWD``) while the bytes of the kept groups' chunks
(:attr:`~ds_patrickstar.chunks.group_bytes.GroupBytes.members`) stay within ``keep_gathered``; over
the limit the oldest kept group is released, so the groups kept are the last ones of the forward
pass, which are the first ones backward needs. Between gradient-accumulation micro-steps the
gathered groups are kept the same way for the next forward. Without a limit every group is gathered
once per micro-step, as in ZeRO-3 with its default
``stage3_max_live_parameters``/``stage3_max_reuse_distance``, and each rank holds the whole
low-precision model during the step (without placement the default limit follows the host memory the
ranks share, see [Note: default kept groups from host memory]).
With placement, the kept chunks are charged to the device ledger like any gathered chunk, and a
group is kept only when the gathered groups (each counted as in [Note: chunk group bytes]) fit the
room the budget leaves beside the highest tide the trace plans for the rest of the iteration and
the groups used later, on *every* rank: which groups are
gathered decides which collectives run, so the decision must be the same everywhere, and a kept
group is never released on one rank alone. The ranks agree on that room once per step, not per
decision (see [Note: agreed gather plan]). The same holds for a prefetch under placement. Under pressure,
placement first completes the reduce-scatters in flight (``memory/reductions.py``, drained by
placement's moves), which frees their flat gradient buffers (see [Note: flat group buffers] in groups/flat.py).
A no-grad forward (evaluation) keeps nothing. After the reduce-scatter, and at every step,
no other rank's chunk stays gathered (its values would be stale after the update).
"""

from __future__ import annotations

from .gather_plan import GatherPlan


class KeepPolicy:
    """Whether a group whose use is over stays gathered, and how many kept bytes are too many; see
    [Note: kept groups]. A decision only: the residency (``residency.py``) keeps or releases."""

    def __init__(self, plan: GatherPlan | None, limit: int | None) -> None:
        self._plan = plan
        self.limit = limit  # bytes of kept groups' chunks; None: as many as memory holds

    def keeps(self, members_bytes: int, gathered_bytes: int) -> bool:
        """Whether a group of ``members_bytes`` stays gathered beside ``gathered_bytes`` of gathered groups
        (itself included): within the limit and, with placement, what the agreed plan holds for the rest of
        the iteration."""
        if self.limit is not None and members_bytes > self.limit:
            return False
        return self._plan is None or self._plan.allows_keep(gathered_bytes)

    def over(self, kept_bytes: int) -> bool:
        """Whether ``kept_bytes`` of kept groups' chunks pass the limit (the oldest then go)."""
        return self.limit is not None and kept_bytes > self.limit
