"""The figures the step-time model prices a step with (see [Note: step-time model] in placement/step_time.py),
measured at initialize where the accelerator is a GPU.

[Note: device profile]
On CUDA, initialize measures the four rates of :class:`~ds_patrickstar.placement.step_time.DeviceProfile`
itself, in about 0.1 s: a pinned host buffer of ``PROBE_BYTES`` copied to the device and back (the copy
stream's path: a buffer of the host pool, non-blocking copies; the best of ``REPEATS``, timed with CUDA events), and
Adam over ``PROBE_ELEMENTS`` elements with the kernels the step runs (the host one on the host clock, the
device one with CUDA events; the best of ``REPEATS`` after a first call). An H200 machine measured 39 GB/s
to the device and 53 GB/s back, where the figures this project measured on an H100 say 54 and 54, and its
host Adam ran 1.5x slower than that H100 machine's: priced with another machine's figures, placement picks
for the wrong machine. On the strict emulated accelerator there is nothing to measure: it prices with the
H100's figures (:data:`~ds_patrickstar.placement.step_time.H100_PROFILE`), so that the twin's choices are
those the H100 would make. ``zero_optimization.device_profile`` gives any of the four figures instead (all
four: nothing is measured). The profile is logged once at initialize.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import fields, replace

import torch

from ..memory.accelerator import Accelerator
from ..memory.cuda import CudaAccelerator
from ..optim.adam_math import AdamHyper
from ..optim.chunk_adam import adam_backend
from ..placement.step_time import H100_PROFILE, DeviceProfile
from .config import ProfileFigures

logger = logging.getLogger(__name__)

PROBE_BYTES = 64 * 2**20
PROBE_ELEMENTS = 1 << 22
REPEATS = 3
_HYPER = AdamHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, adamw=True)


def device_profile(accel: Accelerator, given: ProfileFigures | None = None) -> DeviceProfile:
    """The accelerator's own figures on CUDA, the H100's elsewhere, each one ``given`` in its place (see [Note:
    device profile])."""
    figures = given.model_dump(exclude_none=True) if given is not None else {}
    if not figures:
        return measured_profile(accel)
    if len(figures) == len(fields(DeviceProfile)):
        profile = DeviceProfile(**figures)
    else:
        profile = replace(measured_profile(accel), **figures)
    logger.info("ds_patrickstar: device profile %s (given: %s)", profile, ", ".join(sorted(figures)))
    return profile


def measured_profile(accel: Accelerator) -> DeviceProfile:
    """The accelerator's own figures on CUDA, the H100's elsewhere."""
    if not isinstance(accel, CudaAccelerator):
        return H100_PROFILE
    device = accel.device
    to_device, to_host = copy_rates(accel)
    profile = DeviceProfile(
        to_device_bytes_per_s=to_device,
        to_host_bytes_per_s=to_host,
        host_adam_elements_per_s=adam_rate(torch.device("cpu"), host_clock),
        device_adam_elements_per_s=adam_rate(device, cuda_clock(device)),
    )
    logger.info(
        "ds_patrickstar: device profile measured on %s: %.1f GB/s to the device, %.1f GB/s to the host, "
        "host Adam %.2fe9 elements/s, device Adam %.1fe9 elements/s (see [Note: device profile])",
        torch.cuda.get_device_name(device),
        profile.to_device_bytes_per_s / 1e9,
        profile.to_host_bytes_per_s / 1e9,
        profile.host_adam_elements_per_s / 1e9,
        profile.device_adam_elements_per_s / 1e9,
    )
    return profile


Clock = Callable[[Callable[[], object]], float]


def rate(amount: float, work: Callable[[], object], clock: Clock) -> float:
    """``amount`` per second of ``work``: the best of ``REPEATS`` timed runs after one untimed one."""
    work()
    return amount / min(clock(work) for _ in range(REPEATS))


def host_clock(work: Callable[[], object]) -> float:
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


def cuda_clock(device: torch.device) -> Clock:
    """Seconds of ``work`` on the current stream, by CUDA events (its host time not counted)."""

    def clock(work: Callable[[], object]) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(torch.cuda.current_stream(device))
        work()
        end.record(torch.cuda.current_stream(device))
        end.synchronize()
        return max(start.elapsed_time(end) / 1000.0, 1e-9)

    return clock


def copy_rates(accel: CudaAccelerator) -> tuple[float, float]:
    """Bytes per second from a pinned host buffer of the host pool to the device and back (see [Note: device
    profile] and [Note: pinned host memory] in memory/host_pool.py: not torch's caching host allocator)."""
    host = accel.host_empty(PROBE_BYTES, torch.uint8)
    on_device = torch.empty(PROBE_BYTES, dtype=torch.uint8, device=accel.device)
    clock = cuda_clock(accel.device)
    try:
        return (
            rate(PROBE_BYTES, lambda: on_device.copy_(host, non_blocking=True), clock),
            rate(PROBE_BYTES, lambda: host.copy_(on_device, non_blocking=True), clock),
        )
    finally:
        torch.cuda.current_stream(accel.device).synchronize()
        accel.host_free(host)


def adam_rate(device: torch.device, clock: Clock) -> float:
    """Elements per second of the Adam kernel the step runs on ``device``, the gradient read from the bf16 slot
    (see [Note: device profile])."""
    step = adam_backend(device)
    slot = torch.full((PROBE_ELEMENTS,), 1e-3, dtype=torch.bfloat16, device=device)
    master, exp_avg, exp_avg_sq = (torch.zeros(PROBE_ELEMENTS, device=device) for _ in range(3))
    return rate(
        PROBE_ELEMENTS,
        lambda: step(slot, master, exp_avg, exp_avg_sq, step=1, hyper=_HYPER, grad_scale=1.0),
        clock,
    )
