"""DeepSpeed's activation checkpointing configured from a "patrickstar" config.

[Note: DeepSpeed's checkpointing configured from our config]
``deepspeed.checkpointing.configure(mpu, deepspeed_config=cfg)`` (Megatron-DeepSpeed calls it with
the user's DeepSpeed config, a dict or a JSON path) parses the whole config with DeepSpeed's own
``DeepSpeedConfig`` to read its ``activation_checkpointing`` block, and that model rejects a string
stage and our keys. :func:`configure_from_our_config` wraps ``configure`` once: a "patrickstar"
config is validated as :func:`~ds_patrickstar.integration.config.split_config` validates it for
``deepspeed.initialize`` and DeepSpeed gets the sanitized copy (stage 0), which has the same
``activation_checkpointing`` block; every other config, and every call without one, goes to
DeepSpeed's function with its arguments as they are.

``partition_activations`` splits each checkpointed input across the ranks of a tensor
(model-parallel) group; with none (``mpu`` None) DeepSpeed keeps it whole on every rank, which only
costs a copy. The wrapper says so in a warning, for a "patrickstar" config, since that is not what a
user setting it without tensor parallelism expects (the option is accepted, as stock DeepSpeed does,
because ``contiguous_memory_optimization`` needs it).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from .config import is_patrickstar, split_config

logger = logging.getLogger(__name__)

_MARK = "_ds_patrickstar_reads_our_config"


def _load(config: Any) -> Any:
    if config is None or isinstance(config, dict):
        return config
    from deepspeed.runtime.tensor_parallel.init_utils import load_ds_config

    return load_ds_config(config)


def _warn_partition_without_model_parallelism(config: dict, mpu: Any, partition_activations: Any) -> None:
    from deepspeed.runtime.activation_checkpointing import checkpointing

    block = config.get("activation_checkpointing") or {}
    wanted = partition_activations if partition_activations is not None else block.get("partition_activations")
    if wanted and mpu is None and checkpointing.mpu is None:
        logger.warning(
            "activation_checkpointing.partition_activations=true partitions checkpointed activations across "
            "a tensor (model-parallel) group, and deepspeed.checkpointing.configure got none (mpu=None): every "
            "rank keeps each checkpoint whole. Stage 'patrickstar' is data parallel only; set it to false "
            "unless contiguous_memory_optimization (which requires it) is wanted."
        )


def configure_from_our_config() -> bool:
    """Install the wrapper (once); return whether it was installed now. See
    [Note: DeepSpeed's checkpointing configured from our config]."""
    from deepspeed.runtime.activation_checkpointing import checkpointing

    original = checkpointing.configure
    if getattr(original, _MARK, False):
        return False

    @functools.wraps(original)
    def configure(mpu_: Any, deepspeed_config: Any = None, partition_activations: Any = None, **kwargs: Any) -> Any:
        loaded = _load(deepspeed_config)
        if isinstance(loaded, dict) and is_patrickstar(loaded):
            _warn_partition_without_model_parallelism(loaded, mpu_, partition_activations)
            deepspeed_config = split_config(loaded)[1]
        return original(mpu_, deepspeed_config=deepspeed_config, partition_activations=partition_activations, **kwargs)

    setattr(configure, _MARK, True)
    checkpointing.configure = configure
    return True
