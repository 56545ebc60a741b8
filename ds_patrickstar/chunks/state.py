"""The tensor state machine: the states a trainable parameter moves through, and the legal moves.

[Note: tensor states]
Every trainable parameter has a :class:`TensorState`:

* ``FREE``: its payload is not materialized (the storage of the chunk of each of its pieces
  is released, see [Note: pieces released one by one]);
* ``HOLD``: its value is present and nobody is using it;
* ``COMPUTE``: a module is using it (forward, backward or a recomputation);
* ``HOLD_AFTER_FWD``: used in this forward and done for now;
* ``HOLD_AFTER_BWD``: its slot holds its *gradient* (see [Note: gradient in the param slot]).

The legal moves are the table :data:`_LEGAL`; anything else raises
:class:`IllegalTransition`. A frozen parameter (see [Note: frozen chunks]) never holds a gradient:
its table, :data:`_LEGAL_FROZEN`, has no ``HOLD_AFTER_BWD``, and its backward use ends in
``HOLD_AFTER_FWD`` like a forward use. Using a tensor whose slot holds a gradient for compute is
illegal: that is what catches a forward that would read a gradient as a weight.

A chunk's state is derived from its tensors (:attr:`~ds_patrickstar.chunks.chunk.Chunk.state`):
``COMPUTE`` pins it (it may neither move nor be freed), all-``FREE`` means ``RELEASED``,
anything else is ``HOLD`` (movable).
"""

from __future__ import annotations

import enum

from .kind import ChunkKind


class IllegalTransition(RuntimeError):
    """A tensor was asked to move between states in a way the state machine forbids."""


class TensorState(enum.Enum):
    FREE = "free"
    HOLD = "hold"
    COMPUTE = "compute"
    HOLD_AFTER_FWD = "hold_after_fwd"
    HOLD_AFTER_BWD = "hold_after_bwd"


_S = TensorState
_LEGAL: dict[TensorState, frozenset[TensorState]] = {
    _S.FREE: frozenset({_S.HOLD}),
    _S.HOLD: frozenset({_S.FREE, _S.COMPUTE, _S.HOLD_AFTER_BWD}),
    # COMPUTE -> COMPUTE: a module nested in a module that uses the same tensor.
    # COMPUTE -> HOLD: the gradient of a non-boundary micro-step went to the accumulator.
    _S.COMPUTE: frozenset({_S.COMPUTE, _S.HOLD, _S.HOLD_AFTER_FWD, _S.HOLD_AFTER_BWD}),
    _S.HOLD_AFTER_FWD: frozenset({_S.FREE, _S.HOLD, _S.COMPUTE, _S.HOLD_AFTER_BWD}),
    # A slot holding a gradient goes back to HOLD once the step (or an overflow restore)
    # has written a parameter value into it, or to FREE once its gradient is consumed
    # elsewhere (data parallel reduce-scatter). Never straight to COMPUTE, and never a
    # second gradient into the same slot: that would mean a weight was read after its
    # slot had been overwritten.
    _S.HOLD_AFTER_BWD: frozenset({_S.HOLD, _S.FREE}),
}


_LEGAL_FROZEN: dict[TensorState, frozenset[TensorState]] = {
    _S.FREE: frozenset({_S.HOLD}),
    _S.HOLD: frozenset({_S.FREE, _S.COMPUTE}),
    _S.COMPUTE: frozenset({_S.COMPUTE, _S.HOLD, _S.HOLD_AFTER_FWD}),
    _S.HOLD_AFTER_FWD: frozenset({_S.FREE, _S.HOLD, _S.COMPUTE}),
    _S.HOLD_AFTER_BWD: frozenset(),
}
_TABLES = {ChunkKind.TRAINABLE: _LEGAL, ChunkKind.FROZEN: _LEGAL_FROZEN}


def check_transition(
    old: TensorState, new: TensorState, name: str = "tensor", kind: ChunkKind = ChunkKind.TRAINABLE
) -> None:
    legal = _TABLES[kind]
    if new not in legal[old]:
        raise IllegalTransition(
            f"{name}: illegal tensor state transition {old.name} -> {new.name} ({kind.value} tensor); "
            f"from {old.name} only {sorted(s.name for s in legal[old])} are allowed"
        )


class ChunkState(enum.Enum):
    RELEASED = "released"
    HOLD = "hold"
    COMPUTE = "compute"
