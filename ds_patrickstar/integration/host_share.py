"""How many chunk groups stay gathered by default on a run without placement: from the host memory
the ranks of this host share.

[Note: default kept groups from host memory]
Without placement every rank keeps its model data in host memory, and the groups it keeps gathered
between uses (see [Note: kept groups]) come on top: with every group kept, a rank also holds the
gathered storage of every group, the whole model in bf16/fp16 (see [Note: gathered group
storage] in store/chunk_store.py). The ranks on one host share its memory, so ``keep_gathered: None``
(the default) is decided at initialize. Each rank's *share* is

* the host's available memory at that moment, plus the bytes the chunk parameters' own
  storages hold (freed once the chunks hold their values and initialize returns, see
  [Note: initialize as a transaction]; a parameter built under ``Init`` holds none),
* divided by the ranks on this host (``LOCAL_WORLD_SIZE`` from torchrun, ``LOCAL_SIZE`` from
  DeepSpeed's launcher, else every rank of the run: each host decides for its own ranks).

Before any group may be kept, the share must hold what a step allocates with no group kept (the
model data, and :func:`step_bytes` from the chunk plan for the parts after it):

* the model data per rank ``M`` (:func:`~ds_patrickstar.memory.preflight.plan_for_rank`: the owned
  low-precision chunks, fp32 master, momentum, variance and, with gradient accumulation, the
  owned accumulators);
* the groups gathered at once: the one in use and ``prefetch_groups`` ahead, each its storage of
  ``W`` chunks beside the owned chunk (the owned chunk's landing slot is one chunk *more* than
  the other ranks' chunks) and its joined buffers, the largest group counted for each;
* with gradient accumulation, the flat gradient buffers of ``W`` chunks of the micro-steps before
  the boundary: the one being filled and the reduce-scatters in flight
  (:data:`~ds_patrickstar.memory.reductions.LIMIT`), the largest counted for each (see
  [Note: flat group buffers]);
* the step's temporaries: the gradient autograd makes for a parameter before its slot takes it,
  twice the largest parameter (a tied weight's two contributions before they are summed);
* and what the arithmetic does not see: ``M / 10`` (the host allocator keeps pages of freed
  temporaries mapped, and the step's small temporaries) and 0.5 GiB (the activations of a
  step and the collectives' buffers), the footprint of a run that releases every group.

Half of what is left is the limit on kept bytes (the other half stays free, for activations
larger than that): when it covers every group (the whole low-precision model), nothing is limited
(ZeRO-3's volume: one all-gather per group and step); otherwise the kept bytes are limited to it,
``0`` when nothing is left. So near the cap a run keeps nothing, and a model that trains with
``keep_gathered: 0`` trains with the default: a 1.21B GPT at two ranks releases every group when
the host has ``1.1 x 14`` bytes per parameter plus 0.5 GiB per rank. The limit is the minimum over
the ranks (one all-reduce at initialize), as keep decisions must be the same on every rank. An
explicit ``keep_gathered`` always wins, and with placement the device budget decides instead (see
[Note: agreed gather plan]).
"""

from __future__ import annotations

import logging

import psutil
import torch

from ..chunks.group_bytes import planned_group_bytes
from ..chunks.layout import ChunkSpec
from ..groups.comm import ChunkComm
from ..memory.preflight import ModelDataPlan, local_world_size
from ..memory.reductions import LIMIT as REDUCTIONS_IN_FLIGHT

logger = logging.getLogger(__name__)

UNSEEN_FRACTION = 10
"""Of the model data, ``1 / UNSEEN_FRACTION`` is left for what the arithmetic does not see."""
NON_MODEL_BYTES = 1 << 29
"""Per rank, left for a step's activations and the collectives' buffers."""


def every_group_bytes(plan: ModelDataPlan) -> int:
    """The storage of every chunk group gathered: the whole low-precision model (see
    [Note: gathered group storage] in store/chunk_store.py)."""
    return plan.total_elements * plan.lp_bytes


def step_bytes(specs: list[ChunkSpec], lp_bytes: int, world_size: int, accumulate: bool, prefetch: int) -> int:
    """What a rank allocates in a step beyond its model data with no group kept; see
    [Note: default kept groups from host memory]."""
    sizes = planned_group_bytes(specs, lp_bytes, world_size, accumulate)
    gathered = max((s.storage + s.joined for s in sizes), default=0)
    grad_buffer = max((s.grad_buffer for s in sizes), default=0)
    largest = max((p.numel() for spec in specs for _, p, _, _, _ in spec.members), default=0)
    return (1 + prefetch) * gathered + (1 + REDUCTIONS_IN_FLIGHT) * grad_buffer + 2 * largest * lp_bytes


def keep_limit(plan: ModelDataPlan, host_available: int, local_ranks: int, step: int) -> int | None:
    """Bytes of gathered group storage a rank may keep (None: every group), ``step`` the bytes of
    :func:`step_bytes`; see [Note: default kept groups from host memory]."""
    model_data = plan.model_data_bytes
    need = model_data + model_data // UNSEEN_FRACTION + NON_MODEL_BYTES + step
    room = (host_available // local_ranks - need) // 2
    return None if room >= every_group_bytes(plan) else max(0, room)


def own_bytes(module: torch.nn.Module) -> int:
    """Bytes the chunk parameters' own storages hold (trainable and frozen floating-point ones), each
    storage once (an empty storage, as under ``Init``, holds none)."""
    storages = {}
    for p in module.parameters():
        if p.is_floating_point() and not p.is_meta:
            storage = p.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def default_keep_gathered(module: torch.nn.Module, plan: ModelDataPlan, step: int, comm: ChunkComm) -> int | None:
    """The default ``keep_gathered`` of a run without placement, the same on every rank."""
    if comm.world_size == 1:
        return None
    local_ranks = local_world_size(comm.world_size)
    limit = keep_limit(plan, psutil.virtual_memory().available + own_bytes(module), local_ranks, step)
    every_group = every_group_bytes(plan)
    (agreed,) = comm.agreement.agree_min("keep_gathered", [every_group if limit is None else limit])
    if agreed >= every_group:
        return None
    logger.info(
        "ds_patrickstar: %d ranks share this host's memory: at most %.3f GiB of gathered group storage stays "
        "gathered between uses (of %.3f GiB); set zero_optimization.keep_gathered to choose",
        local_ranks,
        agreed / 2**30,
        every_group / 2**30,
    )
    return agreed
