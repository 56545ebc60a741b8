"""Checkpoints: the optimizer's state in DeepSpeed's folder layout and resharding (the commit of a
save, its markers and checks: ``commit.py``).

[Note: checkpoint format]
DeepSpeed writes, per tag, ``mp_rank_00_model_states.pt`` (the module's full
``state_dict``, LR scheduler, step counters, ``client_state``) and one
``*zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` per data-parallel rank holding
``optimizer.state_dict()``. Ours is :func:`optimizer_state` below: the owned chunks' fp32
master, momentum and variance as whole flat tensors, plus the layout that maps every
parameter name to ``(shape, pieces)``, a piece being ``(chunk, offset, start, numel)``:
elements ``start ..`` of the flattened parameter at ``offset`` in ``chunk`` (see
[Note: straddling tensors]; files of format 1, one whole piece per parameter, load too).
Because the layout is per parameter, a checkpoint can be loaded into any world size or
chunk size: each rank reads the saved files whose chunks cover the pieces it now owns (at an
unchanged world size, only its own: :func:`owned_optimizer_files`) and copies those elements.

[Note: loading without pickle]
Our files are read weights-only (:func:`load_file`): tensors, containers, numbers and strings,
plus DeepSpeed's two loss-scaler classes (the optimizer state holds the scaler), and nothing
that runs code while it is read, so a checkpoint from elsewhere cannot execute anything through
``engine.load_checkpoint``'s optimizer files or ``python -m ds_patrickstar.zero_to_fp32``. A file
holding anything else is refused with a :class:`CheckpointError` naming it. The model-states file
also carries ``client_state`` (any objects the user saved); ``engine.load_checkpoint`` leaves that
file to DeepSpeed, which unpickles it as for every stage, and checks its parameter shapes first
when they can be read weights-only.

[Note: disk tier checkpoints]
A chunk whose states live in the disk tier is saved as a file of its own in the tag folder
(``ds_patrickstar_optim_rank<r>_chunk<id>.states``: its master, momentum and variance, each
padded to 4 KiB, whatever the swap files' pieces), copied piece by piece through the tier's
one-piece cache (see [Note: swap pieces]), so a save holds no more than one piece of a spilled
chunk in RAM; the optimizer file names it (``{"file", "numel", "stride"}``) instead of holding
tensors. The files are written (and fsynced) before DeepSpeed writes the optimizer file,
so the completion marker lists them and checks their sizes like every other file. Loading (any
world size) and ``zero_to_fp32`` read the slices they need from such a file on demand
(:func:`saved_values`); a run with the disk tier loads them into its own tier piece by piece.
"""

from __future__ import annotations

import math
import os
import pickle
import re
from collections.abc import Iterable, Iterator
from typing import Any

import numpy
import torch
from deepspeed.runtime.fp16.loss_scaler import LossScalerBase

from ..chunks.chunk import Piece
from ..chunks.chunk_map import ChunkMap, owner_of
from ..disk.io import align_up
from ..optim.states import STATE_KEYS, OptimizerStates
from .commit import FORMAT, CheckpointError, check_same_update, listed, read_marker, resolve_tag, verify_complete

_FORMATS = (FORMAT, "ds_patrickstar/1")
OPTIM_GLOB = "*zero_pp_rank_*_mp_rank_*_optim_states.pt"
FOLDER_KEY = "_folder"  # set on load: the tag folder a saved dict's states files are in


def check_model_file(chunk_map: ChunkMap, load_dir: str, tag: str) -> None:
    """Compare the parameter shapes DeepSpeed recorded in the model file with this model."""
    path = os.path.join(load_dir, tag, "mp_rank_00_model_states.pt")
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint {os.path.join(load_dir, tag)!r} has no mp_rank_00_model_states.pt")
    try:
        saved = load_file(path)
    except CheckpointError:
        return  # client_state objects: DeepSpeed unpickles the file next; the optimizer files' layouts are checked
    shapes = {}
    for group in saved.get("param_shapes") or []:
        shapes.update(group)
    check_same_shapes(chunk_map, shapes)


