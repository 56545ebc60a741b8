"""Will it fit? The model-data arithmetic of the pre-flight check, from the chunk plan alone.

[Note: pre-flight]
Before anything is allocated, the chunk plan (:func:`~ds_patrickstar.chunks.layout.plan_chunks`)
gives each rank's owned elements. Model data per rank is

* low-precision parameters (their gradients reuse the slots): ``lp_bytes`` per owned element;
* fp32 master, momentum and variance: 12 bytes per owned element;
* with gradient accumulation, an fp32 accumulator per owned element: 4 bytes (with one rank every
  element is owned; with ``W`` ranks a rank accumulates only what it owns, see
  [Note: gradient accumulation] in groups/grads.py);
* frozen parameters (see [Note: frozen chunks] in chunks/kind.py): ``lp_bytes`` per owned frozen
  element and nothing else.

With placement these bytes may live on the accelerator (up to its budget) or on the host,
so the run fits when they are at most budget + available host memory; and the budget must hold
the most one moment needs at once, a chunk group in use (:func:`largest_group_bytes`, see
[Note: chunk group bytes] in chunks/group_bytes.py, and :func:`check_budget_holds`), or the first
step would fail. One implementation, used by ``deepspeed.initialize``, by
``python -m ds_patrickstar.plan`` (the same functions on a parameter count, a GPT shape or a Hugging
Face config.json built on ``meta``) and by the tests that compare it with a real run's counters.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..chunks.group_bytes import ACC_BYTES_PER_ELEMENT, planned_group_bytes
from ..chunks.layout import ChunkSpec

OPTIM_BYTES_PER_ELEMENT = 12  # fp32 master + momentum + variance

__all__ = [
    "ACC_BYTES_PER_ELEMENT",
    "OPTIM_BYTES_PER_ELEMENT",
    "ModelDataPlan",
    "check_budget_holds",
    "check_fits",
    "largest_fitting_params",
    "largest_frozen_params",
    "largest_group_bytes",
    "local_world_size",
    "plan_for_rank",
    "plan_for_specs",
]


@dataclass(frozen=True)
class ModelDataPlan:
    owned_elements: int  # trainable elements this rank owns
    total_elements: int  # every chunk element of every rank, both kinds
    lp_bytes: int
    accumulate: bool
    frozen_elements: int = 0  # frozen elements this rank owns (see [Note: frozen chunks])

    @property
    def bytes_per_owned_element(self) -> int:
        return self.lp_bytes + OPTIM_BYTES_PER_ELEMENT

    @property
    def model_data_bytes(self) -> int:
        """Model data on this rank, device and host together."""
        acc = ACC_BYTES_PER_ELEMENT if self.accumulate else 0
        return self.owned_elements * (self.bytes_per_owned_element + acc) + self.frozen_bytes

    @property
    def frozen_bytes(self) -> int:
        """The owned frozen chunks: their payload only."""
        return self.frozen_elements * self.lp_bytes


def plan_for_rank(
    capacities: list[int],
    owners: list[int],
    rank: int,
    lp_bytes: int,
    accumulate: bool,
    frozen: list[bool] | None = None,
) -> ModelDataPlan:
    """This rank's model data from the chunks' capacities, owners and (``frozen``) kinds."""
    kinds = frozen or [False] * len(capacities)
    owned = sum(c for c, o, f in zip(capacities, owners, kinds) if o == rank and not f)
    owned_frozen = sum(c for c, o, f in zip(capacities, owners, kinds) if o == rank and f)
    return ModelDataPlan(owned, sum(capacities), lp_bytes, accumulate, owned_frozen)


def plan_for_specs(
    specs: list[ChunkSpec], world_size: int, rank: int, lp_bytes: int, accumulate: bool
) -> ModelDataPlan:
    """:func:`plan_for_rank` of a chunk plan (chunk ``i`` owned by rank ``i % world_size``)."""
    return plan_for_rank(
        [s.capacity for s in specs],
        [i % world_size for i in range(len(specs))],
        rank,
        lp_bytes,
        accumulate,
        [not s.kind.trainable for s in specs],
    )


def largest_fitting_params(plan: ModelDataPlan, available: int, world_size: int) -> int:
    """The most trainable parameters whose model data fits ``available`` bytes per rank at this world
    size, beside the plan's frozen chunks (see [Note: frozen chunks])."""
    per_param = plan.bytes_per_owned_element + (ACC_BYTES_PER_ELEMENT if plan.accumulate else 0)
    return max(0, available - plan.frozen_bytes) // per_param * world_size


