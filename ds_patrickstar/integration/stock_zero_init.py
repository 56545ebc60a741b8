"""``deepspeed.zero.Init`` and stage "patrickstar": a config of ours builds with ``ds_patrickstar.Init``, a
model stock's ``zero.Init`` partitioned is taken over at initialize.

[Note: stock zero.Init]
Two ways a ``deepspeed.zero.Init`` meets our stage:

* ``deepspeed.zero.Init(config_dict_or_path=cfg)`` with ``cfg``'s stage "patrickstar": stock's constructor
  would validate the config with its own model (a pydantic error on the stage). Construction is routed
  (registration.py installs ``Init.__new__``; see [Note: registration]) to :func:`our_init`, which returns a
  ``ds_patrickstar.Init`` block for the same config: the model is built on the ``meta`` device and
  materialized into chunks at initialize (see [Note: deferred init]; its values are that block's, seeded by
  module name, not stock's). ``enabled=False`` is a no-op block, as stock; ``module=`` (stock partitions an
  existing module) gets a no-op block too: the module is whole and initialize packs it. Stock's other
  arguments (``remote_device``, ``dtype``, groups, quantization) do not apply and are ignored (one debug line).
  Any other config goes to stock's constructor untouched.
* A model built under stock's ``zero.Init`` (a stage-3 config, or none) and given to a "patrickstar"
  initialize: its parameters hold a 1/W partition (``ds_tensor``) and an empty ``data``. :func:`take_over_stock_model`
  gathers each parameter's full value with stock's own ``param.all_gather()`` (a collective over the
  parameter's ``ds_process_group``, one parameter at a time, in the model's order on every rank), makes it
  the parameter's ``data`` (the same parameter object, so optimizers built on it still hold it) and removes
  every attribute stock's ``zero.Init`` put on it (:data:`STOCK_PARAM_ATTRS`, and any other ``ds_*``), which
  frees the partition. Initialize then packs the model into chunks as any model. stock's ``zero.Init`` also
  leaves ``torch.nn.functional.linear`` replaced by its memory-efficient version (``zero3_linear_wrap``,
  "this will persist unless manually reset"); registration.py puts torch's back once a model was taken over.
  A "patrickstar" initialize called inside an open stock ``zero.Init`` block pauses the block's wrappers
  meanwhile, as stock's initialize does (``shutdown_init_context``/``restore_init_context``).
  The values are stock's exactly (nothing is re-initialized), so training matches stock ZeRO-3 on the same
  model. Limit: after the take-over the model is whole on every rank until initialize has packed it (as a
  model built without ``zero.Init``); to never have it whole, build it under ``ds_patrickstar.Init``.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

import torch
from torch import nn

from .config import is_patrickstar

logger = logging.getLogger(__name__)

# what stock's zero.Init (DeepSpeed 0.19) puts on a parameter, besides any other ds_* attribute
STOCK_PARAM_ATTRS = (
    "aligned_size",
    "all_gather",
    "all_gather_coalesced",
    "convert_to_zero_parameters",
    "is_external_param",
    "item",
    "nvme_swapper",
    "padding_size",
    "partition",
    "partition_gradients",
    "partition_numel",
    "reduce_gradients_at_owner",
    "_z3_optimizer",
)
_IGNORED_ARGS = ("module", "config_dict_or_path", "config", "enabled", "mpu")


def _load(config: Any) -> Any:
    if config is None or isinstance(config, dict):
        return config
    from deepspeed.runtime.tensor_parallel.init_utils import load_ds_config

    return load_ds_config(config)


def our_init(stock_init: type, args: tuple, kwargs: dict) -> Any:
    """A ``ds_patrickstar.Init`` block for ``deepspeed.zero.Init(*args, **kwargs)`` when its config selects
    stage "patrickstar", else None (stock's constructor runs); see [Note: stock zero.Init]."""
    try:
        init = vars(stock_init)["__init__"]  # the class's own (signature(cls) would read the routing __new__)
        bound = inspect.signature(init).bind(None, *args, **kwargs).arguments
    except TypeError:
        return None  # stock's constructor reports the bad arguments
    given = bound.get("config_dict_or_path") or bound.get("config")
    config = _load(given)
    if not (isinstance(config, dict) and is_patrickstar(config)):
        return None
    from ..io.init import Init

    enabled = bool(bound.get("enabled", True))
    if bound.get("module") is not None:
        logger.info(
            "ds_patrickstar: deepspeed.zero.Init(module=...) with stage 'patrickstar': the module is already "
            "built; deepspeed.initialize packs it into chunks"
        )
        enabled = False
    ignored = sorted(k for k in bound if k not in _IGNORED_ARGS and k != "self")
    if ignored:
        logger.debug("ds_patrickstar: deepspeed.zero.Init arguments %s do not apply to stage 'patrickstar'", ignored)
    return Init(config=config, enabled=enabled)


def stock_partitioned(model: nn.Module) -> list[nn.Parameter]:
    """The parameters of ``model`` that stock's ``zero.Init`` partitioned (each once, in model order)."""
    seen: dict[nn.Parameter, None] = {}
    for param in model.parameters():
        if hasattr(param, "ds_tensor") and param not in seen:
            seen[param] = None
    return list(seen)


@torch.no_grad()
def _gather_one(param: Any) -> torch.Tensor:
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    if param.ds_status != ZeroParamStatus.AVAILABLE:
        param.all_gather()
    return param.data.detach().reshape(param.ds_shape).clone()


def _strip(param: nn.Parameter) -> None:
    for name in [*STOCK_PARAM_ATTRS, *(k for k in list(vars(param)) if k.startswith("ds_"))]:
        if name in vars(param):
            delattr(param, name)


def take_over_stock_model(model: nn.Module) -> int:
    """Give every parameter stock's ``zero.Init`` partitioned its full value and drop stock's attributes; a
    collective when there are any (every rank calls it with the same model). Returns how many parameters it
    took over; see [Note: stock zero.Init]."""
    params = stock_partitioned(model)
    for param in params:
        value = _gather_one(param)
        _strip(param)
        param.data = value
    if params:
        logger.info(
            "ds_patrickstar: %d parameters built under stock deepspeed.zero.Init were gathered and taken over "
            "(to never have the model whole on a rank, build it under ds_patrickstar.Init or "
            "deepspeed.zero.Init with this config)",
            len(params),
        )
    return len(params)
