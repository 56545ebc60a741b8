"""A leaf module (``set_z3_leaf_modules``) called several times in one forward, the first calls on the model's
input (no input requiring grad, so no post-backward mark) and a later one on an activation: its gradients wait
for the last call's backward (see [Note: leaf modules]) and training matches stock ZeRO-3 at 2 real gloo ranks
(DeepSpeed's own ``TestCoalesceZero3LeafModule`` model). Stock without the leaf: with it, stock's reducer asserts on
the reused leaf's parameters (duplicate ids in a bucket), as that test's docstring says. fp32, 144 parameters."""
from __future__ import annotations

import torch
from harness import loss_model_steps, make_config
from multiproc import run_ranks


class Reused(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first, self.second = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x):
        x = self.first(x) + self.first(x)  # twice on the input: neither call's input requires grad
        return (self.first(x) + self.second(x)).pow(2).mean()  # and once more on an activation


def _run(rank, world_size, stage, leaf):
    import deepspeed
    from deepspeed.utils import set_z3_leaf_modules

    import ds_patrickstar  # noqa: F401

    model = Reused()
    if leaf:
        set_z3_leaf_modules(model, [torch.nn.Linear])
    cfg = make_config(stage, chunk_size=1024, lr=1e-2)
    cfg.pop("train_batch_size")
    engine = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())[0]
    result = loss_model_steps(engine, rank, 8)
    engine.destroy()
    return result


def test_leaf_called_on_the_input_and_again_matches_zero3():
    stock, ours = run_ranks(_run, 2, 3, False), run_ranks(_run, 2, "patrickstar", True)
    for rank in range(2):
        torch.testing.assert_close(ours[rank][0], stock[rank][0], rtol=1e-5, atol=1e-6)
        for name, value in stock[rank][1].items():
            torch.testing.assert_close(ours[rank][1][name], value, rtol=1e-5, atol=1e-6, msg=name)
