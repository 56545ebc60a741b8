"""What a run's activation offload is set up from: the mode, the model's blocks and the traced iteration's rule
(see [Note: activation offload] in activations/offloader.py)."""

from __future__ import annotations

import logging

import torch

from ..activations.offloader import OffloadMode, repeated_blocks
from ..activations.traced_keep import TracedKeep
from ..chunks.chunk_map import ChunkMap
from ..memory.accelerator import Accelerator
from ..memory.preflight import OPTIM_BYTES_PER_ELEMENT
from ..placement.chunk_needs import all_held_bytes
from ..placement.interface import Placement
from .config import PatrickStarConfig

logger = logging.getLogger(__name__)


def activation_mode(options: PatrickStarConfig, chunk_map: ChunkMap, budget: int) -> OffloadMode:
    """``offload_activations`` as set, else "auto".

    [Note: activations by default]
    Left out, ``offload_activations`` is "auto": the traced iteration offloads every block that may not fit (see
    [Note: the traced iteration's offload] in activations/traced_keep.py), and the plan made from it at that
    iteration's step offloads the fewest bytes that let the chunks fit beside the tide, nothing where nothing is
    needed (see [Note: auto activation offload] in activations/plan.py). Whether the tide fits beside the chunks a
    moment needs is known only from the trace: a model whose data fits the budget can still have activations that
    do not fit beside it (measured on an H200: gpt2-medium, 4.97 GB of model data under a 5.35 GB budget, 4.1 GB of
    activations), where "none" is refused and ZeRO-3 offload trains. Where nothing is needed and a quarter of the
    budget stays free beside every chunk and activation, nothing moves at all; otherwise the traced iteration pays
    once: the blocks it offloads go to pinned host memory and back. Set the key to choose; "none" refuses a budget
    below the tide with the remedies and the bytes each saves.
    """
    if options.offload_activations is not None:
        return options.offload_activations
    chunks = sum(c.nbytes for c in chunk_map.chunks)
    states = OPTIM_BYTES_PER_ELEMENT * sum(c.capacity for c in chunk_map.trainable_owned())
    if chunks + states > budget:
        logger.info(
            "ds_patrickstar: model data (%d B of chunks and optimizer states) is larger than device_budget (%d B): "
            "activations of the model's blocks move to the host where the chunks would not fit beside them "
            '(offload_activations "auto"; set the key to choose)',
            chunks + states,
            budget,
        )
    return "auto"


def traced_keep(accel: Accelerator, chunk_map: ChunkMap, accumulate: bool) -> TracedKeep:
    """The traced iteration's choice of blocks kept (see [Note: the traced iteration's offload])."""
    ledger = accel.ledger
    return TracedKeep(ledger.budget, all_held_bytes(chunk_map, accumulate), lambda: ledger.non_model)


def activation_blocks(module: torch.nn.Module, placement: Placement, mode: str | None) -> list[torch.nn.Module]:
    """The blocks whose inputs the emulated accelerator's meter counts (see [Note: held inputs]) and whose
    activations may be offloaded (see [Note: activation offload]); none without either."""
    offloader = placement.activations
    if offloader is None and placement.meter is None:
        return []
    blocks = repeated_blocks(module)
    if offloader is not None:
        offloader.blocks_found(len(blocks))
    if not blocks and offloader is not None and mode is not None:
        logger.warning(
            "ds_patrickstar: zero_optimization.offload_activations=%r finds no blocks (a ModuleList or Sequential "
            "of at least two modules) in %s: no activation is offloaded",
            mode,
            type(module).__name__,
        )
    return blocks