def load_file(path: str) -> Any:
    """One of our checkpoint files, weights-only; see [Note: loading without pickle]."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler

    with torch.serialization.safe_globals([LossScaler, DynamicLossScaler]):
        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as err:
            detail = next((line.strip() for line in str(err).splitlines() if "GLOBAL" in line), "")
            raise CheckpointError(
                f"{path!r} holds objects other than tensors, containers, numbers and DeepSpeed's loss scaler "
                f"({detail or err}); ds_patrickstar reads checkpoint files weights-only, so that a file from "
                f"elsewhere cannot run code. Load it only if you trust its source, with torch.load(..., "
                f"weights_only=False)."
            ) from None


# ---- optimizer state ----------------------------------------------------------------
def optimizer_state(
    chunk_map: ChunkMap,
    states: OptimizerStates,
    group_steps: list[int],
    loss_scaler: LossScalerBase,
    param_groups: list[dict],
    folder: str | None = None,
    update: str = "Adam",
) -> dict[str, Any]:
    """This rank's part of the checkpoint; see [Note: checkpoint format]; ``update``: the optimizer's (see
    [Note: SGD on chunks]), which a load checks. The states are copied to
    the host one chunk at a time (those on the accelerator), so saving needs no accelerator memory;
    with ``folder`` (the tag folder of a save) spilled states go into files of their own there,
    chunk by chunk, piece by piece (see [Note: disk tier checkpoints])."""
    layout = {
        info.name: (tuple(info.shape), [(p.chunk_id, p.offset, p.start, p.numel) for p in info.pieces])
        for info in chunk_map.trainable_infos()  # frozen ones are in the module state (see [Note: frozen chunks])
    }
    chunks: dict[int, dict[str, Any]] = {}
    for cid in sorted(states.chunks):
        if cid in states.spilled and folder is not None:
            chunks[cid] = _write_states_file(states, cid, chunk_map.rank, folder)
        elif cid in states.spilled:
            chunks[cid] = states.spilled_copy(cid)
        else:
            opt = states.state(cid)  # .cpu(): the host states themselves, no copy
            chunks[cid] = {"master": opt.master.cpu(), "exp_avg": opt.exp_avg.cpu(), "exp_avg_sq": opt.exp_avg_sq.cpu()}
    return {
        "format": FORMAT,
        "rank": chunk_map.rank,
        "world_size": chunk_map.world_size,
        "layout": layout,
        "chunks": chunks,
        "group_steps": list(group_steps),
        "loss_scaler": loss_scaler,
        "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in param_groups],
        "update": update,
    }


_KEYS = STATE_KEYS


def _write_states_file(states: OptimizerStates, cid: int, rank: int, folder: str) -> dict[str, Any]:
    """A spilled chunk's states, copied into the tag folder piece by piece (master, momentum and
    variance each padded to the alignment, whatever the swap files' pieces); the entry that names it."""
    name = f"ds_patrickstar_optim_rank{rank}_chunk{cid}.states"
    numel = states.chunks[cid].capacity
    stride = align_up(numel * 4)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, name), "wb") as f:
        f.truncate(len(_KEYS) * stride)
        for start, piece in states.slices(cid):
            for k, values in enumerate(piece.tensors()):
                os.pwrite(f.fileno(), memoryview(values.numpy()).cast("B"), k * stride + start * 4)  # type: ignore[arg-type]
        os.fsync(f.fileno())
    return {"file": name, "numel": numel, "stride": stride}


def saved_values(sd: dict, cid: int, key: str) -> torch.Tensor:
    """A saved chunk's ``key`` values: a tensor in the file, or a view of its own states file
    (read on demand, see [Note: disk tier checkpoints])."""
    entry = sd["chunks"][cid]
    if "file" not in entry:
        return entry[key]
    path = os.path.join(sd[FOLDER_KEY], entry["file"])
    offset = _KEYS.index(key) * entry["stride"]
    values = numpy.memmap(path, dtype=numpy.float32, mode="c", offset=offset, shape=(entry["numel"],))
    return torch.from_numpy(values)


