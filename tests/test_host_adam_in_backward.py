"""Host updates begun during backward (see [Note: host updates in backward]) against the serial step on the strict
twin: losses and weights bit-identical at 1 rank (GA 1 and 2, fp16/bf16/fp32, clipping on and off) and 2 ranks;
kept where the step turned out as they assumed, redone where it did not (clipping that applies, a skipped fp16
step, the learning rate or the gradient changed between backward() and step()), and the gradient read between
backward() and step() is the gradient; the host worker cancels a job not started and runs the rest in order."""

import math
import sys
import threading
from pathlib import Path

import pytest
import torch
from harness import allow_fp16_on_cpu, ensure_distributed
from multiproc import run_ranks

from ds_patrickstar.memory.host_work import HostWaits, HostWorker

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

_GPT = {"n_layer": 3, "n_head": 2, "n_embd": 32, "block_size": 16, "vocab_size": 64}
STEPS = 4
BUDGET = {1: 260_000, 2: 280_000}  # as tests/counter_runs.py: every optimizer state on the host


def _config(dtype: str, clip: float, ga: int, budget: int, early: int | str | None) -> dict:
    zero = {
        "stage": "patrickstar",
        "chunk_size": 4096,
        "emulate_accelerator": True,
        "device_budget": budget,
        "overlap_host_adam": early is not None,
    }
    if early is not None:
        zero["host_adam_in_backward"] = early
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": ga,
        "gradient_clipping": clip,
        "steps_per_print": 10**9,
        "zero_optimization": zero,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-3, "warmup_num_steps": 2}},
    }
    if dtype == "fp16":
        config["fp16"] = {"enabled": True, "initial_scale_power": 8}
    elif dtype == "bf16":
        config["bf16"] = {"enabled": True}
    return config


def _train(rank: int, world: int, dtype: str, clip: float, ga: int, budget: int, early, between=None,
           sgd: bool = False) -> dict:
    """``between(engine, step)``, when given, runs between the boundary's backward() and step(); ``sgd``: a client
    ``torch.optim.SGD`` with momentum instead of the config's AdamW."""
    import deepspeed
    from deepspeed.utils import safe_get_full_grad
    from gpt_model import GPT, GPTConfig

    import ds_patrickstar  # noqa: F401

    ensure_distributed()
    torch.manual_seed(0)
    model = GPT(GPTConfig(**_GPT))
    config = _config(dtype, clip, ga, budget, early)
    optimizer = None
    if sgd:
        config.pop("optimizer")
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=0.01)
    with allow_fp16_on_cpu():
        engine, *_ = deepspeed.initialize(model=model, config=config, optimizer=optimizer,
                                          model_parameters=None if sgd else model.parameters())
    gen = torch.Generator().manual_seed(1 + rank)
    losses, counts, grads = [], [], []
    for step in range(STEPS):
        for micro in range(ga):
            idx = torch.randint(0, _GPT["vocab_size"], (2, _GPT["block_size"] + 1), generator=gen)
            loss = engine(idx[:, :-1].contiguous(), idx[:, 1:].contiguous())[1]
            engine.backward(loss)
            if micro == ga - 1:
                grads.append(safe_get_full_grad(engine.module.lm_head.weight).float().clone())
                if between is not None:
                    between(engine, step)
            engine.step()
            losses.append(loss.item())
        counters = engine.get_patrickstar_counters()
        counts.append((counters["host_updates_in_backward"], counters["host_updates_redone"]))
    fp32 = {k: v.clone() for k, v in engine.optimizer.fp32_state_dict(engine.module).items()}
    engine.destroy()
    return {"losses": losses, "fp32": fp32, "counts": counts, "grads": grads}


def _same(serial: dict, early: dict) -> None:
    assert serial["losses"] == early["losses"]
    for ours, theirs in zip(serial["grads"], early["grads"]):
        assert torch.equal(ours, theirs)
    for key in serial["fp32"]:
        assert torch.equal(serial["fp32"][key], early["fp32"][key]), key


