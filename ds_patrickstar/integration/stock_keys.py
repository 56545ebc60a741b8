"""Stock ZeRO keys in a ``"stage": "patrickstar"`` block: what each does here, and which are refused.

[Note: stock ZeRO keys]
A working ZeRO-3 config should run with only its stage changed (Hugging Face's ZeRO-3 template has
``sub_group_size`` and ``stage3_*``; OpenRLHF's has ``offload_*`` with ``"device": "cpu"``,
``zero_hpz_partition_size: 1`` and quantization off). So a stock key is *accepted* when a run here
gives the results the same config gives under ZeRO-3, and the log says once, in one info line, what
each accepted key does here (most tune how ZeRO-3 buckets, fetches or partitions, which chunks do
their own way). A key is *refused* (``ValueError`` naming it, its value and what works) only where
the value would change results or asks for a feature that is not here: quantized weights or
gradients, hierarchical partitioning over more than one rank, ZenFlow, ``load_from_fp32_weights:
false`` (loads here always restore the fp32 masters), an offload device other than ``none``,
``cpu`` or ``nvme``. ``"device": "cpu"`` is accepted: placement already keeps in host memory what
does not fit the accelerator, decided from the trace (on a CPU-only run everything is in host
memory), and the line says what each setting of such a block does here (ZeRO-Offload++'s ``ratio``
of states kept on the host: the step-time model chooses that); ``"nvme"`` is the disk tier
(``disk/config.py``).
"""

from __future__ import annotations

import enum
import logging
from typing import Any

logger = logging.getLogger(__name__)

_OFFLOAD_DEVICES = ("none", "cpu", "nvme")

# what an accepted key does here, by key (the key's value does not matter)
_HERE = {
    "sub_group_size": "optimizer sub-groups are the chunks here (chunk_size)",
    "stage3_gather_16bit_weights_on_model_save": "save_16bit_model always writes the full weights here",
    "stage3_gather_fp16_weights_on_model_save": "save_16bit_model always writes the full weights here",
    "gather_16bit_weights_on_model_save": "save_16bit_model always writes the full weights here",
    "cpu_offload_use_pin_memory": "host copies are pinned where placement runs on a GPU",
    "zero_hpz_partition_size": "one partition group over all data-parallel ranks, as here",
    "zero_quantized_weights": "full-precision communication, as here",
    "zero_quantized_gradients": "full-precision communication, as here",
    "zero_quantized_nontrainable_weights": "full-precision communication, as here",
    "zenflow": "off",
    "load_from_fp32_weights": "loads restore the fp32 masters, as here",
}
_FETCH = "ZeRO-3 fetch tuning: chunk groups are fetched by the trace here (prefetch_groups, keep_gathered)"
_BUCKETS = "bucket and overlap tuning: gradients are reduce-scattered per chunk group here"
_NOTHING = "a setting of stock stages with no counterpart here"
_STAGE3_FETCH = {
    "stage3_prefetch_bucket_size",
    "stage3_max_live_parameters",
    "stage3_max_reuse_distance",
    "stage3_module_granularity_threshold",
    "stage3_use_all_reduce_for_fetch_params",
    "stage3_allgather_sequential",
    "prefetch_bucket_size",
    "max_live_parameters",
    "max_reuse_distance",
    "module_granularity_threshold",
    "use_all_reduce_for_fetch_params",
    "allgather_sequential",
}
_BUCKET_KEYS = {
    "contiguous_gradients",
    "reduce_scatter",
    "reduce_bucket_size",
    "use_multi_rank_bucket_allreduce",
    "allgather_partitions",
    "allgather_bucket_size",
    "overlap_comm",
    "round_robin_gradients",
}