def _entry(entry: tuple) -> tuple[tuple, list[tuple[int, int, int, int]]]:
    """A saved layout entry as ``(shape, pieces)``, from format 2 or format 1 ``(chunk, offset, numel, shape)``."""
    if len(entry) == 4:
        cid, offset, numel, shape = entry
        return tuple(shape), [(cid, offset, 0, numel)]
    shape, pieces = entry
    return tuple(shape), [tuple(p) for p in pieces]


def check_same_model(chunk_map: ChunkMap, saved_layout: dict[str, tuple]) -> None:
    check_same_shapes(chunk_map, {name: _entry(entry)[0] for name, entry in saved_layout.items()})


def check_same_shapes(chunk_map: ChunkMap, saved_shapes: dict[str, Any]) -> None:
    """Raise :class:`CheckpointError` naming the first differences between the checkpoint and the model."""
    ours = {info.name: tuple(info.shape) for info in chunk_map.trainable_infos()}
    theirs = {name: tuple(shape) for name, shape in saved_shapes.items()}
    problems = [f"{n} missing from the checkpoint" for n in sorted(ours.keys() - theirs.keys())]
    problems += [
        f"{n} in the checkpoint is not a trainable parameter of this model" for n in sorted(theirs.keys() - ours.keys())
    ]
    problems += [
        f"{n} has shape {theirs[n]} in the checkpoint but {ours[n]} in the model"
        for n in sorted(ours.keys() & theirs.keys())
        if ours[n] != theirs[n]
    ]
    if problems:
        shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        raise CheckpointError(f"the checkpoint is of another model: {shown}")


def _overlaps(ours: list[Piece], saved: list[tuple[int, int, int, int]]) -> Iterator[tuple[Piece, slice, int, slice]]:
    """``(our slice, saved slice)`` for every element range one of ``ours`` (pieces) shares with
    one of ``saved`` (``(chunk, offset, start, numel)``), with the saved piece's chunk id."""
    for piece in ours:
        for cid, offset, start, numel in saved:
            lo, hi = max(piece.start, start), min(piece.start + piece.numel, start + numel)
            if lo < hi:
                yield (
                    piece,
                    slice(piece.offset + lo - piece.start, piece.offset + hi - piece.start),
                    cid,
                    slice(offset + lo - start, offset + hi - start),
                )


@torch.no_grad()
def _saved_rank(path: str) -> int:
    match = re.search(r"zero_pp_rank_(\d+)_", os.path.basename(path))
    return int(match.group(1)) if match else -1


def optimizer_files(load_dir: str, tag: str) -> tuple[list[str], int]:
    """The paths of the optimizer files the tag's marker lists, one per saved rank, and the saved world
    size, from the marker (or, for a marker written before the manifest, DeepSpeed's model file); see
    [Note: checkpoint manifest]. Raises :class:`CheckpointError` when they do not agree."""
    folder = os.path.join(load_dir, tag)
    marker = read_marker(load_dir, tag)
    names = listed(marker, OPTIM_GLOB)
    world = marker.get("world_size")
    if not isinstance(world, int):
        world = _model_file_world(folder, len(names))
    ranks = sorted(_saved_rank(name) for name in names)
    if ranks != list(range(world)):
        stale = [name for name in names if _saved_rank(name) >= world]
        fix = f"remove {stale[:4]} from the folder or save the tag again" if stale else "save the tag again"
        raise CheckpointError(
            f"checkpoint {folder!r} was saved at {world} data-parallel ranks but lists the optimizer files of ranks "
            f"{ranks}: files of another save are among them (a re-save into the tag at another world size, before "
            f"ds_patrickstar removed a tag's old rank files); {fix}, or load another tag"
        )
    return [os.path.join(folder, name) for name in names], world


