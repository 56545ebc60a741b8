"""Per-step counters: what moved where, readable from the engine and written to DeepSpeed's monitor."""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class StepCounters:
    """Reset at every optimizer step; every field is a count or bytes for the last step."""

    bytes_all_gathered: int = 0
    """bytes received by all-gathers of chunk groups (data parallel)"""
    bytes_reduce_scattered: int = 0
    """bytes sent to other ranks by reduce-scatters of gradients (data parallel)"""
    all_gathers: int = 0
    reduce_scatters: int = 0
    bytes_to_device: int = 0
    """chunk bytes copied host -> accelerator (placement)"""
    bytes_to_host: int = 0
    """chunk bytes copied accelerator -> host (placement)"""
    evictions: int = 0
    prefetches: int = 0
    prefetch_hits: int = 0
    adam_chunks_device: int = 0
    """chunks whose Adam update ran on the accelerator"""
    adam_chunks_host: int = 0
    """chunks whose Adam update ran on the host"""
    peak_model_bytes_device: int = 0
    peak_non_model_bytes_device: int = 0

    def reset(self) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, 0)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)
