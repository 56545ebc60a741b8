"""Issue 43: an exception inside backward, then training goes on (see [Note: a backward that raised]): the
next forward abandons the failed iteration, and the run matches one without the failure bit for bit, and stock
ZeRO-3's run without it, at 1 and 2 real gloo ranks (the failure comes after some gradients were written into
their slots and reduced). Stock ZeRO-3 itself fails this retry (DeepSpeed 0.19.8: ``assert len(set(p.ds_id for p
in params_in_bucket)) == len(params_in_bucket)`` in its reduction, the failed backward's bucket left behind), so
it is compared without the failure. With gradient accumulation the step's earlier micro-steps are discarded too,
with a warning, and training goes on. fp32, ~4K parameters."""
from __future__ import annotations

import pytest
import torch
from harness import make_config
from multiproc import run_ranks

STEPS = 3
BUDGET = {"emulate_accelerator": True, "device_budget": 32768}  # about half the model and two chunks in flight


class _RaiseOnce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, value, control):
        ctx.control = control
        return value.view_as(value)

    @staticmethod
    def backward(ctx, grad):
        if ctx.control["raise"]:
            ctx.control["raise"] = False
            raise RuntimeError("injected failure in backward")
        return grad, None


class _Model(torch.nn.Module):
    """The failure comes after the last two layers' gradients (their slots written, reduced), before the first's."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.first, self.second, self.head = torch.nn.Linear(32, 64), torch.nn.Linear(64, 32), torch.nn.Linear(32, 2)
        self.control = {"raise": False}

    def forward(self, x):
        h = _RaiseOnce.apply(torch.nn.functional.gelu(self.first(x)), self.control)
        return self.head(torch.nn.functional.gelu(self.second(h)))


def _run(rank, world_size, stage, fail, placed=False):
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    import ds_patrickstar  # noqa: F401

    model = _Model()
    cfg = make_config(stage, chunk_size=1024, lr=1e-2, extra_zero=BUDGET if placed else None)
    cfg.pop("train_batch_size")
    engine = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())[0]
    losses, raised, retraces = [], None, 0
    for step in range(STEPS):
        x = torch.randn(4, 32, generator=torch.Generator().manual_seed(100 * step + rank))
        if step == fail:
            model.control["raise"] = True
            try:
                engine.backward(engine(x).pow(2).mean())
            except RuntimeError as err:
                raised = str(err)
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if stage == "patrickstar":  # placement's re-traces: none for the failed iteration's moments
            counters = engine.optimizer.last_step_counters
            retraces += counters["retraces_order"] + counters["retraces_shape"]
    with torch.no_grad():
        losses.append(engine(torch.ones(4, 32)).pow(2).mean().item())
    params = {n: safe_get_full_fp32_param(p).detach().cpu().clone() for n, p in engine.module.named_parameters()}
    engine.destroy()
    return {"losses": losses, "params": params, "raised": raised, "retraces": retraces}


# (ranks, the failing step, placement on the strict emulated accelerator: the failure while it traces)
@pytest.mark.parametrize("world_size, fail, placed", [(1, 1, False), (2, 1, False), (1, 0, True)])
def test_training_after_a_backward_that_raised_matches_a_run_without_it(world_size, fail, placed):
    ours = run_ranks(_run, world_size, "patrickstar", fail, placed)
    clean = run_ranks(_run, world_size, "patrickstar", None, placed)
    stock = run_ranks(_run, world_size, 3, None, memo=True)
    for rank in range(world_size):
        assert ours[rank]["raised"] is not None and "injected failure in backward" in ours[rank]["raised"]
        assert ours[rank]["retraces"] == clean[rank]["retraces"]  # the failed iteration's moments left the trace
        assert ours[rank]["losses"] == clean[rank]["losses"], rank  # bit for bit: the failed iteration left nothing
        torch.testing.assert_close(ours[rank]["losses"], stock[rank]["losses"], rtol=0, atol=1e-5)
        for name, value in clean[rank]["params"].items():
            assert torch.equal(ours[rank]["params"][name], value), name
            torch.testing.assert_close(value, stock[rank]["params"][name], rtol=0, atol=2e-6, msg=name)


def _accumulating_run(rank, world_size):
    import logging

    import deepspeed

    import ds_patrickstar  # noqa: F401

    said = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("ds_patrickstar.groups.manager").addHandler(handler)
    model = _Model()
    cfg = make_config("patrickstar", chunk_size=1024, lr=1e-2, gas=2)
    cfg.pop("train_batch_size")
    engine = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())[0]
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(rank))
    engine.backward(engine(x).pow(2).mean())  # micro-step 0, accumulated
    engine.step()
    model.control["raise"] = True
    try:
        engine.backward(engine(x).pow(2).mean())  # micro-step 1 raises
    except RuntimeError:
        pass
    start = {n: deepspeed.utils.safe_get_full_fp32_param(p).clone() for n, p in engine.module.named_parameters()}
    for _ in range(3):  # micro-step 1 again (the boundary), then a whole step
        engine.backward(engine(x).pow(2).mean())
        engine.step()
    end = {n: deepspeed.utils.safe_get_full_fp32_param(p).clone() for n, p in engine.module.named_parameters()}
    logging.getLogger("ds_patrickstar.groups.manager").removeHandler(handler)
    engine.destroy()
    return {"said": said, "moved": all(not torch.equal(start[n], end[n]) for n in start)}


def test_a_backward_that_raised_with_accumulation_discards_the_step_and_says_so():
    result = run_ranks(_accumulating_run, 1)[0]
    assert any("earlier micro-steps included) are discarded" in line for line in result["said"]), result["said"]
    assert result["moved"]  # training went on: every parameter was updated after the failure
