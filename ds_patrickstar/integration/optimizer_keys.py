"""The DeepSpeed keys outside ``zero_optimization`` that stage 'patrickstar' reads or refuses: the
``optimizer`` block (ours runs Adam or AdamW from its hyper-parameters, see [Note: no DeepSpeed optimizer]
in engine.py) and the top-level gradient-reduction keys. Bad input is refused with the key and what would
work, before DeepSpeed builds anything."""

from __future__ import annotations

from typing import Any

_ADAM_TYPES = ("adam", "adamw")  # DeepSpeed compares optimizer types case-insensitively
_UNSUPPORTED_ADAM_PARAMS = ("amsgrad", "maximize")


def check_optimizer_block(config: dict[str, Any]) -> None:
    """Refuse an ``optimizer`` block we cannot run before DeepSpeed builds it (its errors name no key)."""
    block = config.get("optimizer")
    if not isinstance(block, dict) or block.get("type") is None:
        return
    kind = block["type"]
    if not isinstance(kind, str) or kind.lower() not in _ADAM_TYPES:
        raise ValueError(
            f"optimizer.type={kind!r} is not supported by stage 'patrickstar', which updates parameters "
            f'with its own fused Adam: use "type": "Adam" or "AdamW"'
        )
    params = block.get("params") or {}
    for flag in _UNSUPPORTED_ADAM_PARAMS:
        if params.get(flag):
            raise ValueError(
                f"optimizer.params.{flag}={params[flag]!r} is not supported by stage 'patrickstar'; "
                f"remove it or set it to false"
            )


# Keys of DeepSpeed's Adam block that only choose DeepSpeed's implementation (FusedAdam,
# DeepSpeedCPUAdam, torch's Adam): ours always runs, so they are accepted and ignored.
_ADAM_IMPLEMENTATION_KEYS = ("torch_adam", "fp32_optimizer_states", "foreach", "fused", "set_grad_none", "capturable")
_ADAM_DEFAULTS = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}  # those of FusedAdam


def torch_adam_from_block(kind: str, params: dict[str, Any] | None) -> tuple[type, dict[str, Any], dict[str, Any]]:
    """The torch optimizer class, its keyword arguments and extra param-group keys that hold the
    hyper-parameters of a DeepSpeed ``optimizer`` block (see [Note: no DeepSpeed optimizer]).

    ``"Adam"`` means AdamW unless ``adam_w_mode`` is false, ``"AdamW"`` always does, as in
    DeepSpeed; missing values take FusedAdam's defaults (weight_decay 0, unlike torch's AdamW).
    """
    import torch

    params = dict(params or {})
    if "max_grad_norm" in params:
        raise ValueError(
            'optimizer.params.max_grad_norm is not supported; use the DeepSpeed key "gradient_clipping" instead'
        )
    adam_w_mode = bool(params.pop("adam_w_mode", True))
    adamw = kind.lower() == "adamw" or adam_w_mode
    for key in _ADAM_IMPLEMENTATION_KEYS:
        params.pop(key, None)
    group_keys = {"bias_correction": bool(params.pop("bias_correction"))} if "bias_correction" in params else {}
    unknown = sorted(set(params) - set(_ADAM_DEFAULTS) - set(_UNSUPPORTED_ADAM_PARAMS))
    if unknown:
        allowed = ", ".join(sorted([*_ADAM_DEFAULTS, "adam_w_mode", "bias_correction", *_ADAM_IMPLEMENTATION_KEYS]))
        raise ValueError(
            f"optimizer.params.{unknown[0]}={params[unknown[0]]!r} is not an Adam option known to stage "
            f"'patrickstar'; the options are: {allowed}"
        )
    kwargs = {**_ADAM_DEFAULTS, **params}
    return (torch.optim.AdamW if adamw else torch.optim.Adam), kwargs, group_keys


def check_reduction_settings(
    *,
    model_dtype: Any,
    communication_data_type: Any,
    prescale_gradients: bool,
    gradient_predivide_factor: float,
    grad_accum_dtype: Any,
) -> None:
    """DeepSpeed's top-level gradient-reduction keys, as DeepSpeed parsed them: accepted where they
    say what stage 'patrickstar' does (gradients divided by the world size, then reduce-scattered in
    place in the chunks, in the training dtype; accumulated in fp32), refused with the key where
    they ask for something else (ZeRO-3 refuses the first two as well)."""
    import torch

    dtype_names = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
    if prescale_gradients:
        raise ValueError(
            "prescale_gradients=true is not supported by stage 'patrickstar' (nor by ZeRO-3): gradients are "
            "divided by the data-parallel world size before they are summed. Remove the key."
        )
    if gradient_predivide_factor != 1.0:
        raise ValueError(
            f"gradient_predivide_factor={gradient_predivide_factor!r} is not supported by stage 'patrickstar' "
            "(nor by ZeRO-3): gradients are divided by the data-parallel world size before they are summed. "
            "Remove the key or set it to 1.0."
        )
    if communication_data_type is not None and communication_data_type != model_dtype:
        name = dtype_names.get(communication_data_type, str(communication_data_type))
        raise ValueError(
            f"communication_data_type={name!r} is not supported by stage 'patrickstar': gradients are "
            f"reduce-scattered in place in a flat buffer of their chunk group, in the training dtype "
            f"({dtype_names.get(model_dtype, str(model_dtype))}). Remove the key."
        )
    if grad_accum_dtype is not None and grad_accum_dtype != torch.float32:
        name = dtype_names.get(grad_accum_dtype, str(grad_accum_dtype))
        raise ValueError(
            f"data_types.grad_accum_dtype={name!r} is not supported by stage 'patrickstar', which "
            "accumulates gradients in fp32 (see docs/configuration.md, what DeepSpeed reads). Remove the key or "
            'set it to "fp32".'
        )
