"""What autograd is doing now, and the tensors inside a module's inputs or outputs.

A leaf module: every layer may import it (the hook registry, placement and the chunk manager
all ask whether a backward pass is running).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import torch


def iter_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Tensors inside (possibly nested) tuples, lists, dicts and dataclasses."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):  # includes Hugging Face ModelOutput
        for value in obj.values():
            yield from iter_tensors(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from iter_tensors(value)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from iter_tensors(getattr(obj, f.name))
