"""ZeRO-3's per-parameter surface on chunk parameters: ``ds_id``, ``ds_shape``, ``ds_numel``, ``ds_status``,
``deepspeed.utils.safe_get/set_full_*`` and ``safe_*_local_*``, ``deepspeed.zero.GatheredParameters``.

[Note: ZeRO-3 parameter attributes]
DeepSpeed's ``deepspeed.utils`` functions (``tensor_fragment.py``) and ``deepspeed.zero.GatheredParameters`` find
a stage-3 parameter by its attribute ``ds_id`` and call its stage-3 optimizer, ``param._z3_optimizer``, and its
methods ``all_gather``/``partition``. So at the end of a "patrickstar" initialize every chunk parameter (trainable
or frozen) gets those attributes, as stock's ``zero.Init`` gives them, with :class:`Zero3Params` as its
``_z3_optimizer``, and ``engine.destroy()`` takes them off again; no DeepSpeed function is wrapped:

* ``ds_id`` (its index in the chunk map, the same on every rank), ``ds_shape``, ``ds_numel``,
  ``ds_process_group`` (the data-parallel group), ``ds_persist`` (True where every chunk group the parameter
  lies in stays gathered between steps, see [Note: persistent chunk groups]); ``ds_status`` is ``AVAILABLE``
  while a module uses the parameter (its tensor state is ``COMPUTE``: inside the forward of its module, also
  nested, and in its backward) and inside ``GatheredParameters``, ``NOT_AVAILABLE`` otherwise (its full value
  is not readable through ``param.data`` between uses), as stage 3's between its fetch and its release;
* ``safe_get_full_fp32_param``/``safe_get_full_optimizer_state`` (``"exp_avg"``, ``"exp_avg_sq"``; with SGD
  ``"momentum_buffer"``): the full fp32
  value, each rank contributing the pieces of the chunks it owns (a collective: call it on every rank, as
  stock's); ``safe_set_full_*`` write the owned pieces of the value given (the same on every rank) into the
  fp32 master or state: as stock, the low-precision parameter follows at the next step. A frozen parameter
  has none: None, as stock returns for ``requires_grad=False``;
* the ``_local_`` variants read or write this rank's share: the elements of the parameter in the chunks it
  owns, in element order (a parameter lies in one chunk or straddles a few: a rank may own none of it, and the
  shares differ from stock's 1/W slices; all ranks' shares in rank order are the whole parameter);
* gradients (``safe_get/set_full_grad``, ``safe_get/set_local_grad``, ``safe_update_full_grad_vectorized``)
  between backward and step, read and written where they live (the owned slots or the fp32 accumulators; see
  [Note: gradients between backward and step] in zero3_grads.py), shared out as the fp32 values are;
* ``GatheredParameters(params, modifier_rank=r)``: ``all_gather`` points each listed parameter at a copy of its
  full value on the device the parameter lives on (one streamed pass over the chunk groups through the host, a
  collective), ``partition`` writes the values
  back into the chunks and fp32 masters when the block changed them (``modifier_rank``: after stock's
  broadcast, so every rank writes its own pieces) and points the parameters at their chunks again. Training
  forwards inside the block are not supported; forwards with the hooks off are (generation: see
  [Note: hooks for generation] in generation_hooks.py). A parameter a module is using (state COMPUTE) is left as
  it is: its values are there (stock's ``zero.Init`` leaves ``F.linear`` replaced by a function whose
  backward calls ``weight.all_gather()`` for a ``NOT_AVAILABLE`` weight; it must stay a no-op there).
"""

from __future__ import annotations

import itertools
import types
import weakref
from collections.abc import Callable
from typing import Any

import torch
from deepspeed import comm as dist
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

from ..chunks.chunk import TensorInfo
from ..chunks.state import TensorState
from ..groups.persistent import persistent_tensors
from .zero3_grads import ChunkGradients

_ATTRIBUTES = (
    "ds_id",
    "ds_shape",
    "ds_numel",
    "ds_status",
    "ds_process_group",
    "ds_persist",
    "_z3_optimizer",
    "all_gather",
    "partition",
)
_SERIALS = itertools.count()  # engines in the order this process made them: the same order on every rank
_STATES = {None: "master", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}
_SGD_STATES = {None: "master", "momentum_buffer": "exp_avg"}  # torch's SGD's key (see [Note: SGD on chunks])


