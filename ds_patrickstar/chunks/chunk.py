"""Chunks: fixed-size flat payloads that parameters live in, and per-parameter metadata
(:class:`TensorInfo`: where a parameter's pieces are, its state).

[Note: gradient in the param slot]
After a parameter's last backward use, autograd has accumulated its gradient; a
post-accumulate-grad hook copies it into the parameter's own slot of the low-precision
chunk and drops ``param.grad``. The old value is not lost: the fp32 master holds it, and
the optimizer step writes the new value back into the slot. That is how model data costs
14 bytes per parameter in fp16/bf16 (2 param/grad + 4 master + 4 + 4 Adam moments).

[Note: ready payload]
A chunk's values are in one place at a time: the accelerator payload, or the host buffer
while placement keeps the chunk on the host (or, for a frozen chunk on disk away from use, its
disk record, see [Note: frozen chunks on disk]). Copies between the two are asynchronous (a
copy stream on CUDA, the strict emulated accelerator on CPU), so a buffer may still be
waiting for its values. :meth:`Chunk.ready` waits on every pending copy of the chunk and
returns the buffer that holds the values now; code that reads or writes a chunk's values
goes through it (or :meth:`Chunk.ready_acc` for the gradient accumulator), never through
the buffers directly.

[Note: storage resize]
A parameter is a view into its chunk's payload for its whole life (or into its joined
buffer, see [Note: straddling tensors]). Releasing a chunk
resizes the payload's untyped storage to zero bytes and materializing it resizes it back,
so the views (and the views autograd saved for backward) stay valid, as in FSDP2. While the
storage holds no bytes the parameter itself points at an empty tensor (see
[Note: released parameters read as empty] in memory/released_views.py).

[Note: pieces released one by one]
A tensor straddling the chunks of a group (see [Note: straddling tensors]) has a piece in
chunks that are released separately: after the reduce-scatter this rank releases the other
ranks' chunks, while its own piece holds the tensor's averaged gradient until the step. So a
tensor's state is the state of the pieces this rank still holds: it goes ``FREE`` only once
the chunk of its last piece is released (:attr:`TensorInfo.released` records which are), and
until then keeps the state its present pieces are in (``HOLD_AFTER_BWD`` from the
reduce-scatter to the step: ``state_dict`` and ``load_state_dict`` refuse to run there).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch

from .kind import ChunkKind
from .state import ChunkState, IllegalTransition, TensorState, check_transition


@dataclass(frozen=True)
class Piece:
    """Elements ``[start, start + numel)`` of a flattened parameter, at ``offset`` in chunk ``chunk_id``."""

    chunk_id: int
    offset: int
    start: int
    numel: int

    @property
    def in_chunk(self) -> slice:
        return slice(self.offset, self.offset + self.numel)

    @property
    def in_param(self) -> slice:
        return slice(self.start, self.start + self.numel)


@dataclass(eq=False)
class TensorInfo:
    """Our metadata for one chunk parameter, trainable or frozen (nothing is stored on the ``nn.Parameter``).

    ``pieces`` says where its elements live: one piece, or (data parallel) several pieces in
    consecutive chunks of one chunk group, whose values are copied into ``joined`` while the group
    is gathered (see [Note: straddling tensors])."""

    name: str
    param: torch.nn.Parameter
    pieces: list[Piece]
    numel: int
    shape: torch.Size
    group_index: int
    state: TensorState = TensorState.HOLD
    joined: torch.Tensor | None = None  # the parameter's own buffer when it ``joins``
    released: set[int] = field(default_factory=set)  # chunks of its pieces released on this rank
    bound: bool = False  # the parameter is a view of its chunk (or its joined buffer): see store/binding.py
    kind: ChunkKind = ChunkKind.TRAINABLE  # see [Note: frozen chunks]
    # called with ``(self, in_use)`` when it enters or leaves ``COMPUTE`` (ZeRO-3's ``ds_status``, see
    # integration/zero3_params.py)
    on_use: Callable[[TensorInfo, bool], None] | None = None

    @property
    def trainable(self) -> bool:
        return self.kind.trainable

    @property
    def straddles(self) -> bool:
        return len(self.pieces) > 1

    @property
    def joins(self) -> bool:
        """It has a joined buffer: a trainable tensor that straddles chunks (a frozen one is a view of its
        group's storage, see [Note: straddling tensors])."""
        return self.straddles and self.trainable

    @property
    def chunk_ids(self) -> list[int]:
        return [piece.chunk_id for piece in self.pieces]

    def transition(self, new: TensorState) -> None:
        check_transition(self.state, new, self.name, self.kind)
        was = self.state is TensorState.COMPUTE
        self.state = new
        if self.on_use is not None and was is not (new is TensorState.COMPUTE):
            self.on_use(self, not was)

    # Named moves: what the hooks and the optimizer call.
    def start_compute(self) -> None:
        self.transition(TensorState.COMPUTE)

    def end_forward(self) -> None:
        self.transition(TensorState.HOLD_AFTER_FWD)

    def end_backward_use(self) -> None:
        """A backward use is over and the gradient still waits for another use (a tied weight):
        the values are not needed until then (see [Note: tied weights between backward uses])."""
        self.transition(TensorState.HOLD_AFTER_FWD)

    def grad_written(self) -> None:
        self.transition(TensorState.HOLD_AFTER_BWD)

    def settle(self) -> None:
        """Value present and unused (after a step, a restore or an accumulation)."""
        if self.state is not TensorState.HOLD:
            self.transition(TensorState.HOLD)

    def piece_released(self, chunk_id: int) -> None:
        """The chunk holding one of its pieces was released: ``FREE`` once no piece is left (see
        [Note: pieces released one by one])."""
        self.released.add(chunk_id)
        if self.state is not TensorState.FREE and self.released.issuperset(self.chunk_ids):
            self.transition(TensorState.FREE)

    def piece_present(self, chunk_id: int) -> None:
        """The chunk holding one of its pieces has memory again: a ``FREE`` tensor is ``HOLD``."""
        self.released.discard(chunk_id)
        if self.state is TensorState.FREE:
            self.transition(TensorState.HOLD)


class Home(Enum):
    """Where a chunk's values live now (see [Note: chunk locations] in store/chunk_store.py): on the accelerator
    (its payload), on the host (its host buffer) or in its disk record (a frozen chunk on disk away from use,
    see [Note: frozen chunks on disk]). Only the chunk store changes it."""

    DEVICE = "device"
    HOST = "host"
    DISK = "disk"


@dataclass(eq=False)
class Chunk:
    """A flat payload of ``capacity`` elements holding some tensors back to back.

    The buffers (``payload`` on the accelerator, ``host`` while the chunk lives on the host,
    the gradient accumulators ``acc``/``acc_host``) are created and moved by
    :class:`~ds_patrickstar.store.chunk_store.ChunkStore`; their values are read and written only
    through :meth:`ready` / :meth:`ready_acc` (see [Note: ready payload]).
    """

    chunk_id: int
    capacity: int
    dtype: torch.dtype
    group_index: int
    tensors: list[TensorInfo] = field(default_factory=list)  # every tensor with a piece here, in order
    pieces: list[Piece] = field(default_factory=list)  # their pieces in this chunk, in the same order
    payload: torch.Tensor = field(
        default_factory=lambda: torch.empty(0)
    )  # on the accelerator; parameters are views of it
    host: torch.Tensor | None = None  # the values while the chunk lives on the host (see store/chunk_store.py)
    home: Home = Home.DEVICE  # where the values live now; changed by the chunk store only
    acc: torch.Tensor | None = None  # fp32 gradient accumulator beside the payload (GA > 1)
    acc_host: torch.Tensor | None = None  # ... and while the chunk is away from the accelerator
    pending: list = field(default_factory=list)  # copies into or out of this chunk not yet waited on
    prefetched: bool = False
    kind: ChunkKind = ChunkKind.TRAINABLE  # see [Note: frozen chunks]
    on_disk: bool = False  # a frozen chunk whose record is its home away from use (see [Note: frozen chunks on disk])
    # on the accelerator: the host buffer it came from and the payload's version then (see [Note: clean evictions])
    clean: torch.Tensor | None = None
    clean_version: int = -1

    @property
    def on_host(self) -> bool:
        """Away from the accelerator: on the host or in its disk record."""
        return self.home is not Home.DEVICE

    @property
    def trainable(self) -> bool:
        return self.kind.trainable

    @property
    def used(self) -> int:
        return self.pieces[-1].offset + self.pieces[-1].numel if self.pieces else 0

    @property
    def nbytes(self) -> int:
        return self.capacity * self.dtype.itemsize

    @property
    def acc_nbytes(self) -> int:
        return self.capacity * 4 if (self.acc is not None or self.acc_host is not None) else 0

    def ready(self) -> torch.Tensor:
        """The chunk's values where they live now, once every copy into or out of the chunk has
        completed: the one accessor for reading or writing them (see [Note: ready payload])."""
        self.wait_pending()
        if self.home is Home.DISK:
            raise RuntimeError(
                f"chunk {self.chunk_id} lives in its disk record: read it through ChunkStore.values (it stages it)"
            )
        return self.host_buffer() if self.home is Home.HOST else self.payload

    def host_buffer(self) -> torch.Tensor:
        """The host buffer of a chunk that lives on the host (not waited on: use :meth:`ready`)."""
        if self.host is None:
            raise RuntimeError(f"chunk {self.chunk_id} has no host buffer (it lives on the accelerator)")
        return self.host

    def ready_acc(self) -> torch.Tensor | None:
        """The gradient accumulator where it lives now (None when there is none), after its copies."""
        self.wait_pending()
        return self.acc_host if self.acc_host is not None else self.acc

    def wait_pending(self) -> None:
        while self.pending:
            self.pending.pop(0).wait()

    def hand_over(self, start: Callable[[torch.Tensor, list], Any]) -> None:
        """A host job takes the used values of this chunk, which lives on the host (the gradient in, the
        new parameters out), until it has run: ``start(values, after)`` starts it once the copies
        ``after`` have completed and returns its pending job, which every reader then waits for (see
        [Note: overlapped host Adam] in memory/host_work.py)."""
        values = self.host_buffer()[: self.used]
        self.pending = [*self.pending, start(values, list(self.pending))]

    def wait_copies(self) -> None:
        """Wait for the copies into or out of the chunk, not for a host job holding its values."""
        for pending in [p for p in self.pending if not p.host_work]:
            pending.wait()
        self.pending = [p for p in self.pending if p.host_work]

    def wait_host_work(self) -> None:
        """Wait for a host job holding the chunk's values (before they are copied anywhere)."""
        for pending in [p for p in self.pending if p.host_work]:
            pending.wait()
        self.pending = [p for p in self.pending if not p.host_work]

    @property
    def is_materialized(self) -> bool:
        return self.payload.untyped_storage().nbytes() > 0

    @property
    def state(self) -> ChunkState:
        states = {t.state for t in self.tensors}
        if TensorState.COMPUTE in states:
            return ChunkState.COMPUTE
        if states == {TensorState.FREE}:
            return ChunkState.RELEASED
        return ChunkState.HOLD

    @property
    def movable(self) -> bool:
        return self.state is not ChunkState.COMPUTE

    def append(self, info: TensorInfo, piece: Piece) -> None:
        if piece.offset < self.used or piece.offset + piece.numel > self.capacity:
            raise ValueError(
                f"{info.name}: elements {piece.start}..{piece.start + piece.numel} do not fit chunk "
                f"{self.chunk_id} at offset {piece.offset} (used {self.used} of {self.capacity})"
            )
        self.tensors.append(info)
        self.pieces.append(piece)

    def view_of(self, info: TensorInfo) -> torch.Tensor:
        """The parameter's view of the payload (a tensor with one piece, in this chunk)."""
        (piece,) = info.pieces
        return self.payload[piece.in_chunk].view(info.shape)

    def mark_released(self) -> None:
        """Its tensors' pieces here are gone: a tensor with no piece left is ``FREE`` (the store frees
        the memory; see [Note: storage resize] and [Note: pieces released one by one])."""
        if self.state is ChunkState.COMPUTE:
            raise IllegalTransition(f"chunk {self.chunk_id} is in use (COMPUTE) and cannot be released")
        for info in self.tensors:
            info.piece_released(self.chunk_id)

    def mark_present(self) -> None:
        """``FREE`` tensors are ``HOLD`` again once the payload has memory."""
        for info in self.tensors:
            info.piece_present(self.chunk_id)
