"""A second ``deepspeed.initialize`` on a model a live "patrickstar" engine holds.

[Note: a second initialize on a live model]
A live engine's parameters are views of its chunks (see [Note: storage resize]): with data parallelism a rank
holds only its own chunks between uses, so a parameter of another rank's chunk has no memory behind it, and a
second initialize that read the parameters (its start-up broadcast, its chunk building) would read freed memory
(gloo's ``writev ... Bad address``). With stock ZeRO-3 the second engine builds its partitions from the
parameters the first one partitioned, and takes the model over. So here too the second engine takes the model
over: before anything reads the parameters (and before any collective of the new initialize), each live engine
that holds one of the model's parameters is destroyed, a collective that every rank runs as it calls
initialize (see [Note: engine teardown]): the parameters get the trained values back as host tensors of their
own, which the new engine starts from (the first engine's Adam states are not carried over; stock's new engine
starts its optimizer afresh too). A warning names what happened. The old engine then refuses a forward, a
backward or a step with a message naming the engine to use, instead of training a model it no longer holds
(stock leaves both engines driving the same partitions). A live engine is found through the ``_z3_optimizer``
every chunk parameter carries (see [Note: ZeRO-3 parameter attributes]), which keeps a weak reference to its
engine: the model does not keep an engine alive.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from .zero3_params import Zero3Params

logger = logging.getLogger(__name__)

TAKEN_OVER = (
    "this engine's model was taken over by a later deepspeed.initialize, which destroyed this engine first "
    "(see [Note: a second initialize on a live model]): use the engine that call returned"
)


def live_engines(model: torch.nn.Module) -> list[Any]:
    """The live "patrickstar" engines holding a parameter of ``model``, in parameter order."""
    engines: list[Any] = []
    for param in model.parameters():
        holder = param.__dict__.get("_z3_optimizer")
        engine = holder.engine() if isinstance(holder, Zero3Params) and holder.engine is not None else None
        if engine is not None and not any(engine is known for known in engines):
            engines.append(engine)
    return engines


def take_over(model: torch.nn.Module) -> None:
    """Destroy every live engine that holds a parameter of ``model`` (a collective with data parallelism); see
    [Note: a second initialize on a live model]."""
    for engine in live_engines(model):
        logger.warning(
            "ds_patrickstar: deepspeed.initialize on a model that a live engine holds: that engine is destroyed "
            "first (the model keeps its trained values, its optimizer states are not carried over) and refuses "
            "further use; call engine.destroy() before initializing again to make this explicit"
        )
        engine.taken_over = True
        engine.destroy()
