"""The disk tier's configuration: DeepSpeed's ``offload_optimizer``/``offload_param`` with ``"device": "nvme"``.

[Note: disk tier configuration]
``zero_optimization.offload_optimizer`` or ``offload_param`` with ``"device": "nvme"`` (either, or
both) turns the disk tier on (see [Note: disk tier] and [Note: frozen chunks on disk]): one plan
puts on disk what ``host_budget`` cannot hold, frozen chunks and optimizer states alike (see
[Note: disk tier plan]). With both blocks their ``nvme_path`` must be the same folder.
``"device": "none"`` is no offload, ``"cpu"`` is accepted and left to placement (see
[Note: stock ZeRO keys]). In ``offload_param``, ``buffer_count`` is the number of host buffers frozen chunks are read
ahead into (each one frozen chunk's owned slice; default: ``offload_optimizer``'s, else 4), and
``buffer_size``/``max_in_cpu`` are accepted with a warning (a buffer holds one chunk; ``host_budget``
decides what stays in RAM). Of DeepSpeed's keys, ``nvme_path`` is the folder of the swap files and
``buffer_count`` the number of aligned host buffers the step streams through (at least 3:
read-ahead, compute, write-behind); ``pipeline_read``/``pipeline_write`` are what the tier always
does. ``buffer_size`` (named after the buffers of DeepSpeed's ``offload_param``, in elements) is
ours: the piece each buffer holds, master, momentum and variance of that many elements (see
[Note: swap pieces]; rounded up to a multiple of 1024). ``io_backend`` (ours too) picks the
implementation of the tier's I/O: ``"threads"`` (threads calling ``preadv``/``pwritev``, no build
step, every result checked), ``"aio"`` (DeepSpeed's ``aio_handle``, the libaio engine of
ZeRO-Infinity; needs ``libaio-dev`` to build and a file system that takes ``O_DIRECT`` and
page-lockable buffers; it does not check each libaio completion, logged as a warning, see
[Note: aio disk I/O]) or ``"auto"`` (the default: ``"threads"``, the backend that sees every
failed read and write, with a log line saying so). The top-level ``aio`` block's ``intra_op_parallelism``
(``thread_count`` in older DeepSpeed) is the number of I/O threads and its ``block_size`` the part
of a request each thread reads or writes at a time, for both backends; ``queue_depth``,
``single_submit`` and ``overlap_events`` are settings of the ``aio_handle`` (warned about with
``"threads"``). Keys that mean nothing here are accepted with a warning naming them:
``pin_memory`` (the buffers feed the CPU Adam, never a device copy), ``fast_init``, ``ratio``,
``super_offload``, ``cpuadam_cores_perc`` and ``aio.use_gds`` (GPUDirect Storage reads into device
memory).
"""

from __future__ import annotations

import logging
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .io import DEFAULT_BLOCK_SIZE, DEFAULT_THREADS
from .swap_layout import PIECE_ELEMENTS

logger = logging.getLogger(__name__)

_IDLE_OFFLOAD_KEYS = {
    "pin_memory": "the disk tier's buffers feed the CPU Adam, never a device copy",
    "fast_init": "the swap files are written once at initialize",
    "ratio": "host_budget decides which optimizer states go to disk",
    "super_offload": "a ZeRO-3 offload feature",
    "cpuadam_cores_perc": "the CPU Adam uses OpenMP's threads",
}
_IDLE_PARAM_KEYS = {
    "pin_memory": "the disk tier's buffers are host buffers the chunks are copied from",
    "buffer_size": "a frozen chunk's read-ahead buffer holds its owned slice",
    "max_in_cpu": "host_budget decides which frozen chunks stay in RAM",
}
_PIPELINE_KEYS = ("pipeline_read", "pipeline_write")
_HANDLE_KEYS = ("queue_depth", "single_submit", "overlap_events")
_IDLE_AIO_KEYS = ("use_gds",)
_AIO_THREAD_KEYS = ("intra_op_parallelism", "thread_count")


