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

An owned frozen chunk in RAM lives in one place at a time, as every owned chunk does (see
[Note: chunk locations]): evicted, its unchanged payload is copied back to the host (one on
disk has its clean copy in its record, so its eviction copies nothing, see
[Note: frozen chunks on disk]). A clean host copy kept while the chunk is on the accelerator
would spare that copy but hold those bytes twice. The copy is spared only where frozen chunks
are evicted, i.e. where the frozen base does not fit the budget, and there it is the
device-to-host half of the streaming; the price is every frozen byte on the accelerator held
again on the host for the whole run (the whole base where it fits the budget, with nothing
spared). Model data must fit budget plus host memory (see [Note: pre-flight]): with clean
copies the frozen base alone would have to fit the host, so the largest base that trains
shrinks by the budget, and under the disk tier's ``host_budget`` the doubled bytes push
optimizer states or frozen chunks to disk, whose reads cost more than the copy spared. Frozen
values also change (``load_state_dict``, ``load_checkpoint``, ``load_pretrained``), and a
stale clean copy would silently bring back old weights.
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
