"""Host buffers kept beside the accelerator payload, so that an unchanged chunk goes back without a copy.

[Note: clean evictions]
With tide-aware placement and no host budget, a chunk brought to the accelerator keeps the host buffer it came
from (``Chunk.clean``) with its payload's version counter then. Evicted while that counter has not moved (a
frozen chunk; a trainable one in forward, before backward writes its gradients into the payload), it copies
nothing back: the payload goes once the copy in has run, and the kept buffer is its host home again (counter
``clean_evictions``; the bytes are not in ``bytes_to_host``). Any write through a tensor op into the payload or
a view of it (the gradients, a rejoin, ``GatheredParameters``, a load) moves the counter, and the eviction
copies out instead. The step's writes are not all tensor ops (the accelerator's Adam kernel writes through a
pointer): it gives the trainable chunks' kept buffers back first and keeps none while it runs; a frozen chunk
keeps its buffer across steps (nothing but tensor ops writes it). Collectives write through pointers too, but
never into an owned payload: an all-gather reads it into the group's storage, and a reduce-scatter's piece goes
into the owned slot by a tensor copy (see :meth:`~ds_patrickstar.groups.group.ChunkGroup.reduce_scatter`), so
several ranks keep buffers as one does. With gradient accumulation the micro-steps' gradients go into the
accumulator, and a payload stays unchanged (its eviction free) until the boundary folds the sum into it. The
strict emulated accelerator checks at every eviction without a copy that the payload holds what the kept buffer
holds, bit for bit, so a write no counter saw fails a CPU test. The price is host memory: the kept buffers of
the chunks on the accelerator (every chunk starts on the host, so the peak is the one initialize had). The move
model replays it: a chunk brought is clean, a moment dirties the chunks its gradients went into (recorded while
tracing), the step keeps the frozen chunks' buffers only (see [Note: predicted moves] in
placement/move_model.py).
"""

from __future__ import annotations

import torch

from ..chunks.chunk import Chunk, Home
from ..counters import StepCounters
from ..memory.accelerator import Accelerator


class CleanCopies:
    """The host buffers chunks on the accelerator keep (see [Note: clean evictions])."""

    def __init__(self, accel: Accelerator, counters: StepCounters) -> None:
        self.accel, self.counters = accel, counters
        self.enabled = False  # set where placement keeps them
        self._stepping = False  # the step writes payloads no version counts: nothing is kept meanwhile
        self._kept: set[Chunk] = set()

    def keep(self, chunk: Chunk, host: torch.Tensor) -> bool:
        """Whether ``chunk``, just copied in from ``host``, keeps it (else the caller gives it back)."""
        if not self.enabled or self._stepping:
            return False
        chunk.clean, chunk.clean_version = host, chunk.payload._version
        self._kept.add(chunk)
        return True

    @staticmethod
    def unchanged(chunk: Chunk) -> bool:
        """Whether ``chunk`` keeps a host buffer its payload still equals (its eviction would copy nothing)."""
        return chunk.clean is not None and chunk.payload._version == chunk.clean_version

    def evict(self, chunk: Chunk) -> bool:
        """Whether ``chunk`` went back to its kept buffer without a copy (its payload unchanged since it came)."""
        host = chunk.clean
        if host is None or not self.unchanged(chunk):
            return False
        self.take(chunk)
        last = chunk.pending[-1] if chunk.pending else None  # the copy in, if it still runs
        self.accel.check_clean(chunk.payload, host, chunk.chunk_id, last)
        self.accel.free(chunk.payload, "chunk", after=last)
        chunk.host, chunk.home, chunk.prefetched = host, Home.HOST, False
        self.counters.clean_evictions += 1
        return True

    def take(self, chunk: Chunk) -> torch.Tensor | None:
        """``chunk``'s kept buffer, which it no longer keeps (None: it keeps none)."""
        host, chunk.clean, chunk.clean_version = chunk.clean, None, -1
        self._kept.discard(chunk)
        return host

    def step_begins(self) -> list[tuple[Chunk, torch.Tensor]]:
        """The step begins: the trainable chunks' kept buffers, for the caller to give back (frozen chunks keep
        theirs: the step does not write them); none is kept until :meth:`step_ends`."""
        self._stepping = True
        # in chunk order: the pool keeps the buffers given back last, so the order decides which it keeps
        trainable = sorted((chunk for chunk in self._kept if chunk.trainable), key=lambda chunk: chunk.chunk_id)
        return [(chunk, host) for chunk in trainable if (host := self.take(chunk)) is not None]

    def step_ends(self) -> None:
        self._stepping = False