def _model_file_world(folder: str, default: int) -> int:
    """The data-parallel world size DeepSpeed recorded in the model file (``default`` when unreadable)."""
    try:
        saved = load_file(os.path.join(folder, "mp_rank_00_model_states.pt"))
    except (CheckpointError, OSError):
        return default
    world = saved.get("dp_world_size") if isinstance(saved, dict) else None
    return world if isinstance(world, int) else default


def owned_optimizer_files(chunk_map: ChunkMap, paths: list[str], world: int) -> Iterator[dict]:
    """The optimizer state dicts this rank needs, read once each, from the files of a save at ``world``
    ranks (:func:`optimizer_files`): the file of its own rank number first (at an unchanged world size
    the only one), then the saved ranks whose chunks hold elements this rank owns now, found from the
    first file's layout (the same in every file; saved chunk ``c`` was owned by rank ``c % world``).
    Every rank reads at most the files it needs, not all ``world`` of them (see [Note: checkpoint
    format]); each must say it was saved at ``world`` ranks."""
    by_rank = {_saved_rank(p): p for p in paths}
    first_path = by_rank.get(chunk_map.rank, paths[0])
    first = _read_optimizer_file(first_path, world)
    yield first
    needed = {by_rank.get(owner_of(cid, world), "") for cid in _overlapping_saved_chunks(chunk_map, first)}
    for path in paths:
        if path in needed and path != first_path:
            yield _read_optimizer_file(path, world)


def _read_optimizer_file(path: str, world: int) -> Any:
    sd = _with_folder(load_file(path)["optimizer_state_dict"], path)
    saved = sd.get("world_size", world) if isinstance(sd, dict) else world
    if saved != world:
        raise CheckpointError(
            f"{path!r} was saved at {saved} data-parallel ranks, the checkpoint's other files at {world}: it is "
            f"left from another save; save the tag again or load another tag"
        )
    return sd


def _with_folder(sd: Any, path: str) -> Any:
    """``sd`` knowing the folder its states files are in (see [Note: disk tier checkpoints])."""
    if isinstance(sd, dict):
        sd[FOLDER_KEY] = os.path.dirname(path)
    return sd


def _overlapping_saved_chunks(chunk_map: ChunkMap, saved: dict) -> set[int]:
    """Saved chunk ids holding elements of the pieces this rank owns now."""
    chunks = set()
    for info in chunk_map.trainable_infos():
        ours = [p for p in info.pieces if chunk_map.is_owned(chunk_map.chunks[p.chunk_id])]
        if ours and info.name in saved.get("layout", {}):
            chunks |= {cid for _, _, cid, _ in _overlaps(ours, _entry(saved["layout"][info.name])[1])}
    return chunks


def load_optimizer_states(
    chunk_map: ChunkMap, states: OptimizerStates, saved: Iterable[dict], load_moments: bool, update: str = "Adam"
) -> dict:
    """Copy the elements of every owned piece from whichever saved rank held them into the states
    (spilled ones piece by piece through the disk tier's cache); returns one saved dict. ``update``: this
    run's optimizer, whose moments must be those saved when they load."""
    owned = {info.name: [p for p in info.pieces if p.chunk_id in states.chunks] for info in chunk_map.trainable_infos()}
    owned = {name: pieces for name, pieces in owned.items() if pieces}
    covered = dict.fromkeys(owned, 0)
    keys = ("master", "exp_avg", "exp_avg_sq") if load_moments else ("master",)
    first = None
    for sd in saved:
        if not isinstance(sd, dict) or sd.get("format") not in _FORMATS:
            raise CheckpointError(
                "the optimizer state in this checkpoint was not written by ds_patrickstar "
                f"(format {sd.get('format') if isinstance(sd, dict) else type(sd).__name__!r})"
            )
        check_same_model(chunk_map, sd["layout"])
        if load_moments:
            check_same_update(sd.get("update", "Adam"), update)
        first = first or sd
        for name, entry in sd["layout"].items():
            if name not in owned:
                continue
            pieces = [p for p in _entry(entry)[1] if p[0] in sd["chunks"]]
            for piece, ours, cid, theirs in _overlaps(owned[name], pieces):
                for key in keys:
                    states.write_values(piece.chunk_id, key, ours.start, saved_values(sd, cid, key)[theirs])
                covered[name] += ours.stop - ours.start
    states.flush()
    if first is None:
        raise CheckpointError("the checkpoint has no optimizer state files")
    missing = sorted(name for name, pieces in owned.items() if covered[name] != sum(p.numel for p in pieces))
    if missing:
        raise CheckpointError(f"the checkpoint's optimizer files do not cover {missing[:5]}: a rank's file is missing")
    return first


