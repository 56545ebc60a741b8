"""The disk tier of the optimizer states (offload_optimizer: {"device": "nvme"}): a run with most
states on disk equals the same run with every state in RAM, bit for bit (the same CPU kernel on
the same values: only where the states wait between steps differs); the step counts its I/O;
checkpoints, bad input and faults."""
from __future__ import annotations

import contextlib
import errno
import json
import logging
import math
import os
import subprocess

import pytest
import torch
from harness import make_config, run_training
from multiproc import run_ranks
from quirk_models import QUIRK_MODELS


def disk_zero(path, host_budget=4096, **extra):
    return {"offload_optimizer": {"device": "nvme", "nvme_path": str(path), **extra}, "host_budget": host_budget}


def needs_backend(backend):
    """Skip ``"aio"`` where DeepSpeed's async_io op is not built (a first build takes minutes, too long
    for a test) or cannot load; ``"threads"`` always runs."""
    if backend == "aio":
        from ds_patrickstar.disk.aio import async_io_built, load_async_io

        why = "" if async_io_built() else "DeepSpeed's async_io op is not built in TORCH_EXTENSIONS_DIR"
        why = why or load_async_io()[1]
        if why:
            pytest.skip(why)


def make_io(backend, **kwargs):
    from ds_patrickstar.disk.aio import AioDiskIO
    from ds_patrickstar.disk.io import ThreadDiskIO

    needs_backend(backend)
    return AioDiskIO(**kwargs) if backend == "aio" else ThreadDiskIO(**kwargs)


def assert_same(a, b):
    assert a.losses == b.losses
    for name in b.fp32_weights:
        assert torch.equal(a.fp32_weights[name], b.fp32_weights[name]), name
        assert torch.equal(a.lp_weights[name], b.lp_weights[name]), name


@pytest.mark.parametrize("model,dtype,gas,backend", [
    ("tied", "fp32", 1, "threads"), ("reused", "bf16", 2, "threads"), ("tied", "fp32", 1, "aio")])
