"""Parameters with several names: tied weights and parameters shared by modules.

[Note: every name is a copy]
A parameter reachable under several names (GPT-2's ``lm_head.weight`` is
``transformer.wte.weight``; one Linear's weight assigned to another) appears in
``state_dict()`` once per name, all entries the same tensor: a view into its chunk.
With data parallelism the chunk is released again when ``state_dict()`` returns, on every
rank that does not own it, so an entry left as a view reads freed memory (garbage or a
SIGSEGV). Matching entries by parameter name misses the aliases (the chunk map knows a
parameter by its first name only), so :func:`copy_chunk_views` matches by *storage*:
every entry whose untyped storage is a chunk payload's is replaced by a clone. That covers
every alias, whatever the module structure, and leaves buffers and frozen parameters
(not in chunks) alone.
"""
from __future__ import annotations

from typing import Any, Iterable

import torch


def chunk_storages(payloads: Iterable[torch.Tensor]) -> set[int]:
    """Identities of the payloads' untyped storages (the same for every view into them)."""
    return {p.untyped_storage()._cdata for p in payloads}


def copy_chunk_views(state_dict: dict[str, Any], storages: set[int]) -> list[str]:
    """Replace every tensor of ``state_dict`` that views one of ``storages`` by a detached clone;
    return the keys replaced. See [Note: every name is a copy]."""
    replaced = []
    for key, value in state_dict.items():
        if isinstance(value, torch.Tensor) and value.untyped_storage()._cdata in storages:
            state_dict[key] = value.detach().clone()
            replaced.append(key)
    return replaced
