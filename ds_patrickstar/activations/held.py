"""The blocks' inputs that a checkpoint holds outside saved tensors, as entries of activation offload
(see [Note: held inputs] in ``storages.py``)."""

from __future__ import annotations

import functools
import weakref

import torch

from ..placement.saved_meter import SavedTensorMeter
from .copies import StorageCopies
from .storages import Entry, HeldInput, Segment, State


class HeldInputs:
    """Which block inputs are entries, and the hooks that bring them back before their block's
    backward; see [Note: held inputs]."""

    def __init__(self, meter: SavedTensorMeter, copies: StorageCopies) -> None:
        self.meter, self.copies = meter, copies
        self._held_ids: dict[int, Entry] = {}  # id of a held input -> its entry, while it is alive

    def hold(self, segment: Segment, tensor: torch.Tensor) -> None:
        """``tensor``, an input of ``segment``'s block: counted while held, an entry where it moves."""
        storage = tensor.untyped_storage()
        if storage.nbytes() == 0 or self.meter.is_model(storage):
            return
        entry = self.copies.entry_of(storage)
        if entry is None and (not segment.offload or self.meter.holds(storage)):
            if not self.meter.holds(storage):
                segment.nbytes += storage.nbytes()
            self.meter.hold(tensor)
            return
        if entry is None:
            entry = self.copies.new_entry(segment, storage, None)
        if entry.held is None:
            entry.held = HeldInput(tensor)
            self._held_ids[id(tensor)] = entry
            weakref.finalize(tensor, self._held_gone, entry, id(tensor))
            weakref.finalize(storage, self.copies.storage_gone, entry, entry.ptr)

    def repeated(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is (a view of) an earlier block's input (an attention mask): then it is
        back on the accelerator, to stay."""
        entry = self._held_ids.get(id(tensor))
        if entry is None and tensor.untyped_storage().nbytes():
            entry = self.copies.entry_of(tensor.untyped_storage())
        if entry is None or entry.held is None or entry.state is State.RELEASED:
            return False
        if not entry.pinned:
            entry.pinned = True
            entry.segment.nbytes -= entry.nbytes
            self.copies.restore(entry)
            if entry.state is State.TO_DEVICE:
                self.copies.wait_before_use(entry)
        return True

    def watch_backward(self, segment: Segment, inputs: list[torch.Tensor]) -> None:
        """The next block's inputs come from ``segment``'s block: their autograd nodes run just before
        its backward (and its recomputation)."""
        nodes = {id(t.grad_fn): t.grad_fn for t in inputs if t.grad_fn is not None}
        for node in nodes.values():
            node.register_prehook(functools.partial(self._before_backward, segment))
        segment.triggered = segment.triggered or bool(nodes)

    def _before_backward(self, segment: Segment, grad_outputs: object) -> None:
        self.copies.needed_in_backward(segment)
        for entry in segment.entries:
            if entry.state is State.TO_DEVICE:
                self.copies.wait_before_use(entry)

    def _held_gone(self, entry: Entry, ident: int) -> None:
        """A held input was freed: what is off the accelerator for it alone is not needed any more."""
        if self._held_ids.get(ident) is entry:
            del self._held_ids[ident]
        if not entry.needed() and entry.state in (State.TO_HOST, State.ON_HOST, State.TO_DEVICE):
            self.copies.release_now(entry)
