"""Hugging Face Trainer: evaluation or prediction without training.

[Note: evaluation without training]
``Trainer.evaluate()``/``predict()`` before any ``train()`` (``--do_eval`` without
``--do_train``) calls ``deepspeed_init(trainer, 0, inference=True)``, which Hugging Face allows
for ZeRO stage 3 only ("ZeRO inference only makes sense with ZeRO Stage 3 - please adjust your
config") and which removes the config's ``optimizer`` block, so that ``deepspeed.initialize``
builds an inference-only engine. Stage "patrickstar" has one engine, the training one, and it
evaluates as it trains (a ``no_grad`` forward is placed like any other, see
[Note: evaluation moments]). For a "patrickstar" config :func:`guard_eval_only` makes that call
do what it does for stage 3 but keep the engine buildable: the Trainer's arguments fill the
config's "auto" values, the ``scheduler`` block goes (zero training steps leave it no valid
warm-up), and the ``optimizer`` block stays (one is added, AdamW with the Trainer's settings, when
the config has none); the optimizer states are allocated but no step runs. The Trainer then
prepares the model through accelerate, which calls ``deepspeed.initialize`` with the model alone.
The wrapper replaces ``deepspeed_init`` in ``transformers.trainer`` (which imported the name) as
soon as that module is imported (a finder at the front of ``sys.meta_path`` that removes itself:
``ds_patrickstar_autoload.after_import``, the project's one import hook), or at once if it already
was. Other configs and training go to Hugging Face's function unchanged.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from ds_patrickstar_autoload import after_import

from .config import is_patrickstar

logger = logging.getLogger(__name__)

TRAINER = "transformers.trainer"
_MARK = "_ds_patrickstar_eval_guard"


def _init_for_evaluation(trainer: Any, num_training_steps: int) -> tuple[None, None]:
    """``deepspeed_init(..., inference=True)`` for a "patrickstar" config; see [Note: evaluation without training]."""
    hf_config = trainer.accelerator.state.deepspeed_plugin.hf_ds_config
    hf_config.trainer_config_finalize(trainer.args, trainer.model, num_training_steps)
    hf_config.del_config_sub_tree("scheduler")
    config = hf_config.config
    if "optimizer" not in config:
        args = trainer.args
        config["optimizer"] = {
            "type": "AdamW",
            "params": {"lr": args.learning_rate, "weight_decay": args.weight_decay, "eps": args.adam_epsilon},
        }
    logger.info("ds_patrickstar: evaluation without training: the training engine evaluates (no step runs)")
    return None, None


def _wrap(module: Any) -> None:
    original = getattr(module, "deepspeed_init", None)
    if original is None or getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def deepspeed_init(trainer, num_training_steps, inference=False, **kwargs):
        if inference:
            config = trainer.accelerator.state.deepspeed_plugin.hf_ds_config.config
            if is_patrickstar(config):
                return _init_for_evaluation(trainer, num_training_steps)
        return original(trainer, num_training_steps, inference=inference, **kwargs)

    setattr(deepspeed_init, _MARK, True)
    module.deepspeed_init = deepspeed_init


def guard_eval_only() -> None:
    """See [Note: evaluation without training]."""
    after_import(TRAINER, _wrap)
