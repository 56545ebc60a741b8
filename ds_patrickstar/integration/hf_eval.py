"""Hugging Face Trainer: evaluation or prediction without training, refused with what to do.

[Note: evaluation without training]
``Trainer.evaluate()``/``predict()`` before any ``train()`` (``--do_eval`` without
``--do_train``) calls ``deepspeed_init(trainer, 0, inference=True)``, which Hugging Face allows
for ZeRO stage 3 only ("ZeRO inference only makes sense with ZeRO Stage 3 - please adjust your
config"): that sends a "patrickstar" user to change the stage. Stage "patrickstar" builds no
inference-only engine, so for a "patrickstar" config the same refusal says what works instead.
:func:`guard_eval_only` wraps ``deepspeed_init`` in ``transformers.trainer`` (which imported the
name) as soon as that module is imported (a finder at the front of ``sys.meta_path`` that
removes itself: ``ds_patrickstar_autoload.after_import``, the project's one import hook), or at
once if it already was. Other configs and training go to Hugging Face's
function unchanged.
"""

from __future__ import annotations

import functools
from typing import Any

from ds_patrickstar_autoload import after_import

from .config import is_patrickstar

TRAINER = "transformers.trainer"
_MARK = "_ds_patrickstar_eval_guard"

EVAL_ONLY_MESSAGE = (
    "evaluation or prediction without training (--do_eval/--do_predict without --do_train, or evaluate()/"
    "predict() before train()) is not supported with DeepSpeed stage 'patrickstar': Hugging Face builds an "
    "inference-only DeepSpeed engine for ZeRO stage 3 only, and stage 'patrickstar' trains. Evaluate without "
    "--deepspeed (a model saved by a 'patrickstar' run is a plain Hugging Face model: from_pretrained loads it), "
    "or call evaluate()/predict() after train() in the same run."
)


def _wrap(module: Any) -> None:
    original = getattr(module, "deepspeed_init", None)
    if original is None or getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def deepspeed_init(trainer, num_training_steps, inference=False, **kwargs):
        if inference:
            config = trainer.accelerator.state.deepspeed_plugin.hf_ds_config.config
            if is_patrickstar(config):
                raise ValueError(EVAL_ONLY_MESSAGE)
        return original(trainer, num_training_steps, inference=inference, **kwargs)

    setattr(deepspeed_init, _MARK, True)
    module.deepspeed_init = deepspeed_init


def guard_eval_only() -> None:
    """See [Note: evaluation without training]."""
    after_import(TRAINER, _wrap)