def _refusal(key: str, value: Any) -> str | None:
    """Why ``key: value`` cannot be honoured here, or None when it is harmless."""
    if key in ("zero_quantized_weights", "zero_quantized_gradients", "zero_quantized_nontrainable_weights"):
        quantized = "quantized communication is not implemented (it changes the values sent); set it to false"
        return quantized if value else None
    if key == "zero_hpz_partition_size":
        return None if value in (None, 1) else "hierarchical partitioning (hpZ) is not implemented; set it to 1"
    if key == "zenflow":
        return "ZenFlow is a stage-1/2 feature; remove it" if value else None
    if key == "load_from_fp32_weights":
        return None if value in (None, True) else "loads here always restore the fp32 masters; remove it"
    return None


def offload_device(key: str, value: Any) -> str:
    """The device of an ``offload_param``/``offload_optimizer`` block (``"none"`` for None); another
    device raises ``ValueError`` naming the ones that work."""
    if value is None:
        return "none"
    raw = value.get("device", "none") if isinstance(value, dict) else None
    # DeepSpeed's own OffloadDeviceEnum (a str Enum: str() gives its class name) where a config went through it
    device = str(raw.value if isinstance(raw, enum.Enum) else raw).lower() if raw is not None else None
    if device not in _OFFLOAD_DEVICES:
        raise ValueError(
            f'zero_optimization.{key}={value!r}: write a block with "device": "none" (no offload), "cpu" '
            f'(placement may keep it in host memory) or "nvme" (the disk tier, with "nvme_path")'
        )
    return device


# what the settings of a ``"device": "cpu"`` block do here (the placement decides what stays on the accelerator)
_NVME_ONLY = "a setting of the nvme device"
_OVERLAPPED = "placement overlaps the transfers and the host Adam by the step-time model"
_CPU_SETTINGS = {
    "ratio": "placement chooses how many optimizer states stay on the accelerator (optimizer_placement)",
    "pin_memory": _HERE["cpu_offload_use_pin_memory"],
    **dict.fromkeys(("buffer_count", "buffer_size", "max_in_cpu", "fast_init", "nvme_path"), _NVME_ONLY),
    **dict.fromkeys(("pipeline", "pipeline_read", "pipeline_write"), _OVERLAPPED),
    "super_offload": "placement overlaps the host Adam with the next forward (overlap_host_adam)",
    "cpuadam_cores_perc": "the host Adam uses torch's intra-op threads",
}


def _offload_meaning(key: str, device: str, block: Any = None) -> str:
    what = "parameters (chunks)" if key in ("offload_param", "cpu_offload_param") else "optimizer states"
    if device != "cpu":
        return "no offload"
    said = f"placement may keep {what} in host memory (it does when they do not fit the accelerator)"
    settings = [k for k in block if k != "device"] if isinstance(block, dict) else []
    return said + "".join(f"; its {k}: {_CPU_SETTINGS.get(k, _NOTHING)}" for k in sorted(settings))


def meaning(key: str, value: Any) -> str:
    """What the accepted stock key ``key`` does here; raises ``ValueError`` for one that is refused."""
    why = _refusal(key, value)
    if why is not None:
        raise ValueError(f"zero_optimization.{key}={value!r} cannot be used with stage 'patrickstar': {why}")
    if key in ("offload_param", "offload_optimizer"):
        return _offload_meaning(key, offload_device(key, value), value)
    if key in ("cpu_offload", "cpu_offload_param"):
        return _offload_meaning(key, "cpu" if value else "none")
    if key in _HERE:
        return _HERE[key]
    if key in _STAGE3_FETCH:
        return _FETCH
    return _BUCKETS if key in _BUCKET_KEYS else _NOTHING


def log_accepted(meanings: dict[str, str]) -> None:
    """One info line: the accepted stock keys, grouped by what they do here."""
    if not meanings:
        return
    by_meaning: dict[str, list[str]] = {}
    for key, text in sorted(meanings.items()):
        by_meaning.setdefault(text, []).append(key)
    said = "; ".join(f"{', '.join(keys)}: {text}" for text, keys in by_meaning.items())
    logger.info("zero_optimization keys of stock ZeRO accepted by stage 'patrickstar': %s", said)
