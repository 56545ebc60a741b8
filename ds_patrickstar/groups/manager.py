"""The chunk manager: the moments of training (a module uses its tensors, a forward or backward use
ends, a gradient arrives, the step is over) turned into chunk-group work.

A short facade over the classes that each do one job: :class:`~ds_patrickstar.chunks.chunk_map.ChunkMap`
(what is where), :class:`~ds_patrickstar.groups.residency.GroupResidency` (gathered groups and their
collectives), :class:`~ds_patrickstar.groups.keep.KeepPolicy` (whether a group stays gathered),
:class:`~ds_patrickstar.groups.group.ChunkGroup` (one group, with its joined buffers) and
:class:`~ds_patrickstar.groups.grads.GradientSink` (gradients, reduce-scatters, the norm). With one
rank every collective is a no-op and the same code runs.

[Note: tied weights between backward uses]
A weight held by two modules (GPT's token embedding and LM head) gets its gradient only after
the last backward use, so its group, with the gradient slots it will receive, would stay gathered
from the LM head's backward to the embedding's: the whole backward pass. A module holding such
a weight therefore gets a post-backward hook (:mod:`ds_patrickstar.integration.hooks`); when the module's
backward is over and no other backward use of the tensor is under way (uses are counted from
each backward access, recomputations included, and a use counts as over only when its
post-backward says so), the tensor goes back to ``HOLD_AFTER_FWD`` and its group is treated as
after a forward use: kept within ``keep_gathered``, released above it, gathered again at the
next use. A dense ``nn.Embedding`` reads no weight values in backward, so its backward makes none
ready (:meth:`ChunkManager.grads_only`): a kept group is not joined again, and a released group
that holds only its tensors is not gathered, the gradient's arrival giving it zeroed slots
instead (:meth:`GradientSink.take_grad`). With ``keep_gathered: 0`` the tied weight is gathered
three times per step (embedding and LM head forward, LM head backward) and held gathered only
while used.

[Note: nested forward uses]
A parameter may belong to a module and to a module nested inside it (the outer one reads the
inner one's weight after calling it): the inner module's forward ends while the outer one's
use goes on. Forward uses are therefore counted like backward uses (each pre-forward adds
one, each post-forward takes one away), and a tensor is ``HOLD_AFTER_FWD``, its group free to
be released or evicted, only when its last forward use is over.

[Note: a backward that raised]
An exception inside backward (a checkpoint's recomputation raising, a hook, an autograd function) leaves the
iteration half done: some slots hold gradients instead of parameters (``HOLD_AFTER_BWD``), some tensors are in use
(``COMPUTE``), some groups are gathered, reduce-scatters may be in flight, accumulators hold part of the
micro-step. Autograd drops our final callback (see [Note: end of backward]), so no epilogue runs, and the run
stays mid-backward (see [Note: run state]). The next forward of the root module (training or evaluation) first
abandons that iteration as a skipped step does (:meth:`ChunkManager.abort_iteration`, called by the hook target):
the tensors' uses end, the reduce-scatters already issued complete (every rank issued them, as it ran the same
backward), the owned slots get their values back from the fp32 masters, the gathered groups are released, the
accumulators and flat buffers go, placement takes the iteration's moments back, and the run is ``IDLE``: the
forward begins a new iteration. So the failed backward's gradients are discarded and no update is applied:
training goes on as if the failed iteration had not run (tests/test_backward_raised.py; stock ZeRO-3, DeepSpeed
0.19.8, fails that retry where the failed backward had filled part of its reduction bucket). With
``gradient_accumulation_steps`` > 1 the gradients of the step's earlier micro-steps are discarded too (they were
summed with the failed one's in the accumulators); a warning says so.
"""

from __future__ import annotations

import logging

import torch

from ..chunks.chunk import TensorInfo
from ..chunks.chunk_map import ChunkMap
from ..chunks.state import TensorState
from ..memory.reductions import InFlightReductions
from ..placement.chunk_needs import chunk_needs
from ..placement.interface import Placement
from ..run_state import RunState
from ..store.chunk_store import ChunkStore
from .comm import ChunkComm
from .gather_plan import GatherPlan
from .grads import GradientSink
from .group import build_groups
from .leaves import LeafGradients
from .persistent import PersistentGroups, persistent_groups
from .residency import GroupResidency

_S = TensorState
logger = logging.getLogger(__name__)


