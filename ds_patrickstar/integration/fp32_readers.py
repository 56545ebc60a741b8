"""DeepSpeed's fp32 reader functions on this stage's checkpoints; see [Note: DeepSpeed's fp32 readers].

[Note: DeepSpeed's fp32 readers]
Users and libraries call DeepSpeed's readers in ``deepspeed.utils.zero_to_fp32`` directly:
``get_fp32_state_dict_from_zero_checkpoint``, ``convert_zero_checkpoint_to_fp32_state_dict`` (and, in
DeepSpeed >= 0.19.8, ``convert_zero_checkpoint_to_state_dict`` with its ``dtype``) and
``load_state_dict_from_zero_checkpoint``. Stock's parser refuses our optimizer files ("is not a zero
checkpoint"). :func:`read_ours_in_deepspeeds_readers` (called by the registration, once) replaces the module
attribute ``get_fp32_state_dict_from_zero_checkpoint``: a tag folder holding our completion marker
(``ds_patrickstar_complete.json``, written by every complete save of this stage and by nothing else; the tag
resolved as stock does, from ``tag`` or the save folder's ``latest``) is read by
:func:`ds_patrickstar.io.checkpoint.consolidate_fp32_state_dict`, and every other call goes to DeepSpeed's
function with its arguments as given. The others are left as they are: stock's ``convert_*`` and
``load_state_dict_from_zero_checkpoint`` call ``get_fp32_state_dict_from_zero_checkpoint`` by its global name
in that module, so they read our folders through the wrapper and write their files (shards, index,
safetensors, ``dtype``) or load the model with stock's own code, also when a caller imported them by name
before ds_patrickstar was imported. The wrapper is the module's attribute from the moment
``import deepspeed`` has registered the stage, so ``from deepspeed.utils.zero_to_fp32 import ...`` after it
gets the wrapper; a name imported before ds_patrickstar (with the autoload hook off) keeps stock's function.

What ours returns is what stock returns for a ZeRO-3 checkpoint of the same model: an fp32 tensor per name of
the model's ``state_dict`` (trainable parameters from the fp32 masters, buffers and frozen parameters from the
module state), the names of a tied parameter mapped to one tensor, ``exclude_frozen_parameters`` leaving the
frozen parameters out. ``lazy_mode=True`` returns the same dict (tensors, whose ``.contiguous()`` is what a
lazy caller calls, so stock's sharding code runs on it): not lazier, since our reader reads each saved file
once (logged). Frozen parameters are fp32 here where stock's ZeRO-3 reader keeps their training dtype.
A folder of an interrupted save of ours has no marker and goes to stock's function, which refuses it;
``python zero_to_fp32.py`` in the save folder names the problem (see [Note: the recovery script] in
io/recovery_script.py).
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
from typing import Any

from ..io.checkpoint import consolidate_fp32_state_dict
from ..io.commit import MARKER

logger = logging.getLogger(__name__)

_MARK = "_ds_patrickstar_reads_ours"


def is_our_checkpoint(checkpoint_dir: Any, tag: Any = None) -> bool:
    """Whether the tag folder DeepSpeed's reader would read (``tag``, else the one ``latest`` names) holds our
    completion marker."""
    if tag is None:
        latest = os.path.join(checkpoint_dir, "latest")
        if not os.path.isfile(latest):
            return False  # stock's function raises its own error
        with open(latest) as f:
            tag = f.read().strip()
    return os.path.isfile(os.path.join(checkpoint_dir, str(tag), MARKER))


def read_ours_in_deepspeeds_readers() -> bool:
    """Install the wrapper (once); return whether it was installed now."""
    from deepspeed.utils import zero_to_fp32 as readers

    original = readers.get_fp32_state_dict_from_zero_checkpoint
    if getattr(original, _MARK, False):
        return False
    signature = inspect.signature(original)

    @functools.wraps(original)
    def get_fp32_state_dict_from_zero_checkpoint(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        given = bound.arguments
        if not is_our_checkpoint(given["checkpoint_dir"], given.get("tag")):
            return original(*args, **kwargs)
        state = consolidate_fp32_state_dict(
            os.fspath(given["checkpoint_dir"]), given.get("tag"), bool(given.get("exclude_frozen_parameters"))
        )
        if given.get("lazy_mode"):
            logger.info("ds_patrickstar: lazy_mode: a stage 'patrickstar' checkpoint is read whole (tensors)")
            return state
        return readers.to_torch_tensor(state)  # as stock's: contiguous, tied names still one tensor

    setattr(get_fp32_state_dict_from_zero_checkpoint, _MARK, True)
    readers.get_fp32_state_dict_from_zero_checkpoint = get_fp32_state_dict_from_zero_checkpoint
    return True
