"""Pretrained weights streamed into the chunks: ``ds_patrickstar.load_pretrained(engine, path)``.

[Note: pretrained loading]
``path`` is a ``state_dict`` file (``torch.save``: ``.bin``/``.pt``/``.pth``; or ``.safetensors``)
or a folder of Hugging Face weights: ``model.safetensors`` / ``pytorch_model.bin``, or shards
listed by ``model.safetensors.index.json`` / ``pytorch_model.bin.index.json``. Files are read
one at a time and tensor by tensor (safetensors reads one tensor at a time; torch files are
memory-mapped), so the extra host memory is at most one shard, never a full-model copy per
rank. Each rank writes only the parameters of the chunks it owns, into the low-precision slot
and the fp32 master (at the checkpoint's precision), through
:meth:`~ds_patrickstar.io.export.ChunkExport.write_value`, the path ``engine.module.load_state_dict``
takes too; frozen parameters are in chunks as well and get their owned slices only (see
[Note: frozen chunks]). Buffers and parameters that are not in a chunk (not floating point) are
copied whole on every rank. No collective: every rank reads the files itself.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from deepspeed.runtime.engine import DeepSpeedEngine

from ..chunks.chunk import TensorInfo
from ..chunks.chunk_map import ChunkMap
from .export import ChunkExport

logger = logging.getLogger(__name__)

_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
_SINGLE = ("model.safetensors", "pytorch_model.bin")


@dataclass
class LoadResult:
    """Keys of the model the files did not have, and keys of the files the model does not have."""

    missing_keys: list[str] = field(default_factory=list)
    unexpected_keys: list[str] = field(default_factory=list)


def checkpoint_files(path: str) -> list[str]:
    """The weight files ``path`` stands for, in load order; see [Note: pretrained loading]."""
    if os.path.isfile(path):
        return [path]
    if not os.path.isdir(path):
        raise ValueError(f"load_pretrained: {path!r} is neither a file nor a folder")
    for index in _INDEXES:
        index_path = os.path.join(path, index)
        if os.path.isfile(index_path):
            with open(index_path) as f:
                weight_map = json.load(f)["weight_map"]
            return [os.path.join(path, name) for name in sorted(set(weight_map.values()))]
    for name in _SINGLE:
        if os.path.isfile(os.path.join(path, name)):
            return [os.path.join(path, name)]
    raise ValueError(f"load_pretrained: no weights in {path!r}; expected one of {', '.join(_INDEXES + _SINGLE)}")


def iter_tensors(file: str) -> Iterator[tuple[str, torch.Tensor]]:
    """``(key, tensor)`` of one file, one tensor at a time."""
    if file.endswith(".safetensors"):
        from safetensors import safe_open

        with safe_open(file, framework="pt", device="cpu") as f:
            for key in f.keys():
                yield key, f.get_tensor(key)
        return
    state = torch.load(file, map_location="cpu", mmap=True, weights_only=True)
    if not isinstance(state, dict):
        raise ValueError(f"load_pretrained: {file!r} holds a {type(state).__name__}, not a state_dict")
    for key in list(state):
        yield key, state.pop(key)


def _whole_targets(module: torch.nn.Module, chunk_map: ChunkMap) -> dict[str, torch.Tensor]:
    """Persistent buffers and parameters outside the chunks: copied whole on every rank."""
    targets = {}
    for mod_name, mod in module.named_modules():
        prefix = mod_name + "." if mod_name else ""
        for key, buf in mod._buffers.items():
            if buf is not None and key not in mod._non_persistent_buffers_set:
                targets[prefix + key] = buf
        for key, param in mod._parameters.items():
            if param is not None and chunk_map.info(param) is None:
                targets[prefix + key] = param
    return targets


@torch.no_grad()
def load_pretrained(engine: DeepSpeedEngine, path: str, strict: bool = True) -> LoadResult:
    """Stream the weights at ``path`` into ``engine``'s chunks (call it on every rank); see
    [Note: pretrained loading]. ``strict``: raise ``ValueError`` on missing or unexpected keys."""
    export = engine.optimizer.export
    module = engine.module
    names = export.names(module, "")
    export.refuse_gradients(names, "load_pretrained()")
    by_key = {key: info for info, keys in names.items() for key in keys}
    whole = _whole_targets(module, engine.optimizer.chunk_map)
    loaded: set[object] = set()
    result, errors = LoadResult(), list[str]()

    with export.writing():  # frozen chunks on disk: straight into their records
        for file in checkpoint_files(path):
            _load_file(file, export, by_key, whole, loaded, result, errors)
    result.missing_keys = [keys[0] for info, keys in names.items() if info not in loaded]
    result.missing_keys += [key for key in whole if key not in loaded]
    if errors:
        raise ValueError("load_pretrained: " + "; ".join(errors))
    if strict and (result.missing_keys or result.unexpected_keys):
        raise ValueError(
            f"load_pretrained({path!r}): missing keys {result.missing_keys}, unexpected keys "
            f"{result.unexpected_keys}; pass strict=False to load what matches"
        )
    return result


def _load_file(
    file: str,
    export: ChunkExport,
    by_key: dict[str, TensorInfo],
    whole: dict[str, torch.Tensor],
    loaded: set[object],
    result: LoadResult,
    errors: list[str],
) -> None:
    """One weight file's tensors into the chunks (``by_key``) or whole targets; see [Note: pretrained loading]."""
    for key, value in iter_tensors(file):
        if key in by_key:
            export.write_value(by_key[key], key, value, errors)
            loaded.add(by_key[key])
        elif key in whole:
            target = whole[key]
            if tuple(target.shape) != tuple(value.shape):
                errors.append(
                    f"size mismatch for {key}: {tuple(value.shape)} in the checkpoint, "
                    f"{tuple(target.shape)} in the model"
                )
            else:
                target.copy_(value)
                loaded.add(key)
        else:
            result.unexpected_keys.append(key)
    logger.info("ds_patrickstar: loaded %s", file)
