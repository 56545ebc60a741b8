"""ds_patrickstar.Init: models built straight into chunks (see [Note: deferred init] in init.py)."""
import math
import os
import sys

import pytest
import torch
from multiproc import run_ranks

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

from gpt_model import GPT, GPTConfig

TINY = GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=32, vocab_size=128)


def _config(chunk_size, dtype="bf16"):
    cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": "patrickstar", "chunk_size": chunk_size},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def _build_and_read(rank, world_size, chunk_size, seed):
    import deepspeed

    import ds_patrickstar

    cfg = _config(chunk_size)
    torch.manual_seed(1000 + rank)  # the global RNG differs per rank: Init must not depend on it
    with ds_patrickstar.Init(config=cfg, seed=seed):
        model = GPT(TINY)
    assert all(p.is_meta for p in model.parameters())
    engine, *_ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
    manager = engine.optimizer.manager
    foreign_materialized = [c.is_materialized for c in manager.map.chunks if not manager.map.is_owned(c)]
    lp = {k: v.float() for k, v in engine.module.state_dict().items()}
    fp32 = engine.get_fp32_state_dict()
    x = torch.randint(0, TINY.vocab_size, (2, 16), generator=torch.Generator().manual_seed(rank))
    _, loss = engine(x, x)
    engine.backward(loss)
    engine.step()
    return {"lp": lp, "fp32": fp32, "foreign_materialized": foreign_materialized,
            "chunks": len(manager.map.chunks), "loss": loss.item()}


def test_same_seed_same_model_on_1_2_3_ranks_and_any_chunk_size():
    single = run_ranks(_build_and_read, 1, 4096, 7)[0]
    for world_size, chunk_size in ((2, 2048), (3, 8192)):
        results = run_ranks(_build_and_read, world_size, chunk_size, 7)
        for rank, result in enumerate(results):
            assert not any(result["foreign_materialized"]), "another rank's chunk was materialized"
            for key, value in single["lp"].items():
                assert torch.equal(result["lp"][key], value), (world_size, rank, key)
            for key, value in single["fp32"].items():
                assert torch.equal(result["fp32"][key], value), (world_size, rank, key)
            assert math.isfinite(result["loss"])
    assert single["chunks"] != results[0]["chunks"]


def _gpt_under(init, seed=3):
    torch.manual_seed(seed)
    with init:
        return GPT(TINY)


def _initialize(model, cfg):
    import deepspeed

    import ds_patrickstar  # noqa: F401

    engine, *_ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
    return engine


def test_distributions_follow_the_modules_own_init(dist):
    import ds_patrickstar

    engine = _initialize(_gpt_under(ds_patrickstar.Init()), _config(4096, "fp32"))
    weights = engine.get_fp32_state_dict()
    # GPT._init_weights: normal(0, 0.02) for Linear/Embedding weights, zero biases; LayerNorm's own reset_parameters
    assert abs(weights["blocks.0.mlp.c_fc.weight"].std().item() - 0.02) < 0.002
    assert abs(weights["wte.weight"].std().item() - 0.02) < 0.002
    assert torch.equal(weights["blocks.0.mlp.c_fc.bias"], torch.zeros(4 * TINY.n_embd))
    assert torch.equal(weights["blocks.1.ln_2.weight"], torch.ones(TINY.n_embd))
    assert engine.module.lm_head.weight is engine.module.wte.weight  # still tied
    # distinct modules draw distinct values
    assert not torch.equal(weights["blocks.0.attn.c_proj.weight"], weights["blocks.1.attn.c_proj.weight"])


def test_reset_parameters_distribution_and_frozen_parameter(dist):
    import ds_patrickstar

    torch.manual_seed(0)
    with ds_patrickstar.Init():
        model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 4))
    model[2].bias.requires_grad_(False)
    engine = _initialize(model, _config(4096, "fp32"))
    weight = engine.get_fp32_state_dict()["0.weight"]
    bound = 1 / math.sqrt(256)  # nn.Linear.reset_parameters: kaiming_uniform(a=sqrt(5)) -> U(-1/sqrt(fan_in), ..)
    assert weight.abs().max().item() <= bound
    assert abs(weight.std().item() - bound / math.sqrt(3)) < 0.05 * bound
    frozen = model[2].bias  # in a frozen chunk, its values from its module's own init (see [Note: frozen chunks])
    assert not frozen.is_meta and not engine.optimizer.chunk_map.info(frozen).trainable
    assert frozen.abs().max().item() <= 1 / math.sqrt(512) and frozen.abs().sum() > 0


def test_meta_device_model_equals_init_model_with_the_same_seed(dist):
    import ds_patrickstar

    with_init = _initialize(_gpt_under(ds_patrickstar.Init(seed=5)), _config(4096)).module.state_dict()
    torch.manual_seed(5)
    with torch.device("meta"):
        model = GPT(TINY)
    on_meta = _initialize(model, _config(4096)).module.state_dict()
    for key, value in with_init.items():
        assert torch.equal(on_meta[key], value), key


def test_no_init_model_keeps_its_values_and_disabled_init_is_a_no_op(dist):
    import ds_patrickstar

    model = _gpt_under(ds_patrickstar.Init(enabled=False))
    assert not any(p.is_meta for p in model.parameters())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    after = _initialize(model, _config(4096, "fp32")).module.state_dict()
    for key, value in before.items():
        assert torch.equal(after[key], value), key


def test_nesting_and_config_checks():
    import ds_patrickstar

    with ds_patrickstar.Init(seed=1):
        with ds_patrickstar.Init(seed=2):
            inner = torch.nn.Linear(2, 2)
        outer = torch.nn.Linear(2, 2)
    after = torch.nn.Linear(2, 2)
    assert inner.weight.is_meta and outer.weight.is_meta and not after.weight.is_meta
    with pytest.raises(ValueError, match="stage 'patrickstar' only"):
        ds_patrickstar.Init(config={"zero_optimization": {"stage": 3}})


def test_meta_buffers_are_refused(dist):
    class WithBuffer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
            self.register_buffer("scale", torch.ones(4))

        def forward(self, x):
            return self.lin(x) * self.scale

    with torch.device("meta"):
        model = WithBuffer()
    with pytest.raises(ValueError, match="buffer scale is on the meta device"):
        _initialize(model, _config(4096, "fp32"))


def test_hugging_face_model_keeps_init_weights_distribution(dist):
    transformers = pytest.importorskip("transformers")
    import ds_patrickstar

    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=32,
                                     initializer_range=0.05)
    torch.manual_seed(0)
    with ds_patrickstar.Init():
        model = transformers.GPT2LMHeadModel(config)
    engine = _initialize(model, _config(4096, "fp32"))
    weights = engine.get_fp32_state_dict()
    assert abs(weights["transformer.h.0.mlp.c_fc.weight"].std().item() - 0.05) < 0.005
    assert torch.equal(weights["transformer.h.0.ln_1.weight"], torch.ones(64))
    x = torch.randint(0, 128, (2, 16))
    loss = engine(input_ids=x, labels=x).loss
    engine.backward(loss)
    engine.step()
    assert math.isfinite(loss.item())
