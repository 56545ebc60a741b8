"""The copies of one offloaded accelerator storage (an :class:`Entry`) to pinned host memory and
back, and what they count: the meter's tide, the host bytes, the step counters (see [Note: activation
offload] in ``offloader.py``)."""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable

import torch

from ..counters import StepCounters
from ..memory.accelerator import Accelerator
from ..placement.saved_meter import SavedTensorMeter
from .host_stack import HostStack
from .storages import Entry, Segment, State

logger = logging.getLogger(__name__)


class StorageCopies:
    """Each entry's way off the accelerator and back, from its first saved tensor (or held input) to
    its release; see [Note: activation offload]."""

    def __init__(
        self, accel: Accelerator, meter: SavedTensorMeter, counters: StepCounters, clock: Callable[[], int]
    ) -> None:
        self.accel, self.meter, self.counters = accel, meter, counters
        self._clock = clock  # the current moment of the iteration
        self._by_storage: dict[int, Entry] = {}  # accelerator storage -> its entry, while held
        self.host_stack = HostStack(accel)  # the host buffers (see [Note: activation host stack])
        self.host_bytes = 0  # bytes of offloaded activations off the accelerator now

    def entry_of(self, storage: torch.UntypedStorage) -> Entry | None:
        """The entry of the accelerator storage ``storage``, while it has one."""
        return self._by_storage.get(storage.data_ptr())

    def new_entry(self, segment: Segment, storage: torch.UntypedStorage, view: torch.Tensor | None) -> Entry:
        """A storage of ``segment``, counted on the accelerator; ``view`` (set to it) keeps it alive."""
        device = view.set_(storage) if view is not None else None
        entry = Entry(device, storage.nbytes(), segment, storage=weakref.ref(storage), ptr=storage.data_ptr())
        self._by_storage[entry.ptr] = entry
        segment.entries.append(entry)
        segment.nbytes += entry.nbytes
        self._charge(entry, entry.nbytes)
        return entry

    # ---- to the host ------------------------------------------------------------------------
    def copy_out(self, entry: Entry) -> None:
        """Issue ``entry``'s copy to a pinned host buffer; its accelerator storage stays until it has run."""
        entry.device = entry.kept()  # the copy's source, alive until the copy has run
        assert entry.device is not None
        entry.move(State.TO_HOST)
        entry.host = self.host_stack.take(entry.nbytes)
        entry.pending = self.accel.bytes_to_host(entry.device, entry.host)
        self.counters.activation_bytes_offloaded += entry.nbytes

    def leave(self, entry: Entry) -> None:
        """Wait on the copy out; then the accelerator storage is dropped (a held input emptied), unless
        something else still holds it; then it stays, and nothing moved (see [Note: held inputs])."""
        assert entry.pending is not None
        entry.pending.wait_host()
        entry.empty_held()
        entry.device, entry.pending = None, None
        storage = entry.storage() if entry.storage is not None else None
        if storage is not None:
            self._held_elsewhere(entry, storage)
            return
        entry.move(State.ON_HOST)
        if self._by_storage.get(entry.ptr) is entry:
            del self._by_storage[entry.ptr]
        self._charge(entry, -entry.nbytes)
        self.host_bytes += entry.nbytes
        if not entry.needed():
            self.release_now(entry)

    def _held_elsewhere(self, entry: Entry, storage: torch.UntypedStorage) -> None:
        """The accelerator storage outlived the drop: ``entry`` keeps it, the host copy is given back."""
        entry.move(State.BACK)
        entry.refill_held(storage)
        if entry.refs:
            entry.device = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
        assert entry.host is not None
        self.host_stack.give(entry.host)
        entry.host = None
        self.counters.activation_bytes_offloaded -= entry.nbytes
        entry.segment.nbytes -= entry.nbytes
        logger.debug("ds_patrickstar: a %d B activation is held elsewhere too: it stays", entry.nbytes)

    # ---- back to the accelerator -----------------------------------------------------------
    def needed_in_backward(self, segment: Segment) -> None:
        """The first use of ``segment`` in backward brings it back, and the previous one (the prefetch:
        the next block in backward order) unless that one comes back at its own backward."""
        segment.begun = True
        if segment.restore_at < 0:
            self._bring_back(segment)
            previous = segment.previous
            if previous is not None and previous.ahead and previous.restore_at < 0:
                self._bring_back(previous)

    def _bring_back(self, segment: Segment) -> None:
        segment.restore_at = self._clock()
        for entry in segment.entries:
            self.restore(entry)

    def restore(self, entry: Entry) -> None:
        """Issue ``entry``'s copy back, if it left (a held input points at the new storage at once)."""
        if entry.state in (State.ON_DEVICE, State.TO_HOST):  # never left: keep the accelerator storage
            if entry.state is State.TO_HOST:
                assert entry.host is not None
                self.host_stack.give(entry.host, after=entry.pending)
                entry.host, entry.pending = None, None
            entry.move(State.BACK)
            if not entry.refs and entry.held is not None:
                entry.device = None
        elif entry.state is State.ON_HOST:
            assert entry.host is not None
            entry.move(State.TO_DEVICE)
            entry.device, entry.pending = self.accel.bytes_to_device(entry.host)
            storage = entry.device.untyped_storage()
            entry.storage, entry.ptr = weakref.ref(storage), storage.data_ptr()
            if entry.refill_held(storage):
                weakref.finalize(storage, self.storage_gone, entry, entry.ptr)
            self._charge(entry, entry.nbytes)
            self.counters.activation_bytes_restored += entry.nbytes

    def call_back(self, entry: Entry) -> bool:
        """Undo ``entry``'s copy back before its first use: waited on, the accelerator storage dropped (a held input
        emptied again), the host copy kept for its block's backward; whether it could (a held input a saved tensor
        refers to as well keeps the storage: it stays). See [Note: activations give way] in give_way.py."""
        if entry.state is not State.TO_DEVICE or (entry.held is not None and entry.refs):
            return False
        assert entry.pending is not None
        entry.pending.wait_host()  # the destination outlives its copy
        entry.move(State.ON_HOST)
        entry.empty_held()
        entry.device, entry.pending, entry.storage = None, None, None
        self._charge(entry, -entry.nbytes)
        return True

    def wait_before_use(self, entry: Entry) -> None:
        """The copy back has completed before the storage is read (see [Note: activation offload])."""
        assert entry.pending is not None
        entry.pending.wait()
        self.back_home(entry)

    def back_home(self, entry: Entry) -> None:
        """The copy back of ``entry`` has been waited on: its host buffer goes back to the pool."""
        entry.move(State.BACK)
        assert entry.host is not None
        self.host_stack.give(entry.host, after=entry.pending)
        self.host_bytes -= entry.nbytes
        entry.host, entry.pending = None, None  # the copy keeps its buffers until it is dropped
        if not entry.refs and entry.held is not None:
            entry.device = None  # the storage lives as long as its holder does

    # ---- the end of an entry ---------------------------------------------------------------
    def release(self, entry: Entry) -> None:
        """A saved tensor is gone (autograd freed it); the storage goes with the last one, unless a
        held input still refers to it."""
        entry.refs -= 1
        if entry.refs:
            return
        if not entry.needed():
            self.release_now(entry)
        elif entry.state in (State.ON_DEVICE, State.BACK):
            entry.device = None  # the storage lives as long as its holder does

    def storage_gone(self, entry: Entry, ptr: int) -> None:
        """The accelerator storage of a held input was freed (its holder let it go)."""
        if entry.ptr == ptr and entry.state in (State.ON_DEVICE, State.BACK) and not entry.refs:
            self.release_now(entry)

    def release_now(self, entry: Entry) -> None:
        """Nothing refers to ``entry`` any more: its buffers go, once the copy in flight has run. The entry is
        ``RELEASED`` first: letting go of its storage below can run that storage's finalizer at once
        (:meth:`storage_gone`), which must find it released, not release it again (the meter freed its block
        twice)."""
        state = entry.state
        entry.move(State.RELEASED)
        if state in (State.TO_HOST, State.TO_DEVICE):
            assert entry.pending is not None
            entry.pending.wait_host()  # the source (resp. destination) must outlive its copy
        if entry.host is not None:
            self.host_stack.give(entry.host, after=entry.pending)
            self.host_bytes -= entry.nbytes if state in (State.ON_HOST, State.TO_DEVICE) else 0
        if state is not State.ON_HOST:
            self._charge(entry, -entry.nbytes)
        if self._by_storage.get(entry.ptr) is entry:
            del self._by_storage[entry.ptr]
        entry.device, entry.host, entry.pending = None, None, None

    def _charge(self, entry: Entry, nbytes: int) -> None:
        """``entry``'s accelerator storage came (``nbytes`` > 0) or went (< 0)."""
        if nbytes > 0:
            self.meter.allocated(entry, nbytes)
        else:
            self.meter.freed(entry, -nbytes)
        counters = self.counters
        counters.peak_activation_bytes_device = max(counters.peak_activation_bytes_device, self.meter.bytes)
