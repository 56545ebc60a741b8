"""``requires_grad`` changed after initialize (see [Note: requires_grad after initialize]): a block frozen after
initialize, unfrozen after 2 steps and frozen again after 2 more trains as with plain PyTorch's AdamW (its
own step count when unfrozen, no weight decay while frozen), at 1 and 2 ranks; a parameter frozen at
initialize that is unfrozen is refused at the next forward, by name."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from multiproc import run_ranks
from torch import nn

SEED = 5
LR, WD, EPS = 1e-2, 0.1, 1e-8
SCHEDULE = [False, False, True, True, False, False]  # the middle block's requires_grad at each step


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.mid = nn.Linear(32, 32)
        self.out = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.inp(x))
        h = h + F.gelu(self.mid(h))
        return F.cross_entropy(self.out(h), y)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)  # the same batch on every rank
    return torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)


def _config(world_size: int, chunk_size: int, overlap: bool = False) -> dict:
    # 40 KiB: the chunk fits, its optimizer state does not (every step's update runs on the host worker)
    placement = {"emulate_accelerator": True, "device_budget": 40 << 10, "overlap_host_adam": True} if overlap else {}
    return {
        "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,  # plain AdamW clips nothing
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": [0.9, 0.999], "eps": EPS, "weight_decay": WD}},
        "zero_optimization": {"stage": "patrickstar", "chunk_size": chunk_size, **placement},
        "steps_per_print": 10**9,
    }


def _torch_run(model: nn.Module) -> tuple[list[float], dict[str, torch.Tensor]]:
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=EPS, weight_decay=WD)
    losses = []
    for step, trains in enumerate(SCHEDULE):
        model.mid.requires_grad_(trains)
        opt.zero_grad(set_to_none=True)
        loss = model(*_batch(step))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _ours(rank: int, world_size: int, chunk_size: int, overlap: bool):
    import deepspeed

    import ds_patrickstar  # noqa: F401

    torch.manual_seed(SEED)
    model = Net()
    ref_losses, ref_weights = _torch_run(copy.deepcopy(model))
    config = _config(world_size, chunk_size, overlap)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    jobs = []
    host_work = engine.optimizer.accel.host_work
    engine.optimizer.accel.host_work = lambda *a: jobs.append(1) or host_work(*a)
    losses = []
    for step, trains in enumerate(SCHEDULE):
        engine.module.mid.requires_grad_(trains)
        loss = engine(*_batch(step))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    weights = {k: v.clone() for k, v in engine.get_fp32_state_dict().items()}
    engine.destroy()
    assert bool(jobs) == overlap, len(jobs)
    return losses, ref_losses, weights, ref_weights


@pytest.mark.parametrize("world_size,chunk_size,overlap", [(1, 4096, False), (2, 1024, False), (1, 4096, True)])
def test_freeze_and_unfreeze_between_steps_match_torch_adamw(world_size, chunk_size, overlap):
    """The middle block shares its chunks with the trainable ones (one chunk at 1 rank; at 2 ranks groups
    whose pieces straddle the ranks), so the update skips a run inside a chunk; with ``overlap_host_adam``
    the host worker runs the update cut when it was handed over."""
    for losses, ref_losses, weights, ref_weights in run_ranks(_ours, world_size, chunk_size, overlap, timeout=120):
        assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
        for name, ref in ref_weights.items():
            torch.testing.assert_close(weights[name], ref, rtol=1e-5, atol=1e-6, msg=name)


def _unfreeze_frozen(rank: int, world_size: int) -> str:
    import deepspeed

    import ds_patrickstar  # noqa: F401

    torch.manual_seed(SEED)
    model = Net()
    model.mid.requires_grad_(False)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=_config(1, 4096))
    engine.module.mid.weight.requires_grad_(True)
    try:
        engine(*_batch(0))
    except RuntimeError as err:
        return str(err)
    finally:
        engine.module.mid.weight.requires_grad_(False)
        engine.destroy()
    return "no error"


def test_unfreezing_a_parameter_frozen_at_initialize_raises_naming_it():
    (message,) = run_ranks(_unfreeze_frozen, 1, timeout=60)
    assert "mid.weight" in message and "requires_grad=False at deepspeed.initialize" in message


def test_update_runs_cut_a_chunk_where_the_step_changes_and_count_each_skip_once():
    """A chunk of four tensors, the second frozen and the fourth unfrozen after 2 skipped steps, updated
    whole and in two halves (a spilled chunk's pieces): the same runs, each skip counted once."""
    from ds_patrickstar.chunks.chunk import Chunk, Piece, TensorInfo
    from ds_patrickstar.optim.frozen_steps import KEY, Run, SkippedSteps, update_runs

    def runs_of(ranges):
        group = {KEY: {"d": 2}}
        chunk = Chunk(0, 64, torch.float32, 0)
        for name, offset, numel, trains in (("a", 0, 10, True), ("b", 12, 10, False), ("c", 22, 8, True),
                                            ("d", 30, 20, True)):
            param = nn.Parameter(torch.zeros(numel), requires_grad=trains)
            piece = Piece(0, offset, 0, numel)
            chunk.append(TensorInfo(name, param, [piece], numel, param.shape, 0), piece)
        steps = SkippedSteps(group)
        return [run for start, stop in ranges for run in update_runs(chunk, start, stop, steps, 5)], group[KEY]

    whole, counts = runs_of([(0, 50)])
    assert whole == [Run(0, 12, 5), Run(12, 22, None), Run(22, 30, 5), Run(30, 50, 3)]
    assert counts == {"b": 1, "d": 2}
    halves, counts = runs_of([(0, 16), (16, 50)])
    assert halves == [Run(0, 12, 5), Run(12, 16, None), Run(16, 22, None), Run(22, 30, 5), Run(30, 50, 3)]
    assert counts == {"b": 1, "d": 2}
