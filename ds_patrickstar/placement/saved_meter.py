"""The saved-tensor meter: the bytes autograd holds for backward on the strict emulated accelerator (the tide the
memory tracer reads there, see [Note: moments and the trace] in tracer.py)."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable

import torch

from ..memory.caching_allocator import CachingAllocatorModel


class SavedTensorMeter:
    """Live bytes autograd holds for backward that are not chunk payloads (emulated accelerator).

    Installed as saved-tensor hooks around the forward; a storage is counted once while any
    saved tensor referring to it is alive, or, for a block's input (:meth:`hold`), while the
    storage itself is (see [Note: held inputs]). Each counted storage, and each one counted
    elsewhere (:meth:`allocated`), is a block of ``allocator``, the emulated accelerator's model of
    the caching allocator (see [Note: caching allocator model] in memory/caching_allocator.py).
    """

    def __init__(
        self, is_model_storage: Callable[[torch.UntypedStorage], bool], allocator: CachingAllocatorModel | None = None
    ) -> None:
        self._is_model = is_model_storage
        self._allocator = allocator
        self._live: dict[int, list[int]] = {}  # storage ptr -> [bytes, refs]
        self._held: set[int] = set()  # storage ptrs held as a block's input
        self.bytes = 0

    def is_model(self, storage: torch.UntypedStorage) -> bool:
        return self._is_model(storage)

    def holds(self, storage: torch.UntypedStorage) -> bool:
        """Whether a live saved tensor of this meter refers to ``storage``."""
        return storage.data_ptr() in self._live

    def allocated(self, key: Hashable, nbytes: int) -> None:
        """Saved bytes counted elsewhere (activation offload, under ``key``) came to the accelerator."""
        self.bytes += nbytes
        if self._allocator is not None:
            self._allocator.malloc(key, nbytes)

    def freed(self, key: Hashable, nbytes: int) -> None:
        """The bytes of :meth:`allocated` under ``key`` left the accelerator."""
        self.bytes -= nbytes
        if self._allocator is not None:
            self._allocator.free(key)

    def _release(self, key: int) -> None:
        entry = self._live.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del self._live[key]
            self.freed(key, entry[0])

    def _count(self, storage: torch.UntypedStorage) -> int:
        key = storage.data_ptr()
        entry = self._live.setdefault(key, [storage.nbytes(), 0])
        if entry[1] == 0:
            self.allocated(key, entry[0])
        entry[1] += 1
        return key

    def pack(self, tensor: torch.Tensor) -> torch.Tensor | _Saved:
        storage = tensor.untyped_storage()
        if self._is_model(storage) or storage.nbytes() == 0:
            return tensor
        holder = _Saved(tensor.detach())  # not the tensor itself: see [Note: moments and the trace]
        weakref.finalize(holder, self._release, self._count(storage))
        return holder

    def hold(self, tensor: torch.Tensor) -> None:
        """Count ``tensor``'s storage, a block's input, until the storage is freed (once per
        storage, with the saved tensors referring to it); see [Note: held inputs]."""
        storage = tensor.untyped_storage()
        if self._is_model(storage) or storage.nbytes() == 0 or storage.data_ptr() in self._held:
            return
        key = self._count(storage)
        self._held.add(key)
        weakref.finalize(storage, self._unhold, key)

    def _unhold(self, key: int) -> None:
        self._held.discard(key)
        self._release(key)

    @staticmethod
    def unpack(packed: torch.Tensor | _Saved) -> torch.Tensor:
        return packed.tensor if isinstance(packed, _Saved) else packed

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


class _Saved:
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
