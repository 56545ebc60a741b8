"""What the chunks in use take on the accelerator at each moment of a trace, for the plans.

[Note: chunk bytes per moment]
The plans made from a trace (which optimizer states live on the accelerator, see
[Note: optimizer-state placement]; which blocks' activations "auto" offloads, see
[Note: auto activation offload]) need, per moment, the accelerator bytes that cannot move then.
Those are the chunks held at that moment (:meth:`~ds_patrickstar.placement.trace.Trace.held_chunks`:
the moment's own and those of the modules recomputed before it whose backward has not come, in
use until then), each with its chunk group gathered: storage, owned chunk and joined buffers
(:meth:`~ds_patrickstar.chunks.chunk_map.ChunkMap.group_bytes`, see [Note: chunk group bytes] in
chunks/group_bytes.py). With gradient accumulation each micro-step of the traced iteration
(:meth:`~ds_patrickstar.placement.trace.Trace.micro_steps`) adds the other parts of a group as
it holds them then (see [Note: gradient accumulation] in groups/grads.py), not as any micro-step
might:

* a held group's fp32 accumulator from the moment it comes into being: in the first micro-step,
  with ``W > 1``, at the group's micro-step reduce-scatter (during its last backward moment), with
  one rank at its first gradient (its first backward moment); in later micro-steps it is there from
  the start; it goes once the boundary has put its sum in the slot, so the step has none (a bound:
  the moments of the boundary's backward count it until their end);
* with ``W > 1`` in every micro-step but the boundary, a group's flat gradient buffer (see
  [Note: flat group buffers] in groups/flat.py) from the group's first backward moment of the
  micro-step to its last, whether or not the group is held then (a recomputation may run between
  two of its gradients); the boundary reduce-scatters in the group's own storage.

The step moment's chunks (those updated on the accelerator) are brought one at a time, each after room is made
for it alone, and no group is gathered for the update: the step needs its largest owned chunk, not all of them
(counting all of them, every plan made after the traced step's, which has no step moment yet, placed fewer
states than the traced step's on the same tide).
"""

from __future__ import annotations

from collections.abc import Callable

from ..chunks.chunk_map import ChunkMap
from .trace import BACKWARD, Moment, Trace

__all__ = ["all_held_bytes", "chunk_needs", "gathered_storage"]


def gathered_storage(chunk_map: ChunkMap) -> Callable[[Moment], int]:
    """With several ranks, the gathered storage of the chunk groups a moment uses (each is all-gathered at its use):
    what the bytes floor holds beside the tide (see [Note: the bytes floor] in bytes_floor.py)."""
    world = chunk_map.world_size
    storage = [chunk_map.group_bytes(g, False).storage for g in range(chunk_map.num_groups)]
    return lambda moment: sum(storage[g] for g in {chunk_id // world for chunk_id in moment.chunks})


def all_held_bytes(chunk_map: ChunkMap, accumulate: bool) -> int:
    """Every chunk group held at once, as a moment holds one (with gradient accumulation its accumulator, and one
    flat gradient buffer): more than any moment's chunks take (see [Note: the traced iteration's offload] in
    activations/traced_keep.py)."""
    sizes = [chunk_map.group_bytes(g, accumulate) for g in range(chunk_map.num_groups)]
    return sum(size.gathered for size in sizes) + max((size.grad_buffer for size in sizes), default=0)


def chunk_needs(trace: Trace, chunk_map: ChunkMap, accumulate: bool) -> list[int]:
    """Per moment of ``trace``, the accelerator bytes of the chunks in use then; see
    [Note: chunk bytes per moment]."""
    world = chunk_map.world_size
    sizes = [chunk_map.group_bytes(g, accumulate) for g in range(chunk_map.num_groups)]
    groups = [{chunk_id // world for chunk_id in chunks} for chunks in trace.held_chunks()]
    needs = [sum(sizes[g].storage + sizes[g].owned + sizes[g].joined for g in held) for held in groups]
    for index, moment in enumerate(trace.moments):
        if moment.label == "step":  # one owned chunk at a time, nothing gathered
            needs[index] = max((sizes[g].owned for g in groups[index]), default=0)
    if not accumulate:
        return needs
    micro = trace.micro_steps()
    spans = _backward_spans(trace, micro, world)
    boundary = micro[-1] if micro else 0
    for index, held in enumerate(groups):
        step = micro[index]
        if trace.moments[index].label == "step":  # every sum is in its slot: no accumulator is left
            continue
        for group in held:
            span = spans.get((0, group))
            born = span is not None and index >= (span[1] if world > 1 else span[0])
            if step > 0 or born:
                needs[index] += sizes[group].accumulator
        if step != boundary:
            open_groups = (g for (k, g), (first, last) in spans.items() if k == step and first <= index <= last)
            needs[index] += sum(sizes[g].grad_buffer for g in open_groups)
    return needs


def _backward_spans(trace: Trace, micro: list[int], world: int) -> dict[tuple[int, int], tuple[int, int]]:
    """``(micro-step, group) -> (first, last)`` backward moment using a chunk of the group."""
    spans: dict[tuple[int, int], tuple[int, int]] = {}
    for index, moment in enumerate(trace.moments):
        if not moment.label.startswith(BACKWARD):
            continue
        for group in {chunk_id // world for chunk_id in moment.chunks}:
            key = (micro[index], group)
            first, _ = spans.get(key, (index, index))
            spans[key] = (first, index)
    return spans
