"""Which blocks' activations the traced iteration keeps on the accelerator under ``offload_activations: "auto"``.

[Note: the traced iteration's offload]
The traced iteration has no trace to plan from, so it must fit whatever the activations turn out to be. Offloading
every block always fits where any plan does, but costs at the first step even where every activation fits beside
the chunks (the default budget, a model far smaller than the accelerator): every block's activations copied to
pinned host memory and back once, and that pinned memory allocated (on gpt-1.3b, batch 8 x 512, 6.4 GB each way;
pinning host memory is slow, and a large model's activations may be more than the host can pin). So the traced
iteration decides per segment when the segment ends, before its copies out would be issued (see [Note: activation
offload] in offloader.py), with what it saved known: the segment stays on the accelerator when the tide now
(:attr:`~ds_patrickstar.memory.ledger.DeviceLedger.non_model`, read at the latest moment), the segment once more
(that reading may precede its last tensors) and each block after it in this forward, counted as the largest segment
of the forward so far, fit beside every chunk group held at once
(:func:`~ds_patrickstar.placement.chunk_needs.all_held_bytes`: more than any moment's chunks take, see [Note: chunk
bytes per moment]) in the budget less a reserve of a quarter of it. Otherwise the segment is offloaded. Where some
must go, the earliest blocks go (those that would stay away longest), as the plan would choose ([Note: auto
activation offload] in plan.py).

The reserve is for what the trace has not seen when it decides: the head and the loss after the last block (a
language model's logits, and their fp32 copies in the loss, can weigh several blocks) and backward's temporaries.
Beyond the reserve, the chunks a moment does not use (counted above as all held) can be evicted to make room for
them: a traced iteration that keeps blocks fails only where those exceed a quarter of the budget and every chunk
the moment does not use, where it fit by offloading every block.

The records say which segments were offloaded, and the plan makes the tide without offload from those alone, so
it plans from a partly offloaded trace as from one that offloaded everything. One difference is left: the
allocator pieces the traced iteration stranded, which a plan that offloads keeps free (see [Note: auto activation
offload]), come only from the blocks it offloaded; a plan offloading other blocks too (for optimizer states, see
[Note: activations offloaded for optimizer states] in placement/states_room.py) strands pieces the driver reads
at each moment beside the tide (see [Note: stranded allocator bytes] in memory/cuda.py), and a tide risen above
the plan re-plans.
"""

from __future__ import annotations

from collections.abc import Callable

RESERVE = 4
"""The budget's share (1 / RESERVE) the traced iteration leaves free of kept activations: see [Note: the traced
iteration's offload]."""


class TracedKeep:
    """Whether a segment of the traced iteration stays on the accelerator; see [Note: the traced iteration's
    offload]."""

    def __init__(self, budget: int, model_bytes: int, tide_now: Callable[[], int]) -> None:
        self.room = budget - budget // RESERVE - model_bytes  # for the tide, kept segments included
        self._tide_now = tide_now  # the tide read at the latest moment, stranded pieces included
        self.blocks = 0  # the model's blocks (see [Note: activation offload])
        self._largest = 0  # the largest segment of this forward

    def start_forward(self) -> None:
        self._largest = 0

    def keeps(self, block: int, nbytes: int) -> bool:
        """Whether block ``block``'s segment of ``nbytes`` stays on the accelerator."""
        self._largest = max(self._largest, nbytes)
        after = max(self.blocks - 1 - block, 0)
        return self._tide_now() + nbytes + self._largest * after <= self.room
