"""A failed ``deepspeed.initialize`` leaves the model as it was: the very same parameter and buffer
tensors with their values, no hook of ours or DeepSpeed's, no disk tier thread, descriptor or file;
the original exception comes out unchanged, and initialize with a working config then trains the same
model as it would a fresh one. ``SwapFiles`` that fail part way close and remove what they opened.
"""
from __future__ import annotations

import errno
import gc
import math
import os
import threading

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from ds_patrickstar.memory.ledger import DeviceBudgetExceeded
from harness import make_config
from test_disk_tier import disk_zero

EMULATED = {"emulate_accelerator": True, "device_budget": 10**6}
MODULE_HOOKS = (
    "_forward_pre_hooks",
    "_forward_hooks",
    "_backward_pre_hooks",
    "_backward_hooks",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)


def _model(norm: type[torch.nn.Module] = torch.nn.BatchNorm1d) -> torch.nn.Module:
    """A linear layer, a norm (BatchNorm1d: buffers), a frozen bias."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), norm(32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    model[3].bias.requires_grad_(False)
    return model


def _hooks(model: torch.nn.Module) -> list[str]:
    found = [f"{name}.{kind}" for name, mod in model.named_modules() for kind in MODULE_HOOKS if getattr(mod, kind)]
    for name, param in model.named_parameters():
        if param._backward_hooks or getattr(param, "_post_accumulate_grad_hooks", None):
            found.append(f"{name} (parameter hooks)")
    return found


def _open_fds(under: str = "") -> list[str]:
    """This process's open descriptors (on files under ``under``, when given) as "fd -> target"."""
    fds = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the descriptor listdir itself used
            continue
        if target.startswith(under):
            fds.append(f"{fd} -> {target}")
    return sorted(fds)


def _tensors(model: torch.nn.Module) -> dict[str, tuple]:
    """Each parameter and buffer: the object, its storage and its device."""
    named = [*model.named_parameters(), *model.named_buffers()]
    return {name: (t, t.untyped_storage().data_ptr(), t.device) for name, t in named}


def _config(tmp_path):
    zero = {**EMULATED, **disk_zero(tmp_path, io_backend="threads")}
    return make_config("patrickstar", chunk_size=1024, extra_zero=zero)


def _losses(engine, steps: int = 2) -> list[float]:
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x = torch.randn(8, 32, generator=gen).to(next(engine.module.parameters()).dtype)
        loss = engine(x).float().square().mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _fail_in_kernel_build(monkeypatch, error):
    from ds_patrickstar.optim.chunk_adam import ChunkAdam

    def build_kernels(self, devices):
        raise error

    monkeypatch.setattr(ChunkAdam, "build_kernels", build_kernels)


def _fail_after_the_optimizer_states(monkeypatch, error):
    """The optimizer states were made (the disk tier wrote its first states) and then ran out of budget."""
    from ds_patrickstar.integration import assembly

    real = assembly.OptimizerStates

    def states(*args, **kwargs):
        real(*args, **kwargs)
        raise error

    monkeypatch.setattr(assembly, "OptimizerStates", states)


def _fail_after_the_engine(monkeypatch, error):
    """Our whole engine and DeepSpeed's were built; the last step of initialize fails."""
    from ds_patrickstar.integration import registration

    def adapt():
        raise error

    monkeypatch.setattr(registration, "adapt_accelerate", adapt)


FAILURES = {
    "kernel build": (_fail_in_kernel_build, lambda: RuntimeError("no compiler")),
    "optimizer states": (_fail_after_the_optimizer_states, lambda: DeviceBudgetExceeded("the states do not fit")),
    "after the engine": (_fail_after_the_engine, lambda: ValueError("accelerate")),
}


