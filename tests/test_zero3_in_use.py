"""Issue 43: what ZeRO-3 clients see of a parameter while a module uses it, against stock ZeRO-3 on the same model
and seed (fp32, ~1.4K parameters, real gloo ranks): ``ds_status`` inside a module's forward and between uses (see
[Note: ZeRO-3 parameter attributes]), and ``deepspeed.runtime.zero.unwrap_model_for_generation``: the hooks off,
the whole model gathered, forwards inside it and training after it (see [Note: hooks for generation])."""
from __future__ import annotations

import torch
from harness import make_config
from multiproc import run_ranks


class _Recording(torch.nn.Linear):
    """Records the ``ds_status`` of its own parameters at each forward."""

    def forward(self, x):
        self.seen.append(tuple(p.ds_status.name for p in self.parameters(recurse=False)))
        return super().forward(x)


def _model():
    torch.manual_seed(0)
    layers = [_Recording(16, 32), torch.nn.GELU(), _Recording(32, 16), torch.nn.GELU(), _Recording(16, 4)]
    for layer in layers:
        layer.seen = []
    return torch.nn.Sequential(*layers)


def _engine(stage, partitioned: bool = False):
    """``partitioned``: no persistent group (see [Note: persistent chunk groups]): this small model's would stay
    gathered between steps."""
    import deepspeed

    import ds_patrickstar  # noqa: F401

    model = _model()
    cfg = make_config(stage, chunk_size=1024, lr=1e-2,
                      extra_zero={"stage3_param_persistence_threshold": 0} if partitioned else None)
    cfg.pop("train_batch_size")
    return deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())[0], model


def _step(engine, rank, step):
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(100 * step + rank))
    loss = engine(x).pow(2).mean()
    engine.backward(loss)
    engine.step()
    return loss.item()


def _statuses(rank, world_size, stage):
    engine, model = _engine(stage)
    for step in range(2):
        _step(engine, rank, step)
    between = sorted({p.ds_status.name for p in model.parameters()})
    with torch.no_grad():
        engine(torch.zeros(2, 16))
    seen = [m.seen for m in model if isinstance(m, _Recording)]
    engine.destroy()
    return {"seen": seen, "between": between}


def test_ds_status_is_available_inside_the_modules_forward_as_zero3():
    ours = run_ranks(_statuses, 2, "patrickstar")  # two ranks: one rank's is the same code with one group
    stock = run_ranks(_statuses, 2, 3, memo=True)
    assert ours == stock
    assert ours[0]["seen"][0] == [("AVAILABLE", "AVAILABLE")] * 3  # two training forwards, one without grad
    assert ours[0]["between"] == ["NOT_AVAILABLE"]


def _generation(rank, world_size, stage):
    from deepspeed.runtime.zero import unwrap_model_for_generation

    engine, model = _engine(stage)
    losses = [_step(engine, rank, 0)]
    holder = getattr(engine.optimizer, "parameter_offload", engine.optimizer)  # where stock's helper looks
    with unwrap_model_for_generation(engine) as unwrapped:
        hooks = len(holder.forward_hooks) + len(holder.backward_hooks)
        shapes = [tuple(p.shape) for p in unwrapped.parameters()]
        with torch.no_grad():
            out = unwrapped(torch.ones(2, 16)).clone()  # a rank's own forward: no collective without hooks
    after = len(holder.forward_hooks)
    losses += [_step(engine, rank, step) for step in (1, 2)]
    engine.destroy()
    return {"hooks": hooks, "shapes": shapes, "out": out, "losses": losses, "after": after > 0}


def test_unwrap_model_for_generation_gathers_and_training_goes_on_as_zero3():
    ours = run_ranks(_generation, 2, "patrickstar")
    stock = run_ranks(_generation, 2, 3)
    for rank in range(2):
        assert ours[rank]["hooks"] == 0 and ours[rank]["after"]
        assert ours[rank]["shapes"] == stock[rank]["shapes"] == [(32, 16), (32,), (16, 32), (16,), (4, 16), (4,)]
        torch.testing.assert_close(ours[rank]["out"], stock[rank]["out"], rtol=0, atol=2e-6)
        torch.testing.assert_close(ours[rank]["losses"], stock[rank]["losses"], rtol=0, atol=2e-6)


