"""How many chunk groups stay gathered by default on a run without placement: from the host memory
the ranks of this host share.

[Note: default kept groups from host memory]
Without placement every rank keeps its model data in host memory, and the groups it keeps gathered
between uses (see [Note: kept groups]) come on top: with every group kept, a rank also holds the
gathered storage of every group, the whole model in bf16/fp16 (see [Note: gathered group
storage] in memory/store.py). The ranks on one host share its
memory, so ``keep_gathered: None`` (the default) is decided at initialize from

* the host's available memory at that moment, plus the chunk parameters' own bytes (freed once
  the chunks hold their values and initialize returns, see [Note: initialize as a transaction]),
* the ranks on this host (``LOCAL_WORLD_SIZE`` from torchrun, ``LOCAL_SIZE`` from DeepSpeed's
  launcher, else every rank of the run),
* and the planner's model data per rank (:func:`~ds_patrickstar.memory.preflight.plan_for_rank`):

each rank's share is the available memory divided by the ranks on this host; what its model data
leaves of that share, halved (the other half is left to activations and temporaries), is the
default limit on kept bytes. When that covers every group, nothing is limited (ZeRO-3's volume:
one all-gather per group and step); otherwise the kept bytes are limited to it (``0`` when the
model data alone fills the share). The limit is the minimum over the ranks (one all-reduce at
initialize), as keep decisions must be the same on every rank. An explicit ``keep_gathered``
always wins, and with placement the device budget decides instead (see [Note: agreed gather plan]).
"""

from __future__ import annotations

import logging

import psutil
import torch

from ..groups.comm import ChunkComm
from ..memory.preflight import ModelDataPlan, local_world_size

logger = logging.getLogger(__name__)


def every_group_bytes(plan: ModelDataPlan) -> int:
    """The storage of every chunk group gathered: the whole low-precision model (see
    [Note: gathered group storage] in memory/store.py)."""
    return plan.total_elements * plan.lp_bytes


def keep_limit(plan: ModelDataPlan, host_available: int, local_ranks: int) -> int | None:
    """Bytes of gathered group storage a rank may keep (None: every group); see
    [Note: default kept groups from host memory]."""
    every_group = every_group_bytes(plan)
    room = (host_available // local_ranks - plan.model_data_bytes) // 2
    return None if room >= every_group else max(0, room)


def default_keep_gathered(module: torch.nn.Module, plan: ModelDataPlan, comm: ChunkComm) -> int | None:
    """The default ``keep_gathered`` of a run without placement, the same on every rank."""
    if comm.world_size == 1:
        return None
    own = sum(p.numel() * p.element_size() for p in module.parameters() if p.is_floating_point() and not p.is_meta)
    local_ranks = local_world_size(comm.world_size)
    limit = keep_limit(plan, psutil.virtual_memory().available + own, local_ranks)
    every_group = every_group_bytes(plan)
    (agreed,) = comm.agree([every_group if limit is None else limit])
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
