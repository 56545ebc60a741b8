"""torch.optim.SGD's math on a flat slice of a chunk, in pure torch.

[Note: SGD on chunks]
A client's ``torch.optim.SGD`` trains as a client's Adam does: its param groups stay the groups of
the run (an LR scheduler's edits are read at every step) and the step updates the fp32 masters, the
gradient read from the chunk's low-precision slot, one slice per call with the signature of
:func:`~ds_patrickstar.optim.adam_math.adam_step_reference` (see [Note: one Adam, several backends]),
so the step's driver, the host worker, the disk tier's streaming and the frozen runs are the same for
both. The arithmetic is torch's ``_single_tensor_sgd`` term by term: ``maximize`` negates the gradient,
``weight_decay`` adds ``weight_decay * param`` to it (L2: SGD has no decoupled form), then with
``momentum != 0`` the buffer is the gradient itself at the parameter's first step (torch clones it
then) and ``momentum * buf + (1 - dampening) * grad`` after, and the update is ``-lr`` times the buffer,
or with ``nesterov`` times ``grad + momentum * buf``. The first step is the parameter's own step count
1 (:mod:`~ds_patrickstar.optim.frozen_steps` counts it as for Adam), so a resumed run continues its
buffers. One math serves the host and the accelerator (no kernel: SGD reads and writes two fp32
streams where Adam has three, and it is memory-bound on both).

The states keep Adam's per-chunk layout: the momentum buffer in the ``exp_avg`` slot (zeros while it
does not exist, and with ``momentum == 0`` for good), ``exp_avg_sq`` allocated and unused. A checkpoint
saves and loads the three as for Adam, so a round trip is exact and DeepSpeed's fp32 readers read the
masters unchanged; the optimizer file names the update (``"update": "SGD"``), and a load of SGD's states
into a run with Adam, or of Adam's into one with SGD, is refused (the weights alone load). The states take Adam's
:data:`~ds_patrickstar.memory.preflight.OPTIM_BYTES_PER_ELEMENT` (12 bytes) per element for SGD too,
where SGD needs 8 (4 without momentum): the memory plan and what is allocated agree, and a run with SGD
is planned, placed and spilled as one with Adam, without the saving the lighter states could give.

One difference from torch remains: a group whose ``momentum`` is 0 at its first steps and set non-zero
later, with ``dampening != 0``, starts its buffer at ``(1 - dampening) * grad`` where torch starts it at
``grad`` (the same with ``dampening == 0``, torch's default).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SgdHyper:
    """Hyper-parameters of one SGD param group, read afresh at every step."""

    lr: float
    momentum: float = 0.0
    dampening: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False
    maximize: bool = False

    @classmethod
    def from_group(cls, group: dict) -> SgdHyper:
        return cls(
            lr=float(group["lr"]),
            momentum=float(group.get("momentum", 0.0)),
            dampening=float(group.get("dampening", 0.0)),
            weight_decay=float(group.get("weight_decay", 0.0)),
            nesterov=bool(group.get("nesterov", False)),
            maximize=bool(group.get("maximize", False)),
        )


@torch.no_grad()
def sgd_step_reference(
    param_lp: torch.Tensor,
    master: torch.Tensor,
    momentum_buffer: torch.Tensor,
    unused: torch.Tensor,
    *,
    step: int,
    hyper: SgdHyper,
    grad_scale: float,
) -> None:
    """One ``torch.optim.SGD`` step on a flat slice (``param_lp`` holds the gradient on entry and the new
    low-precision parameter on exit; ``unused`` is the ``exp_avg_sq`` slot); see [Note: SGD on chunks]."""
    if step < 1:
        raise ValueError(f"SGD step count must be >= 1, got {step}")
    grad = param_lp.to(master.dtype) * grad_scale
    if hyper.maximize:
        grad.neg_()
    if hyper.weight_decay != 0.0:
        grad = grad.add(master, alpha=hyper.weight_decay)
    if hyper.momentum != 0.0:
        if step == 1:
            momentum_buffer.copy_(grad)
        else:
            momentum_buffer.mul_(hyper.momentum).add_(grad, alpha=1.0 - hyper.dampening)
        grad = grad.add(momentum_buffer, alpha=hyper.momentum) if hyper.nesterov else momentum_buffer
    master.add_(grad, alpha=-hyper.lr)
    param_lp.copy_(master)
