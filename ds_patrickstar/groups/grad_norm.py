"""The gradient norm, taken chunk by chunk as each owned gradient slot becomes final.

[Note: the norm as gradients become final]
The step needs the global norm of the gradients before any update (clipping, and the overflow check of a
loss-scaled run). It used to be read at the step, each owned slot where it lived then: on a GPU run whose
states are mostly on the host that is the host, where the gradients had gone during backward (see [Note:
gradients leave in backward]), and the norm became a serial host pass over every gradient between backward
and the first update. Measured on an H200 (gpt-1.3b, 12 GiB budget, 98 of 100 chunks updated on the host):
316 host ``vector_norm`` calls, 0.45 s of a 0.88 s step.

So each owned chunk's squared norm is taken when its slot becomes final, where the slot is at that moment: with
one rank when the group's last gradient is in (the chunk was brought to the accelerator to receive it), with
``W`` ranks when the reduce-scatter's piece (plus what was accumulated before the boundary) is in the slot, and
for unmanaged accumulation when the step writes the sums. On a GPU that is a kernel on the compute stream during
backward, before the chunk can leave: it reads the slot in the accelerator's memory, and the copy to the host is
ordered after it. The step then sums one value per chunk, in the chunks' order, on the device of the
collective (:meth:`GradientNorms.total`). A slot that changes after it was final (a ``safe_set_full_grad`` or
``safe_set_local_grad`` between ``backward()`` and ``step()``, see [Note: gradients between backward and step]
in integration/zero3_grads.py) has its value taken again: :meth:`record` is the one place values come from, and
:meth:`GradientNorms.clear` forgets them at every step and abandoned iteration.

Each chunk's value is the sum of the squared norms of its slices in order (4 Mi elements each: a whole chunk's
fp32 upcast would be a large temporary), and the values are summed as one vector, so the result depends on the
placement (a CUDA reduction and a host one round differently) but not on when the step reads it: the overlapped
and serial steps agree bit for bit, and on the strict emulated accelerator, where both places are the host,
every placement agrees.
"""

from __future__ import annotations

import torch

from ..chunks.chunk import Chunk

_NORM_SLICE = 1 << 22


def squared_norm(values: torch.Tensor) -> torch.Tensor:
    """Sum of squares of ``values`` in fp32, slice by slice, on their device (a 0-dim tensor)."""
    total = torch.zeros((), dtype=torch.float32, device=values.device)
    for part in values.split(_NORM_SLICE):
        total += torch.linalg.vector_norm(part, dtype=torch.float32).square()
    return total


class GradientNorms:
    """Per owned trainable chunk: the squared norm of its final gradient slot (see [Note: the norm as
    gradients become final])."""

    def __init__(self) -> None:
        self._values: dict[int, torch.Tensor] = {}

    @torch.no_grad()
    def record(self, chunk: Chunk) -> None:
        """``chunk``'s slot holds its final gradient now: its squared norm, where the slot is."""
        self._values[chunk.chunk_id] = squared_norm(chunk.ready()[: chunk.used])

    def clear(self) -> None:
        self._values.clear()

    @torch.no_grad()
    def total(self, chunks: list[Chunk], device: torch.device) -> torch.Tensor:
        """The squared norm of ``chunks``' gradients on ``device``; a chunk not recorded is read now."""
        for chunk in chunks:
            if chunk.chunk_id not in self._values:
                self.record(chunk)
        if not chunks:
            return torch.zeros((), dtype=torch.float32, device=device)
        return torch.stack([self._values[chunk.chunk_id].to(device) for chunk in chunks]).sum()
