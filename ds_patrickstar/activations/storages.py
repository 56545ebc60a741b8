"""What activation offload keeps per accelerator storage and per block's segment (see [Note: activation
offload] in ``offloader.py``), and the inputs a checkpoint holds outside saved tensors.

[Note: held inputs]
DeepSpeed's ``deepspeed.checkpointing.checkpoint`` keeps a checkpointed block's inputs as attributes of
its autograd context, its ``non_reentrant_checkpoint`` in its own closure: not as saved tensors, so no
saved-tensor hook sees them (torch's checkpoints save theirs, the reentrant one with
``ctx.save_for_backward``, the non-reentrant one as saved tensors of its frame). The forward pre-hook of
each block (see [Note: activation offload]) sees the block's tensor inputs (positional and keyword):

* **Counted.** The emulated accelerator's meter counts an input's storage from the block's pre-forward
  until the storage is freed (``weakref.finalize`` on the storage, whose Python object torch keeps for
  as long as the storage lives), once per storage with the saved tensors of it
  (:meth:`~ds_patrickstar.placement.saved_meter.SavedTensorMeter.hold`): a CUDA allocator holds those bytes
  as long.
* **Moved.** With ``offload_activations`` an input is an entry of its block's segment, like a saved
  storage, but known by weak references (the tensor, its storage) so that it lives as long as its
  holder keeps it. Once its copy to the host has run, the tensor's ``.data`` is pointed at an empty
  tensor (DeepSpeed's own ``cpu_checkpointing`` empties the input the same way) and the storage is
  freed; before the block's backward a new accelerator buffer receives the copy back and the tensor is
  pointed at it with its old geometry: the holder keeps the same tensor object throughout. An input that
  a hook saves as well (torch's checkpoints, a block without checkpoint) is not emptied: its saved
  tensors keep the bytes, which go as any saved storage's.
* **Held elsewhere.** A storage (held input or saved) that something else still holds once its copy
  out has run (a view the model keeps, the caller's batch) survives the drop: the tensor is pointed
  back at it, the host copy is given back, and nothing moved (the counters do not count it).
* **When its backward comes.** No unpack announces DeepSpeed's recomputation: at the next block's
  pre-forward, the autograd nodes of that block's inputs (this block's output) get a pre-hook, which
  runs before this block's backward and so before its recomputation; it brings the segment back, with
  the prefetch of the previous one, and waits on its copies (the wait before use). The last block has
  no next block: its held inputs stay on the accelerator.
* **Repeated inputs.** A tensor given to several blocks (an attention mask) stays on the accelerator
  from its second block on (brought back and waited on at once, if it had left).
* **Not seen:** tensors a checkpoint derives from its inputs (DeepSpeed's ``partition_activations``
  copies, with ``contiguous_memory_optimization`` in buffers of its own), and the inputs of checkpoints
  around anything but a block.
"""

from __future__ import annotations

import enum
import weakref
from dataclasses import dataclass, field

import torch

from ..memory.pending import Pending
from .plan import SegmentRecord

__all__ = ["Entry", "Handle", "HeldInput", "Segment", "State"]


class State(enum.Enum):
    ON_DEVICE = "on device"  # packed or held; the accelerator storage is the one autograd made
    TO_HOST = "copying to host"
    ON_HOST = "on host"  # the accelerator storage is dropped
    TO_DEVICE = "copying back"
    BACK = "back on device"
    RELEASED = "released"  # nothing refers to it any more (saved tensors, held input, storage)


_MOVES = {
    State.ON_DEVICE: {State.TO_HOST, State.BACK, State.RELEASED},
    State.TO_HOST: {State.ON_HOST, State.BACK, State.RELEASED},
    State.ON_HOST: {State.TO_DEVICE, State.RELEASED},
    State.TO_DEVICE: {State.BACK, State.ON_HOST, State.RELEASED},  # back to the host: a prefetch giving way
    State.BACK: {State.TO_HOST, State.RELEASED},  # to the host again: kept ones giving way in backward
    State.RELEASED: set(),
}


