"""Pinned host memory for offloaded activations: a stack of slabs, pinned once and kept across steps.

[Note: activation host stack]
A step's offloaded activations leave the accelerator in forward order and come back in backward, newest
first: their host buffers are taken and given back as a stack. The host pool (see [Note: pinned host memory]
in memory/host_pool.py) keeps a buffer given back only for a later request of exactly its size, and only up
to its cache limit (the chunks' buffers): offloaded activations are gigabytes a step of sizes the batch sets,
so each step pinned them anew (``cudaHostRegister`` of fresh pages, a host cost inside the forward). Measured
on an H200: gpt2-medium under a 5.35 GB budget offloaded 2.8 GB a step and its forward took 0.58-1.04 s
(0.74 s median), the step's transfers at the pinned bandwidth about 65 ms.

:class:`HostStack` takes its memory from the pool as *slabs* (pinned once each) and carves blocks from the
top of the newest one (aligned to :data:`BLOCK_ALIGNMENT`):

* a block given back is free once the copy that reads or writes it has completed; the top pops through
  free blocks (a block freed below the top waits for those above it: at worst until the step's backward has
  brought every activation back);
* where the slabs have no room at the top, a new slab is taken, at least twice the bytes held so far (the
  first iteration takes a few slabs, not one per block);
* once every block is free and the stack spans several slabs, they go back to the pool and one slab of the
  stack's highest extent is taken: from then on a step of the same or shorter shapes (batches padded per
  step) pins nothing; a longer one grows it once more;
* :meth:`HostStack.reset` gives the slabs back and takes one of the size a plan expects (the ``"auto"`` plan
  offloads fewer blocks than the traced iteration, which offloaded all: its slab would hold the difference
  pinned for the rest of the run).

The slabs are the pool's buffers, so the pinned bytes are counted where every pinned byte is
(:meth:`Accelerator.host_bytes_allocated`), and the pool unpins them when it closes. Each block is a tensor
of its own over the slab's storage (``set_``), with a version counter of its own: the strict emulated
accelerator's check that a copy's source did not change while it ran sees writes to that block only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..memory.accelerator import Accelerator
from ..memory.pending import Pending

BLOCK_ALIGNMENT = 512  # bytes: each block starts at a multiple of this within its slab


@dataclass(eq=False)
class _Block:
    slab: int  # index into the stack's slabs
    start: int  # byte offset in the slab
    nbytes: int
    tensor: torch.Tensor  # what was handed out (its storage may be emptied once the pool has closed)
    free: bool = False
    after: Pending | None = None  # the copy that must complete before the bytes can be reused

    @property
    def end(self) -> int:
        return self.start + -(-self.nbytes // BLOCK_ALIGNMENT) * BLOCK_ALIGNMENT


class HostStack:
    """Host buffers of offloaded activations, carved from pinned slabs kept across steps; see
    [Note: activation host stack]."""

    def __init__(self, accel: Accelerator) -> None:
        self.accel = accel
        self._slabs: list[torch.Tensor] = []
        self._blocks: list[_Block] = []  # bottom to top
        self._handed: dict[int, _Block] = {}  # id of a handed-out tensor -> its block
        self.peak_extent = 0  # the highest :attr:`extent` since the slabs were last laid out
        self.slabs_taken = 0  # slabs taken from the pool so far (each pinned once)

    @property
    def slab_bytes(self) -> int:
        return sum(slab.numel() for slab in self._slabs)

    @property
    def extent(self) -> int:
        """Bytes the stack spans now: the slabs below its newest block's in full (their skipped tails included),
        and that block's own up to its end."""
        if not self._blocks:
            return 0
        top = self._blocks[-1]
        return sum(slab.numel() for slab in self._slabs[: top.slab]) + top.end

    def take(self, nbytes: int) -> torch.Tensor:
        """A pinned host buffer of ``nbytes`` (uint8; contents undefined); give it back with :meth:`give`."""
        self._pop(wait=True)
        slab, start = self._top()
        size = -(-max(nbytes, 1) // BLOCK_ALIGNMENT) * BLOCK_ALIGNMENT
        while slab < len(self._slabs) and start + size > self._slabs[slab].numel():
            slab, start = slab + 1, 0  # the tail of this slab stays unused
        if slab == len(self._slabs):
            self._add_slab(max(size, 2 * self.slab_bytes))
        base = self._slabs[slab]
        offset = base.storage_offset() + start
        tensor = torch.empty(0, dtype=torch.uint8).set_(base.untyped_storage(), offset, (nbytes,), (1,))
        block = _Block(slab, start, nbytes, tensor)
        self._blocks.append(block)
        self.peak_extent = max(self.peak_extent, self.extent)
        self._handed[id(tensor)] = block
        return tensor

    def give(self, tensor: torch.Tensor, after: Pending | None = None) -> None:
        """Give back a buffer of :meth:`take`; its bytes are reused once ``after`` (a copy reading or writing
        them) has completed."""
        if self.accel.host_pool.closed:
            return  # the pool let go of every slab (a saved activation dying after its run)
        block = self._handed.get(id(tensor))
        if block is None or block.tensor is not tensor:
            raise RuntimeError(f"activation host stack: giving back a buffer ({tensor.numel()} B) it did not hand out")
        del self._handed[id(tensor)]
        block.free, block.after = True, after
        self._pop(wait=False)
        if not self._blocks and len(self._slabs) > 1:
            self._lay_out(self.peak_extent)

    def reset(self, expected: int) -> None:
        """Every block given back: the slabs go back to the pool, and one of ``expected`` bytes is taken
        (none for 0), what the next steps are planned to offload. With blocks still handed out, nothing."""
        if self._handed:
            return  # a forward without backward still holds some (its graph alive): growth lays them out later
        self._pop(wait=True)
        self._lay_out(expected)

    # ---- inside -----------------------------------------------------------------------------
    def _top(self) -> tuple[int, int]:
        if not self._blocks:
            return 0, 0
        top = self._blocks[-1]
        return top.slab, top.end

    def _pop(self, wait: bool) -> None:
        """Free blocks leave the top, once their copies have completed (waited on, with ``wait``)."""
        while self._blocks and self._blocks[-1].free:
            top = self._blocks[-1]
            if top.after is not None and not top.after.done():
                if not wait:
                    return
                top.after.wait_host()
            self._blocks.pop()

    def _add_slab(self, nbytes: int) -> None:
        self._slabs.append(self.accel.host_empty(nbytes, torch.uint8))
        self.slabs_taken += 1

    def _lay_out(self, nbytes: int) -> None:
        """The (empty) stack's slabs become one of ``nbytes`` (none for 0), unless it is that already."""
        self.peak_extent = 0
        if len(self._slabs) == 1 and self._slabs[0].numel() == nbytes:
            return
        for slab in self._slabs:
            self.accel.host_free(slab)
        self._slabs = []
        if nbytes:
            self._add_slab(nbytes)
