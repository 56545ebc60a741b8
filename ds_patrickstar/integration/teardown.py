"""The end of a run, and of a failed initialize: the parameters get their values back, then what was built goes.

[Note: engine teardown]
``engine.destroy()`` ends the run (:meth:`ChunkedModel.close`): every hook we put on the model goes,
the disk tier's I/O threads stop and its files go, and the accelerator gives back every allocation
still held and its pinned host buffers (see [Note: closing the accelerator]), all at once, even if
the caller keeps the engine. The hooks must go: torch keeps a parameter's post-accumulate-grad hooks
in its C++ autograd metadata, where the garbage collector does not look, so a hook's closure (the
hook target, and through it the optimizer and the engine) would keep the engine reachable from every
parameter. The parameters are views of the chunks (see [Note: storage resize]), which go: before
they do, every parameter gets its values back as a host tensor of its own (streamed one chunk group
at a time as ``state_dict()`` does, so with data parallelism ``destroy`` is a collective: call it on
every rank, as DeepSpeed's users do). The module stays a plain model with the trained weights, on
the host: it can be read, saved, evaluated or given to a new engine (as the Hugging Face Trainer
does when ``train()`` runs again; a destroyed stock ZeRO-3 engine leaves its partitions behind
instead). Between backward and step the slots hold gradients, so the fp32 masters give the values
then. Where the values cannot be read back, each parameter is left empty (0 elements, with a
warning; a new engine refuses it by name), never a view of freed memory: where reading fails, and,
with data parallelism, where the engine is destroyed mid-iteration (a training forward or backward
began and did not end, see [Note: run state]: a rank that failed mid-step and destroys its engine on
the way out must not start a gather the other ranks never join; it would hang instead of reporting
its error). A forward without backward (a validation loss under grad mode) has ended: destroy gathers.
Such an interrupted engine also keeps its accelerator memory until it is collected: a collective in
flight may still read or write its buffers (gloo's threads, NCCL's stream), and waiting for it could
hang as well; and the ranks' agreement keeps its side group (see [Note: rank agreement]).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import torch

from ..chunks.chunk import Chunk, TensorInfo
from ..chunks.chunk_map import ChunkMap
from ..disk.frozen import FrozenDisk
from ..disk.states import DiskStates
from ..groups.agreement import RankAgreement
from ..io.export import owned_host_values
from ..memory.accelerator import Accelerator
from ..store.chunk_store import ChunkStore
from .hooks import HookRegistry
from .planning import VALUES_LOST

logger = logging.getLogger(__name__)


@torch.no_grad()
def unbind_parameters(
    infos: list[TensorInfo],
    read: Callable[[], Iterable[tuple[TensorInfo, torch.Tensor]]] | None,
    who: str,
    why_unread: str,
) -> None:
    """Every parameter of ``infos`` gets its value from ``read()`` as a host tensor of its own (see
    [Note: engine teardown]). Those it does not give (``why_unread``; all of them when there is no
    ``read`` or reading fails) are left empty and marked :data:`VALUES_LOST`, with one warning that
    names how many and why. Their gradients go."""
    given: set[TensorInfo] = set()
    why = why_unread
    if read is not None:
        try:
            for info, value in read():
                info.param.data = value.to(info.param.dtype)
                given.add(info)
        except Exception as err:
            given.clear()
            why = f"reading them failed: {err!r}"
    lost = [info for info in infos if info not in given]
    if lost:
        logger.warning(
            "ds_patrickstar: %s did not read the weights back from the chunks for %d of %d parameters: %s; they "
            "are left empty (load a checkpoint into a new model to go on)",
            who,
            len(lost),
            len(infos),
            why,
        )
    for info in lost:
        info.param.data = torch.empty(0, dtype=info.param.dtype)
        setattr(info.param, VALUES_LOST, True)
    for info in infos:
        info.param.grad = None


def give_back(
    chunk_map: ChunkMap,
    has_values: Callable[[torch.nn.Parameter], bool],
    hooks: HookRegistry | None,
    disk: DiskStates | None,
    accel: Accelerator,
    frozen_disk: FrozenDisk | None = None,
    store: ChunkStore | None = None,
    agreement: RankAgreement | None = None,
) -> None:
    """A failed initialize: every bound parameter that came with values gets them back from the chunks this
    rank owns (no collective runs on a failing rank), then what was built goes (:func:`release`); see
    [Note: initialize as a transaction]. The release runs even when the read-back raised."""
    try:
        infos = [info for info in chunk_map.infos() if info.bound and has_values(info.param)]
        why = "they lie in chunks other ranks own, and a rank whose initialize failed starts no collective"
        values = store.values if store is not None else Chunk.ready
        read = lambda: owned_host_values(chunk_map, infos, values)
        unbind_parameters(infos, read, "a failed deepspeed.initialize", why)
    finally:
        release(hooks, disk, accel, frozen_disk, agreement)


def release(
    hooks: HookRegistry | None,
    disk: DiskStates | None,
    accel: Accelerator | None,
    frozen_disk: FrozenDisk | None = None,
    agreement: RankAgreement | None = None,
) -> None:
    """Our hooks leave the model, the disk tier's I/O threads stop and its files go (see [Note: swap files]),
    the accelerator gives back its memory, the ranks' agreement its side group (see [Note: rank agreement]);
    each even when one before it raised."""
    try:
        if hooks is not None:
            hooks.remove()
    finally:
        try:
            if disk is not None:
                disk.close()
            if frozen_disk is not None:
                frozen_disk.close()
        finally:
            try:
                if accel is not None:
                    accel.close()
            finally:
                if agreement is not None:
                    agreement.destroy()


def give_back_logged(
    chunk_map: ChunkMap,
    has_values: Callable[[torch.nn.Parameter], bool],
    hooks: HookRegistry | None,
    disk: DiskStates | None,
    accel: Accelerator,
    frozen_disk: FrozenDisk | None,
    store: ChunkStore | None,
    agreement: RankAgreement | None,
) -> None:
    """After a failed :func:`assemble`: :func:`give_back`; an error doing so is logged, the failure's own
    error is the one that propagates."""
    try:
        give_back(chunk_map, has_values, hooks, disk, accel, frozen_disk, store, agreement)
    except Exception:
        logger.exception("ds_patrickstar: giving back what a failed initialize built failed too")
