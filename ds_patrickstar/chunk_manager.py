"""The chunk manager: packs parameters into chunks, owns their metadata, moves their states.

[Note: gradient accumulation]
With GA = 1 a gradient goes straight into its parameter slot
(see [Note: gradient in the param slot]). With GA > 1 the parameters must survive until
the last micro-step, so every micro-step adds its gradient into an fp32 accumulator
(one per chunk that received a gradient, on every rank) instead; on the boundary
micro-step the accumulated sum is written into the slot, rounded to the param dtype
once (the precision a GA = 1 gradient has). Accumulators exist only from a chunk's first
non-boundary gradient to the end of the step, and follow their chunk between the
accelerator and the host (see [Note: chunk locations]). Cost: 4 more bytes per parameter
(18 instead of 14 in fp16/bf16) during accumulation, paid only when GA > 1.

[Note: kept groups]
Releasing a chunk group after its last forward use and gathering it again for backward
doubles the all-gather volume. A group whose forward use is over is therefore *kept*
gathered (its tensors stay ``HOLD_AFTER_FWD``) while the kept bytes (other ranks' chunks)
stay within ``keep_gathered``; over the limit the oldest kept group is released, so the
groups kept are the last ones of the forward pass, which are the first ones backward needs.
Between gradient-accumulation micro-steps the gathered groups are kept the same way for the
next forward. Without a limit (the default) every group is gathered once per micro-step, as
in ZeRO-3 with its default ``stage3_max_live_parameters``/``stage3_max_reuse_distance``,
and each rank holds the whole low-precision model during the step. With placement, the
kept chunks are charged to the device ledger like any gathered chunk, and a group is kept only
when the budget holds it next to the highest tide the trace plans for the rest of the
iteration and one more gathered group (``PlacementRuntime.can_keep``), on *every* rank
(``ChunkComm.agree``, a one-integer all-reduce): which groups are gathered decides which
collectives run, so the decision must be the same everywhere, and a kept group is never
released on one rank alone. The same holds for a prefetch under placement. Under pressure,
placement first completes the reduce-scatters in flight (``PlacementRuntime.drain_reductions``),
which release other ranks' chunks.
A no-grad forward (evaluation) keeps nothing. After the reduce-scatter, and at every step,
no other rank's chunk stays gathered (its values would be stale after the update).

[Note: tied weights between backward uses]
A weight held by two modules (GPT's token embedding and LM head) gets its gradient only after
the last backward use, so its group, with the gradient slots it will receive, would stay gathered
from the LM head's backward to the embedding's: the whole backward pass. A module holding such
a weight therefore gets a post-backward hook (:mod:`ds_patrickstar.hooks`); when the module's
backward is over and no other backward use of the tensor is under way (uses are counted from
each backward access, recomputations included, and a use counts as over only when its
post-backward says so), the tensor goes back to ``HOLD_AFTER_FWD`` and its group is treated as
after a forward use: kept within ``keep_gathered``, released above it, gathered again at the
next use. A dense ``nn.Embedding`` reads no weight values in backward, so its backward makes none
ready (:meth:`ChunkManager.grads_only`): a kept group is not joined again, and a released group
that holds only its tensors is not gathered, the gradient's arrival giving it zeroed slots
instead (:meth:`ChunkManager.take_grad`). With ``keep_gathered: 0`` the tied weight is gathered
three times per step (embedding and LM head forward, LM head backward) and held gathered only
while used.

[Note: straddling tensors]
With data parallelism a chunk group is one flat sequence cut into ``W`` equal members (see
[Note: balanced chunk groups]), so a tensor may have pieces in two or more members of its
group, each owned by another rank. Everything that works on chunk elements (the all-gather,
the gradient slots and the reduce-scatter, the fp32 masters and Adam, the gradient norm,
checkpoints) works on pieces and needs nothing else. Only the module needs the tensor whole
and contiguous: such a parameter is a view of its own *joined* buffer (charged to the device
ledger like a chunk, storage resized to zero while it is not needed). The buffer gets memory when
its group is all-gathered and is filled from the pieces at the tensor's first use after the gather
has completed (:meth:`ChunkManager._join`); it is freed with the group, and also when the group is
*kept* between uses (see [Note: kept groups]): the pieces stay gathered, and the next use gets the
buffer back and fills it again from them (a local copy, no communication), so a rank holding
every group gathered does not also hold a second copy of every straddling tensor. Autograd's
saved views of the parameter stay valid across the free (its storage is resized, not replaced). Its
gradient is copied piece by piece into the slots, as any gradient is copied into its slot. At
most ``W - 1`` tensors per group straddle, so the extra memory is a few tensors while gathered.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from .chunk import Chunk, Piece, TensorInfo, TensorState
from .comm import ChunkComm
from .gather_order import GatherOrder
from .hooks import inside_backward
from .layout import ALIGN, ChunkSpec, _plan_group, plan_chunks  # noqa: F401  (re-exported)

logger = logging.getLogger(__name__)

_NORM_SLICE = 1 << 22
_REDUCES_IN_FLIGHT = 2
_S = TensorState


class ChunkManager:
    """Owns chunks and every :class:`TensorInfo`; moves tensor states; see [Note: chunk layout]."""

    def __init__(self, specs: list[ChunkSpec], chunk_size: int, accumulate: bool, comm: ChunkComm,
                 store, deferred=None, keep_gathered: int | None = None, prefetch_groups: int = 1) -> None:
        self.chunk_size = chunk_size
        self._deferred = deferred  # a DeferredModel: its parameters have no values to copy (see init.py)
        self.accumulate = accumulate
        self.comm = comm
        self.store = store
        self.chunks: list[Chunk] = []
        self._infos: dict[torch.nn.Parameter, TensorInfo] = {}
        world = comm.world_size
        for first in range(0, len(specs), world):
            self._build_group(specs[first:first + world])
        self._present = {g for g in range(self.num_groups)
                         if all(c.is_materialized for c in self.group_members(g))}
        self._reduced: set[int] = set()
        self._pending = self._group_sizes()  # per group: tensors whose gradient is not in its slot yet
        self.placement = None  # a PlacementRuntime once attach_placement() is called
        self.keep_limit = keep_gathered  # bytes of kept groups; None: as many as memory holds
        self.prefetch_groups = prefetch_groups
        self._kept: dict[int, int] = {}  # kept group -> bytes of its other ranks' chunks, oldest first
        self._fresh: set[int] = set()  # gathered (maybe still in flight) and not used since
        self._prefetched: set[int] = set()  # gathered ahead of use and not used since
        self._reducing: list = []  # reduce-scatters in flight, oldest first
        self._unjoined: set[TensorInfo] = set()  # straddling tensors gathered but not joined yet
        self._backward_users: dict[TensorInfo, int] = {}  # backward uses begun and not over, this backward
        self.order = GatherOrder()
        self._largest_group_bytes = max([0] + [c.nbytes for c in self.chunks]) * comm.world_size
        logger.info("ds_patrickstar: %d params in %d chunks (chunk_size=%d elements, %d rank(s))",
                    len(self._infos), len(self.chunks), chunk_size, comm.world_size)

    # ---- construction -------------------------------------------------------------
    def _build_group(self, specs: list[ChunkSpec]) -> None:
        """Create one chunk group, bind its tensors and let go of what this rank does not keep: one
        group's payloads at a time beside the model (initialize never doubles model memory)."""
        members = []
        for spec in specs:
            chunk = Chunk(len(self.chunks), spec.capacity, spec.dtype, spec.group_index)
            self.chunks.append(chunk)
            self.store.create(chunk, self.is_owned(chunk))
            members.append(chunk)
        infos: dict[torch.nn.Parameter, TensorInfo] = {}
        for chunk, spec in zip(members, specs):
            for name, param, offset, start, numel in spec.members:
                info = infos.get(param)
                if info is None:
                    info = infos[param] = TensorInfo(name, param, [], param.numel(), param.shape, spec.group_index)
                piece = Piece(chunk.chunk_id, offset, start, numel)
                info.pieces.append(piece)
                chunk.append(info, piece)
        for param, info in infos.items():
            self._infos[param] = info
            self._bind(info, not (self._deferred and self._deferred.is_deferred(param)))
        for chunk in members:
            self.store.settle(chunk, self.is_owned(chunk))

    @torch.no_grad()
    def _bind(self, info: TensorInfo, has_values: bool) -> None:
        """The parameter becomes a view of its chunk payload (of its joined buffer when it straddles
        chunks); its values go into the owned pieces (on the host with placement) when it
        ``has_values`` (see [Note: deferred init]), and its own storage is dropped."""
        chunk = self.chunks[info.pieces[0].chunk_id]
        if info.param.dtype != chunk.dtype:
            raise ValueError(f"parameter {info.name} has dtype {info.param.dtype} but its param group's chunks "
                             f"hold {chunk.dtype}; put parameters of different dtypes in different param groups")
        if has_values:
            self.write_pieces(info, info.param.data.reshape(-1), lambda c: c.ready())
        if info.straddles:
            info.joined = self.store.accel.empty(info.numel, chunk.dtype, "chunk", f"{info.name} (joined)")
            info.param.data = info.joined.view(info.shape)
            self.store.accel.free(info.joined, "chunk")
        else:
            info.param.data = chunk.view_of(info)

    def write_pieces(self, info: TensorInfo, flat: torch.Tensor, target) -> None:
        """``flat`` (the whole flattened parameter) into ``target(chunk)`` of every owned chunk
        holding a piece of ``info``."""
        for piece in info.pieces:
            chunk = self.chunks[piece.chunk_id]
            if self.is_owned(chunk):
                target(chunk)[piece.in_chunk].copy_(flat[piece.in_param])

    def owns_any(self, info: TensorInfo) -> bool:
        return any(self.is_owned(self.chunks[cid]) for cid in info.chunk_ids)

    def model_storages(self) -> set[int]:
        """The storages model data lives in on the accelerator (payloads and joined buffers)."""
        tensors = [c.payload for c in self.chunks] + [i.joined for i in self._infos.values() if i.joined is not None]
        return {t.untyped_storage()._cdata for t in tensors}

    # ---- lookup -------------------------------------------------------------------
    @property
    def num_groups(self) -> int:
        return len(self.chunks) // self.comm.world_size

    def info(self, param: torch.Tensor) -> TensorInfo | None:
        return self._infos.get(param)

    def infos(self) -> list[TensorInfo]:
        return list(self._infos.values())

    def chunk_of(self, info: TensorInfo) -> Chunk:
        """The chunk of a tensor's first piece (all its pieces are in that chunk's group)."""
        return self.chunks[info.pieces[0].chunk_id]

    def is_owned(self, chunk: Chunk) -> bool:
        return self.comm.owner(chunk.chunk_id) == self.comm.rank

    def owned_chunks(self) -> list[Chunk]:
        return [c for c in self.chunks if self.is_owned(c)]

    def group_members(self, group: int) -> list[Chunk]:
        world = self.comm.world_size
        return self.chunks[group * world:(group + 1) * world]

    def group_of(self, chunk: Chunk) -> int:
        return chunk.chunk_id // self.comm.world_size

    def group_tensors(self, group: int) -> list[TensorInfo]:
        """Every tensor with a piece in ``group``, once, in layout order."""
        return list(dict.fromkeys(info for chunk in self.group_members(group) for info in chunk.tensors))

    def _joined(self, group: int) -> list[TensorInfo]:
        return [info for info in self.group_tensors(group) if info.straddles]

    def _group_sizes(self) -> list[int]:
        return [len(self.group_tensors(g)) for g in range(self.num_groups)]

    def attach_placement(self, runtime) -> None:
        """From now on chunks move between accelerator and host (see [Note: placement])."""
        self.placement = runtime
        runtime.drain_reductions = self._drain_reductions

    def _bring(self, chunk: Chunk, keep: set[int]) -> None:
        if self.placement is not None:
            self.placement.bring(chunk, keep)

    # ---- materialize and release (see [Note: chunk groups]) ------------------------
    # Whether a group is present is decided from tensor states, which every rank moves
    # identically, so every rank enters the same collectives in the same order.
    def _gather_bytes(self, group: int) -> int:
        """Accelerator bytes gathering ``group`` takes now: its chunks not there yet."""
        chunks = sum(c.nbytes + c.acc_nbytes for c in self.group_members(group) if not c.is_materialized or c.on_host)
        return chunks + sum(i.numel * i.joined.element_size() for i in self._joined(group)
                            if not i.joined.untyped_storage().nbytes())

    def _gather_group(self, group: int, fill: bool = True, keep: frozenset[int] = frozenset()) -> None:
        """Issue the all-gather of ``group`` (see [Note: asynchronous collectives]): its result is
        on every member's pending list, and waited on by whoever uses a member."""
        members = self.group_members(group)
        keep = set(keep) | {c.chunk_id for c in members}
        if self.placement is not None:  # room for the whole group at once: the owned chunk and the others
            self.placement.make_room(self._gather_bytes(group), keep)
        for chunk in members:
            if self.is_owned(chunk):
                self._bring(chunk, keep)
            self.store.materialize(chunk)
        payloads = [c.ready() for c in members]
        if fill:
            pending = self.comm.all_gather_async(payloads)
            for chunk in members:
                chunk.pending.append(pending)
            for info in self._joined(group):  # charged now, filled at first use (see _join)
                self.store.accel.materialize(info.joined, "chunk", f"{info.name} (joined)")
                self._unjoined.add(info)
        else:
            for chunk, payload in zip(members, payloads):
                if not self.is_owned(chunk):
                    payload.zero_()
        self._present.add(group)
        self._fresh.add(group)

    def _drop_joined(self, group: int) -> None:
        """The joined buffers of ``group``'s straddling tensors go; their values stay in the pieces."""
        for info in self._joined(group):
            if info.joined.untyped_storage().nbytes():
                self.store.accel.free(info.joined, "chunk")
            self._unjoined.discard(info)

    def _rejoin(self, info: TensorInfo, keep: frozenset[int]) -> None:
        """A straddling tensor of a kept group is about to be used: its joined buffer comes back
        (filled from the pieces by :meth:`_join`); see [Note: straddling tensors]."""
        if not info.straddles or info.joined.untyped_storage().nbytes():
            return
        if self.placement is not None:
            self.placement.make_room(info.numel * info.joined.element_size(), set(keep))
        self.store.accel.materialize(info.joined, "chunk", f"{info.name} (joined)")
        self._unjoined.add(info)

    def _release_group(self, group: int) -> None:
        if self.comm.world_size == 1 or group not in self._present:
            return
        self._drop_joined(group)
        for chunk in self.group_members(group):
            if not self.is_owned(chunk):
                self.store.release(chunk)  # waits for a collective still using the chunk
                continue
            # The other ranks' copies of these tensors go FREE and come back HOLD when the group is
            # gathered again; ours must read the same, or a later "all used in this forward" test
            # (after_forward) would differ between ranks and so would the collectives.
            for info in chunk.tensors:
                if info.state is _S.HOLD_AFTER_FWD:
                    info.settle()
        self._present.discard(group)
        self._kept.pop(group, None)
        self._fresh.discard(group)
        self._prefetched.discard(group)

    # ---- kept groups (see [Note: kept groups]) ---------------------------------------
    def _kept_bytes(self, group: int) -> int:
        return sum(c.nbytes for c in self.group_members(group) if not self.is_owned(c))

    def _keep(self, group: int) -> None:
        """Keep ``group`` gathered for its next use, releasing the oldest kept groups over the limit;
        with placement only when every rank's budget holds it for the rest of the iteration."""
        if self.keep_limit is not None and self._kept_bytes(group) > self.keep_limit:
            self._release_group(group)
            return
        if self.placement is not None:
            reserve = self._largest_group_bytes * self._groups_at_once_ahead()
            if not self.comm.agree(self.placement.can_keep(0, reserve)):
                self._release_group(group)
                return
        self._kept[group] = self._kept_bytes(group)
        self._drop_joined(group)  # a kept group keeps its pieces, not their joined copies
        while self.keep_limit is not None and sum(self._kept.values()) > self.keep_limit:
            self._release_group(next(iter(self._kept)))
        held = sum(self._kept.values())
        self.comm.counters.peak_kept_gathered_bytes = max(self.comm.counters.peak_kept_gathered_bytes, held)

    def _groups_at_once_ahead(self) -> int:
        """The most chunk groups one moment of the rest of the trace uses at once (room for them
        must stay beside the kept groups); 1 while tracing."""
        trace = self.placement.tracer.current_trace()
        if trace is None:
            return 1
        world = self.comm.world_size
        ahead = trace.moments[self.placement.moment + 1:]
        return max([1] + [len({chunk_id // world for chunk_id in m.chunks}) for m in ahead])

    def _drain_reductions(self) -> int:
        """Placement is short of room: finish the reduce-scatters in flight (each releases other
        ranks' chunks). Kept and prefetched groups stay: releasing one on this rank only would make
        this rank alone gather it again (see [Note: kept groups]). Returns how many were waited on."""
        waited = len(self._reducing)
        self._wait_reductions()
        return waited

    # ---- moments ------------------------------------------------------------------
    def _training(self) -> bool:
        return self.comm.world_size > 1 and (torch.is_grad_enabled() or inside_backward())

    def access(self, infos: list[TensorInfo], label: str = "") -> None:
        """A moment: make the chunks of ``infos`` present on the accelerator, mark the tensors
        ``COMPUTE``, and (with placement) check the budget and prefetch the next moment."""
        ids = tuple(dict.fromkeys(cid for info in infos for cid in info.chunk_ids))
        if self.placement is not None:
            self.placement.begin_moment(label, ids)
        keep = frozenset(ids)
        training = self._training()
        for chunk_id in ids:
            chunk = self.chunks[chunk_id]
            group = self.group_of(chunk)
            if group not in self._present:
                self._gather_group(group, keep=keep)
            else:
                self._bring(chunk, set(keep))
                if group in self._prefetched:
                    self._prefetched.discard(group)
                    self.comm.counters.prefetched_all_gather_hits += 1
            if group in self._fresh:
                self._fresh.discard(group)
                if training:
                    self.order.used(group)
            self._kept.pop(group, None)  # in use again: no longer a candidate for release
            if chunk.prefetched:
                chunk.prefetched = False
                self.comm.counters.prefetch_hits += 1
            self._wait_for_use(chunk)
        backward = inside_backward()  # a backward use, or a recomputation for one: not over before it says so
        for info in infos:
            self._rejoin(info, keep)
            self._join(info)
            info.start_compute()
            if backward:
                self._backward_users[info] = self._backward_users.get(info, 0) + 1
        if training:
            self._prefetch(keep)
        if self.placement is not None:
            self.placement.end_moment(set(keep))

    @torch.no_grad()
    def _join(self, info: TensorInfo) -> None:
        """Fill a straddling tensor's joined buffer from its pieces (once per gather of its group;
        the pieces' chunks are ready); see [Note: straddling tensors]."""
        if info not in self._unjoined:
            return
        self._unjoined.discard(info)
        for piece in info.pieces:
            info.joined[piece.in_param].copy_(self.chunks[piece.chunk_id].ready()[piece.in_chunk])

    @staticmethod
    def _wait_for_use(chunk: Chunk) -> None:
        """The compute that follows reads the payload through the views: every copy and
        collective into the chunk must be complete (see [Note: ready payload])."""
        chunk.wait_pending()

    def _prefetch(self, in_use: frozenset[int]) -> None:
        """Issue the all-gathers of the next groups in the gather order (see [Note: gather order])."""
        for group in self.order.ahead(self.prefetch_groups):
            if group in self._present or group in self._reduced:
                continue
            if self.placement is not None and not self.comm.agree(self.placement.can_prefetch(self._gather_bytes(group))):
                return
            self._gather_group(group, keep=in_use)
            self._prefetched.add(group)
            self.comm.counters.prefetched_all_gathers += 1

    def after_forward(self, infos: list[TensorInfo]) -> None:
        groups = set()
        for info in infos:
            if info.state is _S.COMPUTE:
                info.end_forward()
            groups.add(self.group_of(self.chunk_of(info)))
        if self.placement is not None:
            for chunk_id in dict.fromkeys(cid for info in infos for cid in info.chunk_ids):
                chunk = self.chunks[chunk_id]
                if self.is_owned(chunk):
                    self.placement.after_use(chunk)
        if self.comm.world_size == 1:
            return
        training = torch.is_grad_enabled()  # a backward will follow; a no-grad forward releases
        for group in sorted(groups):
            if all(t.state is _S.HOLD_AFTER_FWD for t in self.group_tensors(group)):
                if training:
                    self._keep(group)
                else:
                    self._release_group(group)

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
                groups.add(self.group_of(self.chunk_of(info)))
        if self.comm.world_size == 1:
            return
        for group in sorted(groups):
            if group in self._present and all(t.state is _S.HOLD_AFTER_FWD for t in self.group_tensors(group)):
                self._keep(group)

    def grads_only(self, infos: list[TensorInfo]) -> bool:
        """Whether ``infos``' gradients can go to slots without their values being made ready: every
        group of theirs is gathered (kept: its slots are there), or released and holding nothing
        else (its slots are then zeroed, not gathered, when the first gradient arrives, see
        :meth:`take_grad`)."""
        if self.comm.world_size == 1:
            return False
        mine = set(infos)
        groups = {self.group_of(self.chunk_of(info)) for info in infos}
        return all(g in self._present or set(self.group_tensors(g)) <= mine for g in groups)

    # ---- gradients ----------------------------------------------------------------
    @torch.no_grad()
    def take_grad(self, info: TensorInfo, grad: torch.Tensor, boundary: bool) -> None:
        """Consume ``param.grad`` into the tensor's pieces on the accelerator; see
        [Note: gradient accumulation]."""
        if not self.accumulate and not boundary:
            raise RuntimeError("a non-boundary micro-step without gradient accumulation")
        flat = grad.reshape(-1)
        keep = set(info.chunk_ids)
        group = self.group_of(self.chunk_of(info))
        if self.comm.world_size > 1 and group not in self._present:  # see grads_only()
            self._gather_group(group, fill=False)
        for piece in info.pieces:
            chunk = self.chunks[piece.chunk_id]
            self._bring(chunk, keep)  # a gradient is never written through a host round trip
            part = flat[piece.in_param]
            if self.accumulate:
                if chunk.acc is None and chunk.acc_host is None and self.placement is not None:
                    self.placement.make_room(chunk.acc_nbytes or 4 * chunk.capacity, keep)
                acc_slot = self.store.accumulator(chunk)[piece.in_chunk]
                acc_slot.add_(part.to(acc_slot.dtype))
                part = acc_slot
            if boundary:
                chunk.ready()[piece.in_chunk].copy_(part)
        if not boundary:
            info.settle()
            return
        info.grad_written()
        self._pending[group] -= 1
        if self._pending[group] == 0:  # the group's last gradient: O(1) per parameter, not a scan
            self._reduce_group(group)

    def _reduce_group(self, group: int) -> None:
        """Launch the reduce-scatter of ``group``'s gradients; the other ranks' chunks are released
        once it completes (see [Note: asynchronous collectives]). At most two are in flight."""
        members = self.group_members(group)
        self._reduced.add(group)
        self._kept.pop(group, None)
        if self.comm.world_size == 1:
            return
        keep = {c.chunk_id for c in members}
        for chunk in members:
            if self.is_owned(chunk):
                self._bring(chunk, keep)
        pending = self.comm.reduce_scatter_mean_async([c.ready() for c in members],
                                                      after=lambda: self._release_group(group))
        for chunk in members:
            chunk.pending.append(pending)
        self._reducing.append(pending)
        while len(self._reducing) > _REDUCES_IN_FLIGHT:
            self._reducing.pop(0).wait()

    def _wait_reductions(self) -> None:
        while self._reducing:
            self._reducing.pop(0).wait()

    @torch.no_grad()
    def end_backward(self, boundary: bool) -> None:
        """Backward epilogue: at the boundary every group gets its gradients and is reduced; before
        it, the gathered groups are kept for the next micro-step (see [Note: kept groups])."""
        self._backward_users.clear()
        if not boundary:
            for info in self._infos.values():
                if info.state in (_S.COMPUTE, _S.HOLD_AFTER_FWD):
                    info.settle()
            for group in sorted(self._present, reverse=True):  # the first groups of the forward stay longest
                self._keep(group)
            return
        for group in range(self.num_groups):
            if group in self._reduced:
                continue
            if group not in self._present:
                self._gather_group(group, fill=False)  # every slot is about to be overwritten
            self._fill_missing_grads(group)
            self._reduce_group(group)
        self._wait_reductions()

    def _fill_missing_grads(self, group: int) -> None:
        """Tensors of ``group`` that got no gradient this step get zero (or what they accumulated)."""
        for info in self.group_tensors(group):
            if info.state is _S.HOLD_AFTER_BWD:
                continue
            for piece in info.pieces:
                chunk = self.chunks[piece.chunk_id]
                data, acc = chunk.ready(), chunk.ready_acc()
                if acc is None:
                    data[piece.in_chunk].zero_()
                else:
                    data[piece.in_chunk].copy_(acc[piece.in_chunk])
            info.grad_written()
            self._pending[group] -= 1

    def grads_ready(self) -> bool:
        return len(self._reduced) == self.num_groups

    # ---- after the step -----------------------------------------------------------
    def finish_step(self) -> None:
        """Slots hold parameters again (the step or a restore wrote them); accumulators go; no other
        rank's chunk stays gathered across a step (its values are stale now)."""
        self._wait_reductions()
        self.release_all_groups()
        self.comm.trim()
        self.order.next_step()
        for chunk in self.chunks:
            self.store.drop_accumulator(chunk)
        self._next_step()

    def _next_step(self) -> None:
        """Every present tensor holds its parameter again; no group has gradients."""
        for info in self._infos.values():
            if info.state not in (_S.HOLD, _S.FREE):
                info.settle()
        self._reduced.clear()
        self._pending = self._group_sizes()

    def release_all_groups(self) -> None:
        for group in range(self.num_groups):
            self._release_group(group)

    def owned_grad_norm_sq(self, comm_device: torch.device) -> torch.Tensor:
        """Sum over ranks of the squared norms of the owned gradient slots (fp32), each read where
        it lives (accelerator or host) through :meth:`Chunk.ready`."""
        partial: dict[torch.device, torch.Tensor] = {}
        for chunk in self.owned_chunks():
            data = chunk.ready()[:chunk.used]
            sq = partial.setdefault(data.device, torch.zeros((), dtype=torch.float32, device=data.device))
            # in slices: the fp32 upcast of a whole large chunk would be a large temporary
            for part in data.split(_NORM_SLICE):
                sq += torch.linalg.vector_norm(part, dtype=torch.float32).square()
        total = torch.zeros((), dtype=torch.float32, device=comm_device)
        for sq in partial.values():
            total += sq.to(comm_device)
        return self.comm.all_reduce_sum(total)