def test_states_on_disk_equal_states_in_ram(tmp_path, model, dtype, gas, backend):
    needs_backend(backend)
    ram = run_training(QUIRK_MODELS[model], make_config("patrickstar", dtype, gas=gas, chunk_size=1024), steps=3,
                       seed=0)
    disk = run_training(
        QUIRK_MODELS[model],
        make_config("patrickstar", dtype, gas=gas, chunk_size=1024,
                    extra_zero=disk_zero(tmp_path, io_backend=backend)),
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
    from ds_patrickstar.disk.budget import record_bytes
    from ds_patrickstar.placement.tide_plot import disk_caption

    config = make_config("patrickstar", "fp32", chunk_size=1024, weight_decay=0.01)
    ram = run_training(_wide, config, steps=3, seed=0)
    config["zero_optimization"].update(disk_zero(tmp_path, buffer_size=1000))  # rounded up to 1024
    disk = run_training(_wide, config, steps=3, seed=0)
    assert_same(disk, ram)
    last = disk.counters[-1]
    assert last["disk_buffer_bytes"] == (4 + 1) * record_bytes(1024) < record_bytes(16 * 512)
    assert last["disk_bytes_read"] == last["model_bytes_disk"] > record_bytes(16 * 512)
    caption = disk_caption(last)  # the tide plot's line for the tier (the plot itself needs matplotlib)
    assert f"{last['model_bytes_disk'] / 2**30:.2f} GiB of optimizer states on disk" in caption
    assert f"{last['disk_buffer_bytes'] / 2**20:.0f} MiB of host buffers" in caption
    assert disk_caption(ram.counters[-1]) == ""


def test_reads_start_in_backward_and_a_skipped_step_drops_them(tmp_path):
    """fp16 starting at a loss scale that overflows: the skipped steps' reads (started in backward)
    are waited for and dropped, nothing is written, and the run equals the one in RAM."""
    from ds_patrickstar.disk.budget import record_bytes

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


@pytest.mark.parametrize("backend", ["threads", "aio"])
def test_strict_accelerator_tight_budget_with_disk_tier(tmp_path, backend):
    """Placement evicts every step (tight device budget) while every state streams from disk; a read
    used before its wait would be NaN (poisoned buffers) and change the numbers."""
    needs_backend(backend)
    emulated = {"emulate_accelerator": True, "device_budget": 16384}
    ram = run_training(QUIRK_MODELS["mlp"], make_config("patrickstar", "fp32", chunk_size=1024, extra_zero=emulated),
                       steps=3, seed=0)
    tier = disk_zero(tmp_path, io_backend=backend)
    disk = run_training(QUIRK_MODELS["mlp"], make_config("patrickstar", "fp32", chunk_size=1024,
                                                         extra_zero={**emulated, **tier}), steps=3, seed=0)
    assert_same(disk, ram)
    assert disk.counters[-1]["bytes_to_device"] > 0 and disk.counters[-1]["disk_bytes_read"] > 0


@pytest.mark.parametrize("backend", ["threads", "aio"])
def test_a_missing_wait_reads_poison(tmp_path, backend):
    """Both backends: a read holds NaN until waited on, a write whose source changed before its wait
    raises; requests of any aligned length (here 3 pages over 2 aio threads) land whole; counted."""
    from ds_patrickstar.disk.io import aligned_empty
    from ds_patrickstar.memory.pending import CopyHazard

    io = make_io(backend, poison=True, **({"intra_op_parallelism": 2} if backend == "aio" else {}))
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT | os.O_DIRECT)
    os.posix_fallocate(fd, 0, 4 * 4096)
    src = io.empty(3 * 4096).view(torch.float32)
    torch.arange(src.numel(), out=src)
    io.write(fd, 4096, src).wait()
    dst = aligned_empty(3 * 4096).view(torch.float32)
    pending = io.read(fd, 4096, dst)
    assert dst.isnan().all(), "a read not waited on holds NaN"
    pending.wait()
    assert torch.equal(dst, src)
    assert (io.bytes_read, io.bytes_written) == (3 * 4096, 3 * 4096) and io.io_seconds > 0
    pending = io.write(fd, 0, src)
    src.add_(1)
    with pytest.raises(CopyHazard):
        pending.wait()
    with pytest.raises(OSError):
        io.read(fd, 2 * 4096, dst).wait()  # past the end of the file
    io.close()
    os.close(fd)


def _mlp_engine(swap, gas):
    import deepspeed

    import ds_patrickstar  # noqa: F401

    if swap:
        os.makedirs(swap, exist_ok=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 64), torch.nn.GELU(),
                                torch.nn.Linear(64, 4))
    zero = {"stage": "patrickstar", "chunk_size": 1024, **(disk_zero(swap) if swap else {})}
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": gas, "zero_optimization": zero,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}, "gradient_clipping": 0.5}
    return deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())[0]