class NvmeOffload(BaseModel):
    """The disk tier's settings, from ``offload_optimizer`` and ``aio``; see [Note: disk tier configuration]."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    nvme_path: str
    """The folder of the swap files (each rank uses ``ds_patrickstar_swap/rank<r>/`` under it)."""

    buffer_count: int = Field(default=4, ge=3, le=64)
    """Aligned host buffers of one piece's states the step streams through (read-ahead, compute,
    write-behind)."""

    buffer_size: int = Field(default=PIECE_ELEMENTS, ge=1, le=2**31)
    """Elements of the piece each buffer holds (its master, momentum and variance: 12 bytes per
    element); see [Note: swap pieces]."""

    threads: int = Field(default=DEFAULT_THREADS, ge=1, le=64)
    """I/O threads (``aio.intra_op_parallelism``)."""

    block_size: int = Field(default=DEFAULT_BLOCK_SIZE, ge=4096, le=2**30)
    """Bytes one thread reads or writes at a time (``aio.block_size``)."""

    io_backend: Literal["auto", "threads", "aio"] = "auto"
    """The implementation of the tier's I/O (``offload_optimizer.io_backend``): ``"threads"``,
    ``"aio"`` (DeepSpeed's ``aio_handle``, which does not check each completion) or ``"auto"``
    (``"threads"``)."""

    queue_depth: int = Field(default=8, ge=1, le=1024)
    """Requests each ``aio_handle`` thread keeps in flight (``aio.queue_depth``)."""

    single_submit: bool = False
    """``aio_handle``: submit requests one at a time (``aio.single_submit``)."""

    overlap_events: bool = True
    """``aio_handle``: submit new requests while completing others (``aio.overlap_events``)."""


def means_nvme(value: Any) -> bool:
    return isinstance(value, dict) and str(value.get("device", "")).lower() == "nvme"


def parse_nvme(block: dict[str, Any], aio: dict[str, Any] | None, name: str = "offload_optimizer") -> NvmeOffload:
    """The disk tier's settings from the block ``name`` (``offload_optimizer`` or ``offload_param``);
    bad values raise ``ValueError`` naming the key, idle keys warn."""
    if not isinstance(block.get("nvme_path"), str) or not block["nvme_path"]:
        raise ValueError(
            f'zero_optimization.{name}: "device": "nvme" needs "nvme_path": the folder of the swap '
            f"files (got {block.get('nvme_path')!r})"
        )
    param = name == "offload_param"
    idle_keys = _IDLE_PARAM_KEYS if param else _IDLE_OFFLOAD_KEYS
    idle = [f"{name}.{k}" for k in idle_keys if k in block]
    idle += [f"{name}.{k}" for k in _PIPELINE_KEYS if block.get(k) is False and not param]
    settings = ("buffer_count", "io_backend") if param else ("buffer_count", "buffer_size", "io_backend")
    known = {"device", "nvme_path", *settings, *idle_keys, *(() if param else _PIPELINE_KEYS)}
    unknown = sorted(set(block) - known)
    if unknown:
        raise ValueError(
            f"zero_optimization.{name}.{unknown[0]} is not a key of DeepSpeed's {name} "
            f"block; the keys are: {', '.join(sorted(known))}"
        )
    values: dict[str, Any] = {"nvme_path": block["nvme_path"]}
    for key in settings:
        if key in block:
            values[key] = block[key]
    aio = aio or {}
    for key in _AIO_THREAD_KEYS:
        if key in aio:
            values["threads"] = aio[key]
            break
    for key in ("block_size", *_HANDLE_KEYS):
        if key in aio:
            values[key] = aio[key]
    idle += [f"aio.{k}" for k in _IDLE_AIO_KEYS if k in aio]
    if block.get("io_backend") == "threads":
        idle += [f"aio.{k}" for k in _HANDLE_KEYS if k in aio]
    if idle:
        logger.warning(
            "ds_patrickstar: keys %s do nothing for stage 'patrickstar''s disk tier (its host buffers feed the "
            'CPU Adam; queue_depth, single_submit and overlap_events tune io_backend "aio"); remove them',
            idle,
        )
    try:
        return NvmeOffload(**values)
    except ValidationError as err:
        names = {"threads": "aio.intra_op_parallelism", **{k: f"aio.{k}" for k in ("block_size", *_HANDLE_KEYS)}}
        error = err.errors()[0]
        field = str(error["loc"][0]) if error["loc"] else name
        key = names.get(field, f"zero_optimization.{name}.{field}")
        raise ValueError(f"{key}={error.get('input')!r} is invalid: {error['msg']}") from None


def check_same_folder(states: NvmeOffload | None, params: NvmeOffload | None) -> None:
    """Both blocks name one swap folder, or ``ValueError`` naming both values and the fix."""
    if states is not None and params is not None and states.nvme_path != params.nvme_path:
        raise ValueError(
            f"zero_optimization.offload_optimizer.nvme_path={states.nvme_path!r} and "
            f"zero_optimization.offload_param.nvme_path={params.nvme_path!r} differ: the disk tier keeps optimizer "
            "states and frozen chunks in one swap folder. Give both blocks the same nvme_path (or drop one block)"
        )


def tier_settings(states: NvmeOffload | None, params: NvmeOffload | None) -> NvmeOffload | None:
    """The disk tier's settings when either block turns it on (the I/O settings come from the ``aio``
    block, the same in both); see [Note: disk tier configuration]."""
    return states if states is not None else params


def frozen_buffer_count(states: NvmeOffload | None, params: NvmeOffload | None) -> int:
    """Host buffers frozen chunks are read ahead into: ``offload_param.buffer_count`` if set, else
    ``offload_optimizer``'s, else its default."""
    if params is not None and "buffer_count" in params.model_fields_set:
        return params.buffer_count
    return (states or params or NvmeOffload(nvme_path=".")).buffer_count
