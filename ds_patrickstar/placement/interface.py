"""What placement offers the layers above (:class:`Placement`), the activation offload it drives
(:class:`ActivationPolicy`, which the layer above implements), and the placement of a run without an
accelerator (:class:`NullPlacement`).

[Note: null placement]
A plain CPU run (``HostAccelerator``) has one memory: chunks stay where they are built, nothing is
brought, evicted, traced or planned. Its placement is a :class:`NullPlacement`, whose every moment,
room and move does nothing, and whose answers are those of one memory: no budget bounds what stays
gathered (:meth:`Placement.budgeted`: no agreed gather plan, see [Note: agreed gather plan]), all model
data is on the host, there is no meter, no activation offload and no trace to plot. Callers hold a
:class:`Placement` and never test for its absence.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ..chunks.chunk import Chunk
from .saved_meter import SavedTensorMeter
from .step_time import ActivationMoves
from .trace import AccumulatorEvent, Trace
from .tracer import MemoryTracer

if TYPE_CHECKING:
    from .states_room import StatesRoom

NO_SNAPSHOT = (
    "no planner snapshot to write: the step-time model plans the optimizer states "
    '(zero_optimization.optimizer_placement: "time", the default) on CUDA or with '
    "zero_optimization.emulate_accelerator=true, thoroughly from the second optimizer step on"
)
NO_TIDE = (
    "no placement trace to plot: placement runs on CUDA or with "
    "zero_optimization.emulate_accelerator=true, after at least one iteration"
)


class ActivationPolicy(Protocol):
    """Activation offload (``activations/offloader.py``), which implements it; see
    [Note: activation offload]."""

    host_bytes: int  # bytes of offloaded activations off the accelerator now
    gave_way: bool  # this iteration's activations left to make room ([Note: activations give way])

    @property
    def priced(self) -> ActivationMoves:
        """The planned iteration's copies (see [Note: step-time model] in step_time.py)."""
        ...

    def blocks_found(self, count: int) -> None:
        """The model has ``count`` blocks (see [Note: activation offload])."""

    def start_iteration(self, tracer: MemoryTracer) -> None: ...

    def plan(
        self,
        trace: Trace,
        budget: int,
        chunk_needs: Callable[[Trace], list[int]],
        stranded: int = 0,
    ) -> None: ...

    def replan(self, trace: Trace, states: StatesRoom) -> None: ...

    def stranded_rose(self, trace: Trace, stranded: int) -> None: ...

    def tide_rose(self, trace: Trace, over: dict[int, int]) -> dict[int, int]: ...

    def give_room(self, nbytes: int) -> int:
        """Activations still on the accelerator leave for the host now until ``nbytes`` did; the bytes that left
        (see [Note: activations give way] in activations/give_way.py)."""
        ...

    def keeps_blocks(self) -> bool:
        """Whether some block's activations stay on the accelerator now (for the remedies a budget error names)."""
        ...

    def start_forward(self, every_block: bool = False) -> None: ...

    def unplanned_away(self, moment: int) -> int:
        """Bytes offloaded beyond the plan and away at ``moment`` (see [Note: a risen tide] in
        activations/plan.py)."""
        ...

    def drop_forward(self) -> None: ...

    def enter_block(self, block: int, inputs: list[torch.Tensor]) -> None: ...

    def end_forward(self) -> None: ...

    def hooks(self) -> AbstractContextManager[Any]: ...