def _two_engines(rank, world_size, out_dir):
    import deepspeed

    trained, _ = _engine("patrickstar")
    _step(trained, rank, 0)
    trained.save_checkpoint(out_dir, tag="t")
    loaded, _ = _engine("patrickstar")
    loaded.load_checkpoint(out_dir, tag="t", load_module_only=True)
    pairs = list(zip(trained.module.parameters(), loaded.module.parameters()))
    with deepspeed.zero.GatheredParameters([p for pair in pairs for p in pair]):  # both models' at once
        values = [(a.detach().clone(), b.detach().clone()) for a, b in pairs]
    # stock sorts a set of the parameters by ds_id, which the two models share: the list's order differs by rank
    mixed = [p for pair in pairs for p in (pair if rank == 0 else pair[::-1])]
    mixed[0].all_gather(param_list=mixed)
    again = [(a.detach().clone(), b.detach().clone()) for a, b in pairs]
    mixed[0].partition(param_list=mixed)
    assert all(torch.equal(x, y) for pair, other in zip(values, again) for x, y in zip(pair, other))
    trained.destroy()
    loaded.destroy()
    return values


def test_gathered_parameters_of_two_engines_at_once(tmp_path):
    """DeepSpeed's checkpoint tests gather a trained and a loaded model's parameters in one
    ``GatheredParameters``, which calls the first parameter's ``all_gather`` with all of them: each engine
    gathers its own (before: the second model's stayed partitioned, and reading them crashed the process)."""
    for values in run_ranks(_two_engines, 2, str(tmp_path), timeout=120):
        assert [tuple(a.shape) for a, _ in values] == [(32, 16), (32,), (16, 32), (16,), (4, 16), (4,)]
        for a, b in values:
            assert torch.equal(a, b)


def _read_between_uses(rank, world_size, out_dir):
    """As DeepSpeed's checkpoint tests compare a trained and a loaded model (their gather gets (name, parameter)
    pairs and gathers nothing): every parameter read directly between uses, then training goes on."""
    trained, _ = _engine("patrickstar", partitioned=True)
    _step(trained, rank, 0)
    trained.save_checkpoint(out_dir, tag="t")
    loaded, _ = _engine("patrickstar", partitioned=True)
    loaded.load_checkpoint(out_dir, tag="t", load_module_only=True)
    read = []
    for a, b in zip(trained.module.parameters(), loaded.module.parameters()):
        read.append((tuple(a.shape), tuple(b.shape), bool(torch.allclose(a, b)), a.ds_status.name))
    losses = [_step(engine, rank, 1) for engine in (trained, loaded)]
    trained.destroy()
    loaded.destroy()
    return read, losses


def test_a_released_parameter_reads_as_an_empty_tensor(tmp_path):
    """See [Note: released parameters read as empty]: between uses a parameter of a chunk this rank does not
    keep is an empty tensor, as stock's, and its values come back with its chunk (before: it was a view of
    zero bytes, and reading it killed the rank with a segfault: DeepSpeed's harness then hung)."""
    reads = run_ranks(_read_between_uses, 2, str(tmp_path), timeout=120)
    shapes = [(32, 16), (32,), (16, 32), (16,), (4, 16), (4,)]
    for read, losses in reads:
        assert all(same and status == "NOT_AVAILABLE" for _, _, same, status in read), read
        assert all(a in (s, (0,)) and b == a for (a, b, *_), s in zip(read, shapes)), read
        assert losses[0] == losses[1], losses  # the loaded model trains on from the same weights
    assert any((0,) in (r[0] for r in read) for read, _ in reads)  # some parameter was released somewhere
