"""What the data-parallel ranks must agree on, agreed in fixed-shape messages on a group of its own.

[Note: rank agreement]
Two things need every rank to decide alike: the lockstep check before each chunk-group collective
(see [Note: ranks in lockstep]) and the agreed values taken from each rank's own memory (the gather
plan, see [Note: agreed gather plan], and the default keep limit, see [Note: default kept groups
from host memory]). :class:`RankAgreement` runs both with one protocol. A rank sends a *header* of
a fixed length, ``(kind, count, crc)``: what it is agreeing (a check, a plan, values), how many
values follow and a checksum of what they mean (the collective about to run, the moments' labels),
all-reduced as ``min`` of ``(h, -h)``, so every rank learns in the same call whether every header
is the same. Only then does a *body* of ``count`` values follow (an elementwise ``min``), so its
length is the same on every rank: a collective is never issued with a length that depends on the
rank (ranks whose iterations differed all-reduced plans of different lengths, which NCCL pairs up
into a hang or garbage). Headers that differ are followed by one all-gather of the headers (fixed
shape), from which every rank takes the same decision: plans of different iterations give no plan
(see [Note: agreed gather plan]); anything else means the ranks diverged, and every rank raises
:class:`~ds_patrickstar.groups.lockstep.RanksDiverged` after an exchange of the moments each ran.

Where it runs (``zero_optimization.lockstep``, see [Note: lockstep modes]): with checks on, on a gloo
group of the data-parallel ranks that the object makes at initialize and destroys in
:meth:`RankAgreement.destroy` (``engine.destroy()``, a failed initialize; not an engine destroyed
inside an iteration, as after an error on one rank: another rank waiting in a check would then fail
with a lost connection, reported before the failing rank's own error): host tensors, no device
synchronization before each collective; on NCCL the ranks' hosts then also meet through gloo, over
the interface said at initialize (``GLOO_SOCKET_IFNAME``, or the address the host name resolves to).
With ``"off"`` no side group is made and the values are agreed on the data-parallel group itself
(on NCCL with device tensors, as DeepSpeed's own collectives: no gloo networking at all). What it
costs is in the counters: ``lockstep_checks``, ``agreements`` and ``agreement_seconds``.

[Note: lockstep modes]
``"on"`` (default): every chunk-group collective is checked (a gloo all-reduce of six integers).
``"first_steps"``: only during the first :data:`FIRST_STEPS` optimizer steps of the engine (a
checkpoint load counts as one; a model whose ranks run different modules does so from its first
iterations, unless routing changes with the data), then never: the checks' host synchronization is
gone from the steps after. ``"off"``: never; ranks that issue different collectives then hang (NCCL)
or abort or mix data (gloo), as with stock ZeRO-3. Every rank counts optimizer steps alike, so they
stop checking at the same collective.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum
from typing import Literal

import torch
import torch.distributed as dist

from ..counters import StepCounters
from .lockstep import MOMENTS_KEPT, RanksDiverged, divergence_message

logger = logging.getLogger(__name__)

LockstepMode = Literal["on", "off", "first_steps"]
FIRST_STEPS = 3  # optimizer steps checked under "first_steps" (see [Note: lockstep modes])


class Kind(IntEnum):
    """What a header is agreeing (see [Note: rank agreement])."""

    CHECK = 1  # a lockstep check: no body
    PLAN = 2  # a gather plan: ranks whose iterations differ get no plan
    VALUES = 3  # other values taken from a rank's memory


@dataclass(frozen=True)
class Agreed:
    """What an agreement gave: the elementwise minimum of the values, or None where the ranks' headers
    differed, and then every rank's count of values (rank order)."""

    values: list[int] | None
    counts: tuple[int, ...] = ()


def _no_advice(moments: list[list[str]]) -> str:
    return ""


def crc(text: str) -> int:
    return zlib.crc32(text.encode())


