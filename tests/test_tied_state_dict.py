"""State dicts of models whose parameters have several names, on 2 real ranks (gloo).

A tied embedding / LM head (GPT-2's ``lm_head.weight`` is ``transformer.wte.weight``) and a
parameter shared by two modules appear in ``state_dict()`` once per name. Every entry must be
a copy: an entry that is a view into a chunk is read after the chunk is released on the
rank that does not own it (garbage or a SIGSEGV). Each test first checks that no entry
aliases chunk memory (so a regression fails with a message, not a crash), then the values.
"""
import os

import pytest
import torch
from multiproc import run_ranks


class _Tied(torch.nn.Module):
    """Embedding and LM head share one Parameter; 1272 elements in 2 chunks of <= 1024."""

    def __init__(self):
        super().__init__()
        self.wte = torch.nn.Embedding(50, 16)
        self.body = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 50, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, ids):
        return self.head(torch.tanh(self.body(self.wte(ids))))


class _Shared(torch.nn.Module):
    """One Linear's weight used by a second Linear (two modules, one Parameter)."""

    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(16, 32)
        self.inner = torch.nn.Linear(32, 32)
        self.second = torch.nn.Linear(32, 32)
        self.second.weight = self.inner.weight
        self.out = torch.nn.Linear(32, 4)

    def forward(self, x):
        return self.out(self.second(torch.tanh(self.inner(torch.tanh(self.first(x))))))


_MODELS = {"tied": _Tied, "shared": _Shared}


def _engine(kind):
    import deepspeed

    import ds_patrickstar  # noqa: F401

    torch.manual_seed(0)
    model = _MODELS[kind]()
    cfg = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": "patrickstar", "chunk_size": 1024},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    return deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())[0]


def _step(engine, kind, rank):
    gen = torch.Generator().manual_seed(10 + rank)
    if kind == "tied":
        ids = torch.randint(0, 50, (4, 6), generator=gen)
        loss = torch.nn.functional.cross_entropy(engine(ids).flatten(0, 1), ids.flatten())
    else:
        loss = (engine(torch.randn(4, 16, generator=gen)) ** 2).mean()
    engine.backward(loss)
    engine.step()


def _chunk_aliases(engine, state_dict):
    storages = {c.payload.untyped_storage()._cdata for c in engine.optimizer.manager.map.chunks}
    return sorted(k for k, v in state_dict.items() if v.untyped_storage()._cdata in storages)


def _state_dicts(rank, world_size, kind, ckpt_dir):
    import ds_patrickstar

    engine = _engine(kind)
    _step(engine, kind, rank)
    names = [n for n, _ in engine.module.named_parameters(remove_duplicate=False)]
    sd = engine.module.state_dict()
    aliases = _chunk_aliases(engine, sd)
    if aliases:  # reading them would touch released chunk memory
        raise AssertionError(f"rank {rank}: state_dict entries {aliases} are views into chunk memory, not copies")
    sd = {k: v.clone() for k, v in sd.items()}  # read only now, after the check
    fp32 = engine.get_fp32_state_dict()
    with ds_patrickstar.gathered_parameters(engine):
        gathered = {n: p.detach().clone() for n, p in engine.module.named_parameters(remove_duplicate=False)}
    engine.save_checkpoint(ckpt_dir)
    # a load through the module: perturb, load the saved copies back, read again
    engine.module.load_state_dict({k: v + 1.0 for k, v in sd.items()})
    after_perturb = {k: v.clone() for k, v in engine.module.state_dict().items()}
    engine.module.load_state_dict(sd)
    reloaded = engine.module.state_dict()
    if _chunk_aliases(engine, reloaded):
        raise AssertionError(f"rank {rank}: state_dict after load_state_dict returns chunk views")
    return {"names": names, "sd": sd, "fp32": fp32, "gathered": gathered, "perturbed": after_perturb,
            "reloaded": {k: v.clone() for k, v in reloaded.items()},
            "resumed": _resume(rank, world_size, kind, ckpt_dir)}


def _resume(rank, world_size, kind, ckpt_dir):
    engine = _engine(kind)
    engine.load_checkpoint(ckpt_dir)
    sd = engine.module.state_dict()
    if _chunk_aliases(engine, sd):
        raise AssertionError(f"rank {rank}: state_dict after load_checkpoint returns chunk views")
    return {k: v.clone() for k, v in sd.items()}


@pytest.mark.parametrize("kind", ["tied", "shared"])
def test_every_name_of_a_shared_parameter_is_a_full_copy_on_every_rank(kind, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    ranks = run_ranks(_state_dicts, 2, kind, ckpt)
    alias = {"tied": ("wte.weight", "head.weight"), "shared": ("inner.weight", "second.weight")}[kind]
    for out in ranks:
        assert set(alias) <= set(out["names"]) and set(out["names"]) <= set(out["sd"])
        # the two names hold the same (trained, so non-initial) values, equal to the fp32 master
        assert torch.equal(out["sd"][alias[0]], out["sd"][alias[1]])
        for name in out["names"]:
            assert torch.equal(out["sd"][name], out["fp32"][name]), name
            assert torch.equal(out["gathered"][name], out["sd"][name]), name
            assert torch.equal(out["perturbed"][name], out["sd"][name] + 1.0), name
            assert torch.equal(out["reloaded"][name], out["sd"][name]), name
    for name in ranks[0]["sd"]:
        assert torch.equal(ranks[0]["sd"][name], ranks[1]["sd"][name]), name
    # the model file DeepSpeed writes holds both names with the trained values, and a resume
    # (on 2 ranks, and on 1) gives them back exactly
    tag = open(os.path.join(ckpt, "latest")).read().strip()
    module = torch.load(os.path.join(ckpt, tag, "mp_rank_00_model_states.pt"), weights_only=False)["module"]
    for name in alias:
        assert torch.equal(module[name], ranks[0]["sd"][name]), name
    resumed = [out["resumed"] for out in ranks]
    if kind == "tied":  # and resharded to one rank
        resumed += run_ranks(_resume, 1, kind, ckpt)
    for out in resumed:
        for name, value in ranks[0]["sd"].items():
            assert torch.equal(out[name], value), name


def _train_losses(rank, world_size, chunk_size):
    import deepspeed

    import ds_patrickstar  # noqa: F401

    torch.manual_seed(0)
    model = _Tied()
    cfg = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": "patrickstar", "chunk_size": chunk_size},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    engine = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())[0]
    losses = []
    gen = torch.Generator().manual_seed(10 + rank)
    for _ in range(3):
        ids = torch.randint(0, 50, (4, 6), generator=gen)
        loss = torch.nn.functional.cross_entropy(engine(ids).flatten(0, 1), ids.flatten())
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def test_tied_head_regathering_a_released_group_keeps_ranks_in_step():
    """All parameters in rank 0's chunk (rank 1 owns an empty padding chunk): the group is released
    after the body's forward and gathered again for the tied head. The tensor states must come out
    the same on both ranks, or one rank releases (and later gathers) where the other does not: a hang."""
    one_group = run_ranks(_train_losses, 2, 2048, timeout=90)
    two_chunks = run_ranks(_train_losses, 2, 1024, timeout=90)
    for ours, ref in zip(one_group, two_chunks):
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(ref), rtol=1e-5, atol=1e-6)
