"""The kinds of chunk: trainable parameters, and frozen ones (``requires_grad=False``).

[Note: frozen chunks]
A frozen parameter (a LoRA base, layers frozen by hand) lives in a chunk as a trainable one does,
but in chunks and chunk groups of its own kind, :attr:`ChunkKind.FROZEN`: the payload in the
training dtype (as ZeRO-3 casts every parameter to the engine's dtype) and nothing else. Its
slots never receive a gradient (no post-accumulate-grad hook, no reduce-scatter, no
accumulator), it has no fp32 master and no Adam state, and its tensors move through a smaller
state table (no ``HOLD_AFTER_BWD``, see [Note: tensor states]). Everything else is shared with
the trainable kind: split across ranks in balanced chunk groups and all-gathered on use, placed
by the tide (prefetched, evicted, in the trace, the ledger, the pre-flight and the planner), and
model data for activation offload. Its bytes are the payload's: 2 per parameter in bf16/fp16 (4
in fp32), divided by the world size, plus what is gathered at a moment
(:func:`~ds_patrickstar.chunks.group_bytes.group_bytes` with no accumulator). A module holding a
frozen parameter gets a post-backward hook, so that its group is kept or released as soon as
its backward is over (see [Note: tied weights between backward uses]); where none fires (a
module whose inputs need no gradient) the backward epilogue ends the use. An
activation-checkpoint recomputation marks its frozen tensors too (with reentrant checkpointing
the recomputed graph is the one backward runs, and its forward ran without grad), and a
recomputation's use is not counted as a use of its own: it ends with the backward use it
serves, so a recomputed block's frozen groups go with its backward, not at the epilogue.
"""

from __future__ import annotations

import enum

FROZEN_PARAM_GROUP = -1
"""The optimizer param group index of frozen chunks: none (no optimizer steps them)."""


class ChunkKind(enum.Enum):
    TRAINABLE = "trainable"
    FROZEN = "frozen"

    @property
    def trainable(self) -> bool:
        return self is ChunkKind.TRAINABLE