def _mlp_steps(engine, micro_steps, seed):
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(micro_steps):
        x, y = torch.randn(4, 16, generator=gen), torch.randn(4, 4, generator=gen)
        loss = ((engine(x) - y) ** 2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _two_ranks(rank, world_size, path, gas, disk):
    swap = path if disk else None
    engine = _mlp_engine(swap, gas)
    losses = _mlp_steps(engine, 3 * gas, 100 + rank)
    files = sorted(os.listdir(os.path.join(path, "ds_patrickstar_swap", f"rank{rank}"))) if disk else []
    engine.save_checkpoint(os.path.join(path, "ckpt"), tag="t")
    result = {"losses": losses, "weights": engine.get_fp32_state_dict(), "files": files,
              "spilled": sorted(engine.optimizer.optim_states.spilled)}
    engine.destroy()
    return result


def _one_rank_resume(rank, world_size, ckpt, swap):
    engine = _mlp_engine(swap, 1)
    engine.load_checkpoint(ckpt)
    result = {"losses": _mlp_steps(engine, 2, 7), "weights": engine.get_fp32_state_dict(),
              "spilled": sorted(engine.optimizer.optim_states.spilled)}
    engine.destroy()
    return result


def test_two_ranks_each_spill_their_own_chunks(tmp_path):
    """Two ranks spill their own chunks and equal the run in RAM; their checkpoint, loaded at one rank
    into the tier (resharded), trains on as the RAM run's checkpoint loaded at one rank in RAM."""
    ram = run_ranks(_two_ranks, 2, str(tmp_path / "ram"), 2, False)
    disk = run_ranks(_two_ranks, 2, str(tmp_path / "disk"), 2, True)
    for ours, ref in zip(disk, ram):
        assert ours["losses"] == ref["losses"]
        assert all(torch.equal(ours["weights"][n], v) for n, v in ref["weights"].items())
    for rank, result in enumerate(disk):
        assert result["spilled"] and all(c % 2 == rank for c in result["spilled"])
        assert result["files"] == sorted([f"chunk{c}.swap" for c in result["spilled"]] + ["manifest.json"])
    from ds_patrickstar.io.checkpoint import consolidate_fp32_state_dict

    # both ranks' spilled states went into the tag folder as files of their own; zero_to_fp32 reads them
    ckpt = tmp_path / "disk" / "ckpt"
    assert len(list((ckpt / "t").glob("*.states"))) == sum(len(r["spilled"]) for r in disk)
    full = consolidate_fp32_state_dict(str(ckpt))
    assert all(torch.equal(full[n], v) for n, v in disk[0]["weights"].items())
    [resharded] = run_ranks(_one_rank_resume, 1, str(ckpt), str(tmp_path / "swap1"))
    [in_ram] = run_ranks(_one_rank_resume, 1, str(tmp_path / "ram" / "ckpt"), None)
    assert any(c % 2 for c in resharded["spilled"]), "a chunk rank 1 owned is on rank 0's disk now"
    assert resharded["losses"] == in_ram["losses"]
    assert all(torch.equal(resharded["weights"][n], v) for n, v in in_ram["weights"].items())


def test_planner_puts_what_the_host_cannot_hold_on_disk():
    from ds_patrickstar.disk.budget import record_bytes
    from ds_patrickstar.plan import plan_report

    sizes = [4096] * 10
    report = plan_report(sizes, 4096, 1, 2, False, 0, 10 * 4096 * 2 + 4 * 4096 * 12 + 4 * record_bytes(4096), 3)
    assert report["spilled_chunks"] == 6  # 2 B/param of every chunk, the buffers, then the states of 4 chunks
    assert report["on_disk_bytes"] == 6 * record_bytes(4096)
    assert report["fits"] and report["largest_fitting_params_disk"] > report["largest_fitting_params"]


def test_spill_counts_buffers_of_the_spilled_chunks_only():
    """A large first chunk (an embedding) kept in RAM does not size the buffers of small spilled ones;
    nothing spilled, no buffers."""
    from ds_patrickstar.disk.budget import disk_buffer_bytes, record_bytes, spilled_chunks

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
    from harness import ensure_distributed

    import ds_patrickstar  # noqa: F401

    ensure_distributed()
    model = torch.nn.Linear(64, 64)
    cfg = make_config("patrickstar", "fp32", chunk_size=1024, extra_zero=zero_extra)
    return deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())[0]


