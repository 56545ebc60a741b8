"""The chunk manager: packs parameters into chunks, owns their metadata, moves their states.

[Note: chunk layout]
Each optimizer param group gets its own list of chunks (so one chunk has one set of
Adam hyper-parameters), filled in the order the group lists its parameters, which for
``model.parameters()`` is registration order and so close to the order of use. Placement is
first fit (see :func:`_plan_group`); offsets are aligned to :data:`ALIGN` elements. A
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
(one per chunk, on every rank) instead; on the boundary micro-step the accumulated sum
is written into the slot, rounded to the param dtype once (the precision a GA = 1
gradient has). Cost: 4 more bytes per parameter (18 instead of 14 in fp16/bf16), paid
only when GA > 1.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Iterable

import torch

from .chunk import Chunk, TensorInfo, TensorState
from .comm import ChunkComm

logger = logging.getLogger(__name__)

ALIGN = 32
_NORM_SLICE = 1 << 22
_S = TensorState


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(eq=False)
class OptimizerChunk:
    """fp32 master, momentum and variance aligned with one owned param chunk."""

    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor

    @classmethod
    def for_chunk(cls, chunk: Chunk, device: torch.device | None = None) -> "OptimizerChunk":
        master = chunk.payload.to(device or chunk.device, torch.float32, copy=True)
        return cls(master, torch.zeros_like(master), torch.zeros_like(master))

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.master, self.exp_avg, self.exp_avg_sq

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


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
        index = next((i for i, used in enumerate(fill) if _align(used) + numel <= chunk_size), None)
        if index is None:
            plans.append([])
            fill.append(0)
            index = len(plans) - 1
        offset = _align(fill[index])
        plans[index].append((name, param, offset))
        fill[index] = offset + numel
    return plans


class ChunkManager:
    """Owns chunks, optimizer chunks and every :class:`TensorInfo`; moves tensor states."""

    def __init__(self, named_groups: list[list[tuple[str, torch.nn.Parameter]]], chunk_size: int,
                 accumulate: bool, comm: ChunkComm, optim_device: torch.device | None = None) -> None:
        self.chunk_size = chunk_size
        self.comm = comm
        self.chunks: list[Chunk] = []
        self._infos: dict[torch.nn.Parameter, TensorInfo] = {}
        for group_index, named in enumerate(named_groups):
            self._build_group(group_index, named)
        # with placement on CUDA the optimizer states start on the host (optim_device)
        self.optim: dict[int, OptimizerChunk] = {c.chunk_id: OptimizerChunk.for_chunk(c, optim_device)
                                                 for c in self.owned_chunks()}
        self.grad_acc = [torch.zeros(c.capacity, dtype=torch.float32, device=c.device) if accumulate else None
                         for c in self.chunks]
        self._present = set(range(self.num_groups))  # groups whose every chunk is materialized
        for g in range(self.num_groups):
            self._release_group(g)
        self._reduced: set[int] = set()
        self._pending = self._group_sizes()  # per group: tensors whose gradient is not in its slot yet
        self.placement = None  # a PlacementRuntime once attach_placement() is called
        logger.info("ds_patrickstar: %d params in %d chunks (chunk_size=%d elements, %d rank(s))",
                    len(self._infos), len(self.chunks), chunk_size, comm.world_size)

    # ---- construction -------------------------------------------------------------
    def _build_group(self, group_index: int, named: list[tuple[str, torch.nn.Parameter]]) -> None:
        plans = _plan_group(named, self.chunk_size)
        world = self.comm.world_size
        plans += [[] for _ in range(-len(plans) % world)]
        like = named[0][1] if named else None
        for start in range(0, len(plans), world):
            members = plans[start:start + world]
            # A chunk is as large as its contents need, at most chunk_size unless a single
            # tensor is larger; the members of a group share one size for the collectives.
            capacity = max([ALIGN] + [_align(o + p.numel()) for plan in members for _, p, o in plan])
            for plan in members:
                dtype = plan[0][1].dtype if plan else like.dtype
                device = plan[0][1].device if plan else like.device
                chunk = Chunk(len(self.chunks), capacity, dtype, device, group_index)
                self.chunks.append(chunk)
                for name, param, offset in plan:
                    info = TensorInfo(name, param, chunk.chunk_id, offset, param.numel(), param.shape, group_index)
                    chunk.append(info)
                    self._infos[param] = info
                    self._bind(chunk, info)

    @staticmethod
    def _bind(chunk: Chunk, info: TensorInfo) -> None:
        if info.param.dtype != chunk.dtype:
            raise ValueError(f"parameter {info.name} has dtype {info.param.dtype} but its param group's chunks "
                             f"hold {chunk.dtype}; put parameters of different dtypes in different param groups")
        with torch.no_grad():
            chunk.view_of(info).copy_(info.param.data)
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

    def _group_of(self, chunk: Chunk) -> int:
        return chunk.chunk_id // self.comm.world_size

    def _group_tensors(self, group: int) -> Iterable[TensorInfo]:
        for chunk in self.group_members(group):
            yield from chunk.tensors

    def _group_sizes(self) -> list[int]:
        return [sum(len(c.tensors) for c in self.group_members(g)) for g in range(self.num_groups)]

    def attach_placement(self, runtime) -> None:
        """From now on chunks move between accelerator and host (see [Note: placement]);
        the owned chunks start on the host and come in when first used."""
        self.placement = runtime
        for chunk in self.owned_chunks():
            runtime.mover.to_host(chunk)

    def _bring(self, chunk: Chunk, keep: set[int]) -> None:
        if self.placement is not None:
            self.placement.bring(chunk, keep)

    # ---- materialize and release (see [Note: chunk groups]) ------------------------
    # Whether a group is present is decided from tensor states, which every rank moves
    # identically, so every rank enters the same collectives in the same order.
    def _gather_group(self, group: int, fill: bool = True, keep: frozenset[int] = frozenset()) -> None:
        members = self.group_members(group)
        keep = set(keep) | {c.chunk_id for c in members}
        if self.placement is not None:
            self.placement.make_room(sum(c.nbytes for c in members if not self.is_owned(c)), keep)
        for chunk in members:
            if self.is_owned(chunk):
                self._bring(chunk, keep)
                for info in chunk.tensors:  # the other ranks' copies went FREE -> HOLD: states stay equal
                    if info.state is _S.HOLD_AFTER_FWD:
                        info.settle()
            chunk.materialize()
        if fill:
            self.comm.all_gather([c.payload for c in members])
        else:
            for chunk in members:
                if not self.is_owned(chunk):
                    chunk.payload.zero_()
        self._present.add(group)

    def _release_group(self, group: int) -> None:
        if self.comm.world_size == 1 or group not in self._present:
            return
        for chunk in self.group_members(group):
            if not self.is_owned(chunk):
                chunk.release()
        self._present.discard(group)

    def gather_all(self) -> tuple[list[int], list[int]]:
        """Every parameter readable and writable through its view: gather every released group (a
        collective) and bring owned chunks from the host, past the placement budget for the
        moment. Returns what :meth:`release_groups` undoes."""
        missing = [g for g in range(self.num_groups) if g not in self._present]
        for group in missing:
            self._gather_group(group)
        moved = [c.chunk_id for c in self.owned_chunks() if c.on_host]
        for chunk_id in moved:
            self.placement.mover.to_device(self.chunks[chunk_id])
            self.placement.mover.wait(self.chunks[chunk_id])
        return missing, moved

    def release_groups(self, record: tuple[list[int], list[int]]) -> None:
        groups, moved = record
        for group in groups:
            self._release_group(group)
        for chunk_id in moved:
            self.placement.mover.to_host(self.chunks[chunk_id])

    def access(self, infos: list[TensorInfo], label: str = "") -> None:
        """A moment: make the chunks of ``infos`` present on the accelerator, mark the tensors
        ``COMPUTE``, and (with placement) check the budget and prefetch the next moment."""
        ids = tuple(dict.fromkeys(info.chunk_id for info in infos))
        if self.placement is not None:
            self.placement.begin_moment(label, ids)
        keep = frozenset(ids)
        for chunk_id in ids:
            chunk = self.chunks[chunk_id]
            group = self._group_of(chunk)
            if group not in self._present:
                self._gather_group(group, keep=keep)
            else:
                self._bring(chunk, set(keep))
            if chunk.prefetched:
                chunk.prefetched = False
                self.comm.counters.prefetch_hits += 1
        for info in infos:
            info.start_compute()
        if self.placement is not None:
            self.placement.end_moment(set(keep))

    def after_forward(self, infos: list[TensorInfo]) -> None:
        groups = set()
        for info in infos:
            if info.state is _S.COMPUTE:
                info.end_forward()
            groups.add(self._group_of(self.chunk_of(info)))
        if self.placement is not None:
            for chunk_id in dict.fromkeys(info.chunk_id for info in infos):
                self.placement.after_use(self.chunks[chunk_id])
        if self.comm.world_size == 1:
            return
        for group in sorted(groups):
            if all(t.state is _S.HOLD_AFTER_FWD for t in self._group_tensors(group)):
                self._release_group(group)

    # ---- gradients ----------------------------------------------------------------
    @torch.no_grad()
    def take_grad(self, info: TensorInfo, grad: torch.Tensor, boundary: bool) -> None:
        """Consume ``param.grad``; see [Note: gradient accumulation]."""
        chunk = self.chunk_of(info)
        slot = chunk.data[info.offset:info.end]
        acc = self.grad_acc[info.chunk_id]
        if acc is None:
            if not boundary:
                raise RuntimeError("a non-boundary micro-step without gradient accumulators")
            slot.copy_(grad.reshape(-1))
        else:
            acc_slot = acc[info.offset:info.end]
            acc_slot.add_(grad.reshape(-1).to(acc_slot.dtype))
            if not boundary:
                info.settle()
                return
            slot.copy_(acc_slot)
        info.grad_written()
        group = self._group_of(chunk)
        self._pending[group] -= 1
        if self._pending[group] == 0:  # the group's last gradient: O(1) per parameter, not a scan
            self._reduce_group(group)

    def _reduce_group(self, group: int) -> None:
        members = self.group_members(group)
        if self.comm.world_size > 1:
            for chunk in members:
                if self.is_owned(chunk):
                    self._bring(chunk, {c.chunk_id for c in members})
        self.comm.reduce_scatter_mean([c.payload for c in members])
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
        acc = self.grad_acc[chunk.chunk_id]
        for info in chunk.tensors:
            if info.state is _S.HOLD_AFTER_BWD:
                continue
            slot = chunk.data[info.offset:info.end]
            if acc is None:
                slot.zero_()
            else:
                slot.copy_(acc[info.offset:info.end])
            info.grad_written()
            self._pending[self._group_of(chunk)] -= 1

    def grads_ready(self) -> bool:
        return len(self._reduced) == self.num_groups

    # ---- after the step -----------------------------------------------------------
    @torch.no_grad()
    def finish_step(self, restore: bool) -> None:
        """Slots hold parameters again: the new ones, or (``restore``) the master's after an overflow."""
        for chunk in self.owned_chunks():
            if restore:
                chunk.data[:chunk.used].copy_(self.optim[chunk.chunk_id].master[:chunk.used])
        for acc in self.grad_acc:
            if acc is not None:
                acc.zero_()
        self._next_step()

    def _next_step(self) -> None:
        """Every present tensor holds its parameter again; no group has gradients."""
        for info in self._infos.values():
            if info.state not in (_S.HOLD, _S.FREE):
                info.settle()
        self._reduced.clear()
        self._pending = self._group_sizes()

    @torch.no_grad()
    def params_to_master(self) -> None:
        """After the parameters were overwritten (a module state_dict load): masters follow them."""
        for chunk in self.owned_chunks():
            self.optim[chunk.chunk_id].master[:chunk.used].copy_(chunk.data[:chunk.used])

    @torch.no_grad()
    def master_to_params(self) -> None:
        """After the masters were loaded: the owned slots get their values, other chunks are dropped."""
        for group in range(self.num_groups):
            self._release_group(group)
        for chunk in self.owned_chunks():
            chunk.data[:chunk.used].copy_(self.optim[chunk.chunk_id].master[:chunk.used])
        self._next_step()

    def owned_grad_norm_sq(self) -> torch.Tensor:
        """Sum over ranks of the squared norms of the owned gradient slots (fp32)."""
        chunks = self.owned_chunks()
        device = chunks[0].device if chunks else self.chunks[0].device
        sq = torch.zeros((), dtype=torch.float32, device=device)
        for chunk in chunks:
            # in slices: the fp32 upcast of a whole large chunk would be a large temporary
            for part in chunk.data[:chunk.used].split(_NORM_SLICE):
                sq += torch.linalg.vector_norm(part, dtype=torch.float32).square().to(device)
        return self.comm.all_reduce_sum(sq)

    # ---- accounting ---------------------------------------------------------------
    def model_data_bytes(self) -> int:
        """Bytes this rank holds now: materialized chunks, optimizer chunks, accumulators."""
        payload = sum(c.nbytes for c in self.chunks if c.is_materialized)
        payload += sum(c.host.numel() * c.host.element_size() for c in self.chunks if c.host is not None)
        acc = sum(a.numel() * a.element_size() for a in self.grad_acc if a is not None)
        return payload + self.optimizer_state_bytes() + acc

    def optimizer_state_bytes(self) -> int:
        return sum(o.nbytes for o in self.optim.values())