def largest_frozen_params(plan: ModelDataPlan, available: int, world_size: int) -> int:
    """The most frozen parameters (their payload only) that fit ``available`` bytes per rank at this
    world size beside the plan's trainable model data: the largest frozen base for these adapters."""
    trainable = plan.model_data_bytes - plan.frozen_bytes
    return max(0, available - trainable) // plan.lp_bytes * world_size


def check_fits(plan: ModelDataPlan, budget: int, host_available: int, world_size: int, on_disk: int = 0) -> None:
    """Raise ``ValueError`` when the model data (less ``on_disk``: the states of spilled chunks less the
    disk tier's buffers) cannot fit accelerator budget plus free host memory."""
    need = plan.model_data_bytes - on_disk
    available = budget + host_available
    if need <= available:
        return
    fits = largest_fitting_params(plan, available, world_size)
    raise ValueError(
        f"the model data needs {need / 2**30:.2f} GiB on this rank ({plan.bytes_per_owned_element} "
        f"bytes per owned parameter x {plan.owned_elements:,} owned elements"
        f"{', + 4 bytes per owned parameter for gradient accumulation' if plan.accumulate else ''}"
        f"{_frozen_part(plan)}"
        f") but the "
        f"accelerator budget ({budget / 2**30:.2f} GiB) plus free host memory give "
        f"{available / 2**30:.2f} GiB; the largest model that would fit has about "
        f"{fits / 1e6:,.0f}M {_beside_frozen(plan, available, world_size)}at this world size"
    )


def _beside_frozen(plan: ModelDataPlan, available: int, world_size: int) -> str:
    """How the largest fitting model reads: trainable parameters beside the frozen base, if there is one."""
    if not plan.frozen_elements:
        return "parameters "
    frozen = largest_frozen_params(plan, available, world_size)
    return (
        f"trainable parameters beside this frozen base (or, with these trainable parameters, a frozen base "
        f"of about {frozen / 1e6:,.0f}M parameters) "
    )


def _frozen_part(plan: ModelDataPlan) -> str:
    if not plan.frozen_elements:
        return ""
    return f", + {plan.lp_bytes} bytes x {plan.frozen_elements:,} owned frozen elements"


def largest_group_bytes(specs: list[ChunkSpec], lp_bytes: int, world_size: int, accumulate: bool) -> int:
    """The most a moment using one chunk group of the chunk plan takes on the accelerator
    (:attr:`~ds_patrickstar.chunks.group_bytes.GroupBytes.peak`, see [Note: chunk group bytes] in
    chunks/group_bytes.py); ``placement.chunk_needs`` counts per moment from the built map."""
    return max((size.peak for size in planned_group_bytes(specs, lp_bytes, world_size, accumulate)), default=0)


def check_budget_holds(budget: int, need: int, world_size: int, largest: int = 0, chunk_size: int = 0) -> None:
    """Raise ``ValueError`` when the accelerator budget cannot hold ``need`` bytes, the largest chunk
    group a moment gathers (:func:`largest_group_bytes`), before any activation; ``largest``: the most elements
    of a chunk, more than ``chunk_size`` where one tensor larger than a chunk has one of its own."""
    if need <= budget:
        return
    what = (
        "its storage of all ranks' chunks beside this rank's chunk and its joined buffers"
        if world_size > 1
        else "one chunk"
    )
    fix = "or lower chunk_size"
    if largest > chunk_size > 0:
        fix = (
            f"(its largest chunk holds {largest:,} elements of one tensor larger than chunk_size={chunk_size:,}: "
            f"a smaller chunk_size does not shrink it)"
        )
    raise ValueError(
        f"zero_optimization.device_budget={budget:,} B cannot hold the largest chunk group a moment uses "
        f"({need:,} B: {what}, with what gradient accumulation adds), let alone activations; "
        f"raise device_budget well above {need:,} B {fix}"
    )


def local_world_size(world_size: int) -> int:
    """Ranks on this host, from the launcher's variables; every rank of the run when none is set."""
    for name in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
        value = os.environ.get(name, "")
        if value.isdigit() and int(value) > 0:
            return min(int(value), world_size)
    return world_size