class Zero3Params:
    """The ``_z3_optimizer`` of every chunk parameter; see [Note: ZeRO-3 parameter attributes]."""

    def __init__(self, optimizer: Any, engine: weakref.ref | None = None) -> None:
        self.engine = engine  # see [Note: a second initialize on a live model]
        self.serial = next(_SERIALS)  # the order several engines gather in (see _by_engine)
        self.chunk_map, self.states, self.export = optimizer.chunk_map, optimizer.optim_states, optimizer.export
        self.manager = optimizer.manager
        self.state_keys = _SGD_STATES if optimizer.adam.rule.sgd else _STATES
        self.group = optimizer.dp_process_group
        self.saved_views: dict[TensorInfo, torch.Tensor] = {}
        self.grads = ChunkGradients(self.chunk_map, self.manager, self.group)

    # ---- attributes -------------------------------------------------------------------------
    def expose(self) -> None:
        group = self.group if self.group is not None else dist.get_world_group()
        persistent = persistent_tensors(self.chunk_map, self.manager.persistent.indices)
        for ds_id, info in enumerate(self.chunk_map.infos()):
            param = info.param
            param.ds_id, param.ds_shape, param.ds_numel = ds_id, info.shape, info.numel
            param.ds_process_group, param._z3_optimizer = group, self
            param.ds_persist = info in persistent  # see [Note: persistent chunk groups]
            param.all_gather = types.MethodType(_all_gather, param)
            param.partition = types.MethodType(_partition, param)
            info.on_use = self._use_changed
            self._use_changed(info, info.state is TensorState.COMPUTE)

    def _use_changed(self, info: TensorInfo, in_use: bool) -> None:
        """``ds_status`` follows the tensor's use: ``AVAILABLE`` while a module uses it (``COMPUTE``) or inside
        ``GatheredParameters``, as stage 3's is between its fetch and its release."""
        available = in_use or info in self.saved_views
        info.param.ds_status = ZeroParamStatus.AVAILABLE if available else ZeroParamStatus.NOT_AVAILABLE  # type: ignore[attr-defined]

    def remove(self) -> None:
        for info in self.chunk_map.infos():
            info.on_use = None
            for name in _ATTRIBUTES:
                if name in info.param.__dict__:
                    delattr(info.param, name)

    # ---- fp32 values and optimizer states -----------------------------------------------------
    def _info(self, param: torch.Tensor) -> TensorInfo | None:
        info = self.chunk_map.info(param)
        return info if info is not None and info.trainable else None

    def _key(self, optim_state_key: str | None) -> str:
        if optim_state_key not in self.state_keys:
            kept = " and ".join(repr(key) for key in self.state_keys if key)
            raise ValueError(f"optim_state_key={optim_state_key!r}: stage 'patrickstar' keeps {kept}")
        return self.state_keys[optim_state_key]

    def _owned(self, info: TensorInfo) -> list:
        return [piece for piece in info.pieces if piece.chunk_id in self.states.chunks]

    def _read(self, info: TensorInfo, key: str, piece: Any) -> torch.Tensor:
        values = torch.empty(piece.numel, dtype=torch.float32)
        for lo, state in self.states.slices(piece.chunk_id, piece.offset, piece.offset + piece.numel):
            part = getattr(state, key)
            values[lo - piece.offset : lo - piece.offset + part.numel()].copy_(part)
        return values

    def _write(self, key: str, piece: Any, values: torch.Tensor) -> None:
        self.states.write_values(piece.chunk_id, key, piece.offset, values.detach().to("cpu", torch.float32))

    @torch.no_grad()
    def get_full_hp_param(self, param: torch.Tensor, optim_state_key: str | None = None) -> torch.Tensor | None:
        info, key = self._info(param), self._key(optim_state_key)
        if info is None:
            return None
        full = torch.zeros(info.numel, dtype=torch.float32)
        for piece in self._owned(info):
            full[piece.in_param] = self._read(info, key, piece)
        if dist.get_world_size(group=self.group) > 1:
            dist.all_reduce(full, group=self.group)  # each element comes from its one owner; the rest add zeros
        return full.view(info.shape)

    @torch.no_grad()
    def set_full_hp_param(self, value: torch.Tensor, param: torch.Tensor, optim_state_key: str | None = None) -> None:
        info, key = self._info(param), self._key(optim_state_key)
        if info is None:
            return
        if value.numel() != info.numel:
            raise ValueError(f"{info.name}: a value of {value.numel()} elements for a parameter of {info.numel}")
        flat = value.reshape(-1)
        for piece in self._owned(info):
            self._write(key, piece, flat[piece.in_param])
        self.states.flush()

    @torch.no_grad()
    def get_local_fp32_param(self, param: torch.Tensor, optim_state_key: str | None = None) -> torch.Tensor | None:
        info, key = self._info(param), self._key(optim_state_key)
        if info is None:
            return None
        parts = [self._read(info, key, piece) for piece in self._owned(info)]
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.float32)

    @torch.no_grad()
    def set_local_hp_param(self, value: torch.Tensor, param: torch.Tensor, optim_state_key: str | None = None) -> None:
        info, key = self._info(param), self._key(optim_state_key)
        if info is None:
            return
        owned, flat, at = self._owned(info), value.reshape(-1), 0
        if flat.numel() != sum(piece.numel for piece in owned):
            raise ValueError(
                f"{info.name}: a local value of {flat.numel()} elements; this rank's share has "
                f"{sum(piece.numel for piece in owned)} (safe_get_local_fp32_param gives its shape)"
            )
        for piece in owned:
            self._write(key, piece, flat[at : at + piece.numel])
            at += piece.numel
        self.states.flush()

    # ---- gradients (see [Note: gradients between backward and step] in zero3_grads.py) -------------
    def get_fp32_grad_for_param(self, param: torch.Tensor) -> torch.Tensor | None:
        info = self._info(param)
        return None if info is None else self.grads.get_full(info)

    def set_fp32_grad_for_param(self, value: torch.Tensor, param: torch.Tensor) -> None:
        info = self._info(param)
        if info is not None:
            self.grads.set_full(info, value)

    def get_local_fp32_grad_for_param(self, param: torch.Tensor) -> torch.Tensor | None:
        info = self._info(param)
        return None if info is None else self.grads.get_local(info)

    def set_local_grad_for_param(self, value: torch.Tensor, param: torch.Tensor) -> None:
        info = self._info(param)
        if info is not None:
            self.grads.set_local(info, value)

    def update_fp32_grad_for_param_vectorized(self, update_func: Callable, param_list: list[torch.Tensor]) -> None:
        for param in param_list:
            info = self._info(param)
            if info is not None:
                self.grads.set_full(info, update_func(self.grads.get_full(info), param))

    # ---- GatheredParameters -------------------------------------------------------------------
    @torch.no_grad()
    def gather(self, params: list[torch.Tensor]) -> None:
        infos = [self.chunk_map.info(p) for p in params]
        # in use by a module (stage 3's linear gathers its weight in backward): its values are there already
        wanted = {info: info.param for info in infos if info is not None and info.state is not TensorState.COMPUTE}
        if not wanted:
            return
        self.export.refuse_gradients({info: [info.name] for info in wanted}, "GatheredParameters")
        for info, value in self.export.iter_host_values():
            if info in wanted and info not in self.saved_views:
                self.saved_views[info] = info.param.data
                info.param.data = value.to(info.param.device)  # where the module runs, as stock's
                info.param.ds_status = ZeroParamStatus.AVAILABLE

    @torch.no_grad()
    def release(self, params: list[torch.Tensor], has_been_updated: bool) -> None:
        errors: list[str] = []
        with self.export.writing():
            for info in (self.chunk_map.info(p) for p in params):
                if info is None or info not in self.saved_views:
                    continue
                if has_been_updated:
                    self.export.write_value(info, info.name, info.param.data, errors)
                info.param.data = self.saved_views.pop(info)
                self.export.store.accel.released_views.settle(info.param)  # its chunk may be released meanwhile
                self._use_changed(info, info.state is TensorState.COMPUTE)
        self.states.flush()
        if has_been_updated:
            self.manager.release_all_groups()  # no other rank's chunk stays gathered with its old values
        if errors:
            raise RuntimeError("; ".join(errors))


