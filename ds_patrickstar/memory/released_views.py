"""Parameters whose memory is released read as empty tensors, not as views of no memory.

[Note: released parameters read as empty]
A chunk parameter is a view of its chunk's memory (see [Note: storage resize] in chunks/chunk.py),
which is resized to zero bytes while the chunk is released: with data parallelism the other ranks'
chunks between uses, and an owned chunk's accelerator payload while it lives on the host. A view of
a zero-byte storage still has its shape, and reading it reads address 0: the process dies (a
segfault on the host; DeepSpeed's checkpoint tests compare two models' parameters between uses and
their ranks died, which their harness saw as a hang). So each bound parameter is registered here
with its view, and the accelerator reports each storage it frees and gives memory back: while the
view's storage holds no bytes the parameter points at an empty tensor of its own (0 elements, its
dtype and device, as stock stage 3 shows a ``NOT_AVAILABLE`` parameter), and at the view again once
the storage has its bytes. A parameter pointed elsewhere meanwhile (a host copy inside
``GatheredParameters`` or ``state_dict``, its values given back at ``destroy``) is left alone; code
that points it back at what it held before calls :meth:`ReleasedViews.settle`. The shape stays in
our metadata (``TensorInfo.shape``, which code after binding reads instead of ``param.shape``: the
deferred init's scratch parameters) and in ``ds_shape``; ``param.data = ...`` keeps the parameter's
autograd identity, hooks and version counter.

Only while no autograd graph of the run is alive (the run is ``IDLE`` or ``BACKWARD_DONE``, see
[Note: run state]): autograd reads a parameter's sizes when it accumulates its gradient, and a
tied weight's chunk is released between its backward uses, before that (see
[Note: tied weights between backward uses]). A storage freed during an iteration leaves its
parameters as views (our hooks read nothing there) and is noted; the run reaching a settled phase
points them at their empty tensors (:meth:`ReleasedViews.sweep`, only the noted storages). A
parameter's view comes back whenever its storage gets its bytes.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch


def _key(tensor: torch.Tensor) -> int:
    """The storage object (not its address, which is 0 while released)."""
    return tensor.untyped_storage()._cdata


@dataclass(eq=False)
class _Bound:
    param: weakref.ref
    view: torch.Tensor
    empty: torch.Tensor


class ReleasedViews:
    """The bound parameters of one accelerator, by the storage their view is of; see
    [Note: released parameters read as empty]."""

    def __init__(self) -> None:
        self._by_storage: dict[int, list[_Bound]] = {}
        self._by_param: dict[int, _Bound] = {}
        self.allowed: Callable[[], bool] = lambda: True  # the run's RunState.settled once there is a run
        self._noted: set[int] = set()  # storages freed while not allowed

    def bind(self, param: torch.Tensor) -> None:
        """``param`` is a view of chunk memory now: it follows that memory from here on."""
        view = param.data
        bound = _Bound(weakref.ref(param), view, torch.empty(0, dtype=view.dtype, device=view.device))
        self._by_storage.setdefault(_key(view), []).append(bound)
        self._by_param[id(param)] = bound
        self._follow(bound)

    def released(self, tensor: torch.Tensor) -> None:
        """``tensor``'s storage went to zero bytes."""
        key = _key(tensor)
        if key in self._by_storage and not self.allowed():
            self._noted.add(key)
            return
        for bound in self._by_storage.get(key, ()):
            self._follow(bound)

    def backed(self, tensor: torch.Tensor) -> None:
        """``tensor``'s storage has its bytes again."""
        key = _key(tensor)
        self._noted.discard(key)
        for bound in self._by_storage.get(key, ()):
            self._follow(bound)

    def sweep(self) -> None:
        """The run is settled: the parameters of the storages freed meanwhile point at their empty tensors."""
        noted, self._noted = self._noted, set()
        for key in noted:
            for bound in self._by_storage.get(key, ()):
                self._follow(bound)

    def settle(self, param: torch.Tensor) -> None:
        """``param`` was pointed back at its view (or its empty tensor): at the one that fits now."""
        bound = self._by_param.get(id(param))
        if bound is not None and bound.param() is param:
            self._follow(bound)

    @torch.no_grad()
    def _follow(self, bound: _Bound) -> None:
        param = bound.param()
        if param is None:
            return
        now = _key(param)
        if now != _key(bound.view) and now != _key(bound.empty):
            return  # pointed elsewhere: not ours to change
        backed = bound.view.untyped_storage().nbytes() > 0
        if not backed and not self.allowed():
            self._noted.add(_key(bound.view))
            return
        target = bound.view if backed else bound.empty
        if now != _key(target):
            param.data = target
