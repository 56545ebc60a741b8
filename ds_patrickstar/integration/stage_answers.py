"""What the engine answers to clients that ask which ZeRO stage runs, and the stock calls that follow.

[Note: the stage clients see]
DeepSpeed's engine runs stage 0's code paths for us (see [Note: config split]), so its
``zero_optimization_stage()`` said 0, and clients read that to decide whether parameters are
partitioned (whether to gather before reading a weight, whether ``coalesce_grad_reduction`` applies).
Parameters, gradients and optimizer states are partitioned here, so :class:`StageAnswers` makes
``zero_optimization_stage()`` answer 3 (``ZeroStageEnum.weights``). DeepSpeed's engine asks the same
method itself, so each of its callers was checked (DeepSpeed 0.19.6 to 0.19.8):

* ``zero_optimization_partition_weights()``/``_gradients()`` derive from it and steer stage 3's own
  machinery (``ds_tensor`` partitions, its checkpoint files, its gathered save): they keep stage 0's
  answer (False), so every path the engine took before is taken still;
* ``_consolidated_16bit_state_dict()`` (and ``_zero3_consolidated_16bit_state_dict()``, which
  accelerate and clients call for stage 3) would read stage 3's partitions: here they return the
  module's full 16-bit ``state_dict`` on rank 0 and None on the others, as stock does (a collective);
* the checkpoint writer's data-parallel layout (only with ``checkpoint.writer``, whose decoupled mode is
  refused here) and AutoEP's folding check (AutoEP is not supported here) read it;
* DeepCompile would take its stage-3 pass, which needs stage 3's optimizer: ``get_deepcompile_backend``
  falls back to the torch compiler, as it did for stage 0, and says so;
* ``allreduce_gradients`` compares it with stage 1 only, and never runs (our optimizer reduces);
* ``coalesce_grad_reduction()`` accepts stage 3: see :meth:`StageAnswers.coalesce_grad_reduction`;
* the checkpoint's ``shared_params`` (tied weights, for readers of the model file): with weights not
  partitioned by stage 3, stock finds them by ``data_ptr``, which pairs every parameter whose chunk storage is
  released at the save (a frozen weight with the embedding, seen at two ranks); :meth:`StageAnswers._get_shared_params`
  finds them by the parameter itself, as stock's stage 3 does by ``ds_id``.

[Note: engine without an optimizer]
A reference or reward model (OpenRLHF, TRL, DeepSpeed-Chat) is ``deepspeed.initialize(model=m, config=c)`` with
no ``optimizer`` block and no ``optimizer=``: stock ZeRO-3 partitions its parameters and gathers them on use,
for forwards only. Here every parameter goes into frozen chunks (:func:`freeze_for_inference` sets
``requires_grad=False`` on each, as a reference model has no use for gradients): the payload only, split
across the ranks and gathered on use, placed like every chunk (see [Note: frozen chunks]). The engine runs
forwards (``no_grad`` or not; checked against stock ZeRO-3 at 1 and 2 ranks) and ``state_dict``;
``backward`` and ``step`` have nothing to train.

``load_checkpoint`` on a folder without ``latest`` and no tag warns and returns ``(None, None)`` as stock
does (:func:`no_latest`).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from typing import Any

from deepspeed import comm as dist
from deepspeed.runtime.zero.config import ZeroStageEnum

from ..io.checkpoint import tied_names

logger = logging.getLogger(__name__)


def no_latest(load_dir: str, tag: Any) -> bool:
    """No tag and no ``latest`` file in ``load_dir``: warned, as DeepSpeed does; the caller returns ``(None, None)``."""
    latest = os.path.join(load_dir, "latest")
    if tag is not None or os.path.isfile(latest):
        return False
    logger.warning(
        "no checkpoint loaded: there is no 'latest' file at %s and no tag was given; to load a checkpoint "
        "pass tag= or point load_dir at a folder written by engine.save_checkpoint",
        latest,
    )
    return True


def freeze_for_inference(module: Any) -> None:
    """``requires_grad=False`` on every parameter of an engine without an optimizer, said once in the log."""
    trainable = [p for p in module.parameters() if p.requires_grad]
    for param in trainable:
        param.requires_grad_(False)
    if trainable:
        logger.info(
            "no optimizer: the %d parameters that required gradients are frozen (requires_grad=False) and held "
            "in frozen chunks, for forwards only (see [Note: engine without an optimizer])",
            len(trainable),
        )


class StageAnswers:
    """The engine's answers about its ZeRO stage, mixed into ``PatrickStarEngine``; see
    [Note: the stage clients see]."""

    module: Any
    optimizer: Any

    def zero_optimization_stage(self) -> int:
        return ZeroStageEnum.weights

    def zero_optimization_partition_weights(self) -> bool:
        return False  # stage 3's own partitions (ds_tensor) are not used here

    def zero_optimization_partition_gradients(self) -> bool:
        return False

    def get_deepcompile_backend(self, backend: Any, compile_kwargs: Any, schedule: Any) -> None:
        logger.info("DeepCompile has no pass for stage 'patrickstar': falling back to the torch compiler")
        return None

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict | None:
        """The full 16-bit ``state_dict`` on rank 0, None elsewhere (call it on every rank)."""
        state = self.module_state_dict(exclude_frozen_parameters=exclude_frozen_parameters)  # type: ignore[attr-defined]
        return state if dist.get_rank() == 0 else None

    def _get_shared_params(self) -> dict[str, str]:
        """Tied parameters, a second name -> the first, on rank 0 (see [Note: the stage clients see])."""
        if dist.get_rank() != 0:
            return {}
        return tied_names(self.module.named_parameters(remove_duplicate=False))

    def _consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict | None:
        return self._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters)

    @contextlib.contextmanager
    def coalesce_grad_reduction(self) -> Iterator[None]:
        """Several ``backward`` calls, then one ``engine.step()`` after the block, as stock's context. Here
        each backward's gradients are reduce-scattered per chunk group as they are produced and
        accumulated in fp32 (the same values as one reduction at the end), so the block checks what stock
        checks (``engine.step()`` inside raises, no nesting). With ``gradient_accumulation_steps`` 1 the
        accumulators begin at the block's first backward before the boundary (see [Note: accumulation begun
        by the caller] in groups/grads.py)."""
        if self._unmanaged_accumulation():  # type: ignore[attr-defined]
            raise AssertionError(  # stock's check and words
                "coalesce_grad_reduction is not supported with managed_gradient_accumulation=False; "
                "the caller already owns the accumulation boundary via step()"
            )
        if getattr(self, "inside_no_sync_ctxt", False):
            raise AssertionError("coalesce_grad_reduction cannot be nested inside another no_sync context")
        self.inside_no_sync_ctxt = True
        try:
            yield
        finally:
            self.inside_no_sync_ctxt = False
