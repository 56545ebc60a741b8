"""The one Adam math of ds_patrickstar, in pure torch.

[Note: one Adam, several backends]
Every backend (this reference, the fused CPU kernel, the CUDA kernel) has the
signature of :func:`adam_step_reference` and updates one flat slice of a chunk:

* ``param_lp`` holds the *gradient* on entry (the 14-bytes-per-param layout
  reuses the low-precision param slot for its gradient) and receives the new
  low-precision parameter on exit;
* ``master``, ``exp_avg`` and ``exp_avg_sq`` are the fp32 slices aligned with it
  and are updated in place;
* ``grad_scale`` multiplies the gradient before use; the optimizer passes
  ``clip_coef / loss_scale`` so unscaling and global-norm clipping cost nothing.

The same update from one set of buffers into another (:func:`adam_step_from_reference`, the CPU kernel's
``adam_step_from``: the gradient and the states read, the new parameter and states written elsewhere, bit for
bit what the step in place writes) lets a host update begin into spare buffers (see [Note: host updates in
backward] in optim/early_updates.py).

The reference is both the fallback when no kernel can be built and the oracle
the kernels are tested against (at float64 when the tests pass float64 tensors).
The arithmetic follows ``torch.optim.Adam``/``AdamW`` (L2 or decoupled weight
decay, bias correction), which is also what DeepSpeed's FusedAdam computes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

# A backend: ``step(param_lp, master, exp_avg, exp_avg_sq, *, step, hyper, grad_scale)``, updating in place.
AdamStep = Callable[..., None]


@dataclass(frozen=True)
class AdamHyper:
    """Hyper-parameters of one param group, read afresh at every step."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    adamw: bool
    bias_correction: bool = True

    @classmethod
    def from_group(cls, group: dict, adamw: bool) -> AdamHyper:
        beta1, beta2 = group["betas"]
        return cls(
            lr=float(group["lr"]),
            beta1=float(beta1),
            beta2=float(beta2),
            eps=float(group["eps"]),
            weight_decay=float(group.get("weight_decay", 0.0)),
            adamw=adamw,
            bias_correction=bool(group.get("bias_correction", True)),
        )


def bias_corrections(hyper: AdamHyper, step: int) -> tuple[float, float]:
    """(1 - beta1**step, sqrt(1 - beta2**step)), or (1, 1) without bias correction."""
    if not hyper.bias_correction:
        return 1.0, 1.0
    return 1.0 - hyper.beta1**step, math.sqrt(1.0 - hyper.beta2**step)


@torch.no_grad()
def adam_step_reference(
    param_lp: torch.Tensor,
    master: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    hyper: AdamHyper,
    grad_scale: float,
) -> None:
    """One Adam/AdamW step on a flat slice; see [Note: one Adam, several backends]."""
    if step < 1:
        raise ValueError(f"Adam step count must be >= 1, got {step}")
    grad = param_lp.to(master.dtype) * grad_scale
    if hyper.weight_decay != 0.0:
        if hyper.adamw:
            master.mul_(1.0 - hyper.lr * hyper.weight_decay)
        else:
            grad = grad.add(master, alpha=hyper.weight_decay)
    exp_avg.lerp_(grad, 1.0 - hyper.beta1)
    exp_avg_sq.mul_(hyper.beta2).addcmul_(grad, grad, value=1.0 - hyper.beta2)
    bc1, bc2_sqrt = bias_corrections(hyper, step)
    denom = (exp_avg_sq.sqrt() / bc2_sqrt).add_(hyper.eps)
    master.addcdiv_(exp_avg, denom, value=-hyper.lr / bc1)
    param_lp.copy_(master)


# ``step_from(grad, master, exp_avg, exp_avg_sq, param_lp, master_out, exp_avg_out, exp_avg_sq_out, *, step, hyper,
# grad_scale)``: the update from the first four into the last four.
AdamStepFrom = Callable[..., None]


@torch.no_grad()
def adam_step_from_reference(*tensors: torch.Tensor, step: int, hyper: AdamHyper, grad_scale: float) -> None:
    """:func:`adam_step_reference` from the first four ``tensors`` (the gradient, master, exp_avg, exp_avg_sq) into
    the last four (the parameter and the states): the sources copied there, then updated in place."""
    if len(tensors) != 8:
        raise ValueError(f"the update from four buffers into four others takes 8 tensors, got {len(tensors)}")
    for target, source in zip(tensors[4:], tensors[:4]):
        target.copy_(source)
    adam_step_reference(*tensors[4:], step=step, hyper=hyper, grad_scale=grad_scale)