@pytest.mark.parametrize(
    "dtype,clip,ga,early",
    [("fp32", 0.0, 1, 100), ("bf16", 100.0, 1, "auto"), ("fp16", 0.0, 2, 100)],
    ids=["fp32-ga1", "bf16-clip-unclipped-auto", "fp16-ga2"],
)
def test_updates_begun_in_backward_are_the_serial_step(dtype, clip, ga, early):
    serial = _train(0, 1, dtype, clip, ga, BUDGET[ga], early=None)
    begun = _train(0, 1, dtype, clip, ga, BUDGET[ga], early=early)
    # the first step traces (no gradient leaves in backward); from the second every host-updated chunk's
    # update begins in backward ("auto" on the twin: while no deferred job waits, one a step)
    kept = [k for k, _ in begun["counts"][1:]]
    assert kept == ([9] * (STEPS - 1) if early == 100 else [1] * (STEPS - 1)), begun["counts"]
    assert all(redone == 0 for _, redone in begun["counts"]), begun["counts"]
    _same(serial, begun)


def test_sgd_updates_begun_in_backward_are_the_serial_step():
    """SGD (pure torch, see [Note: SGD on chunks]) begins into spare buffers by copying there first."""
    serial = _train(0, 1, "fp32", 0.0, 1, BUDGET[1], early=None, sgd=True)
    begun = _train(0, 1, "fp32", 0.0, 1, BUDGET[1], early=100, sgd=True)
    assert [kept for kept, _ in begun["counts"]] == [0, 9, 9, 9]
    _same(serial, begun)


def _clip_at_step_2(engine, step):
    engine.optimizer.clip_grad = 1e-4 if step == 2 else 100.0  # read at step(): applies at the third step only


def _lr_at_step_2(engine, step):
    if step == 2:  # (the warm-up's first lr is 0)
        for group in engine.optimizer.param_groups:
            group["lr"] = group["lr"] * 0.5


def _grad_at_step_1(engine, step):
    from deepspeed.utils import safe_get_full_grad, safe_set_full_grad

    if step == 1:  # the final LayerNorm's chunk: its gradient is final early in backward
        weight = engine.module.ln_f.weight
        safe_set_full_grad(weight, safe_get_full_grad(weight) * 2)


@pytest.mark.parametrize(
    "between,counts",
    [
        # clipping applies at the third step: its updates are redone, the fourth begins none, then they begin again
        (_clip_at_step_2, [(0, 0), (9, 0), (0, 9), (0, 0)]),
        (_lr_at_step_2, [(0, 0), (9, 0), (0, 9), (9, 0)]),  # the lr changed between backward() and step()
        (_grad_at_step_1, [(0, 0), (8, 1), (9, 0), (9, 0)]),  # one chunk's gradient written: that one redone
    ],
    ids=["clipping-applies", "lr-set-before-step", "gradient-set-before-step"],
)
def test_updates_whose_assumptions_fail_are_redone(between, counts):
    serial = _train(0, 1, "fp32", 100.0, 1, BUDGET[1], early=None, between=between)
    begun = _train(0, 1, "fp32", 100.0, 1, BUDGET[1], early=100, between=between)
    assert begun["counts"] == counts
    _same(serial, begun)


def test_reads_between_backward_and_step_see_the_states_before_the_update():
    """The masters and the Adam states read between backward() and step() are those of the serial run (a begun update
    writes spare buffers only, swapped in at the step)."""
    def reader(seen):
        def between(engine, step):
            from deepspeed.utils import safe_get_full_optimizer_state

            weight = engine.module.ln_f.weight  # its chunk's update begins in backward
            states = [safe_get_full_optimizer_state(weight, key).clone() for key in ("exp_avg", "exp_avg_sq")]
            seen.append((engine.optimizer.fp32_state_dict(engine.module), states))
        return between

    serial_seen, begun_seen = [], []
    serial = _train(0, 1, "fp32", 0.0, 1, BUDGET[1], early=None, between=reader(serial_seen))
    begun = _train(0, 1, "fp32", 0.0, 1, BUDGET[1], early=100, between=reader(begun_seen))
    assert [kept for kept, _ in begun["counts"]] == [0, 9, 9, 9]
    _same(serial, begun)
    for (ours, our_states), (theirs, their_states) in zip(serial_seen, begun_seen):
        for key in ours:
            assert torch.equal(ours[key], theirs[key]), key
        assert all(torch.equal(a, b) for a, b in zip(our_states, their_states))


