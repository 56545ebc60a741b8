"""The disk tier of the optimizer states (offload_optimizer: {"device": "nvme"}): a run with most
states on disk equals the same run with every state in RAM, bit for bit (the same CPU kernel on
the same values: only where the states wait between steps differs); the step counts its I/O;
checkpoints, bad input and faults."""
from __future__ import annotations

import errno
import json
import math
import os

import pytest
import torch

from harness import make_config, run_training
from multiproc import run_ranks
from quirk_models import QUIRK_MODELS


def disk_zero(path, host_budget=4096, **extra):
    return {"offload_optimizer": {"device": "nvme", "nvme_path": str(path), **extra}, "host_budget": host_budget}


def assert_same(a, b):
    assert a.losses == b.losses
    for name in b.fp32_weights:
        assert torch.equal(a.fp32_weights[name], b.fp32_weights[name]), name
        assert torch.equal(a.lp_weights[name], b.lp_weights[name]), name


@pytest.mark.parametrize("model,dtype,gas", [("tied", "fp32", 1), ("reused", "bf16", 2)])
def test_states_on_disk_equal_states_in_ram(tmp_path, model, dtype, gas):
    ram = run_training(QUIRK_MODELS[model], make_config("patrickstar", dtype, gas=gas, chunk_size=1024), steps=3, seed=0)
    disk = run_training(
        QUIRK_MODELS[model],
        make_config("patrickstar", dtype, gas=gas, chunk_size=1024, extra_zero=disk_zero(tmp_path)),
        steps=3,
        seed=0,
    )
    assert_same(disk, ram)
    last = disk.counters[-1]
    assert last["disk_bytes_read"] > 0 and last["disk_bytes_read"] == last["disk_bytes_written"]
    assert last["model_bytes_disk"] > 0 and last["disk_buffer_bytes"] > 0
    assert 0 < last["disk_bytes_read_ahead"] <= last["disk_bytes_read"], "the first reads start in backward"
    assert not os.path.exists(tmp_path / "ds_patrickstar_swap" / "rank0"), "swap files are scratch: removed at the end"


class _Wide(torch.nn.Module):
    """One 8192-element weight (its own chunk at chunk_size 1024: 8 pieces of 1024) and small ones."""

    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(16, 512), torch.nn.Linear(512, 4)

    def forward(self, x, y):
        return (self.down(torch.nn.functional.gelu(self.up(x))) - y).square().mean()


def _wide(seed):
    torch.manual_seed(seed)

    def batch(step):
        gen = torch.Generator().manual_seed(1000 * seed + step)
        return torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)

    return _Wide(), batch


def test_one_large_chunk_streams_through_buffers_of_one_piece(tmp_path):
    """The buffers hold one piece (buffer_size elements), not the largest chunk; the step updates
    the large chunk piece by piece with the same numbers as in RAM."""
    from ds_patrickstar.memory.preflight import record_bytes

    config = make_config("patrickstar", "fp32", chunk_size=1024, weight_decay=0.01)
    ram = run_training(_wide, config, steps=3, seed=0)
    config["zero_optimization"].update(disk_zero(tmp_path, buffer_size=1000))  # rounded up to 1024
    disk = run_training(_wide, config, steps=3, seed=0)
    assert_same(disk, ram)
    last = disk.counters[-1]
    assert last["disk_buffer_bytes"] == (4 + 1) * record_bytes(1024) < record_bytes(16 * 512)
    assert last["disk_bytes_read"] == last["model_bytes_disk"] > record_bytes(16 * 512)