class HeldInput:
    """A block's input that a checkpoint may hold outside saved tensors (see [Note: held inputs])."""

    __slots__ = ("tensor", "geometry")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = weakref.ref(tensor)
        self.geometry: tuple[torch.dtype, int, torch.Size, tuple[int, ...]] | None = None  # while emptied

    def alive(self) -> torch.Tensor | None:
        return self.tensor()

    def empty(self, tensor: torch.Tensor) -> None:
        """Point ``tensor`` at no memory, remembering its geometry."""
        self.geometry = (tensor.dtype, int(tensor.storage_offset()), tensor.size(), tensor.stride())
        tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)

    def refill(self, tensor: torch.Tensor, storage: torch.UntypedStorage) -> None:
        """Point ``tensor`` at ``storage`` again, with the geometry it had."""
        assert self.geometry is not None
        dtype, offset, size, stride = self.geometry
        tensor.data = torch.empty(0, dtype=dtype, device=tensor.device).set_(storage, offset, size, stride)
        self.geometry = None


@dataclass(eq=False)
class Entry:
    """One accelerator storage of a segment: saved tensors and/or a held block input refer to it."""

    device: torch.Tensor | None  # uint8 view of the accelerator storage, while saved tensors or a copy need it
    nbytes: int
    segment: Segment
    state: State = State.ON_DEVICE
    host: torch.Tensor | None = None
    pending: Pending | None = None
    refs: int = 0  # saved tensors of it alive
    storage: weakref.ref[torch.UntypedStorage] | None = None  # the accelerator storage, while it is there
    ptr: int = 0  # its address
    held: HeldInput | None = None
    pinned: bool = False  # the input of two blocks: never moves

    def move(self, to: State) -> None:
        if to not in _MOVES[self.state]:
            raise RuntimeError(f"activation offload: a saved storage cannot go from {self.state.value} to {to.value}")
        self.state = to

    def needed(self) -> bool:
        """Whether a saved tensor or a held input still refers to these bytes."""
        return self.refs > 0 or (self.held is not None and self.held.alive() is not None)

    def empty_held(self) -> None:
        """Point the held input at no memory, unless a saved tensor keeps these bytes anyway."""
        held = self.held
        tensor = held.alive() if held is not None else None
        if held is not None and tensor is not None and not self.refs:
            held.empty(tensor)

    def refill_held(self, storage: torch.UntypedStorage) -> bool:
        """Point an emptied held input at ``storage``; whether there was one."""
        held = self.held
        tensor = held.alive() if held is not None else None
        if held is None or tensor is None or held.geometry is None:
            return False
        held.refill(tensor, storage)
        return True

    def kept(self) -> torch.Tensor | None:
        """A uint8 view of the accelerator storage, made from the weak reference where we hold none."""
        if self.device is None and self.storage is not None and (storage := self.storage()) is not None:
            return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
        return self.device


@dataclass(eq=False)
class Segment:
    """What one block's forward saved (and its inputs), in one forward of the iteration."""

    block: int
    offload: bool
    entries: list[Entry] = field(default_factory=list)
    nbytes: int = 0  # every storage saved in it (offloaded or not) that can move
    triggered: bool = False  # a hook tells when its backward is about to run (see [Note: held inputs])
    drop_at: int = -1  # the moment after which its offloaded storages are off the accelerator
    restore_at: int = -1  # the moment its storages are needed again (copied back)
    begun: bool = False  # its block's backward began (a saved tensor of it unpacked, or the hook before it ran)
    previous: Segment | None = None
    ahead: bool = True  # brought back when the next block's backward begins (see [Note: activations give way])

    def record(self) -> SegmentRecord:
        back = self.restore_at + 1 if self.restore_at >= 0 else -1
        return SegmentRecord(self.block, self.nbytes, self.drop_at + 1, back, self.offload)


class Handle:
    """What autograd keeps for a saved tensor of a segment."""

    __slots__ = ("segment", "entry", "tensor", "dtype", "offset", "size", "stride", "__weakref__")

    def __init__(self, segment: Segment, entry: Entry | None, tensor: torch.Tensor | object) -> None:
        self.segment, self.entry = segment, entry
        if entry is None:
            self.tensor = tensor  # kept on the accelerator (the meter's holder, or the tensor itself)
            return
        assert isinstance(tensor, torch.Tensor)
        self.tensor = None
        self.dtype, self.offset = tensor.dtype, tensor.storage_offset()
        self.size, self.stride = tensor.size(), tensor.stride()