class RankAgreement:
    """Everything the data-parallel ranks agree on; see [Note: rank agreement]."""

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        world_size: int,
        rank: int,
        counters: StepCounters,
        mode: LockstepMode = "on",
    ) -> None:
        self.world_size, self.rank, self.mode = world_size, rank, mode
        self._counters = counters
        self._side = side_group(group) if world_size > 1 and mode != "off" else None
        self._channel = self._side if self._side is not None else group
        on_host = self._side is not None or (world_size > 1 and "gloo" in str(dist.get_backend(group)))
        self._on_host = on_host  # the channel takes host tensors, else the accelerator's
        self.device = torch.device("cpu")  # the accelerator's (set by ChunkComm.bind)
        self._steps = 0
        self._closed = False
        self._moments: list[str] = []  # since the last agreed check
        # what to do about modules that differ, from their moments per rank (set by the integration)
        self.advice: Callable[[list[list[str]]], str] = _no_advice

    @property
    def checking(self) -> bool:
        """Whether collectives are checked now (see [Note: lockstep modes])."""
        if self.world_size == 1 or self._closed:
            return False
        return self.mode == "on" or (self.mode == "first_steps" and self._steps < FIRST_STEPS)

    def next_step(self) -> None:
        """An optimizer step is over (on every rank alike)."""
        self._steps += 1

    # ---- lockstep ----------------------------------------------------------------------
    def moment(self, label: str) -> None:
        """A moment (a hooked module's use) ran on this rank."""
        if self.checking:
            self._moments.append(label)
            del self._moments[:-MOMENTS_KEPT]

    def check(self, what: str) -> None:
        """Before ``what`` (a collective, or the end of a forward or backward): every rank is about to do
        the same, or every rank raises :class:`RanksDiverged` (see [Note: ranks in lockstep])."""
        if not self.checking:
            return
        self._counters.lockstep_checks += 1
        self._exchange(Kind.CHECK, what, [])
        self._moments.clear()

    # ---- values ------------------------------------------------------------------------
    def agree_min(self, meaning: str, values: list[int]) -> list[int]:
        """The elementwise minimum of ``values`` over the ranks, ``meaning`` what they stand for: every
        rank agrees the same ``meaning`` with as many values, or every rank raises :class:`RanksDiverged`."""
        agreed = self._agree(Kind.VALUES, meaning, values).values
        if agreed is None:  # pragma: no cover - only plans may differ
            raise RuntimeError(f"ds_patrickstar: the ranks did not agree {meaning}")
        return agreed

    def agree_plan(self, meaning: str, values: list[int]) -> Agreed:
        """As :meth:`agree_min`; where the ranks' ``meaning`` (a plan's moments) or number of values differ,
        no values and every rank's count (see [Note: agreed gather plan])."""
        return self._agree(Kind.PLAN, meaning, values)

    def _agree(self, kind: Kind, meaning: str, values: list[int]) -> Agreed:
        if self.world_size == 1:
            return Agreed(list(values))
        self._counters.agreements += 1
        return self._exchange(kind, meaning, values)

    # ---- the protocol ------------------------------------------------------------------
    def _exchange(self, kind: Kind, meaning: str, body: list[int]) -> Agreed:
        if self._closed:
            raise RuntimeError("ds_patrickstar: the ranks' agreement is used after engine.destroy()")
        start = time.perf_counter()
        try:
            header = [int(kind), len(body), crc(meaning)]
            both = self._all_reduce_min([*header, *(-v for v in header)])
            if both[:3] == [-v for v in both[3:]]:  # every header alike: the bodies have one length
                return Agreed(self._all_reduce_min(body) if body else [])
            headers = self._all_gather_headers(header)
        finally:
            self._counters.agreement_seconds += time.perf_counter() - start
        if all(h[0] == Kind.PLAN for h in headers):
            return Agreed(None, tuple(h[1] for h in headers))
        said: list[tuple[str, list[str]] | None] = [None] * self.world_size
        dist.all_gather_object(said, (_described(kind, meaning), list(self._moments)), group=self._channel)
        raise RanksDiverged(divergence_message([s for s in said if s is not None], self.advice))

    def _tensor(self, values: list[int]) -> torch.Tensor:
        device = torch.device("cpu") if self._on_host else self.device
        return torch.tensor(values, dtype=torch.int64, device=device)

    def _all_reduce_min(self, values: list[int]) -> list[int]:
        tensor = self._tensor(values)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self._channel)
        return [int(v) for v in tensor.tolist()]

    def _all_gather_headers(self, header: list[int]) -> list[list[int]]:
        mine = self._tensor(header)
        out = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(out, mine, group=self._channel)
        return [[int(v) for v in h.tolist()] for h in out]

    # ---- lifetime ----------------------------------------------------------------------
    def destroy(self) -> None:
        """The side group goes (``engine.destroy()``, a failed initialize); doing it again does nothing."""
        side, self._side, self._closed = self._side, None, True
        if side is None:
            return
        self._channel = None  # the group's threads end with its last reference
        if not dist.is_initialized():
            return
        try:
            dist.destroy_process_group(side)
        except (ValueError, RuntimeError) as err:  # already gone with every group (destroy_process_group())
            logger.debug("ds_patrickstar: the agreement's side group was already destroyed: %s", err)


def _described(kind: Kind, meaning: str) -> str:
    return meaning if kind is Kind.CHECK else f"agreeing {kind.name.lower()} ({meaning})"


def side_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    """A gloo group of ``group``'s ranks, the agreement's own (see [Note: rank agreement])."""
    if "gloo" not in str(dist.get_backend(group)):
        say_gloo_interface()
    ranks = dist.get_process_group_ranks(group) if group is not None else None
    return dist.new_group(ranks=ranks, backend="gloo")


def say_gloo_interface() -> None:
    """Log the network interface gloo will connect over, before it does: where that fails or hangs (a host
    name resolving to a loopback address, several interfaces), the log says why and how to choose."""
    named = os.environ.get("GLOO_SOCKET_IFNAME")
    if named:
        where, loopback = f"interface {named} (GLOO_SOCKET_IFNAME)", False
    else:
        host = socket.gethostname()
        try:
            address = socket.gethostbyname(host)
        except OSError:
            address = "unresolved"
        where, loopback = f"the address host name {host!r} resolves to ({address})", address.startswith("127.")
    log = logger.warning if loopback and _several_hosts() else logger.info
    log(
        "ds_patrickstar: the ranks' lockstep checks run on a gloo group of the data-parallel ranks, which connects "
        'over %s; set GLOO_SOCKET_IFNAME to choose the interface, or zero_optimization.lockstep to "off" to '
        "use no gloo group (see docs/troubleshooting.md)",
        where,
    )


def _several_hosts() -> bool:
    local = os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE")
    return local is not None and dist.is_initialized() and int(local) < dist.get_world_size()