def _by_engine(first: torch.Tensor, param_list: list[torch.Tensor] | None) -> list[tuple[Zero3Params, list]]:
    """The listed parameters per engine that exposes them, the engines in the order they were made (the same on
    every rank): stock's ``GatheredParameters`` takes parameters of several models at once (e.g. a trained and a
    loaded one) and calls the first one's ``all_gather`` with all of them. Not in the list's order: stock sorts
    a set of them by ``ds_id``, and two engines' parameters share ``ds_id`` values, so which engine's comes first
    differs from rank to rank (each gather is a collective: a different order on two ranks deadlocks)."""
    owners: dict[int, tuple[Zero3Params, list]] = {}
    for param in param_list if param_list is not None else [first]:
        owner = getattr(param, "_z3_optimizer", None)
        if isinstance(owner, Zero3Params):
            owners.setdefault(id(owner), (owner, []))[1].append(param)
    return sorted(owners.values(), key=lambda pair: pair[0].serial)


def _all_gather(self: torch.Tensor, param_list: list[torch.Tensor] | None = None, **kwargs: Any) -> None:
    for owner, params in _by_engine(self, param_list):
        owner.gather(params)


def _partition(
    self: torch.Tensor, param_list: list[torch.Tensor] | None = None, has_been_updated: bool = False, **kwargs: Any
) -> None:
    for owner, params in _by_engine(self, param_list):
        owner.release(params, has_been_updated)