class Placement(Protocol):
    """Placement as the layers above see it: :class:`~ds_patrickstar.placement.runtime.PlacementRuntime`
    or :class:`NullPlacement` (see [Note: null placement])."""

    # ---- moments (see [Note: moments and the trace]) ----
    def begin_moment(self, label: str, chunk_ids: tuple[int, ...]) -> None: ...

    def end_moment(self, in_use: set[int]) -> None: ...

    def recorded_moment(self) -> tuple[int, str] | None:
        """The index and label of the current moment where it is recorded in the trace."""
        ...

    def last_iteration(self) -> Trace | None: ...

    def start_iteration(self, inputs: object) -> bool:
        """An iteration begins; whether it traces (then the optimizer states go to the host first)."""
        ...

    def evaluation_begins(self) -> None:
        """A forward under ``no_grad`` begins (see [Note: evaluation moments])."""
        ...

    def forward_begins(self, inputs: object = None) -> bool:
        """A training forward begins; ``inputs``: a later micro-step's (None for the iteration's first). Returns
        whether they lie beyond every traced shape (see [Note: a risen tide] in activations/plan.py)."""
        ...

    def abort_iteration(self) -> None:
        """A backward raised: every moment of the iteration leaves it (see [Note: a backward that raised])."""
        ...

    def drop_forward(self) -> None:
        """The last training forward had no backward: its moments leave the iteration (see
        [Note: moments and the trace])."""
        ...

    activations: ActivationPolicy | None  # activation offload (see [Note: activation offload])

    @property
    def meter(self) -> SavedTensorMeter | None:
        """The emulated accelerator's count of saved activations (None elsewhere)."""
        ...

    # ---- room and moves ----
    def make_room(self, need: int, keep: set[int]) -> None: ...

    def bring(self, chunk: Chunk, keep: set[int]) -> None: ...

    def written(self, chunk_id: int) -> None:
        """A gradient went into the chunk's payload (see [Note: clean evictions] in store/clean_copies.py)."""

    def gradient_final(self, chunk_id: int) -> None:
        """The owned chunk's slot holds its final gradient of this iteration (its last gradient in; with several
        ranks, its reduce-scatter completed): see [Note: gradients leave in backward]."""

    def gathered_ahead(self, chunk_id: int) -> None:
        """With several ranks, this rank's chunk is on the accelerator for its group's all-gather, issued in the
        current moment's hook ahead of the group's use (see [Note: gather order]; the move model brings it there
        too, see [Note: predicted moves] in move_model.py)."""

    def accumulator(self, chunk_id: int, event: AccumulatorEvent) -> None:
        """The chunk's gradient accumulator came into being, has its boundary sum coming with a collective just
        issued (which completes before the chunk could move), or went (see [Note: predicted moves])."""

    def evict(self, chunk: Chunk) -> None: ...

    def after_use(self, chunk: Chunk) -> None: ...

    def place_for_update(self, chunk: Chunk, on_device: bool) -> None:
        """The optimizer step updates ``chunk`` where its states live (see [Note: optimizer-state placement])."""
        ...

    # ---- the budget ----
    def budgeted(self) -> bool:
        """Whether model data on the accelerator must fit a budget (then the ranks agree what stays gathered)."""
        ...

    def gathered_rooms(self, trace: Trace, held: Callable[[int], int]) -> tuple[list[int], list[int]]: ...

    # ---- the step ----
    def plan_step(self, capacities: dict[int, int]) -> set[int] | None:
        """The planner's decision of where the optimizer states live from this step on (None: where they
        are); see [Note: placement planner]."""
        ...

    def host_updates_begin_in_backward(self, begin: bool) -> None:
        """Whether host updates begin in backward from the next backward on, as the step-time model prices them
        (see [Note: host updates in backward] in optim/early_updates.py)."""
        ...

    def step_moment(self, on_device: set[int]) -> None:
        """The step is a moment, using the chunks updated on the accelerator."""
        ...

    def end_step(self) -> None: ...

    def accumulation_begins(self, chunk_needs: Callable[[Trace], list[int]]) -> None:
        """Gradients accumulate from now on; ``chunk_needs`` counts what that adds (see [Note: accumulation begun
        by the caller] in groups/grads.py)."""
        ...

    def plot_tide(self, path: str, caption: str) -> str: ...

    def planner_snapshot(self, path: str) -> str:
        """Write the last thorough plan's inputs and choice as JSON (see [Note: planner snapshot] in
        snapshot.py); raises ``RuntimeError`` where there is none."""
        ...


class NullPlacement:
    """The placement of a run without an accelerator; see [Note: null placement]."""

    def begin_moment(self, label: str, chunk_ids: tuple[int, ...]) -> None:
        pass

    def end_moment(self, in_use: set[int]) -> None:
        pass

    def recorded_moment(self) -> tuple[int, str] | None:
        return None

    def last_iteration(self) -> Trace | None:
        return None

    def start_iteration(self, inputs: object) -> bool:
        return False

    def evaluation_begins(self) -> None:
        pass

    def forward_begins(self, inputs: object = None) -> bool:
        return False

    def drop_forward(self) -> None:
        pass

    def abort_iteration(self) -> None:
        pass

    meter: SavedTensorMeter | None = None
    activations: ActivationPolicy | None = None

    def make_room(self, need: int, keep: set[int]) -> None:
        pass

    def bring(self, chunk: Chunk, keep: set[int]) -> None:
        pass

    def written(self, chunk_id: int) -> None:
        pass

    def gradient_final(self, chunk_id: int) -> None:
        pass

    def gathered_ahead(self, chunk_id: int) -> None:
        pass

    def accumulator(self, chunk_id: int, event: AccumulatorEvent) -> None:
        pass

    def evict(self, chunk: Chunk) -> None:
        pass

    def after_use(self, chunk: Chunk) -> None:
        pass

    def place_for_update(self, chunk: Chunk, on_device: bool) -> None:
        pass

    def budgeted(self) -> bool:
        return False

    def gathered_rooms(self, trace: Trace, held: Callable[[int], int]) -> tuple[list[int], list[int]]:
        return [], []

    def plan_step(self, capacities: dict[int, int]) -> set[int] | None:
        return None

    def host_updates_begin_in_backward(self, begin: bool) -> None:
        pass

    def step_moment(self, on_device: set[int]) -> None:
        pass

    def end_step(self) -> None:
        pass

    def accumulation_begins(self, chunk_needs: Callable[[Trace], list[int]]) -> None:
        pass

    def plot_tide(self, path: str, caption: str) -> str:
        raise RuntimeError(NO_TIDE)

    def planner_snapshot(self, path: str) -> str:
        raise RuntimeError(NO_SNAPSHOT)
