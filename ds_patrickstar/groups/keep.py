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
placement first completes the reduce-scatters in flight (``PlacementRuntime.drain_reductions``),
which frees their flat gradient buffers (see [Note: flat group buffers] in groups/flat.py).
A no-grad forward (evaluation) keeps nothing. After the reduce-scatter, and at every step,
no other rank's chunk stays gathered (its values would be stale after the update).
"""

from __future__ import annotations

from .comm import ChunkComm
from .gather_plan import GatherPlan
from .residency import GroupResidency


class KeepPolicy:
    """Keeps or releases a group after a use; see [Note: kept groups]."""

    def __init__(
        self,
        comm: ChunkComm,
        residency: GroupResidency,
        plan: GatherPlan | None,
        limit: int | None,
    ) -> None:
        self._comm, self._residency = comm, residency
        self._plan = plan
        self.limit = limit  # bytes of kept groups' chunks; None: as many as memory holds

    def keep(self, group: int) -> None:
        """Keep ``group`` gathered for its next use, releasing the oldest kept groups over the limit;
        with placement only when the agreed plan holds it for the rest of the iteration. With one rank
        nothing is gathered (a group is its one chunk, which placement moves): nothing to keep."""
        if self._comm.world_size == 1:
            return
        residency = self._residency
        if self.limit is not None and residency.groups[group].nbytes.members > self.limit:
            residency.release(group)
            return
        if self._plan is not None and not self._plan.allows_keep(residency.gathered_bytes):
            residency.release(group)
            return
        residency.keep(group)
        while self.limit is not None and sum(residency.kept.values()) > self.limit:
            residency.release(next(iter(residency.kept)))
        held = sum(residency.kept.values())
        counters = self._comm.counters
        counters.peak_kept_gathered_bytes = max(counters.peak_kept_gathered_bytes, held)
