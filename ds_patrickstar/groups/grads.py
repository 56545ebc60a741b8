"""The gradient sink: gradients into the chunk slots, their reduce-scatters, the backward epilogue
and the gradient norm.

[Note: gradient accumulation]
With GA = 1 a gradient goes straight into its parameter slot
(see [Note: gradient in the param slot]). With GA > 1 the parameters must survive until
the last micro-step, and the micro-steps' gradients are summed in fp32 accumulators, which
exist only from a chunk's first micro-step until the boundary has written their sum into the
slot (then they go at once, not at the step: an accumulator kept to the step would follow a
chunk evicted meanwhile to the host for nothing) and follow their chunk between the accelerator
and the host (see [Note: chunk locations]).

With one rank every micro-step adds its gradient into the accumulator of its chunk; on the
boundary micro-step the sum is written into the slot, rounded to the param dtype once.
Cost: 4 more bytes per parameter (18 instead of 14 in fp16/bf16) during accumulation.

With ``W`` ranks a rank keeps accumulators for its *owned* chunks only
(:class:`~ds_patrickstar.groups.accumulation.ScatteredAccumulation`), as FSDP2 keeps its sharded
fp32 gradients: before the boundary, a micro-step's gradients go into one flat buffer per chunk
group (param dtype, zeroed, charged to the ledger; the slots keep the parameters), which is
reduce-scattered in place (pre-divided by ``W``, see [Note: chunk groups]) once the group's
last gradient of the micro-step is in; the owner adds its piece to its accumulator and the
buffer is freed. At the end of every backward each group not reduced yet is (every rank reduces
every group once per micro-step, so the collectives match). On the boundary micro-step the
gradients go into the slots as with GA = 1, and after the slots' reduce-scatter the owner
adds its accumulator and writes the sum into its slot, rounded once: the optimizer reads the
slot as always. Cost per rank: 4 / ``W`` bytes per parameter during accumulation, plus the
buffers of the groups being filled or reduced (a few groups: backward completes them in
order, and the reduce-scatters in flight are bounded, see :mod:`~ds_patrickstar.memory.reductions`);
a group whose gradients are all in is kept or released at once (its joined copies go, see
[Note: kept groups]). Communication: every micro-step reduce-scatters the whole model, so the
reduce-scatter volume per step is GA times that of GA = 1, as in ZeRO-3, which reduce-scatters
at every micro-step too; all-gather volume is unchanged (groups are kept between micro-steps).
The alternative, local fp32 accumulators for every chunk a rank touches and one reduce-scatter
at the boundary, sends GA times less but costs 4 B/param instead of 4 / ``W``
(tests/test_ga_memory.py).

[Note: unmanaged gradient accumulation]
With DeepSpeed's ``managed_gradient_accumulation: false`` the caller owns the boundary: any number of
``backward`` calls, then ``engine.step()``, which is the boundary (stock ZeRO-3 reduce-scatters each backward's
gradients as produced and finalizes them in ``step()``). Here every backward is then a micro-step before the
boundary (the accumulators exist whatever ``gradient_accumulation_steps`` is), and ``step()`` first writes each
owned chunk's accumulated sum into its slot (:meth:`GradientSink.finish_accumulation`), rounded once, and drops the
accumulators (as the boundary micro-step's fold does), before the optimizer reads the slots as always; no gradient
is final before then, so none leaves during backward. A ``step()`` with no backward since the last one raises.

In host memory (a CPU run, where the buffers are the C heap's) the buffers of a micro-step are freed
between the accumulators it allocates, and glibc's heap keeps the pages of freed blocks below its mmap
threshold (32 MiB after initialize, see [Note: host heap]) resident: measured at 2 ranks on a 48M GPT,
1.4-1.6 B/param of resident memory beyond the accumulators into the boundary micro-step. So the end of
a micro-step's backward gives the heap's free pages back to the system (``malloc_trim``, a walk of the
heap's free blocks, :func:`~ds_patrickstar.memory.host_heap.release_free_pages`): GA 2 then costs each
rank the accumulators and about 0.7-0.8 B/param more than GA 1 (benchmarks/ga_memory.py,
docs/benchmarks.md).

[Note: accumulation begun by the caller]
With ``gradient_accumulation_steps`` 1 the run is built without accumulators (none of their bytes in the plans, the
move model in scope). A caller may still accumulate: ``engine.set_gradient_accumulation_boundary(False)`` before a
backward, as DeepSpeed documents, or several backward calls in ``engine.coalesce_grad_reduction()``. The first
backward outside the boundary begins accumulation for the rest of the run, on every rank alike (the boundary is the
caller's, the same on every rank as stock's reductions require): each chunk group's bytes count its accumulator and
flat buffer from then on, the agreed gather plan is dropped until the next step agrees one with the new sizes,
placement plans its next step anew from needs that count them, and the move model and what is built on it (the
step-time choice of states, gradients leaving in backward) end, as at ``gradient_accumulation_steps`` > 1. The
accumulators themselves are made when a micro-step first needs them, as always. One info line says so.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..chunks.chunk import Chunk, TensorInfo
from ..chunks.chunk_map import ChunkMap
from ..chunks.state import TensorState
from ..memory.reductions import InFlightReductions
from .accumulation import ScatteredAccumulation
from .comm import ChunkComm
from .grad_norm import GradientNorms
from .group import ChunkGroup
from .residency import GroupResidency

_S = TensorState


class GradientSink:
    """Where gradients go; see [Note: gradient in the param slot] and [Note: gradient accumulation]."""

    def __init__(
        self,
        chunk_map: ChunkMap,
        groups: list[ChunkGroup],
        comm: ChunkComm,
        residency: GroupResidency,
        reductions: InFlightReductions,
        accumulate: bool,
    ) -> None:
        self._map, self._groups, self._comm = chunk_map, groups, comm
        self._residency, self._reductions = residency, reductions
        self.accumulate = accumulate
        # GA > 1: a local fp32 accumulator per chunk with one rank, else reduce-scatters per micro-step
        self._scattered = (
            ScatteredAccumulation(chunk_map, groups, comm, reductions) if accumulate and comm.world_size > 1 else None
        )
        self.reduced: set[int] = set()  # groups whose reduce-scatter was issued this step
        self._pending = self._group_sizes()  # per group: tensors whose gradient is not in its slot yet
        # frozen groups get no gradient and are never reduced (see [Note: frozen chunks])
        self._trainable = [group.index for group in groups if group.owned.trainable]
        self.norms = GradientNorms()  # see [Note: the norm as gradients become final]

    def _group_sizes(self) -> list[int]:
        return [len(group.tensors) for group in self._groups]

    def accumulation_begins(self) -> None:
        """From now on gradients may accumulate (see [Note: accumulation begun by the caller])."""
        self.accumulate = True
        if self._comm.world_size > 1:
            self._scattered = ScatteredAccumulation(self._map, self._groups, self._comm, self._reductions)

    @torch.no_grad()
    def take_grad(self, info: TensorInfo, grad: torch.Tensor | None, boundary: bool) -> None:
        """Consume ``param.grad`` into the tensor's pieces on the accelerator; None: a zero gradient
        (a leaf module's tensor this rank did not use, see [Note: leaf modules])."""
        if not self.accumulate and not boundary:
            raise RuntimeError("a non-boundary micro-step without gradient accumulation")
        self._reductions.reap()
        flat = grad.reshape(-1) if grad is not None else None
        keep = set(info.chunk_ids)
        group = self._map.group_of_info(info)
        if self._scattered is not None and not boundary:
            if flat is not None:  # the group's buffer starts zeroed
                self._scattered.add(info, flat)
            info.settle()
            self._count(group, self._reduce_micro_step)
            return
        if self._comm.world_size > 1 and not self._residency.is_present(group):  # see ChunkManager.grads_only
            self._residency.gather(group, fill=False)
        chunk_group = self._groups[group]
        for piece in info.pieces:
            chunk = self._map.chunks[piece.chunk_id]
            chunk_group.bring(chunk, keep)  # a gradient is never written through a host round trip
            part = flat[piece.in_param] if flat is not None else None
            if self.accumulate and self._scattered is None:
                if chunk.acc is None and chunk.acc_host is None:
                    chunk_group.make_room(chunk.acc_nbytes or 4 * chunk.capacity, keep)
                acc_slot = chunk_group.accumulator(chunk)[piece.in_chunk]
                if part is not None:
                    acc_slot.add_(part.to(acc_slot.dtype))
                part = acc_slot
            if boundary:
                slot = chunk.ready()[piece.in_chunk]
                slot.copy_(part) if part is not None else slot.zero_()
                chunk_group.written(chunk)
        if not boundary:
            info.settle()
            return
        info.grad_written()
        self._count(group, self._reduce_group)

    def _count(self, group: int, reduce: Callable[[int], None]) -> None:
        self._pending[group] -= 1
        if self._pending[group] == 0:  # the group's last gradient: O(1) per parameter, not a scan
            self.reduced.add(group)
            reduce(group)

    def _reduce_micro_step(self, group: int) -> None:
        """Before the boundary: reduce-scatter ``group``'s gradient buffer; the group's backward use
        is over, so it is kept for the next forward (or released) now, its joined buffers dropped."""
        if self._scattered is None:
            raise RuntimeError("a micro-step reduce-scatter without data-parallel gradient accumulation")
        self._scattered.reduce(group)
        if self._residency.is_present(group):
            self._residency.keep_or_release(group)

    def _reduce_group(self, group: int) -> None:
        """Launch the reduce-scatter of ``group``'s gradients in its storage
        (:meth:`ChunkGroup.reduce_scatter`); the group is released when it completes."""
        self.reduced.add(group)
        self._residency.unkeep(group)
        if self._comm.world_size == 1:
            if self.accumulate:  # the sum is in the slot: the accumulator goes now, not at the step
                self._groups[group].drop_accumulators()
            if self._groups[group].owned.trainable:
                self._final(self._groups[group].owned)
            return
        owned = self._groups[group].owned
        if self._scattered is not None:
            self._groups[group].accumulator_folding()
        pending = self._groups[group].reduce_scatter(then=self._fold)
        self._residency.release(group, until=pending)
        owned.pending.append(pending)  # the owned chunk stays until its slot has the result
        self._reductions.add(pending)

    def _fold(self, owned: Chunk) -> None:
        """The owned slot has its reduced piece: plus what it accumulated before the boundary (see
        [Note: gradient accumulation])."""
        if self._scattered is not None:
            self._scattered.fold(owned)
            self._groups[self._map.group_of(owned)].drop_accumulators()  # its sum is in the slot now
        if owned.trainable:
            self._final(owned)

    def _final(self, owned: Chunk) -> None:
        """``owned``'s slot holds its final gradient: its norm is taken (see [Note: the norm as gradients become
        final]) and placement may send it to the host now (see [Note: gradients leave in backward])."""
        self.norms.record(owned)
        self._groups[self._map.group_of(owned)].gradient_final()

    @torch.no_grad()
    def end_backward(self, boundary: bool) -> None:
        """Backward epilogue: at the boundary every group gets its gradients and is reduced; before
        it, the gathered groups are kept for the next micro-step (see [Note: kept groups])."""
        if not boundary:
            if self._scattered is not None:  # every trainable group is reduced once per micro-step
                for group in self._trainable:
                    if group not in self.reduced:
                        self.reduced.add(group)
                        self._scattered.reduce(group)  # kept below, with the other present groups
                self._reductions.drain()
                self.next_step()
                self._scattered.micro_step_over()
            for info in self._map.infos():
                if info.state in (_S.COMPUTE, _S.HOLD_AFTER_FWD):
                    info.settle()
            for group in reversed(self._residency.present()):  # the first groups of the forward stay longest
                self._residency.keep_or_release(group)
            return
        for group in self._trainable:
            if group in self.reduced:
                continue
            if not self._residency.is_present(group):
                self._residency.gather(group, fill=False)  # every slot is about to be overwritten
            self._fill_missing_grads(group)
            self._reduce_group(group)
        self._reductions.drain()

    def _fill_missing_grads(self, group: int) -> None:
        """Tensors of ``group`` that got no gradient this step get zero (or what they accumulated)."""
        for info in self._groups[group].tensors:
            if info.state is _S.HOLD_AFTER_BWD:
                continue
            for piece in info.pieces:
                chunk = self._map.chunks[piece.chunk_id]
                data = chunk.ready()
                acc = chunk.ready_acc() if self._scattered is None else None  # else added after the reduction
                if acc is None:
                    data[piece.in_chunk].zero_()
                else:
                    data[piece.in_chunk].copy_(acc[piece.in_chunk])
            info.grad_written()
            self._pending[group] -= 1

    def has_accumulated(self) -> bool:
        """Some backward since the step put gradients into the accumulators (every owned chunk gets one at
        ``W`` > 1; a chunk a backward reached, with one rank)."""
        return any(chunk.acc is not None or chunk.acc_host is not None for chunk in self._map.trainable_owned())

    @torch.no_grad()
    def finish_accumulation(self) -> None:
        """``managed_gradient_accumulation: false``: the step is the boundary and every backward before it was
        a micro-step; the accumulated (reduced, with data parallelism) sums go into the owned slots, rounded
        once, as the boundary micro-step's fold does (see [Note: unmanaged gradient accumulation])."""
        self._reductions.drain()
        for group in self._trainable:
            owned = self._groups[group].owned
            acc, slot = owned.ready_acc(), owned.ready()
            slot.copy_(acc) if acc is not None else slot.zero_()
            self._groups[group].drop_accumulators()  # its sum is in the slot: it would follow the chunk for nothing
            self.norms.record(owned)
            for info in self._groups[group].tensors:
                if info.state is _S.HOLD and self._map.owns_any(info):
                    info.grad_written()
            self.reduced.add(group)

    def grads_ready(self) -> bool:
        return self.reduced.issuperset(self._trainable)

    def next_step(self) -> None:
        """No group has gradients any more."""
        if self._scattered is not None:
            self._scattered.discard()
        self.reduced.clear()
        self.norms.clear()
        self._pending = self._group_sizes()

    def owned_grad_norm_sq(self, comm_device: torch.device) -> torch.Tensor:
        """Sum over ranks of the squared norms of the owned gradient slots (fp32), each taken when the slot
        became final (see [Note: the norm as gradients become final])."""
        total = self.norms.total(list(self._map.trainable_owned()), comm_device)
        return self._comm.all_reduce_sum(total)
