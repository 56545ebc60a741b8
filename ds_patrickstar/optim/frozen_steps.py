"""Parameters frozen after initialize: Adam skips them, and each keeps a step count of its own.

[Note: requires_grad after initialize]
A parameter given to the optimizer lives in a trainable chunk whatever its ``requires_grad`` does later
(a chunk's kind is fixed at initialize, see [Note: frozen chunks]). Setting ``requires_grad=False`` on it
between steps freezes it as plain PyTorch's Adam/AdamW does, which steps only the parameters that have a
gradient: from the next step on it is not stepped (no update, no weight decay), and its master, momentum
and variance stay as they were. Setting ``requires_grad=True`` again trains it on from there. Its slot
still takes part in the step's collectives (it gets a zero gradient in the backward epilogue, as a
parameter no forward used does, see [Note: gradient accumulation]), so nothing changes for the ranks'
agreement; :meth:`ChunkAdam._update` reads ``requires_grad`` at the step and updates the chunk in runs of
consecutive pieces with the same step count (:func:`update_runs`), writing the master back into the
frozen runs' slots, which held the zero gradient. With nothing frozen the run is the whole range: one
fused call per chunk, as before. A chunk handed to the host worker (see [Note: overlapped host Adam])
is cut into runs when it is handed over, so ``requires_grad`` is read at the step there too.

PyTorch counts Adam's steps per parameter (``state["step"]``), and bias correction reads that count, so a
parameter unfrozen after ``k`` skipped steps takes its next step with its own count, ``k`` lower than its
group's. :class:`SkippedSteps` keeps the ``k`` of every parameter ever skipped, by name, in its param
group under :data:`KEY` (the checkpoint saves the param groups' entries, so a resume at the same world
size keeps them; the key appears only once a parameter is skipped). A parameter is counted once per
applied step, at the ``_update`` call whose range holds the start of its piece on this rank (with data
parallelism a rank holds one piece of a parameter at most; a spilled chunk is updated piece by piece).
A skipped step (an overflow) counts for nobody, as in PyTorch with a loss scaler.

Change ``requires_grad`` identically on every rank, between steps: the step reads it on each rank for the
pieces that rank owns, and ranks that disagree would update one parameter's pieces differently. A
parameter that was frozen at initialize lives in a frozen chunk (no master, no Adam state) and can never
train: the next forward after ``requires_grad=True`` is set on it raises naming it
(:func:`check_still_frozen`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ..chunks.chunk import Chunk, Piece, TensorInfo

KEY = "ds_patrickstar_skipped_steps"
"""The param group entry ``{parameter name: steps it was not stepped}`` (see [Note: requires_grad after initialize])."""


@dataclass(frozen=True)
class Run:
    """Elements ``[start, stop)`` of a chunk's update range, Adam step ``step`` (None: frozen, not stepped)."""

    start: int
    stop: int
    step: int | None


class SkippedSteps:
    """The per-parameter step counts of one param group; see [Note: requires_grad after initialize]."""

    def __init__(self, group: dict[str, Any]) -> None:
        self._group = group

    def _counts(self) -> dict[str, int]:
        return self._group.setdefault(KEY, {})

    def step_of(self, info: TensorInfo, group_step: int, counting: bool) -> int | None:
        """``info``'s Adam step now (None: frozen); ``counting``: this call counts its skipped step."""
        if not info.param.requires_grad:
            if counting:
                counts = self._counts()
                counts[info.name] = counts.get(info.name, 0) + 1
            return None
        skipped = self._group.get(KEY, {}).get(info.name, 0)
        return group_step - skipped


def update_runs(chunk: Chunk, start: int, stop: int, steps: SkippedSteps, group_step: int) -> list[Run]:
    """Elements ``[start, stop)`` of ``chunk`` cut into runs of consecutive pieces with the same step; a
    gap between pieces goes with the run before it (the first run starts at ``start``)."""
    runs: list[Run] = []
    for info, piece in _pieces_in(chunk, start, stop):
        step = steps.step_of(info, group_step, counting=start <= piece.offset)
        at = max(piece.offset, start)
        if not runs:
            runs.append(Run(start, stop, step))
        elif runs[-1].step != step:
            runs[-1] = Run(runs[-1].start, at, runs[-1].step)
            runs.append(Run(at, stop, step))
    return runs or [Run(start, stop, group_step)]


def _pieces_in(chunk: Chunk, start: int, stop: int) -> Iterable[tuple[TensorInfo, Piece]]:
    for info, piece in zip(chunk.tensors, chunk.pieces):
        if piece.offset < stop and piece.offset + piece.numel > start:
            yield info, piece


def check_still_frozen(frozen: Iterable[TensorInfo]) -> None:
    """Raise naming a parameter of a frozen chunk whose ``requires_grad`` was set (see
    [Note: requires_grad after initialize])."""
    unfrozen = [info.name for info in frozen if info.param.requires_grad]
    if unfrozen:
        shown = ", ".join(unfrozen[:5]) + (f" and {len(unfrozen) - 5} more" if len(unfrozen) > 5 else "")
        raise RuntimeError(
            f"parameter(s) {shown} had requires_grad=False at deepspeed.initialize and were set to "
            f"requires_grad=True since: stage 'patrickstar' keeps a parameter frozen at initialize in a frozen "
            f"chunk, without fp32 master or Adam state, so it can never train. Set requires_grad=True on every "
            f"parameter you will train before deepspeed.initialize (and requires_grad=False after it to freeze "
            f"it for a while: see docs/troubleshooting.md), or set it back to False"
        )
