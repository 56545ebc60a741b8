"""Checkpoints: exact resume, resharding, crash safety, refusal of bad checkpoints, consolidation."""
import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch
from multiproc import WorkerError, run_ranks

STEPS, SAVE_AT = 10, 5


def _model(width=32):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.GELU(), torch.nn.Linear(width, 4))


def _engine(width=32, stage="patrickstar"):
    import deepspeed

    import ds_patrickstar  # noqa: F401

    zero = {"stage": stage, "chunk_size": 1024} if stage == "patrickstar" else {"stage": stage}
    cfg = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": zero, "gradient_clipping": 0.5,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4}}}
    model = _model(width)
    return deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())[0]


def _batches():
    # the same batches on every rank: a run at any world size is the same training
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 16, generator=gen), torch.randn(4, 4, generator=gen)) for _ in range(STEPS)]


def _train(engine, batches):
    losses = []
    for x, y in batches:
        loss = ((engine(x) - y) ** 2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _save_half(rank, world_size, ckpt_dir):
    engine = _engine()
    losses = _train(engine, _batches()[:SAVE_AT])
    engine.save_checkpoint(ckpt_dir, client_state={"epoch": 3})
    return {"losses": losses, "fp32": engine.get_fp32_state_dict()}


def _resume(rank, world_size, ckpt_dir):
    engine = _engine()
    _, client = engine.load_checkpoint(ckpt_dir)
    assert client["epoch"] == 3 and engine.global_steps == SAVE_AT
    return {"losses": _train(engine, _batches()[SAVE_AT:])}


def _uninterrupted(rank, world_size):
    return {"losses": _train(_engine(), _batches())}


@pytest.fixture(scope="module")
def reference():
    return run_ranks(_uninterrupted, 1)[0]["losses"]


@pytest.mark.parametrize("save_world,load_world", [(1, 1), (2, 2), (2, 1), (1, 2)])
def test_resume_and_reshard(tmp_path, reference, save_world, load_world):
    first = run_ranks(_save_half, save_world, str(tmp_path))
    second = run_ranks(_resume, load_world, str(tmp_path))
    resumed = first[0]["losses"] + second[0]["losses"]
    if save_world == load_world:  # exact: fp32 on CPU, same world size as an uninterrupted run
        same_world = reference if load_world == 1 else run_ranks(_uninterrupted, load_world)[0]["losses"]
        assert resumed == same_world
    else:  # another world size averages the same gradients in another order
        torch.testing.assert_close(torch.tensor(resumed), torch.tensor(reference), rtol=1e-5, atol=1e-6)


def test_a_format_1_checkpoint_still_loads(tmp_path, reference):
    """Format 1 (before tensors could straddle chunks) stored one whole piece per parameter as
    ``(chunk, offset, numel, shape)``; rewritten that way, a checkpoint resumes on 2 ranks as before."""
    first = run_ranks(_save_half, 1, str(tmp_path))
    tag = (tmp_path / "latest").read_text().strip()
    (optim,) = (tmp_path / tag).glob("*optim_states.pt")
    state = torch.load(optim, weights_only=False)
    sd = state["optimizer_state_dict"]
    layout = {}
    for name, (shape, pieces) in sd["layout"].items():
        (cid, offset, start, numel), = pieces
        assert start == 0
        layout[name] = (cid, offset, numel, shape)
    sd.update(format="ds_patrickstar/1", layout=layout)
    torch.save(state, optim)
    from ds_patrickstar.io.commit import write_marker

    write_marker(str(tmp_path), tag)
    second = run_ranks(_resume, 2, str(tmp_path))
    torch.testing.assert_close(torch.tensor(first[0]["losses"] + second[0]["losses"]), torch.tensor(reference),
                               rtol=1e-5, atol=1e-6)


def test_consolidated_fp32_equals_live_master(tmp_path):
    live = run_ranks(_save_half, 2, str(tmp_path))[0]["fp32"]
    from ds_patrickstar.io.checkpoint import consolidate_fp32_state_dict

    consolidated = consolidate_fp32_state_dict(str(tmp_path))
    assert consolidated.keys() == live.keys()
    for name, value in live.items():
        assert torch.equal(consolidated[name], value), name
    out = tmp_path / "full.pt"
    subprocess.run([sys.executable, "-m", "ds_patrickstar.zero_to_fp32", str(tmp_path), str(out)], check=True,
                   timeout=120, cwd=os.path.dirname(os.path.dirname(__file__)))
    from_cli = torch.load(out)
    assert all(torch.equal(from_cli[n], live[n]) for n in live)
    # where DeepSpeed writes its zero_to_fp32.py, ours, with DeepSpeed's command line (see [Note: the recovery
    # script]): python zero_to_fp32.py . OUTPUT_DIR [--safe_serialization]
    repo = os.path.dirname(os.path.dirname(__file__))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")])}
    for flags, name in (((), "pytorch_model.bin"), (("--safe_serialization",), "model.safetensors")):
        subprocess.run([sys.executable, "zero_to_fp32.py", ".", "out", *flags], check=True, timeout=120,
                       cwd=tmp_path, env=env)
        if name.endswith(".bin"):
            from_script = torch.load(tmp_path / "out" / name)
        else:
            from safetensors.torch import load_file

            from_script = load_file(tmp_path / "out" / name)
        assert from_script.keys() == live.keys() and all(torch.equal(from_script[n], live[n]) for n in live)


def _save_then_die(rank, world_size, ckpt_dir):
    engine = _engine()
    _train(engine, _batches()[:2])
    engine.save_checkpoint(ckpt_dir, tag="good")
    _train(engine, _batches()[2:4])
    original = engine.checkpoint_engine.save

    def save_and_crash(state_dict, path):
        original(state_dict, path)
        os.kill(os.getpid(), signal.SIGKILL)  # killed in the middle of the save: after the first file

    engine.checkpoint_engine.save = save_and_crash
    engine.save_checkpoint(ckpt_dir, tag="broken")


def _load_tag(rank, world_size, ckpt_dir, tag, width=32):
    engine = _engine(width)
    engine.load_checkpoint(ckpt_dir, tag=tag)
    return engine.global_steps


def test_kill_during_save_leaves_previous_checkpoint(tmp_path):
    with pytest.raises(WorkerError):
        run_ranks(_save_then_die, 1, str(tmp_path), timeout=120)
    assert (tmp_path / "latest").read_text() == "good"
    assert (tmp_path / "broken").is_dir()
    assert run_ranks(_load_tag, 1, str(tmp_path), None) == [2]
    with pytest.raises(WorkerError, match="incomplete"):
        run_ranks(_load_tag, 1, str(tmp_path), "broken")


def test_truncated_foreign_and_other_model_checkpoints_are_refused(tmp_path):
    good = tmp_path / "good"
    run_ranks(_save_half, 1, str(good))
    truncated = tmp_path / "truncated"
    shutil.copytree(good, truncated)
    optim = next((truncated / "global_step5").glob("*optim_states.pt"))
    optim.write_bytes(optim.read_bytes()[:100])
    with pytest.raises(WorkerError, match="truncated"):
        run_ranks(_load_tag, 1, str(truncated), None)
    with pytest.raises(WorkerError, match=r"another model: 0.bias has shape \(32,\) in the checkpoint but \(48,\)"):
        run_ranks(_load_tag, 1, str(good), None, 48)
    stock = tmp_path / "stock"
    run_ranks(_save_stock, 1, str(stock))
    with pytest.raises(WorkerError, match="not a ds_patrickstar checkpoint"):
        run_ranks(_load_tag, 1, str(stock), None)



def test_a_file_only_one_rank_reads_back_damaged_is_refused_on_every_rank(tmp_path):
    """[Note: crash-safe save]: at 2 ranks each reads back half the files' digests; one byte of the
    file that rank 1 checks (the second of the sorted listing: rank 0's optimizer file) is flipped,
    and both ranks refuse the load naming it (neither goes on into the load's collectives alone)."""
    run_ranks(_save_half, 2, str(tmp_path))
    tag = (tmp_path / "latest").read_text().strip()
    names = sorted(p.name for p in (tmp_path / tag).iterdir() if p.name != "ds_patrickstar_complete.json")
    damaged = tmp_path / tag / names[1]
    assert "zero_pp_rank_0" in damaged.name
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0x10
    damaged.write_bytes(bytes(data))
    refusals = run_ranks(_refusal, 2, str(tmp_path), timeout=120)
    assert all(f"{damaged.name} whose crc32 is" in refusal for refusal in refusals), refusals


def _refusal(rank, world_size, ckpt_dir):
    from ds_patrickstar.io.commit import CheckpointError

    try:
        _load_tag(rank, world_size, ckpt_dir, None)
    except CheckpointError as err:
        return str(err)
    return "loaded"

def _save_stock(rank, world_size, ckpt_dir):
    engine = _engine(stage=3)
    _train(engine, _batches()[:1])
    engine.save_checkpoint(ckpt_dir)


RESAVE_AT = 7  # the 2-rank continuation re-saves tag "last" here


def _save_last(rank, world_size, ckpt_dir):
    engine = _engine()
    _train(engine, _batches()[:SAVE_AT])
    engine.save_checkpoint(ckpt_dir, tag="last")


def _resume_and_resave(rank, world_size, ckpt_dir):
    engine = _engine()
    engine.load_checkpoint(ckpt_dir, tag="last")
    _train(engine, _batches()[SAVE_AT:RESAVE_AT])
    engine.save_checkpoint(ckpt_dir, tag="last")
    return _train(engine, _batches()[RESAVE_AT:])


def _resume_last(rank, world_size, ckpt_dir):
    engine = _engine()
    engine.load_checkpoint(ckpt_dir, tag="last")
    assert engine.global_steps == RESAVE_AT
    return _train(engine, _batches()[RESAVE_AT:])


def test_a_resave_at_another_world_size_leaves_no_rank_file_of_the_old_save(tmp_path):
    """[Note: checkpoint manifest]: tag "last" saved at 4 ranks, resumed at 2 and saved again two steps on,
    resumed at 4: every rank resumes the re-save (the same batches on every rank: the continuation at 4 ranks
    is the one at 2, up to the order of the sums). The old save's rank 2 and 3 files stayed in the folder and
    in the new marker, and those ranks restored the older step's masters and moments."""
    import json

    run_ranks(_save_last, 4, str(tmp_path))
    at_two = run_ranks(_resume_and_resave, 2, str(tmp_path))[0]
    marker = json.loads((tmp_path / "last" / "ds_patrickstar_complete.json").read_text())
    assert marker["world_size"] == 2 and marker["chunk_size"] == 1024
    assert not [name for name in os.listdir(tmp_path / "last") if "rank_2" in name or "rank_3" in name]
    at_four = run_ranks(_resume_last, 4, str(tmp_path))
    for losses in at_four:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(at_two), rtol=1e-5, atol=1e-6)


def test_a_marker_listing_another_saves_rank_files_is_refused(tmp_path):
    """A marker written before the manifest (no world size) over a re-save at fewer ranks lists the older
    save's files of the ranks beyond: refused, naming them, not loaded."""
    import json

    from ds_patrickstar.io.commit import write_marker

    run_ranks(_save_half, 2, str(tmp_path))
    tag = (tmp_path / "latest").read_text().strip()
    folder = tmp_path / tag
    run_ranks(_save_half, 1, str(tmp_path))  # the same tag at one rank: rank 1's file goes
    assert not list(folder.glob("*zero_pp_rank_1_*"))
    stale = folder / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    shutil.copy(folder / "zero_pp_rank_0_mp_rank_00_optim_states.pt", stale)  # as an old save left it
    write_marker(str(tmp_path), tag)  # a marker of every file, without the manifest's world size
    assert "world_size" not in json.loads((folder / "ds_patrickstar_complete.json").read_text())
    with pytest.raises(WorkerError, match=r"saved at 1 data-parallel ranks but lists the optimizer files of ranks "
                                          r"\[0, 1\].*remove \['zero_pp_rank_1_mp_rank_00_optim_states.pt'\]"):
        run_ranks(_load_tag, 1, str(tmp_path), None)