def test_reads_start_in_backward_and_a_skipped_step_drops_them(tmp_path):
    """fp16 starting at a loss scale that overflows: the skipped steps' reads (started in backward)
    are waited for and dropped, nothing is written, and the run equals the one in RAM."""
    from ds_patrickstar.memory.preflight import record_bytes

    config = make_config("patrickstar", "fp16", chunk_size=1024)
    config["fp16"].update(initial_scale_power=17, hysteresis=1)
    ram = run_training(_wide, config, steps=4, seed=0)
    config["zero_optimization"].update(disk_zero(tmp_path, buffer_size=1024))
    disk = run_training(_wide, config, steps=4, seed=0)
    assert 0 < ram.skipped_steps < 4
    assert_same(disk, ram)
    assert disk.skipped_steps == ram.skipped_steps
    assert all(c["disk_bytes_read_ahead"] == 3 * record_bytes(1024) for c in disk.counters)  # buffer_count - 1
    skipped = [not math.isfinite(norm) for norm in disk.grad_norms]
    assert sum(skipped) == ram.skipped_steps
    for step, (counters, skip) in enumerate(zip(disk.counters, skipped)):
        if step and skip:  # (the first step's counters hold the first states' writes at initialize)
            assert counters["disk_bytes_written"] == 0, "a skipped step writes nothing"
        elif not skip:
            assert counters["disk_bytes_written"] == counters["model_bytes_disk"]


def test_strict_accelerator_tight_budget_with_disk_tier(tmp_path):
    """Placement evicts every step (tight device budget) while every state streams from disk; a read
    used before its wait would be NaN (poisoned buffers) and change the numbers."""
    emulated = {"emulate_accelerator": True, "device_budget": 16384}
    ram = run_training(QUIRK_MODELS["mlp"], make_config("patrickstar", "fp32", chunk_size=1024, extra_zero=emulated),
                       steps=3, seed=0)
    disk = run_training(QUIRK_MODELS["mlp"], make_config("patrickstar", "fp32", chunk_size=1024,
                                                         extra_zero={**emulated, **disk_zero(tmp_path)}), steps=3, seed=0)
    assert_same(disk, ram)
    assert disk.counters[-1]["bytes_to_device"] > 0 and disk.counters[-1]["disk_bytes_read"] > 0


def test_a_missing_wait_reads_poison(tmp_path):
    from ds_patrickstar.memory.disk_io import ThreadDiskIO, aligned_empty

    io = ThreadDiskIO(poison=True)
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT)
    src = aligned_empty(4096).view(torch.float32).fill_(3.0)
    io.write(fd, 0, src).wait()
    dst = aligned_empty(4096).view(torch.float32)
    pending = io.read(fd, 0, dst)
    assert dst.isnan().all(), "a read not waited on holds NaN"
    pending.wait()
    assert torch.equal(dst, src)
    io.close()
    os.close(fd)