def _overflow_at_step_1(engine, step):
    if step == 1:  # an fp16 overflow: the step is skipped
        weight = engine.module.lm_head.weight
        from deepspeed.utils import safe_get_full_grad, safe_set_full_grad

        grad = safe_get_full_grad(weight)
        grad[0, 0] = float("inf")
        safe_set_full_grad(weight, grad)


def test_a_skipped_step_keeps_no_update_begun_in_backward():
    """The gradient written between backward() and step() is in the norm (the overflow check skips the step:
    before, the norm taken during backward missed it and the inf reached the weights)."""
    serial = _train(0, 1, "fp16", 0.0, 1, BUDGET[1], early=None, between=_overflow_at_step_1)
    begun = _train(0, 1, "fp16", 0.0, 1, BUDGET[1], early=100, between=_overflow_at_step_1)
    assert all(math.isfinite(loss) for loss in serial["losses"]), serial["losses"]
    assert begun["counts"][1] == (0, 9) and begun["counts"][2] == (9, 0), begun["counts"]
    _same(serial, begun)


def test_two_ranks_updates_begun_in_backward_are_the_serial_step():
    serial = run_ranks(_train, 2, "bf16", 100.0, 2, 420_000, None, timeout=300.0)
    begun = run_ranks(_train, 2, "bf16", 100.0, 2, 420_000, 100, timeout=300.0)
    for ours, theirs in zip(serial, begun):
        assert sum(kept for kept, _ in theirs["counts"]) > 0, theirs["counts"]
        _same(ours, theirs)


def test_a_kept_update_read_without_its_wait_fails(monkeypatch):
    """A kept update's new parameters reach the slot by a host job of the chunk: on the strict twin the slot holds NaN
    until it ran, so a chunk that forgets that job trains on NaN."""
    from ds_patrickstar.optim.early_updates import EarlyHostUpdates

    keep = EarlyHostUpdates._keep

    def keep_without_wait(self, begun):
        keep(self, begun)
        begun.chunk.pending = begun.chunk.pending[:-1]  # the job copying the new parameters forgotten

    monkeypatch.setattr(EarlyHostUpdates, "_keep", keep_without_wait)
    with pytest.raises((AssertionError, RuntimeError)):
        result = _train(0, 1, "fp32", 0.0, 1, BUDGET[1], early=100)
        assert all(math.isfinite(loss) for loss in result["losses"]), result["losses"]


def test_the_host_worker_cancels_a_job_not_started():
    worker, ran = HostWorker(HostWaits()), []
    gate = threading.Event()
    running = worker.submit(gate.wait, after=[])
    queued = worker.submit(lambda: ran.append("queued"), after=[])
    later = worker.submit(lambda: ran.append("later"), after=[])
    assert worker.waiting() == 3
    assert queued.cancel() and queued.done()
    assert not running.cancel()  # started: it runs to its end
    gate.set()
    running.wait()
    later.wait()
    worker.close()
    assert ran == ["later"] and worker.waiting() == 0


def test_auto_begins_none_with_the_disk_tier(tmp_path):
    """The disk tier budgets host memory (``host_budget``): "auto" makes no spare set there; a number still applies."""
    import deepspeed
    from gpt_model import GPT, GPTConfig

    import ds_patrickstar  # noqa: F401

    ensure_distributed()
    limits = []
    for early in ("auto", 3):
        config = _config("fp32", 0.0, 1, BUDGET[1], early)
        config["zero_optimization"].update(offload_optimizer={"device": "nvme", "nvme_path": str(tmp_path)},
                                           host_budget=1 << 30)
        model = GPT(GPTConfig(**_GPT))
        engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
        limits.append(engine.optimizer.early.limit)
        engine.destroy()
    assert limits == [0, 3]