class ChunkManager:
    """The moments hooks and the optimizer call; see the module docstring."""

    def __init__(
        self,
        chunk_map: ChunkMap,
        comm: ChunkComm,
        store: ChunkStore,
        placement: Placement,
        reductions: InFlightReductions,
        run: RunState,
        *,
        accumulate: bool,
        keep_gathered: int | None,
        prefetch_groups: int,
        persistence: tuple[int, int] = (0, 0),
    ) -> None:
        self.map = chunk_map
        self.comm = comm
        self.store = store
        self.placement = placement
        self.run = run
        self.groups = build_groups(chunk_map, comm, store, placement, accumulate)
        sizes = [group.nbytes for group in self.groups]
        self.plan = GatherPlan(sizes, comm, placement) if placement.budgeted() else None
        self.residency = GroupResidency(
            chunk_map, comm, self.groups, placement, self.plan, prefetch_groups, keep_gathered
        )
        self.grads = GradientSink(chunk_map, self.groups, comm, self.residency, reductions, accumulate)
        self.leaves = LeafGradients(self.grads)  # see [Note: leaf modules]
        # gathered between steps (see [Note: persistent chunk groups]); (param, model) element thresholds
        chosen = persistent_groups(self.groups, *persistence) if comm.world_size > 1 and self.plan is None else []
        self.persistent = PersistentGroups(self.residency, chosen)
        self._reductions = reductions
        self._backward_users: dict[TensorInfo, int] = {}  # backward uses begun and not over, this backward
        self._forward_users: dict[TensorInfo, int] = {}  # forward uses begun and not over (nested modules)

    # ---- uses -----------------------------------------------------------------------
    def access(self, infos: list[TensorInfo], label: str = "") -> None:
        """A moment: make the chunks of ``infos`` present on the accelerator, mark the tensors
        ``COMPUTE``, and (with placement) check the budget and prefetch the next moment. A training
        moment keeps and prefetches groups; see [Note: run state]."""
        ids = tuple(dict.fromkeys(cid for info in infos for cid in info.chunk_ids))
        self.comm.agreement.moment(label)  # see [Note: ranks in lockstep]
        if self.run.recomputing():  # see [Note: recomputation in the trace]
            self.comm.counters.recompute_moments += 1
        self.placement.begin_moment(label, ids)
        keep = frozenset(ids)
        training = self.comm.world_size > 1 and self.run.trains()
        for chunk_id in ids:
            self.residency.use(self.map.chunks[chunk_id], keep, training)
        backward = self.run.in_backward()  # a backward use: not over before it says so
        counted = not self.run.recomputing()  # a recomputation's use ends with the backward use it serves
        for info in infos:
            joined = self.groups[self.map.group_of_info(info)].joined
            need = joined.rejoin_bytes(info)
            if need:
                self.placement.make_room(need, set(keep))
            joined.rejoin(info)
            joined.join(info)
            info.start_compute()
            if counted:
                users = self._backward_users if backward else self._forward_users
                users[info] = users.get(info, 0) + 1
        if training:
            self.residency.prefetch(keep, self.grads.reduced)
        self.placement.end_moment(set(keep))

    def after_forward(self, infos: list[TensorInfo]) -> None:
        """A module's forward is over: its tensors that no enclosing module still uses are done for
        now (see [Note: nested forward uses]), and a group whose tensors are all done may go."""
        groups = set()
        for info in infos:
            users = self._forward_users.pop(info, 1) - 1
            if users > 0:
                self._forward_users[info] = users
                continue
            if info.state is _S.COMPUTE:
                info.end_forward()
            groups.add(self.map.group_of_info(info))
        for chunk_id in dict.fromkeys(cid for info in infos for cid in info.chunk_ids):
            chunk = self.map.chunks[chunk_id]
            if self.map.is_owned(chunk):
                self.placement.after_use(chunk)
        if self.comm.world_size == 1:
            self._let_go()
            return
        saved = self.run.saves_for_backward()  # a backward will read it; a no-grad forward releases
        for group in sorted(groups):
            if self.groups[group].use_over():
                if saved:
                    self.residency.keep_or_release(group)
                else:
                    self.residency.release(group)

    # ---- tied weights between backward uses ------------------------------------------
    def backward_use_over(self, infos: list[TensorInfo]) -> None:
        """A module's backward is over: its tensors that still wait for a gradient (tied to a module
        that backward reaches later) stop being used, and a group whose tensors all wait may go;
        see [Note: tied weights between backward uses]."""
        groups = set()
        for info in infos:
            self._backward_users[info] = max(0, self._backward_users.get(info, 0) - 1)
            if info.state is _S.COMPUTE and self._backward_users[info] == 0:
                info.end_backward_use()
                groups.add(self.map.group_of_info(info))
        if self.comm.world_size == 1:
            self._let_go()
            return
        for group in sorted(groups):
            if self.residency.is_present(group) and self.groups[group].use_over():
                self.residency.keep_or_release(group)

    def reap_reductions(self) -> None:
        """Reduce-scatters that have finished give their buffers back now (see memory/reductions.py)."""
        self._reductions.reap()

    def _let_go(self, keep: int | None = None) -> None:
        """With one rank, the frozen chunks brought from disk beyond the most recent ``keep`` go where their
        use is over (see [Note: frozen chunks on disk]); with more, they go when their group is released."""
        if self.store.disk is None:
            return
        for chunk in self.store.disk.surplus(keep):
            self.groups[self.map.group_of(chunk)].let_go(chunk)

    def grads_only(self, infos: list[TensorInfo]) -> bool:
        """Whether ``infos``' gradients can go to slots without their values being made ready: every
        group of theirs is gathered (kept: its slots are there), or released and holding nothing
        else (its slots are then zeroed, not gathered, when the first gradient arrives, see
        :meth:`GradientSink.take_grad`)."""
        if self.comm.world_size == 1:
            return False
        mine = set(infos)
        groups = {self.map.group_of_info(info) for info in infos}
        return all(self.residency.is_present(g) or set(self.groups[g].tensors) <= mine for g in groups)

    # ---- gradients and the step -------------------------------------------------------
    def take_grad(self, info: TensorInfo, grad: torch.Tensor, boundary: bool) -> None:
        self.grads.take_grad(info, grad, boundary)

    def end_forward(self) -> None:
        """The root module's forward is over: the ranks agree they all are here (see [Note: ranks in lockstep])."""
        self.comm.agreement.check("the end of a forward")

    def end_backward(self, boundary: bool) -> None:
        """The backward epilogue: the ranks agree they all are here, the leaf modules' gradients not
        handed over yet go (see [Note: leaf modules]), frozen tensors whose backward use no post-backward
        ended are done (see [Note: frozen chunks]; at the boundary no frozen group stays gathered through
        the step), then every group's gradients."""
        self.comm.agreement.check("the end of a backward")
        self._backward_users.clear()
        self._forward_users.clear()
        self.leaves.end_backward(boundary)
        for info in self.map.infos():
            if not info.trainable and info.state in (_S.COMPUTE, _S.HOLD_AFTER_FWD):
                info.settle()
        if boundary and self.comm.world_size > 1:
            for group in self.groups:
                if not group.owned.trainable and group.present:
                    self.residency.release(group.index)
        if self.comm.world_size == 1:
            self._let_go(keep=0)
        self.grads.end_backward(boundary)

    def grads_ready(self) -> bool:
        return self.grads.grads_ready()

    def finish_accumulation(self) -> None:
        """See [Note: unmanaged gradient accumulation]."""
        if not self.grads.has_accumulated():
            raise RuntimeError(
                "engine.step() with managed_gradient_accumulation false and no backward since the last step: "
                "call engine.backward(loss) at least once before step()"
            )
        self.grads.finish_accumulation()

    def accumulation_begins(self) -> None:
        """A backward before the boundary: see [Note: accumulation begun by the caller] in groups/grads.py."""
        if self.grads.accumulate:
            return
        logger.info(
            "ds_patrickstar: a backward before the gradient accumulation boundary with gradient_accumulation_steps "
            "1: gradients accumulate in fp32 from now on (4 bytes per owned parameter while they do), and placement "
            "plans its next step anew"
        )
        for group in self.groups:
            group.nbytes = self.map.group_bytes(group.index, accumulate=True)
        if self.plan is not None:
            self.plan.resize([group.nbytes for group in self.groups])
        self.grads.accumulation_begins()
        self.placement.accumulation_begins(lambda trace: chunk_needs(trace, self.map, accumulate=True))

    def owned_grad_norm_sq(self, comm_device: torch.device) -> torch.Tensor:
        return self.grads.owned_grad_norm_sq(comm_device)

    def finish_step(self) -> None:
        """Slots hold parameters again (the step or a restore wrote them); accumulators go; no other
        rank's chunk stays gathered across a step (its values are stale now)."""
        self._reductions.drain()
        self.residency.release_all()
        if self.store.disk is not None:
            self.store.disk.next_step()
        self.comm.trim()
        self.residency.order.next_step()
        if self.plan is not None:
            self.plan.agree()  # see [Note: agreed gather plan]
        self.comm.agreement.next_step()  # see [Note: lockstep modes]
        for group in self.groups:
            group.finalize()
        self.grads.next_step()
        self.persistent.gather()

    def abort_iteration(self) -> None:
        """A backward raised: the iteration's uses, reduce-scatters and gradients go (the owned slots get
        their values from the masters afterwards; :meth:`finish_step` follows); see [Note: a backward that raised]."""
        self._backward_users.clear()
        self._forward_users.clear()
        self.leaves.abort()
        for info in self.map.infos():
            if info.state in (_S.COMPUTE, _S.HOLD_AFTER_FWD):
                info.settle()
        self._reductions.drain()
        if self.grads.accumulate and self.grads.has_accumulated():
            logger.warning(
                "ds_patrickstar: a backward raised; the gradients accumulated this step (earlier micro-steps "
                "included) are discarded and the step starts again at the next forward"
            )
        self.grads.next_step()

    def empty_cache(self) -> None:
        """``engine.empty_partition_cache()``: every gathered group (kept for a next use or prefetched) but the
        persistent ones lets the other ranks' chunks go, and frozen chunks read from disk go back; the owned chunks
        stay where placement put them (see [Note: the partition cache])."""
        self._reductions.drain()
        for group in range(len(self.groups)):
            if group not in self.persistent:  # they stay, as stock's persistent parameters do
                self.residency.release(group)
        self._let_go(keep=0)
        self.persistent.gather()

    def release_all_groups(self) -> None:
        """Values changed between steps (a load, a write inside ``GatheredParameters``): no group stays gathered
        with its old ones; the persistent groups are gathered again with the new."""
        self.residency.release_all()
        self.persistent.gather()