def _two_ranks(rank, world_size, path, gas):
    import deepspeed

    import ds_patrickstar  # noqa: F401

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 64), torch.nn.GELU(),
                                torch.nn.Linear(64, 4))
    zero = {"stage": "patrickstar", "chunk_size": 1024, **(disk_zero(f"{path}") if path else {})}
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": gas, "zero_optimization": zero,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}, "gradient_clipping": 0.5}
    engine, *_ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
    gen = torch.Generator().manual_seed(100 + rank)
    losses = []
    for _ in range(3 * gas):
        x, y = torch.randn(4, 16, generator=gen), torch.randn(4, 4, generator=gen)
        loss = ((engine(x) - y) ** 2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    files = sorted(os.listdir(os.path.join(path, "ds_patrickstar_swap", f"rank{rank}"))) if path else []
    if path:
        engine.save_checkpoint(os.path.join(path, "ckpt"), tag="t")
    result = {"losses": losses, "weights": engine.get_fp32_state_dict(), "files": files,
              "spilled": sorted(engine.optimizer.optim_states.spilled)}
    engine.destroy()
    return result


def test_two_ranks_each_spill_their_own_chunks(tmp_path):
    ram = run_ranks(_two_ranks, 2, None, 2)
    disk = run_ranks(_two_ranks, 2, str(tmp_path), 2)
    for ours, ref in zip(disk, ram):
        assert ours["losses"] == ref["losses"]
        assert all(torch.equal(ours["weights"][n], v) for n, v in ref["weights"].items())
    for rank, result in enumerate(disk):
        assert result["spilled"] and all(c % 2 == rank for c in result["spilled"])
        assert result["files"] == sorted([f"chunk{c}.swap" for c in result["spilled"]] + ["manifest.json"])
    from ds_patrickstar.io.checkpoint import consolidate_fp32_state_dict

    # both ranks' spilled states went into the tag folder as files of their own; zero_to_fp32 reads them
    assert len(list((tmp_path / "ckpt" / "t").glob("*.states"))) == sum(len(r["spilled"]) for r in disk)
    full = consolidate_fp32_state_dict(str(tmp_path / "ckpt"))
    assert all(torch.equal(full[n], v) for n, v in disk[0]["weights"].items())


def test_planner_puts_what_the_host_cannot_hold_on_disk():
    from ds_patrickstar.memory.preflight import record_bytes
    from ds_patrickstar.plan import plan_report

    sizes = [4096] * 10
    report = plan_report(sizes, 4096, 1, 2, False, 0, 10 * 4096 * 2 + 4 * 4096 * 12 + 4 * record_bytes(4096), 3)
    assert report["spilled_chunks"] == 6  # 2 B/param of every chunk, the buffers, then the states of 4 chunks
    assert report["on_disk_bytes"] == 6 * record_bytes(4096)
    assert report["fits"] and report["largest_fitting_params_disk"] > report["largest_fitting_params"]


def test_spill_counts_buffers_of_the_spilled_chunks_only():
    """A large first chunk (an embedding) kept in RAM does not size the buffers of small spilled ones;
    nothing spilled, no buffers."""
    from ds_patrickstar.memory.preflight import disk_buffer_bytes, record_bytes, spilled_chunks

    owned = {0: 65536, **dict.fromkeys(range(1, 11), 1024)}
    budget = 12 * (65536 + 1024) + 5 * record_bytes(1024)
    assert spilled_chunks(owned, 0, budget, 4, 2**22) == set(range(2, 11))
    assert spilled_chunks(owned, 0, budget - 1, 4, 2**22) == set(range(1, 11))
    assert spilled_chunks(owned, 0, 12 * sum(owned.values()), 4, 2**22) == set()
    assert disk_buffer_bytes([], 4, 2**22) == 0
    assert disk_buffer_bytes([65536, 1024], 3, 2048) == 4 * record_bytes(2048)


# ---- bad input ------------------------------------------------------------------------
def _init(zero_extra):
    import deepspeed

    import ds_patrickstar  # noqa: F401
    from harness import ensure_distributed

    ensure_distributed()
    model = torch.nn.Linear(64, 64)
    cfg = make_config("patrickstar", "fp32", chunk_size=1024, extra_zero=zero_extra)
    return deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())[0]


