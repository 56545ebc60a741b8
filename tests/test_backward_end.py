"""The end of a backward pass comes from autograd's final callback (see [Note: end of backward]): a forward of
the wrapped module and a plain ``loss.backward()``, which DeepSpeed's engine never sees, end it as
``engine.backward`` does; a backward that raises
leaves no backward running, so the next forward is a forward, not a recomputation."""
import pytest
import torch
from harness import ensure_distributed

from ds_patrickstar.integration.backward_end import BackwardEnd


def _graph():
    x = torch.randn(3, requires_grad=True)
    return x, x * 2


def test_the_final_callback_runs_once_at_the_end_of_the_pass():
    ended = []
    end = BackwardEnd(lambda: ended.append(end.running))
    x, y = _graph()
    y.register_hook(lambda g: (end.arm(), end.arm(), g)[2])  # armed twice in one pass: one callback
    assert not end.running
    y.sum().backward()
    assert ended == [False] and not end.running and x.grad is not None


class _Boom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a):
        return a.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("boom")


def test_a_backward_that_raises_leaves_none_running():
    ended = []
    end = BackwardEnd(lambda: ended.append(True))
    x = torch.randn(3, requires_grad=True)
    y = _Boom.apply(x) * 2
    y.register_hook(lambda g: (end.arm(), g)[1])
    with pytest.raises(RuntimeError, match="boom"):
        y.sum().backward()
    assert ended == [] and not end.running


def _train(plain_backward: bool) -> dict:
    import deepspeed

    import ds_patrickstar  # noqa: F401

    ensure_distributed()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    config = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": "patrickstar", "chunk_size": 1024, "emulate_accelerator": True,
                                                  "device_budget": 1 << 20}}
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, y = torch.randn(4, 8, generator=gen), torch.randn(4, 4, generator=gen)
        if plain_backward:  # the wrapped module and autograd alone: DeepSpeed's engine sees no backward
            ((engine.module(x) - y) ** 2).mean().backward()
        else:
            engine.backward(((engine(x) - y) ** 2).mean())
        assert engine.optimizer.run.phase.name == "BACKWARD_DONE"
        engine.step()
    weights = {k: v.clone() for k, v in engine.module.state_dict().items()}
    engine.destroy()
    return weights


def test_the_wrapped_module_and_a_plain_backward_train_as_the_engine():
    plain, engine = _train(True), _train(False)
    assert plain.keys() == engine.keys()
    for key in plain:
        assert torch.equal(plain[key], engine[key]), key