# ---- consolidation ------------------------------------------------------------------
def tied_names(named: Iterable[tuple[str, object]]) -> dict[str, str]:
    """Each name whose object (a parameter, a loaded tensor) came under an earlier name, to that first name:
    the tied weights, found by the object itself (by ``data_ptr`` every storage released at a save pairs)."""
    first: dict[int, str] = {}
    shared: dict[str, str] = {}
    for name, value in named:
        if id(value) in first:
            shared[name] = first[id(value)]
        else:
            first[id(value)] = name
    return shared


def consolidate_fp32_state_dict(
    checkpoint_dir: str, tag: str | None = None, exclude_frozen_parameters: bool = False
) -> dict[str, torch.Tensor]:
    """One full fp32 state dict from a checkpoint folder (what ``zero_to_fp32.py`` gives stock users).

    Trainable parameters come from the fp32 masters; frozen parameters and buffers from the
    module state (upcast to fp32 when they are floating point); ``exclude_frozen_parameters``: the
    frozen parameters left out (the buffers kept), as DeepSpeed's flag of that name does. Every name of
    a tied parameter maps to one tensor, the master's, as in DeepSpeed's reader.
    """
    tag = resolve_tag(checkpoint_dir, tag)
    verify_complete(checkpoint_dir, tag)
    folder = os.path.join(checkpoint_dir, tag)
    paths, world = optimizer_files(checkpoint_dir, tag)  # only the files the marker lists
    result: dict[str, torch.Tensor] = {}
    buffers: set[str] = set()
    # tied weights: one tensor under several names in the module state (the shared_params of files saved before
    # the engine named them by the parameter paired every parameter released at the save: not read)
    shared: dict[str, str] = {}
    for path in [os.path.join(folder, name) for name in listed(read_marker(checkpoint_dir, tag), "*model_states.pt")]:
        state = load_file(path)
        buffers.update(state.get("buffer_names") or ())
        shared.update(tied_names(state.get("module", {}).items()))
        for name, value in state.get("module", {}).items():
            result[name] = value.float() if value.is_floating_point() else value
    flat: dict[str, tuple[torch.Tensor, tuple]] = {}
    covered: dict[str, int] = {}
    for path in paths:
        sd = _read_optimizer_file(path, world)
        if sd.get("format") not in _FORMATS:
            raise CheckpointError(f"{path} was not written by ds_patrickstar")
        for name, entry in sd["layout"].items():
            shape, pieces = _entry(entry)
            for cid, offset, start, numel in pieces:
                if cid in sd["chunks"]:
                    if name not in flat:
                        flat[name] = (torch.empty(math.prod(shape), dtype=torch.float32), shape)
                    flat[name][0][start : start + numel] = saved_values(sd, cid, "master")[offset : offset + numel]
                    covered[name] = covered.get(name, 0) + numel
    for name, (values, shape) in flat.items():
        if covered[name] != values.numel():
            raise CheckpointError(
                f"{folder!r}: the optimizer files hold {covered[name]} of the {values.numel()} "
                f"elements of {name}: a rank's file is missing"
            )
        result[name] = values.view(shape)
    if exclude_frozen_parameters:  # neither a trainable parameter (in the optimizer files) nor a buffer
        result = {name: value for name, value in result.items() if name in flat or name in buffers}
    for name, owner in shared.items():  # one tensor under each name, from the master, as DeepSpeed's reader gives
        if owner in result:
            result[name] = result[owner]
    return result
