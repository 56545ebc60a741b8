"""Resuming reads only the optimizer files a rank needs (issue 18, item 11): at the saved world size
each rank reads its own file (was: every rank read all W files, W^2 reads), and a resharded load
reads the files whose chunks overlap what the rank owns now. Real processes on gloo."""
from __future__ import annotations

import os

import torch
from multiproc import run_ranks


def _engine():
    import deepspeed

    import ds_patrickstar  # noqa: F401

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Linear(64, 32))  # several chunk groups
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": "patrickstar", "chunk_size": 1024}}
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    return engine


def _save(rank, world_size, save_dir):
    engine = _engine()
    engine.backward(engine(torch.randn(2, 32)).sum())
    engine.step()
    engine.save_checkpoint(save_dir, tag="t")
    return engine.get_fp32_state_dict()


def _load_counting_reads(rank, world_size, save_dir):
    from ds_patrickstar.io import checkpoint

    engine = _engine()
    read, real = [], checkpoint.load_file
    checkpoint.load_file = lambda path: read.append(os.path.basename(path)) or real(path)
    try:
        engine.load_checkpoint(save_dir, tag="t")
    finally:
        checkpoint.load_file = real  # the process may run other tests after this one
    return {"read": sorted(f for f in read if f.endswith("optim_states.pt")), "fp32": engine.get_fp32_state_dict()}


def test_a_rank_reads_only_the_optimizer_files_it_needs(tmp_path):
    saved = run_ranks(_save, 2, str(tmp_path))[0]
    same_world = run_ranks(_load_counting_reads, 2, str(tmp_path))
    for rank, result in enumerate(same_world):
        assert result["read"] == [f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"], result["read"]
    (one_rank,) = run_ranks(_load_counting_reads, 1, str(tmp_path))
    assert len(one_rank["read"]) == 2, one_rank["read"]  # resharded: it owns every chunk now
    for result in [*same_world, one_rank]:
        assert result["fp32"].keys() == saved.keys()
        for name, value in saved.items():
            assert torch.equal(result["fp32"][name], value), name