def test_missing_nvme_path_names_path_and_bytes(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(ValueError,
                       match=r"nvme_path=.*nope.* does not exist: the disk tier needs [\d,]+ bytes .* free"):
        _init(disk_zero(missing))


@pytest.mark.parametrize("probe,problem", [
    (dict(exists=True, is_dir=True, writable=True, read_only=True, free=10**9), "read-only file system"),
    (dict(exists=True, is_dir=True, writable=False, read_only=False, free=10**9), "not writable by this process"),
    (dict(exists=True, is_dir=True, writable=True, read_only=False, free=1000), "too little free space"),
    (dict(exists=True, is_dir=False, writable=False, read_only=False, free=0), "not a folder"),
])
def test_unusable_nvme_path(probe, problem):
    from ds_patrickstar.disk.swap_files import PathProbe, check_swap_path

    with pytest.raises(ValueError,
                       match=f"{problem}: the disk tier needs 123,456 bytes there .*, [\\d,]+ bytes are free"):
        check_swap_path("/some/dir", PathProbe(**probe), 123456)
    check_swap_path("/some/dir", PathProbe(True, True, True, False, 123456), 123456)


@pytest.mark.parametrize("block,match", [
    ({"offload_optimizer": {"device": "nvme"}}, "needs \"nvme_path\""),
    ({"offload_optimizer": {"device": "nvme", "nvme_path": "/tmp", "buffer_count": 2}}, "buffer_count=2"),
    ({"offload_optimizer": {"device": "nvme", "nvme_path": "/tmp", "bogus": 1}}, "offload_optimizer.bogus"),
    ({"offload_optimizer": {"device": "disk"}}, "\"nvme\" \\(the disk tier, with \"nvme_path\"\\)"),
    ({"offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}, "host_budget": 1.5}, "host_budget=1.5"),
])
def test_bad_disk_config(block, match):
    from ds_patrickstar.integration.config import split_config

    with pytest.raises(ValueError, match=match):
        split_config({"zero_optimization": {"stage": "patrickstar", **block}})


def test_idle_keys_warn_with_their_names(caplog):
    from ds_patrickstar.integration.config import split_config

    aio = {"intra_op_parallelism": 3, "block_size": 65536, "queue_depth": 16, "single_submit": True, "use_gds": False}
    options, sanitized = split_config({
        "zero_optimization": {"stage": "patrickstar", "offload_optimizer": {
            "device": "nvme", "nvme_path": "/tmp", "pin_memory": True, "buffer_count": 5}}, "aio": aio})
    nvme = options.offload_optimizer
    assert (nvme.buffer_count, nvme.threads, nvme.block_size, nvme.io_backend) == (5, 3, 65536, "auto")
    assert (nvme.queue_depth, nvme.single_submit, nvme.overlap_events) == (16, True, True)
    assert "offload_optimizer.pin_memory" in caplog.text and "aio.use_gds" in caplog.text
    assert "aio.queue_depth" not in caplog.text, "the aio_handle's settings mean something with io_backend auto"
    assert sanitized["zero_optimization"] == {"stage": 0}
    assert split_config({"zero_optimization": {"stage": "patrickstar"}})[0].offload_optimizer is None
    caplog.clear()
    split_config({"zero_optimization": {"stage": "patrickstar", "offload_optimizer": {
        "device": "nvme", "nvme_path": "/tmp", "io_backend": "threads"}}, "aio": aio})
    assert "aio.queue_depth" in caplog.text and "aio.single_submit" in caplog.text
    with pytest.raises(ValueError, match="offload_optimizer.io_backend='libaio' is invalid"):
        split_config({"zero_optimization": {"stage": "patrickstar", "offload_optimizer": {
            "device": "nvme", "nvme_path": "/tmp", "io_backend": "libaio"}}})


class _StandInAioHandle:
    """DeepSpeed 0.19.8's ``aio_handle`` as its source reads (``csrc/aio``), for machines without
    libaio: ``sync_pread``/``sync_pwrite`` open the file by name with ``O_DIRECT`` and return -1 only
    when it does not open, else the number of operations completed; the result of each libaio
    completion (``io_event.res``) is never read, so a failed read or write inside a request is lost."""

    def __init__(self, *settings):
        pass

    def _run(self, buffer, path, offset, write):
        try:
            fd = os.open(path, (os.O_WRONLY if write else os.O_RDONLY) | os.O_DIRECT)
        except OSError:
            return -1
        try:
            call = os.pwritev if write else os.preadv
            call(fd, [memoryview(buffer.numpy())], offset)
        except OSError:
            pass  # io_pgetevents reaped the completion; its res (-ENOSPC, -EIO) is not looked at
        finally:
            os.close(fd)
        return 1

    def sync_pwrite(self, buffer, path, offset):
        return self._run(buffer, path, offset, write=True)

    def sync_pread(self, buffer, path, offset):
        return self._run(buffer, path, offset, write=False)

    def new_cpu_locked_tensor(self, numel, example):
        from ds_patrickstar.disk.io import aligned_empty

        return aligned_empty(numel)

    def free_cpu_locked_tensor(self, tensor):
        return True


def stand_in_aio(monkeypatch):
    """Make the disk tier see a built, loadable async_io op: :class:`_StandInAioHandle`."""
    import types

    op = types.SimpleNamespace(aio_handle=_StandInAioHandle)
    for module in ("ds_patrickstar.disk.tier", "ds_patrickstar.disk.aio"):
        monkeypatch.setattr(f"{module}.load_async_io", lambda: (op, ""), raising=False)
        monkeypatch.setattr(f"{module}.async_io_built", lambda: True, raising=False)


def test_io_backend_choice(caplog, monkeypatch):
    """"auto" is "threads", which checks every read and write, and says so, also where the async_io op
    is built; "aio" warns what it does not check; where it cannot work it names the key and the way out."""
    from ds_patrickstar.disk.aio import AioDiskIO, lock_problem
    from ds_patrickstar.disk.config import NvmeOffload
    from ds_patrickstar.disk.io import ThreadDiskIO
    from ds_patrickstar.disk.tier import make_disk_io

    assert "raise `ulimit -l`" in lock_problem(2**30, limit=8 << 20, privileged=False)
    assert lock_problem(2**30, limit=8 << 20, privileged=True) == lock_problem(4096, 8 << 20, False) == ""
    with pytest.raises(ValueError, match=r'io_backend="aio" cannot be used: .*O_DIRECT.* use "threads"'):
        make_disk_io(NvmeOffload(nvme_path="/dev/shm", io_backend="aio"), direct=False, poison=False)
    caplog.set_level("INFO")
    stand_in_aio(monkeypatch)
    io = make_disk_io(NvmeOffload(nvme_path="/tmp"), direct=True, poison=False)
    assert isinstance(io, ThreadDiskIO) and '"threads" (io_backend "auto": it sees the result of every' in caplog.text
    io.close()
    caplog.clear()
    io = make_disk_io(NvmeOffload(nvme_path="/tmp", io_backend="aio"), direct=True, poison=False)
    assert isinstance(io, AioDiskIO)
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    assert "does not check the result of each libaio completion" in caplog.text
    io.close()


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
    from ds_patrickstar.disk.budget import record_bytes
    from ds_patrickstar.disk.io import ThreadDiskIO
    from ds_patrickstar.io.checkpoint import consolidate_fp32_state_dict

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
    from ds_patrickstar.disk.io import ThreadDiskIO

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


@contextlib.contextmanager
def _tiny_tmpfs(path, size):
    """A tmpfs of ``size`` mounted at ``path`` (skip where mounting needs a privilege this process lacks)."""
    os.makedirs(path)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs: {mounted.stderr.decode().strip()}")
    try:
        yield str(path)
    finally:
        if subprocess.run(["umount", str(path)], capture_output=True).returncode:
            subprocess.run(["umount", "-l", str(path)], check=True)


def _rewrites_need_space(swap):
    """Make each swap file's rewrite need new blocks, then fill the file system but one page: what a
    copy-on-write or thinly provisioned disk does to an in-place rewrite. (The swap files lose their
    blocks, which reads then return as zeros; the manifest's rewrite takes the one page and frees one.)"""
    folder = os.path.join(swap, "ds_patrickstar_swap", "rank0")
    files = [os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".swap")]
    for path in files:
        size = os.path.getsize(path)
        os.truncate(path, 0)
        os.truncate(path, size)
    filler = os.open(os.path.join(swap, "filler"), os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            os.write(filler, bytes(4096))
    except OSError as err:
        assert err.errno == errno.ENOSPC
    os.ftruncate(filler, os.fstat(filler).st_size - 4096)
    os.close(filler)
    return files


@pytest.mark.parametrize("aio_built", [False, True])
def test_a_real_full_disk_fails_the_step_naming_file_and_errno(tmp_path, monkeypatch, aio_built):
    """A rewrite of a swap file that meets a full file system (a tiny tmpfs) fails the step with
    ENOSPC and the file's name, with io_backend "auto" also where DeepSpeed's async_io op is built
    (``aio_built``: a stand-in of the op, which does not see the error); the last checkpoint then
    reloads and trains exactly."""
    if aio_built:
        stand_in_aio(monkeypatch)
    ckpt = str(tmp_path / "ckpt")
    with _tiny_tmpfs(tmp_path / "tmpfs", "1m") as swap:
        engine = _engine(swap)
        _steps(engine, 1)
        engine.save_checkpoint(ckpt, tag="good")
        expected = _steps(engine, 1, seed=1)
        engine.load_checkpoint(ckpt)
        files = _rewrites_need_space(swap)
        with pytest.raises(OSError) as failed:
            _steps(engine, 1, seed=1)
        assert failed.value.errno == errno.ENOSPC and "failed with ENOSPC" in str(failed.value), failed.value
        assert failed.value.filename in files, (failed.value, files)
        engine.destroy()
        os.unlink(os.path.join(swap, "filler"))
        fresh = _engine(swap)
        fresh.load_checkpoint(ckpt)
        assert _steps(fresh, 1, seed=1) == expected
        fresh.destroy()


# ---- the swap folder's lock ------------------------------------------------------------------
def _try_swap_folder(rank, world_size, root):
    from ds_patrickstar.disk.swap_files import SwapFiles
    from ds_patrickstar.disk.swap_lock import SwapFolderBusy

    try:
        files = SwapFiles(root, 0, {0: 4096})
    except SwapFolderBusy as err:
        return str(err)
    files.close()
    return "took"


def test_a_swap_folder_in_use_is_refused_naming_its_holder(tmp_path):
    """Another process over a live run's swap folder is refused with the folder, the holder and the
    ways out, and leaves the files alone, also where the manifest names another host (shared storage,
    where a process id says nothing); so is a second engine of this process; closed, the folder is free."""
    import socket

    from ds_patrickstar.disk.swap_files import MANIFEST, SwapFiles
    from ds_patrickstar.disk.swap_lock import SwapFolderBusy, lock_path

    held = SwapFiles(str(tmp_path), 0, {0: 4096})
    manifest = os.path.join(held.folder, MANIFEST)
    with open(manifest) as f:
        record = json.load(f)
    with open(manifest, "w") as f:
        json.dump({**record, "host": "another-host"}, f)
    [refused] = run_ranks(_try_swap_folder, 1, str(tmp_path))
    assert f"the swap folder {held.folder!r} is in use by another run" in refused, refused
    assert f"process {os.getpid()} on host {socket.gethostname()}" in refused, refused
    assert "another nvme_path" in refused and lock_path(held.folder) in refused, refused
    assert os.path.isfile(held.path(0)), "the refused run left the holder's files alone"
    with pytest.raises(SwapFolderBusy, match="this process: an engine that was not destroyed"):
        SwapFiles(str(tmp_path), 0, {0: 4096})
    held.close()
    assert not os.path.exists(lock_path(held.folder))
    assert run_ranks(_try_swap_folder, 1, str(tmp_path)) == ["took"]


def _race_for_swap_folders(rank, world_size, root, rounds):
    import torch.distributed as dist

    from ds_patrickstar.disk.swap_files import SwapFiles
    from ds_patrickstar.disk.swap_lock import SwapFolderBusy

    outcomes = []
    for i in range(rounds):
        dist.barrier()
        try:
            files, outcome = SwapFiles(os.path.join(root, str(i)), 0, {0: 4096}), "took"
        except SwapFolderBusy:
            files, outcome = None, "refused"
        dist.barrier()  # the one that took it holds it until both have tried
        if files is not None:
            files.close()
        outcomes.append(outcome)
    return outcomes


def test_two_runs_starting_together_exactly_one_takes_the_folder(tmp_path):
    a, b = run_ranks(_race_for_swap_folders, 2, str(tmp_path), 5)
    assert all(sorted(pair) == ["refused", "took"] for pair in zip(a, b)), (a, b)


# ---- kill -9 mid-step, fp16, reshard --------------------------------------------------------
class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _killed_mid_step(rank, world_size, swap, ckpt):
    """Two steps, a checkpoint, then SIGKILL inside the third step's writes: the first system-call
    write of the step has rewritten part of a swap file, the rest never happens."""
    import signal

    from ds_patrickstar.disk.io import ThreadDiskIO

    class KilledAfterFirstWrite(ThreadDiskIO):
        calls = 0

        def pwrite(self, fd, buffer, offset):
            self.calls += 1  # one I/O thread: the calls come one at a time
            if self.calls == 2:
                os.kill(os.getpid(), signal.SIGKILL)
            return super().pwrite(fd, buffer, offset)

    torch.manual_seed(0)
    engine = _engine(swap)
    _steps(engine, 2)
    engine.save_checkpoint(ckpt, tag="t2")
    engine.optimizer.optim_states.disk.replace_io(KilledAfterFirstWrite(threads=1, block_size=4096))
    _steps(engine, 1, seed=1)
    raise AssertionError("the step finished: the kill did not happen")


def _resume_and_reference(rank, world_size, swap, ckpt, reference_swap):
    with open(os.path.join(swap, "ds_patrickstar_swap", "rank0", "manifest.json")) as f:
        left = json.load(f)
    with open(os.path.join(swap, "ds_patrickstar_swap", "rank0.lock")) as f:
        lock_left = json.load(f)
    records = _Records()
    logging.getLogger("ds_patrickstar").addHandler(records)
    try:
        engine = _engine(swap)
    finally:
        logging.getLogger("ds_patrickstar").removeHandler(records)
    engine.load_checkpoint(ckpt)
    resumed = (_steps(engine, 2, seed=1), engine.get_fp32_state_dict())
    engine.destroy()
    torch.manual_seed(0)  # the killed run's initial weights
    engine = _engine(reference_swap)
    _steps(engine, 2)
    reference = (_steps(engine, 2, seed=1), engine.get_fp32_state_dict())
    engine.destroy()
    return {"left": left, "lock_left": lock_left, "log": records.messages, "resumed": resumed, "reference": reference}


def test_kill_9_mid_step_then_resume_from_the_checkpoint(tmp_path):
    from multiproc import WorkerError

    swap, ckpt = str(tmp_path / "swap"), str(tmp_path / "ckpt")
    with pytest.raises(WorkerError, match="exit code -9"):
        run_ranks(_killed_mid_step, 1, swap, ckpt)
    [out] = run_ranks(_resume_and_reference, 1, swap, ckpt, str(tmp_path / "reference"))
    assert out["left"]["clean"] is False, "the killed run's manifest says it stopped mid-step"
    with pytest.raises(ProcessLookupError):  # its lock file stayed; the kernel released its lock
        os.kill(out["lock_left"]["pid"], 0)
    assert any("removing stale swap files" in m and "stopped mid-step" in m for m in out["log"]), out["log"]
    assert out["resumed"][0] == out["reference"][0]
    assert all(torch.equal(out["resumed"][1][n], v) for n, v in out["reference"][1].items())


def test_fp16_with_an_overflow_on_disk_equals_ram(tmp_path):
    """Loss scaling with states on disk: the first step overflows at scale 2**21 and is skipped (the
    states the tier holds are not touched), the scale comes down, then the steps apply."""
    def config(extra):
        cfg = make_config("patrickstar", "fp16", chunk_size=1024, extra_zero=extra)
        cfg["fp16"].update(initial_scale_power=21, hysteresis=1)
        return cfg

    ram = run_training(QUIRK_MODELS["tied"], config({}), steps=6, seed=0)
    disk = run_training(QUIRK_MODELS["tied"], config(disk_zero(tmp_path)), steps=6, seed=0)
    assert 0 < ram.skipped_steps < 6, (ram.skipped_steps, ram.loss_scales)
    assert disk.skipped_steps == ram.skipped_steps and disk.loss_scales == ram.loss_scales
    assert_same(disk, ram)
    assert disk.counters[-1]["disk_bytes_read"] > 0
