"""What would fit when the budget does not: each remedy with the bytes it would save at the moment the
budget ran out, for the error that stops a run (see [Note: placement]). A user at a budget below the
activations learns which setting makes the run train, not only that it does not."""

from __future__ import annotations


def budget_remedies(short: int, budget: int, non_model: int, held: int, offloading: bool, stranded: int = 0) -> str:
    """The remedies, one clause each: ``short`` bytes over the ``budget``, ``non_model`` bytes of activations
    and temporaries then, ``held`` bytes of the chunks in use then; ``offloading``: activation offload is on;
    ``stranded``: free bytes stranded in the allocator's partly used blocks then (see [Note: stranded bytes
    released] in moves.py)."""
    remedies = [f"zero_optimization.device_budget of at least {budget + short:,} B ({short:,} B more)"]
    if not offloading and non_model:
        remedies.append(
            f'zero_optimization.offload_activations "auto" (moves the blocks\' saved activations, of the '
            f"{non_model:,} B of non-model memory here, to the host between their forward and backward)"
        )
    if non_model:
        remedies.append(f"activation checkpointing of the model's blocks (of the {non_model:,} B here)")
        remedies.append(f"a smaller train_micro_batch_size_per_gpu (the {non_model:,} B here grow with it)")
    if held:
        remedies.append(f"a smaller zero_optimization.chunk_size (the chunks in use here take {held:,} B)")
    if stranded:
        remedies.append(
            f"PyTorch's expandable_segments allocator (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, set "
            f"before CUDA starts), which can return the {stranded:,} B stranded here in partly used blocks"
        )
    return "Any of these fits more: " + "; ".join(remedies) + "."