@pytest.mark.parametrize("where", list(FAILURES))
def test_a_failed_initialize_leaves_the_model_as_it_was(dist, tmp_path, monkeypatch, where):
    import deepspeed

    import ds_patrickstar  # noqa: F401

    fail, make_error = FAILURES[where]
    error = make_error()
    model = _model()
    before, threads = _tensors(model), set(threading.enumerate())
    values = {name: t.detach().clone() for name, t in model.state_dict(keep_vars=True).items()}
    fail(monkeypatch, error)
    with pytest.raises(type(error)) as raised:
        deepspeed.initialize(model=model, config=_config(tmp_path), model_parameters=model.parameters())
    assert raised.value is error
    del raised, error  # their traceback holds the frames of initialize
    monkeypatch.undo()

    after = _tensors(model)
    assert after.keys() == before.keys()
    changed = [n for n, (t, storage, device) in before.items() if after[n][0] is not t or after[n][1:] != (storage, device)]
    assert changed == []
    # read only once the storages are known to be the model's own
    assert [name for name, value in model.state_dict().items() if not torch.equal(values[name], value)] == []
    assert _hooks(model) == []
    assert set(threading.enumerate()) == threads
    assert _open_fds(str(tmp_path)) == []  # the swap files (the first initialize opens other files for good)
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []

    own = [StorageWeakRef(p.untyped_storage()) for p in model.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=model, config=_config(tmp_path), model_parameters=model.parameters())
    gc.collect()
    assert all(ref.expired() for ref in own)  # a successful initialize holds none of the model's own tensors
    retried = _losses(engine)
    engine.destroy()
    fresh_model = _model()
    engine, *_ = deepspeed.initialize(
        model=fresh_model, config=_config(tmp_path), model_parameters=fresh_model.parameters()
    )
    assert retried == _losses(engine)
    engine.destroy()


def test_a_failed_bf16_initialize_gives_back_fp32_tensors_and_the_optimizers_groups(dist, monkeypatch):
    """DeepSpeed casts the parameters to bf16 before our part of initialize runs: a failure gives the model
    its fp32 tensors back and a client optimizer its param groups, and initialize then runs on both."""
    import deepspeed

    import ds_patrickstar  # noqa: F401

    model = _model(torch.nn.LayerNorm)  # bf16 batch norm wants bf16 running statistics (DeepSpeed keeps fp32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before, groups = _tensors(model), [(g, dict(g)) for g in optimizer.param_groups]
    config = make_config("patrickstar", "bf16", chunk_size=1024, optimizer_type=None, extra_zero=EMULATED)
    _fail_in_kernel_build(monkeypatch, RuntimeError("no compiler"))
    with pytest.raises(RuntimeError, match="no compiler"):
        deepspeed.initialize(model=model, config=config, optimizer=optimizer)
    monkeypatch.undo()
    after = _tensors(model)
    assert [n for n, (t, storage, device) in before.items() if after[n][0] is not t or after[n][1] != storage] == []
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert [(g, dict(g)) for g in optimizer.param_groups] == groups
    engine, *_ = deepspeed.initialize(model=model, config=config, optimizer=optimizer)
    assert engine.basic_optimizer is optimizer and all(math.isfinite(x) for x in _losses(engine, steps=1))
    engine.destroy()


@pytest.mark.parametrize("step", ["fallocate", "manifest"])
def test_swap_files_failing_part_way_close_and_remove_what_they_opened(tmp_path, monkeypatch, step):
    from ds_patrickstar.disk import swap_files

    if step == "fallocate":  # the third file's space: the disk is full
        real, calls = os.posix_fallocate, []

        def fallocate(fd, offset, size):
            calls.append(fd)
            if len(calls) == 3:
                raise OSError(errno.ENOSPC, "No space left on device")
            real(fd, offset, size)

        monkeypatch.setattr(swap_files.os, "posix_fallocate", fallocate)
    else:  # every file is open

        def manifest(self):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(swap_files.SwapFiles, "_write_manifest", manifest)
    fds = _open_fds()
    with pytest.raises(OSError, match="No space left"):
        swap_files.SwapFiles(str(tmp_path), 0, {c: 8192 for c in range(4)}, direct=False)
    assert _open_fds() == fds
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []


def test_closing_swap_files_again_leaves_a_later_runs_folder(tmp_path):
    """The disk tier's finalizer closes its files again when it is collected, maybe after a new run (a
    retried initialize) took the same folder: that second close leaves the new run's files alone."""
    from ds_patrickstar.disk.swap_files import SwapFiles

    old = SwapFiles(str(tmp_path), 0, {0: 8192}, direct=False)
    old.close()
    new = SwapFiles(str(tmp_path), 0, {0: 8192}, direct=False)
    old.close()
    assert os.path.isfile(new.path(0))
    new.close()