def test_missing_nvme_path_names_path_and_bytes(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(ValueError, match=r"nvme_path=.*nope.* does not exist: the disk tier needs [\d,]+ bytes .* free"):
        _init(disk_zero(missing))


@pytest.mark.parametrize("probe,problem", [
    (dict(exists=True, is_dir=True, writable=True, read_only=True, free=10**9), "read-only file system"),
    (dict(exists=True, is_dir=True, writable=False, read_only=False, free=10**9), "not writable by this process"),
    (dict(exists=True, is_dir=True, writable=True, read_only=False, free=1000), "too little free space"),
    (dict(exists=True, is_dir=False, writable=False, read_only=False, free=0), "not a folder"),
])
def test_unusable_nvme_path(probe, problem):
    from ds_patrickstar.memory.swap_files import PathProbe, check_swap_path

    with pytest.raises(ValueError, match=f"{problem}: the disk tier needs 123,456 bytes there .*, [\\d,]+ bytes are free"):
        check_swap_path("/some/dir", PathProbe(**probe), 123456)
    check_swap_path("/some/dir", PathProbe(True, True, True, False, 123456), 123456)


@pytest.mark.parametrize("block,match", [
    ({"offload_optimizer": {"device": "nvme"}}, "needs \"nvme_path\""),
    ({"offload_optimizer": {"device": "nvme", "nvme_path": "/tmp", "buffer_count": 2}}, "buffer_count=2"),
    ({"offload_optimizer": {"device": "nvme", "nvme_path": "/tmp", "bogus": 1}}, "offload_optimizer.bogus"),
    ({"offload_optimizer": {"device": "cpu"}}, "\"nvme\" \\(the disk tier\\)"),
    ({"offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}, "host_budget": 1.5}, "host_budget=1.5"),
])
def test_bad_disk_config(block, match):
    from ds_patrickstar.integration.config import split_config

    with pytest.raises(ValueError, match=match):
        split_config({"zero_optimization": {"stage": "patrickstar", **block}})


def test_idle_keys_warn_with_their_names(caplog):
    from ds_patrickstar.integration.config import split_config

    options, sanitized = split_config({
        "zero_optimization": {"stage": "patrickstar", "offload_optimizer": {
            "device": "nvme", "nvme_path": "/tmp", "pin_memory": True, "buffer_count": 5}},
        "aio": {"intra_op_parallelism": 3, "block_size": 65536, "queue_depth": 8}})
    nvme = options.offload_optimizer
    assert (nvme.buffer_count, nvme.threads, nvme.block_size) == (5, 3, 65536)
    assert "offload_optimizer.pin_memory" in caplog.text and "aio.queue_depth" in caplog.text
    assert sanitized["zero_optimization"] == {"stage": 0}
    assert split_config({"zero_optimization": {"stage": "patrickstar"}})[0].offload_optimizer is None


# ---- checkpoints and faults -------------------------------------------------------------
def _engine(path):
    """Linear(64, 64) with every state on disk: its weight's chunk in 4 pieces of 1024 elements."""
    os.makedirs(path, exist_ok=True)
    return _init(disk_zero(path, buffer_size=1024))


def _steps(engine, n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(n):
        loss = engine(torch.randn(4, 64, generator=gen)).square().mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def test_checkpoint_resume_with_disk_tier(tmp_path):
    """Saved through 1024-element pieces, resumed into the default pieces and into RAM."""
    from ds_patrickstar.io.checkpoint import consolidate_fp32_state_dict
    from ds_patrickstar.memory.disk_io import ThreadDiskIO
    from ds_patrickstar.memory.preflight import record_bytes

    ckpt = str(tmp_path / "ckpt")
    engine = _engine(tmp_path / "a")
    _steps(engine, 2)
    requests = []

    class Spy(ThreadDiskIO):
        def read(self, fd, offset, dst):
            requests.append(dst.numel())
            return super().read(fd, offset, dst)

    engine.optimizer.optim_states.disk.replace_io(Spy())
    engine.save_checkpoint(ckpt, tag="t")
    assert requests and max(requests) == record_bytes(1024), "a save reads one piece at a time"
    tag_files = os.listdir(os.path.join(ckpt, "t"))
    assert any(f.endswith(".states") for f in tag_files), tag_files
    assert torch.equal(consolidate_fp32_state_dict(ckpt)["weight"], engine.get_fp32_state_dict()["weight"])
    after = _steps(engine, 2, seed=1)
    engine.destroy()
    os.makedirs(tmp_path / "b")
    for resumed_with in (disk_zero(tmp_path / "b"), {}):  # into the tier, and into a run all in RAM
        other = _init(resumed_with)
        other.load_checkpoint(ckpt)
        assert _steps(other, 2, seed=1) == after
        other.destroy()


class _DiskFull(Exception):
    pass


def test_disk_full_fails_the_step_and_the_checkpoint_stays(tmp_path):
    from ds_patrickstar.memory.disk_io import ThreadDiskIO

    class FullDisk(ThreadDiskIO):
        def pwrite(self, fd, buffer, offset):
            raise OSError(errno.ENOSPC, "No space left on device (injected)")

    ckpt = str(tmp_path / "ckpt")
    engine = _engine(tmp_path / "swap")
    _steps(engine, 1)
    engine.save_checkpoint(ckpt, tag="good")
    expected = _steps(engine, 1, seed=1)
    engine.load_checkpoint(ckpt)
    engine.optimizer.optim_states.disk.replace_io(FullDisk())
    with pytest.raises(OSError, match="No space left on device"):
        _steps(engine, 1, seed=1)
    with open(tmp_path / "swap" / "ds_patrickstar_swap" / "rank0" / "manifest.json") as f:
        assert json.load(f)["clean"] is False, "the swap files say a step did not finish"
    engine.destroy()
    fresh = _engine(tmp_path / "swap")  # stale files are removed, never read
    fresh.load_checkpoint(ckpt)
    assert _steps(fresh, 1, seed=1) == expected
    fresh.destroy()
