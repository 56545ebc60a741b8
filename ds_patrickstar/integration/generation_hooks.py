"""Stage 3's hook handles on the optimizer, for the clients that take the hooks off to generate.

[Note: hooks for generation]
``deepspeed.runtime.zero.unwrap_model_for_generation(engine)`` (and TRL's copy of it) gathers the whole
model once for generation and runs it without ZeRO's hooks: inside ``GatheredParameters(model.parameters())``
it finds the hooks on ``engine.optimizer.parameter_offload`` or, without that attribute, on
``engine.optimizer`` itself, calls ``remove()`` on each handle of ``forward_hooks`` and ``backward_hooks``,
sets both to ``[]``, yields, and puts the hooks back with ``_register_deepspeed_module(optimizer.module)``.
:class:`GenerationHooks` gives our optimizer that surface: ``forward_hooks`` is the live list of every
handle the :class:`~ds_patrickstar.integration.hooks.HookRegistry` holds (module hooks, gradient hooks and
the state-dict hooks: while they are off, the model is a plain module over the gathered values),
``backward_hooks`` is empty (our backward hooks are registered from the forward hooks, and go with them),
``module`` is the model, and ``_register_deepspeed_module`` registers every hook again as at initialize.

Inside the block the parameters point at their gathered values (see [Note: ZeRO-3 parameter attributes] in
zero3_params.py), on the device they live on, so the model's forwards run there with no chunk moving and no
collective (each rank generates on its own, as with stock). The run state, the trace and placement see
none of those forwards: for them the block is a pause between two iterations; the next training forward
starts an iteration as after any other pause (the trace stays valid: the hooks are the same, in the same
order on each module).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.hooks import RemovableHandle


class GenerationHooks:
    """``forward_hooks``, ``backward_hooks``, ``module`` and ``_register_deepspeed_module`` as stage 3's
    optimizer has them; see [Note: hooks for generation]. Mixed into the ZeRO-optimizer adapter."""

    parts: Any  # the adapter's ChunkedModel

    @property
    def forward_hooks(self) -> list[RemovableHandle]:
        return self.parts.hooks.handles

    @forward_hooks.setter
    def forward_hooks(self, handles: list[RemovableHandle]) -> None:
        """Stock's ``unwrap_model_for_generation`` sets ``[]`` after removing each handle: the handles not
        given are removed (removing one twice does nothing) and forgotten."""
        given = {id(h) for h in handles}
        live = self.parts.hooks.handles
        for handle in live:
            if id(handle) not in given:
                handle.remove()
        live[:] = [h for h in live if id(h) in given]

    @property
    def backward_hooks(self) -> list[RemovableHandle]:
        return []

    @backward_hooks.setter
    def backward_hooks(self, handles: list[RemovableHandle]) -> None:
        if handles:
            raise ValueError("stage 'patrickstar' keeps no separate backward hooks: only [] can be set")

    @property
    def module(self) -> torch.nn.Module:
        return self.parts.flow.module

    def _register_deepspeed_module(self, module: torch.nn.Module) -> None:
        if module is not self.module:
            raise ValueError("stage 'patrickstar' registers its hooks on the model it was initialized with only")
        self.parts.hooks.register_again()
