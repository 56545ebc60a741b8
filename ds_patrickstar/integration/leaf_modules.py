"""DeepSpeed's leaf modules on a "patrickstar" model: which modules are leaves, their tensors, and the
advice an error gives when the ranks' modules differ outside any leaf (see [Note: leaf modules] and
[Note: ranks in lockstep]).

DeepSpeed marks the leaves itself (``set_z3_leaf_modules`` from code; its engine applies
``zero_optimization.leaf_module``, DeepSpeed's default classes included, to every model it is
given, ours too); this module only reads the marks with DeepSpeed's own helpers.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from deepspeed.utils.z3_leaf_module import get_z3_leaf_modules

from ..chunks.chunk import TensorInfo
from ..groups.lockstep import first_difference

_CONTAINERS = (torch.nn.ModuleList, torch.nn.ModuleDict, torch.nn.Sequential)


def leaf_tensors(
    module: torch.nn.Module, info_of: Callable[[torch.Tensor], TensorInfo | None]
) -> dict[torch.nn.Module, list[TensorInfo]]:
    """Every outermost leaf module of ``module`` (a leaf inside a leaf is part of it, as in ZeRO-3) with the
    chunk tensors of its subtree (trainable and frozen), each once, in module order. A parameter inside a
    leaf that a module outside it holds too raises ``ValueError``: its gradient would be handed over before
    its last use."""
    leaves = get_z3_leaf_modules(module)
    inner = {id(m) for leaf in leaves for m in leaf.modules() if m is not leaf}
    outermost = [leaf for leaf in leaves if id(leaf) not in inner]
    inside = {id(m) for leaf in outermost for m in leaf.modules()}
    leaf_params = {id(p) for leaf in outermost for p in leaf.parameters()}
    for name, sub in module.named_modules():
        if id(sub) in inside:
            continue
        for pname, param in sub.named_parameters(recurse=False):
            if id(param) in leaf_params and info_of(param) is not None:
                raise ValueError(
                    f"parameter {name + '.' if name else ''}{pname} belongs to a leaf module and to module "
                    f"'{name}' outside it: stage 'patrickstar' hands a leaf's gradients over when its backward ends, "
                    "before this other use. Make the leaf the module that holds both uses, or untie the weight."
                )
    found = {leaf: [i for p in leaf.parameters() if (i := info_of(p)) is not None] for leaf in outermost}
    return {leaf: infos for leaf, infos in found.items() if infos}  # a frozen leaf has nothing to gather


def divergence_advice(module: torch.nn.Module) -> Callable[[list[list[str]]], str]:
    """The fix to name when the ranks ran different modules, from their moments since they last agreed."""

    def advise(moments: list[list[str]]) -> str:
        names = _first_different_names(moments)
        if not names:
            return ""
        where = _nearest_block(module, names)
        cls = type(module.get_submodule(where)).__name__ if where else "YourBlock"
        inside = f"inside '{where}' ({cls})" if where else f"around '{names[0]}'"
        return (
            f"The modules that differ are {inside}: make it a leaf module before deepspeed.initialize, "
            f"deepspeed.utils.set_z3_leaf_modules(model, [{cls}]), or in the config "
            f'"zero_optimization": {{"leaf_module": {{"classes": ["{cls}"]}}}} (ZeRO-3 reads the same).'
        )

    return advise


def _first_different_names(moments: list[list[str]]) -> list[str]:
    """The module names of the first moment at which the ranks differ (a rank with no more moments left out)."""
    index = first_difference(moments)
    if index is None:
        return []
    return sorted({m[index].split(":", 1)[-1] for m in moments if index < len(m)})


def _nearest_block(module: torch.nn.Module, names: list[str]) -> str:
    """The deepest module holding every one of ``names`` that is not a plain container (ModuleList,
    ModuleDict, Sequential): the block that chooses which of them run. A single name (the other ranks
    ran nothing there) stands for one of several alternatives: the module holding the nearest container
    above it, else its parent."""
    parts = [name.split(".") for name in names]
    common: list[str] = []
    for pieces in zip(*parts):
        if len(set(pieces)) > 1:
            break
        common.append(pieces[0])
    if len(names) == 1 or common == parts[0]:
        common = common[:-1]
        probe = common
        while probe and not isinstance(module.get_submodule(".".join(probe)), _CONTAINERS):
            probe = probe[:-1]
        common = probe or common
    while common and isinstance(module.get_submodule(".".join(common)), _CONTAINERS):
        common = common[:-1]
    return ".".join(common)
