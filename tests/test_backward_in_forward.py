"""``torch.autograd.grad`` inside a training forward (an input-gradient penalty): stock ZeRO-3 hangs there
(tried on DeepSpeed's CPU accelerator, one rank); stage "patrickstar" raises ``BackwardInForward`` naming
``torch.autograd.grad`` and the module the inner backward reached, and the engine trains on afterwards
(see [Note: run state])."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from multiproc import run_ranks
from torch import nn


class Penalized(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.out = nn.Linear(32, 4)
        self.penalty = True

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = x.requires_grad_()
        loss = F.cross_entropy(self.out(F.gelu(self.inp(x))), y)
        if not self.penalty:
            return loss
        (grad,) = torch.autograd.grad(loss, x, create_graph=True)
        return loss + 0.1 * grad.pow(2).sum()


def _run(rank: int, world_size: int) -> tuple[str, str, float]:
    import deepspeed

    import ds_patrickstar  # noqa: F401
    from ds_patrickstar.run_state import BackwardInForward

    torch.manual_seed(0)
    model = Penalized()
    config = {
        "train_micro_batch_size_per_gpu": 8,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": "patrickstar", "chunk_size": 4096},
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    try:
        engine(x, y)
        kind, message = "no error", ""
    except BackwardInForward as err:
        kind, message = type(err).__name__, str(err)
    engine.module.penalty = False
    loss = engine(x, y)
    engine.backward(loss)
    engine.step()
    engine.destroy()
    return kind, message, loss.item()


def test_autograd_grad_inside_the_forward_raises_naming_it_and_the_module():
    ((kind, message, loss),) = run_ranks(_run, 1, timeout=60)
    assert kind == "BackwardInForward", kind
    assert "torch.autograd.grad" in message and "module 'out' (Linear)" in message, message
    assert torch.isfinite(torch.tensor(loss))
