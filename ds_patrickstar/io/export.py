"""Model values in and out of the chunks, streamed one chunk group at a time through the host.

[Note: state_dict]
With data parallelism a rank keeps only its own chunks between uses, and with placement a
chunk may live on the host; a parameter's view is then backed by no memory and must not
be read directly. So ``engine.module.state_dict()`` (a collective with data parallelism:
call it on every rank, as Hugging Face's save path does) fills every entry that belongs to
a chunk, under every name the parameter has (tied weights included), with a host copy,
taken one chunk group at a time: an owned chunk is copied from wherever it lives; a group
that must be gathered is all-gathered into one temporary accelerator buffer (counted
against the budget), copied to the host and freed. The accelerator never holds more than
one extra group, so models larger than the accelerator budget can be saved and exported.

``load_state_dict()`` needs no collective: each rank writes the values of the parameters
it owns into its chunks (wherever they live) and into their fp32 masters (at the
precision given; a frozen parameter has none), and takes those keys out of torch's own
copy step. :func:`ds_patrickstar.load_pretrained` streams checkpoint files through the same
:meth:`ChunkExport.write_value`. ``get_fp32_state_dict()`` streams the masters the same way.
:func:`ds_patrickstar.gathered_parameters` points every parameter at a host copy for the
duration of a ``with`` block (for reading; writes are discarded).

[Note: tied weights saved once]
Every name of a tied parameter (GPT-2's ``lm_head.weight`` and ``transformer.wte.weight``) gets
the *same* host tensor object in ``state_dict()``, so ``torch.save``, safetensors' ``save_model``
and Hugging Face's ``save_pretrained`` (which drops aliases by storage pointer) store it once, as
they do for a plain model. accelerate's ``get_state_dict`` for a DeepSpeed engine that is not
stage 3 passes the state dict through DeepSpeed's ``clone_tensors_for_torch_save``, which clones
every entry and so separates the aliases (29 tensors for a GPT-2 instead of 28). The values
``fill_state_dict`` returns are already private host copies, so they are marked
(:func:`is_host_copy`) and ``integration/save_compat.py`` lets that clone return them as they are:
the aliases survive and the model is not copied a second time.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..chunks.chunk import Chunk, TensorInfo
from ..chunks.chunk_map import ChunkMap
from ..chunks.state import TensorState
from ..groups.comm import ChunkComm
from ..memory.accelerator import Accelerator
from ..optim.states import OptimizerStates
from ..store.chunk_store import ChunkStore

_HOST_COPY = "_ds_patrickstar_host_copy"


def is_host_copy(value: object) -> bool:
    """Is ``value`` a host copy ``state_dict()`` made, which nothing else holds? See [Note: tied weights saved once]."""
    return isinstance(value, torch.Tensor) and getattr(value, _HOST_COPY, False) is True


def owned_host_values(
    chunk_map: ChunkMap, infos: list[TensorInfo], values: Callable[[Chunk], torch.Tensor] = Chunk.ready
) -> Iterator[tuple[TensorInfo, torch.Tensor]]:
    """``(tensor, its whole value as a new host tensor)`` for each of ``infos`` whose every piece lies in a
    chunk this rank owns, read where the chunk lives (``values``: the store's accessor, which reaches the
    disk tier's records too); no collective (at initialize, the owned chunks are the only ones holding
    values: see store/binding.py)."""
    for info in infos:
        chunks = [chunk_map.chunks[piece.chunk_id] for piece in info.pieces]
        if all(chunk_map.is_owned(chunk) for chunk in chunks):
            pieces = [values(chunk)[piece.in_chunk] for chunk, piece in zip(chunks, info.pieces)]
            value = pieces[0].to("cpu", copy=True) if len(pieces) == 1 else torch.cat([p.cpu() for p in pieces])
            yield info, value.view(info.shape)


class ChunkExport:
    """Streams chunk values to and from the host; see [Note: state_dict]."""

    def __init__(
        self,
        chunk_map: ChunkMap,
        comm: ChunkComm,
        store: ChunkStore,
        optim_states: OptimizerStates,
    ) -> None:
        self.map = chunk_map
        self.store = store
        self.comm = comm
        self.optim_states = optim_states
        self.accel: Accelerator = store.accel
        self._consumed: list[str] = []
        self.skip_frozen = False  # state_dict() leaves frozen parameters out (exclude_frozen_parameters)

    # ---- streaming out ------------------------------------------------------------------
    def _group_on_host(
        self, group: int, values_of: Callable[[Chunk], torch.Tensor], dtype: torch.dtype, what: str
    ) -> list[torch.Tensor]:
        """Host copies of every member's values in ``group``; ``values_of(chunk)`` gives an owned
        chunk's (ready) tensor. A collective with data parallelism."""
        members = self.map.group_members(group)
        if self.comm.world_size == 1:
            return [values_of(members[0]).to("cpu", dtype, copy=True)]
        capacity, rank = members[0].capacity, self.comm.rank
        flat = self.accel.empty(capacity * len(members), dtype, "gather", f"{what} of chunk group {group}")
        try:
            mine = flat[rank * capacity : (rank + 1) * capacity]
            mine.copy_(values_of(members[rank]))
            self.comm.all_gather_async(flat, mine, f"{what} all-gather of chunk group {group}").wait()  # in place
            return list(flat.to("cpu", copy=True).split(capacity))
        finally:
            self.accel.free(flat, "gather")

    def iter_host_groups(self, fp32_masters: bool = False) -> Iterator[tuple[list[Chunk], list[torch.Tensor]]]:
        """``(members, host values)`` per chunk group: the low-precision values, or the fp32 masters (a
        frozen group has none: its values in fp32, see [Note: frozen chunks])."""
        for group in range(self.map.num_groups):
            members = self.map.group_members(group)
            if self.skip_frozen and not self.map.is_trainable_group(group):
                continue
            if fp32_masters and not self.map.is_trainable_group(group):
                hosts = self._group_on_host(group, self.store.values, torch.float32, "frozen values")
            elif fp32_masters:
                hosts = self._group_on_host(
                    group, lambda c: self.optim_states.master_values(c.chunk_id), torch.float32, "fp32 masters"
                )
            else:
                hosts = self._group_on_host(group, self.store.values, members[0].dtype, "values")
            yield members, hosts

    @contextlib.contextmanager
    def without_frozen(self, skip: bool = True) -> Iterator[None]:
        """Inside the block (``skip``), ``state_dict()`` gathers no frozen group: DeepSpeed's
        ``exclude_frozen_parameters`` drops those entries, so their values are never read."""
        self.skip_frozen = skip
        try:
            yield
        finally:
            self.skip_frozen = False

    def frozen_names(self, module: torch.nn.Module) -> set[str]:
        """Every name of every frozen chunk parameter."""
        return {n for info, names in self.names(module, "").items() if not info.trainable for n in names}

    def names(self, module: torch.nn.Module, prefix: str) -> dict[TensorInfo, list[str]]:
        """Every name (aliases of tied or shared parameters included) of every chunk parameter."""
        names: dict[TensorInfo, list[str]] = {}
        for name, param in module.named_parameters(remove_duplicate=False):
            info = self.map.info(param)
            if info is not None:
                names.setdefault(info, []).append(prefix + name)
        return names

    def refuse_gradients(self, names: dict[TensorInfo, list[str]], action: str) -> None:
        for info in names:
            if info.state is TensorState.HOLD_AFTER_BWD:
                raise RuntimeError(
                    f"{action} was called between backward and step: the slot of {info.name} "
                    f"holds its gradient. Call it before backward or after engine.step()."
                )

    def iter_host_values(self, fp32_masters: bool = False) -> Iterator[tuple[TensorInfo, torch.Tensor]]:
        """``(tensor, its whole value as a new host tensor)`` for every chunk parameter, streamed one
        chunk group at a time (a straddling tensor is joined from its pieces)."""
        for members, hosts in self.iter_host_groups(fp32_masters):
            host_of = {chunk.chunk_id: host for chunk, host in zip(members, hosts)}
            for info in dict.fromkeys(info for chunk in members for info in chunk.tensors):
                pieces = [host_of[p.chunk_id][p.in_chunk] for p in info.pieces]
                value = pieces[0].clone() if len(pieces) == 1 else torch.cat(pieces)
                yield info, value.view(info.shape)

    @torch.no_grad()
    def fill_state_dict(self, module: torch.nn.Module, state_dict: dict, prefix: str) -> None:
        names = self.names(module, prefix)
        self.refuse_gradients(names, "state_dict()")
        for info, value in self.iter_host_values():
            setattr(value, _HOST_COPY, True)  # see [Note: tied weights saved once]
            for key in names.get(info, ()):
                if key in state_dict:
                    state_dict[key] = value  # one object for every name of a tied parameter

    @torch.no_grad()
    def fp32_state_dict(self, module: torch.nn.Module) -> dict[str, torch.Tensor]:
        """Every parameter's full fp32 value on the host, keyed by every name it has (a tied
        ``lm_head.weight`` appears beside ``transformer.wte.weight``)."""
        names = self.names(module, "")
        result = {}
        for info, value in self.iter_host_values(fp32_masters=True):
            for key in names.get(info, ()):
                result[key] = value
        for name, param in module.named_parameters(remove_duplicate=False):
            if self.map.info(param) is None:
                result[name] = param.detach().float().cpu().clone()
        return {name: result[name] for name, _ in module.named_parameters(remove_duplicate=False)}

    # ---- streaming in -------------------------------------------------------------------
    def writing(self) -> contextlib.AbstractContextManager[None]:
        """Inside the block, values written into frozen chunks on disk reach their records (see
        [Note: frozen chunks on disk])."""
        disk = self.store.disk
        return disk.writing() if disk is not None else contextlib.nullcontext()

    @torch.no_grad()
    def load_from_state_dict(
        self, module: torch.nn.Module, state_dict: dict, prefix: str, error_msgs: list[str]
    ) -> None:
        """Write the owned parameters' values into their chunks and take their keys out of torch's
        copy step (:meth:`finish_load` tells torch they were not missing)."""
        names = self.names(module, prefix)
        self.refuse_gradients(names, "load_state_dict()")
        self._consumed = []
        with self.writing():
            for info, keys in names.items():
                for key in keys:
                    if key not in state_dict:
                        continue
                    self._consumed.append(key)
                    self.write_value(info, key, state_dict.pop(key), error_msgs)

    @torch.no_grad()
    def write_value(self, info: TensorInfo, key: str, value: torch.Tensor, error_msgs: list[str]) -> None:
        """``value`` into the parameter's slot and its fp32 master (full precision), if this rank owns
        its chunk; a shape mismatch goes to ``error_msgs`` (torch's wording)."""
        if tuple(value.shape) != tuple(info.shape):
            error_msgs.append(
                f"size mismatch for {key}: copying a param with shape {tuple(value.shape)} "
                f"from checkpoint, the shape in current model is {tuple(info.shape)}."
            )
            return
        flat = value.reshape(-1)
        self.map.write_pieces(info, flat, self.store.values)
        for piece in info.pieces:  # spilled masters piece by piece through the disk tier's cache
            if piece.chunk_id in self.optim_states.chunks:
                self.optim_states.write_values(piece.chunk_id, "master", piece.offset, flat[piece.in_param])

    def finish_load(self, incompatible_keys: Any) -> None:
        self.optim_states.flush()  # spilled masters written through the cache go back to disk
        consumed = set(self._consumed)
        incompatible_keys.missing_keys[:] = [k for k in incompatible_keys.missing_keys if k not in consumed]
        self._consumed = []


@contextlib.contextmanager
def host_parameters(export: ChunkExport) -> Iterator[None]:
    """Every chunk parameter points at a host copy of its value inside the block."""
    saved: dict[TensorInfo, torch.Tensor] = {}
    for info, value in export.iter_host_values():
        saved[info] = info.param.data
        info.param.data = value
    try:
        yield
    finally:
        for info, view in saved.items():
            info.param.data = view
            export.store.accel.released_views.settle(info.param)  # see [Note: released parameters read as empty]
