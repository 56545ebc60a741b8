"""Holes in the tensor state machine (issue 18, item 10).

* A tensor straddling two chunks of a group has a piece on each rank: after the reduce-scatter
  the other rank's chunk is released, but this rank's piece still holds the tensor's gradient
  until the step, so the tensor is not ``FREE`` and ``state_dict``/``load_state_dict`` between
  backward and step must still be refused.
* A parameter used by a module and by a module nested inside it: the inner module's exit must
  not end the outer module's use (forward uses are counted as backward uses are).
"""
import pytest
import torch
from multiproc import run_ranks


def _straddling_guard(rank, world_size):
    import deepspeed

    import ds_patrickstar  # noqa: F401

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32, bias=False))  # one tensor: half on each rank
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": "patrickstar", "chunk_size": 1024},
              "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}}
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    info = engine.optimizer.manager.map.info(model[0].weight)
    assert info.straddles
    saved = engine.module.state_dict()  # before backward: load_state_dict's argument (state_dict() is refused below)
    engine.backward(engine(torch.randn(2, 16)).square().mean())
    refused = []
    for name, action in (("state_dict()", engine.module.state_dict),
                         ("load_state_dict()", lambda: engine.module.load_state_dict(saved))):
        try:
            action()
            refused.append(False)
        except RuntimeError as err:
            refused.append(str(err).startswith(f"{name} was called between backward and step"))
    engine.step()
    engine.module.state_dict()  # after the step: allowed again
    engine.module.load_state_dict(saved)
    return info.state.name, refused


def test_straddling_tensor_keeps_its_gradient_state_until_the_step():
    for state, refused in run_ranks(_straddling_guard, 2):
        assert refused == [True, True], "state_dict/load_state_dict passed the guard between backward and step"
        assert state == "HOLD"


class _Outer(torch.nn.Module):
    """Reads ``inner.weight`` (its own parameter too) after ``inner`` has returned."""

    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Linear(32, 32, bias=False)
        self.weight = self.inner.weight

    def forward(self, x):
        return self.inner(x) @ self.weight


def _nested_use(rank, world_size, grad, keep_gathered):
    import copy

    import deepspeed

    import ds_patrickstar  # noqa: F401

    torch.manual_seed(0)
    model = _Outer()  # its group holds nothing else: the inner exit leaves every tensor of it used
    reference = copy.deepcopy(model)
    zero = {"stage": "patrickstar", "chunk_size": 1024, "prefetch_groups": 0}
    if keep_gathered is not None:
        zero["keep_gathered"] = keep_gathered
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": zero,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}}
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    x = torch.randn(2, 32, generator=torch.Generator().manual_seed(1))
    with torch.set_grad_enabled(grad):
        out = engine(x)
    torch.testing.assert_close(out.detach(), reference(x).detach())
    if grad:
        engine.backward(out.square().mean())
        engine.step()
    return True


@pytest.mark.parametrize("grad,keep_gathered", [(True, 0), (False, None)], ids=["keep_gathered_0", "no_grad"])
def test_inner_module_exit_does_not_end_the_outer_modules_use(grad, keep_gathered):
    assert all(run_ranks(_nested_use, 2, grad, keep_gathered))
