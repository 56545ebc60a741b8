"""Saving through accelerate: tied weights stay one tensor; see [Note: tied weights saved once].

:func:`keep_host_copies` wraps ``deepspeed.checkpoint.utils.clone_tensors_for_torch_save``
(accelerate imports it from there at every ``get_state_dict`` call) once: in a dict, an entry
that ``state_dict()`` of a "patrickstar" model made (a private host copy, marked by
``io/export.py``) is returned as it is when the target device is the host; everything else,
and every call of stock stages (whose tensors are never marked), goes to DeepSpeed's function.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from ..io.export import is_host_copy

_MARK = "_ds_patrickstar_keeps_host_copies"
_HOST = torch.device("cpu")


def keep_host_copies() -> bool:
    """Install the wrapper (once); return whether it was installed now."""
    from deepspeed.checkpoint import utils

    original = utils.clone_tensors_for_torch_save
    if getattr(original, _MARK, False):
        return False

    @functools.wraps(original)
    def clone_tensors_for_torch_save(item: Any, device: Any = _HOST) -> Any:
        if isinstance(item, dict) and torch.device(device).type == "cpu" and any(map(is_host_copy, item.values())):
            return type(item)({k: v if is_host_copy(v) else original(v, device) for k, v in item.items()})
        return original(item, device)

    setattr(clone_tensors_for_torch_save, _MARK, True)
    utils.clone_tensors_for_torch_save = clone_tensors_for_torch_save
    return True
