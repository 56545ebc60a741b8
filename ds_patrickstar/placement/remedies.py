"""What would fit when the budget does not: each remedy with the bytes it would save at the moment the
budget ran out, for the error that stops a run (see [Note: placement]). A user at a budget below the
activations learns which setting makes the run train, not only that it does not."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Shortfall:
    """Where the budget ran out, in bytes at that moment."""

    short: int  # over the budget
    budget: int
    non_model: int  # activations and temporaries
    held: int = 0  # the chunks in use
    accumulators: int = 0  # of ``held``, their fp32 gradient accumulators
    stranded: int = 0  # free bytes stranded in the allocator's partly used blocks (see [Note: stranded bytes released])
    offloading: bool = False  # activation offload is on
    kept: bool = False  # "auto" activation offload keeps some blocks' activations on the accelerator
    recomputes: bool = False  # some blocks are checkpointed (recomputed in backward) already
    larger: int = 0  # of ``held``, chunks of one tensor larger than chunk_size (a smaller chunk_size keeps them)


def budget_remedies(at: Shortfall) -> str:
    """The remedies for ``at``, one clause each."""
    remedies = [f"zero_optimization.device_budget of at least {at.budget + at.short:,} B ({at.short:,} B more)"]
    if not at.offloading and at.non_model:
        remedies.append(
            f'zero_optimization.offload_activations "auto" (moves the blocks\' saved activations, of the '
            f"{at.non_model:,} B of non-model memory here, to the host between their forward and backward)"
        )
    if at.kept and at.non_model:
        remedies.append(
            f'zero_optimization.offload_activations "all" (also moves the blocks\' saved activations "auto" keeps on '
            f"the accelerator, of the {at.non_model:,} B of non-model memory here)"
        )
    if at.non_model:
        more = "more of " if at.recomputes else ""
        remedies.append(f"activation checkpointing of {more}the model's blocks (of the {at.non_model:,} B here)")
        remedies.append(f"a smaller train_micro_batch_size_per_gpu (the {at.non_model:,} B here grow with it)")
    if at.held > at.larger:
        of_them = f", {at.accumulators:,} B of them their fp32 gradient accumulators" if at.accumulators else ""
        if at.larger:
            of_them += (
                f"; {at.larger:,} B of them are chunks of single tensors larger than chunk_size, which a smaller "
                f"chunk_size does not shrink"
            )
        remedies.append(f"a smaller zero_optimization.chunk_size (the chunks in use here take {at.held:,} B{of_them})")
    if at.stranded:
        remedies.append(
            f"PyTorch's expandable_segments allocator (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, set "
            f"before CUDA starts), which can return the {at.stranded:,} B stranded here in partly used blocks"
        )
    return "Any of these fits more: " + "; ".join(remedies) + "."
