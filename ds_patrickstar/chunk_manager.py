"""The chunk manager: packs parameters into chunks, owns their metadata, moves their states.

[Note: chunk layout]
Each optimizer param group gets its own list of chunks (so one chunk has one set of
Adam hyper-parameters), filled in the order the group lists its parameters, which for
``model.parameters()`` is registration order and so close to the order of use. Placement is
first fit among the 64 most recent chunks (see :func:`_plan_group`); offsets are aligned to :data:`ALIGN` elements. A
chunk holds at most ``chunk_size`` elements and is allocated as large as its contents
need (so the last chunk of a group wastes nothing); a tensor larger than ``chunk_size``
gets a chunk of its own sized to fit it. With data parallelism all chunks of a chunk
group share the largest member's size, since a collective needs equal sizes. The list is padded with empty chunks to
a multiple of the data-parallel world size (see [Note: chunk groups]). For every owned
chunk there are three fp32 tensors of the same capacity and layout (master, momentum,
variance) in :class:`OptimizerChunk`.

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
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Iterable

import torch

from .chunk import Chunk, TensorInfo, TensorState
from .comm import ChunkComm

logger = logging.getLogger(__name__)

ALIGN = 32
_NORM_SLICE = 1 << 22
_FIRST_FIT_WINDOW = 64
_S = TensorState


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(eq=False)
class ChunkSpec:
    """One planned chunk: its size and what goes where, before any memory is allocated."""

    group_index: int
    capacity: int
    dtype: torch.dtype
    members: list[tuple[str, torch.nn.Parameter, int]] = field(default_factory=list)  # (name, param, offset)


def _plan_group(named: list[tuple[str, torch.nn.Parameter]], chunk_size: int) -> list[list[tuple]]:
    """Split one param group into chunks: a list of [(name, param, offset), ...] per chunk.

    First fit, in order: a tensor goes into the first chunk with room left, else opens a new
    one, so a layer's biases and norms fill the gaps its matrices leave instead of each
    starting a mostly empty chunk. A tensor larger than a chunk gets a chunk of its own.
    """
    plans: list[list[tuple]] = []
    fill: list[int] = []  # elements used in each plan
    for name, param in named:
        numel = param.numel()
        if numel > chunk_size:
            logger.info("ds_patrickstar: %s has %d elements > chunk_size=%d; it gets a chunk of its own",
                        name, numel, chunk_size)
            plans.append([(name, param, 0)])
            fill.append(chunk_size)
            continue
        # first fit among the most recent chunks (older ones are nearly always full): linear, not quadratic
        recent = range(max(0, len(fill) - _FIRST_FIT_WINDOW), len(fill))
        index = next((i for i in recent if _align(fill[i]) + numel <= chunk_size), None)
        if index is None:
            plans.append([])
            fill.append(0)
            index = len(plans) - 1
        offset = _align(fill[index])
        plans[index].append((name, param, offset))
        fill[index] = offset + numel
    return plans


def plan_chunks(named_groups: list[list[tuple[str, torch.nn.Parameter]]], chunk_size: int,
                world_size: int) -> list[ChunkSpec]:
    """The chunk layout of every param group, padded to chunk groups of ``world_size``; see
    [Note: chunk layout]."""
    specs: list[ChunkSpec] = []
    for group_index, named in enumerate(named_groups):
        plans = _plan_group(named, chunk_size)
        plans += [[] for _ in range(-len(plans) % world_size)]
        dtype = named[0][1].dtype if named else torch.float32
        for start in range(0, len(plans), world_size):
            members = plans[start:start + world_size]
            # A chunk is as large as its contents need, at most chunk_size unless a single
            # tensor is larger; the members of a group share one size for the collectives.
            capacity = max([ALIGN] + [_align(o + p.numel()) for plan in members for _, p, o in plan])
            specs += [ChunkSpec(group_index, capacity, plan[0][1].dtype if plan else dtype, plan) for plan in members]
    return specs


class ChunkManager:
    """Owns chunks and every :class:`TensorInfo`; moves tensor states; see [Note: chunk layout]."""

    def __init__(self, specs: list[ChunkSpec], chunk_size: int, accumulate: bool, comm: ChunkComm,
                 store, deferred=None) -> None:
        self.chunk_size = chunk_size
        self._deferred = deferred  # a DeferredModel: its parameters have no values to copy (see init.py)
        self.accumulate = accumulate
        self.comm = comm
        self.store = store
        self.chunks: list[Chunk] = []
        self._infos: dict[torch.nn.Parameter, TensorInfo] = {}
        for spec in specs:
            self._build_chunk(spec)
        self._present = {g for g in range(self.num_groups)
                         if all(c.is_materialized for c in self.group_members(g))}
        self._reduced: set[int] = set()
        self._pending = self._group_sizes()  # per group: tensors whose gradient is not in its slot yet
        self.placement = None  # a PlacementRuntime once attach_placement() is called
        logger.info("ds_patrickstar: %d params in %d chunks (chunk_size=%d elements, %d rank(s))",
                    len(self._infos), len(self.chunks), chunk_size, comm.world_size)

    # ---- construction -------------------------------------------------------------
    def _build_chunk(self, spec: ChunkSpec) -> None:
        chunk = Chunk(len(self.chunks), spec.capacity, spec.dtype, spec.group_index)
        self.chunks.append(chunk)
        owned = self.is_owned(chunk)
        self.store.create(chunk, owned)
        for name, param, offset in spec.members:
            info = TensorInfo(name, param, chunk.chunk_id, offset, param.numel(), param.shape, spec.group_index)
            chunk.append(info)
            self._infos[param] = info
            self._bind(chunk, info, owned and not (self._deferred and self._deferred.is_deferred(param)))
        self.store.settle(chunk, owned)

    @staticmethod
    @torch.no_grad()
    def _bind(chunk: Chunk, info: TensorInfo, copy: bool) -> None:
        """The parameter becomes a view of the chunk payload; its values go into the chunk (on the
        host with placement) when ``copy`` (an owned chunk, a parameter that has values: see
        [Note: deferred init]), and its own storage is dropped."""
        if info.param.dtype != chunk.dtype:
            raise ValueError(f"parameter {info.name} has dtype {info.param.dtype} but its param group's chunks "
                             f"hold {chunk.dtype}; put parameters of different dtypes in different param groups")
        if copy:
            chunk.ready()[info.offset:info.end].copy_(info.param.data.reshape(-1))
        info.param.data = chunk.view_of(info)

    # ---- lookup -------------------------------------------------------------------
    @property
    def num_groups(self) -> int:
        return len(self.chunks) // self.comm.world_size

    def info(self, param: torch.Tensor) -> TensorInfo | None:
        return self._infos.get(param)

    def infos(self) -> list[TensorInfo]:
        return list(self._infos.values())

    def chunk_of(self, info: TensorInfo) -> Chunk:
        return self.chunks[info.chunk_id]

    def is_owned(self, chunk: Chunk) -> bool:
        return self.comm.owner(chunk.chunk_id) == self.comm.rank

    def owned_chunks(self) -> list[Chunk]:
        return [c for c in self.chunks if self.is_owned(c)]

    def group_members(self, group: int) -> list[Chunk]:
        world = self.comm.world_size
        return self.chunks[group * world:(group + 1) * world]

    def group_of(self, chunk: Chunk) -> int:
        return chunk.chunk_id // self.comm.world_size

    def _group_tensors(self, group: int) -> Iterable[TensorInfo]:
        for chunk in self.group_members(group):
            yield from chunk.tensors

    def _group_sizes(self) -> list[int]:
        return [sum(len(c.tensors) for c in self.group_members(g)) for g in range(self.num_groups)]

    def attach_placement(self, runtime) -> None:
        """From now on chunks move between accelerator and host (see [Note: placement])."""
        self.placement = runtime

    def _bring(self, chunk: Chunk, keep: set[int]) -> None:
        if self.placement is not None:
            self.placement.bring(chunk, keep)

    # ---- materialize and release (see [Note: chunk groups]) ------------------------
    # Whether a group is present is decided from tensor states, which every rank moves
    # identically, so every rank enters the same collectives in the same order.
    def _gather_group(self, group: int, fill: bool = True, keep: frozenset[int] = frozenset()) -> None:
        members = self.group_members(group)
        keep = set(keep) | {c.chunk_id for c in members}
        if self.placement is not None:  # room for the whole group at once: the owned chunk and the others
            self.placement.make_room(sum(c.nbytes + c.acc_nbytes for c in members
                                         if not c.is_materialized or c.on_host), keep)
        for chunk in members:
            if self.is_owned(chunk):
                self._bring(chunk, keep)
                # Symmetric with the other ranks' copies, which come back FREE -> HOLD: a tensor of the
                # owned chunk used earlier in this forward starts over too. Otherwise "every tensor of
                # the group used in this forward" (the release test) differs between ranks and their
                # collectives diverge (a tied weight re-gathering a group after its release).
                for info in chunk.tensors:
                    if info.state is _S.HOLD_AFTER_FWD:
                        info.transition(_S.HOLD)
            self.store.materialize(chunk)
        payloads = [c.ready() for c in members]
        if fill:
            self.comm.all_gather(payloads)
        else:
            for chunk, payload in zip(members, payloads):
                if not self.is_owned(chunk):
                    payload.zero_()
        self._present.add(group)

    def _release_group(self, group: int) -> None:
        if self.comm.world_size == 1 or group not in self._present:
            return
        for chunk in self.group_members(group):
            if not self.is_owned(chunk):
                self.store.release(chunk)
        self._present.discard(group)

    def access(self, infos: list[TensorInfo], label: str = "") -> None:
        """A moment: make the chunks of ``infos`` present on the accelerator, mark the tensors
        ``COMPUTE``, and (with placement) check the budget and prefetch the next moment."""
        ids = tuple(dict.fromkeys(info.chunk_id for info in infos))
        if self.placement is not None:
            self.placement.begin_moment(label, ids)
        keep = frozenset(ids)
        for chunk_id in ids:
            chunk = self.chunks[chunk_id]
            group = self.group_of(chunk)
            if group not in self._present:
                self._gather_group(group, keep=keep)
            else:
                self._bring(chunk, set(keep))
            if chunk.prefetched:
                chunk.prefetched = False
                self.comm.counters.prefetch_hits += 1
            chunk.wait_pending()  # the compute that follows reads the payload through the views
        for info in infos:
            info.start_compute()
        if self.placement is not None:
            self.placement.end_moment(set(keep))

    def after_forward(self, infos: list[TensorInfo]) -> None:
        groups = set()
        for info in infos:
            if info.state is _S.COMPUTE:
                info.end_forward()
            groups.add(self.group_of(self.chunk_of(info)))
        if self.placement is not None:
            for chunk_id in dict.fromkeys(info.chunk_id for info in infos):
                chunk = self.chunks[chunk_id]
                if self.is_owned(chunk):
                    self.placement.after_use(chunk)
        if self.comm.world_size == 1:
            return
        for group in sorted(groups):
            if all(t.state is _S.HOLD_AFTER_FWD for t in self._group_tensors(group)):
                self._release_group(group)

    # ---- gradients ----------------------------------------------------------------
    @torch.no_grad()
    def take_grad(self, info: TensorInfo, grad: torch.Tensor, boundary: bool) -> None:
        """Consume ``param.grad`` into the chunk on the accelerator; see [Note: gradient accumulation]."""
        chunk = self.chunk_of(info)
        self._bring(chunk, {chunk.chunk_id})  # a gradient is never written through a host round trip
        flat = grad.reshape(-1)
        if not self.accumulate:
            if not boundary:
                raise RuntimeError("a non-boundary micro-step without gradient accumulation")
            chunk.ready()[info.offset:info.end].copy_(flat)
        else:
            if chunk.acc is None and chunk.acc_host is None and self.placement is not None:
                self.placement.make_room(chunk.acc_nbytes or 4 * chunk.capacity, {chunk.chunk_id})
            acc_slot = self.store.accumulator(chunk)[info.offset:info.end]
            acc_slot.add_(flat.to(acc_slot.dtype))
            if not boundary:
                info.settle()
                return
            chunk.ready()[info.offset:info.end].copy_(acc_slot)
        info.grad_written()
        group = self.group_of(chunk)
        self._pending[group] -= 1
        if self._pending[group] == 0:  # the group's last gradient: O(1) per parameter, not a scan
            self._reduce_group(group)

    def _reduce_group(self, group: int) -> None:
        members = self.group_members(group)
        if self.comm.world_size > 1:
            for chunk in members:
                if self.is_owned(chunk):
                    self._bring(chunk, {c.chunk_id for c in members})
        self.comm.reduce_scatter_mean([c.ready() for c in members])
        self._release_group(group)
        self._reduced.add(group)

    @torch.no_grad()
    def end_backward(self, boundary: bool) -> None:
        """Backward epilogue: at the boundary every group gets its gradients and is reduced."""
        if not boundary:
            for info in self._infos.values():
                if info.state in (_S.COMPUTE, _S.HOLD_AFTER_FWD):
                    info.settle()
            for group in range(self.num_groups):
                self._release_group(group)
            return
        for group in range(self.num_groups):
            if group in self._reduced:
                continue
            if group not in self._present:
                self._gather_group(group, fill=False)  # every slot is about to be overwritten
            for chunk in self.group_members(group):
                self._fill_missing_grads(chunk)
            self._reduce_group(group)

    def _fill_missing_grads(self, chunk: Chunk) -> None:
        missing = [info for info in chunk.tensors if info.state is not _S.HOLD_AFTER_BWD]
        if not missing:
            return
        data, acc = chunk.ready(), chunk.ready_acc()
        for info in missing:
            slot = data[info.offset:info.end]
            if acc is None:
                slot.zero_()
            else:
                slot.copy_(acc[info.offset:info.end])
            info.grad_written()
            self._pending[self.group_of(chunk)] -= 1

    def grads_ready(self) -> bool:
        return len(self._reduced) == self.num_groups

    # ---- after the step -----------------------------------------------------------
    def finish_step(self) -> None:
        """Slots hold parameters again (the step or a restore wrote them); accumulators go."""
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
