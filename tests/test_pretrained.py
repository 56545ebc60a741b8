"""ds_patrickstar.load_pretrained: checkpoint files streamed into the owned chunks."""
import json
import os
import sys

import pytest
import torch
from multiproc import run_ranks

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

from gpt_model import GPT, GPTConfig

TINY = GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=32, vocab_size=128)


def _config(dtype, chunk_size=2048):
    cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": "patrickstar", "chunk_size": chunk_size},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def _engine_under_init(build, cfg):
    import deepspeed

    import ds_patrickstar

    torch.manual_seed(123)  # other values than the checkpoint's
    with ds_patrickstar.Init(config=cfg):
        model = build()
    engine, *_ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
    return engine


def _reference(seed=0):
    torch.manual_seed(seed)
    return GPT(TINY)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_torch_save_file_into_an_init_model(dist, tmp_path, dtype):
    import ds_patrickstar

    ref = _reference()
    path = str(tmp_path / "weights.pt")
    torch.save(ref.state_dict(), path)
    engine = _engine_under_init(lambda: GPT(TINY), _config(dtype))
    result = ds_patrickstar.load_pretrained(engine, path)
    assert result.missing_keys == [] and result.unexpected_keys == []
    masters = engine.get_fp32_state_dict()
    lp = engine.module.state_dict()
    for key, value in ref.named_parameters():
        assert torch.equal(masters[key], value.detach()), key  # the masters keep the checkpoint's fp32 precision
    for key, value in ref.state_dict().items():
        assert torch.equal(lp[key], value.to(lp[key].dtype)), key


def test_strict_reports_missing_and_unexpected_keys(dist, tmp_path):
    import ds_patrickstar

    state = _reference().state_dict()
    state["extra.weight"] = torch.zeros(3)
    del state["ln_f.bias"]
    path = str(tmp_path / "weights.pt")
    torch.save(state, path)
    engine = _engine_under_init(lambda: GPT(TINY), _config("fp32"))
    with pytest.raises(ValueError, match=r"missing keys \['ln_f.bias'\], unexpected keys \['extra.weight'\]"):
        ds_patrickstar.load_pretrained(engine, path)
    result = ds_patrickstar.load_pretrained(engine, path, strict=False)
    assert result.missing_keys == ["ln_f.bias"] and result.unexpected_keys == ["extra.weight"]


def test_module_load_state_dict_keeps_fp32_masters(dist):
    ref = _reference()
    engine = _engine_under_init(lambda: GPT(TINY), _config("bf16"))
    engine.module.load_state_dict(ref.state_dict())
    masters = engine.get_fp32_state_dict()
    for key, value in ref.named_parameters():
        assert torch.equal(masters[key], value.detach()), key


def _load_on_rank(rank, world_size, path):
    import ds_patrickstar

    engine = _engine_under_init(lambda: GPT(TINY), _config("fp32"))
    ds_patrickstar.load_pretrained(engine, path)
    manager = engine.optimizer.manager
    assert not any(c.is_materialized for c in manager.map.chunks if not manager.map.is_owned(c))
    return engine.get_fp32_state_dict()


def test_two_ranks_each_keep_what_they_own(tmp_path):
    ref = _reference()
    path = str(tmp_path / "weights.pt")
    torch.save(ref.state_dict(), path)
    for weights in run_ranks(_load_on_rank, 2, path):
        for key, value in ref.named_parameters():
            assert torch.equal(weights[key], value.detach()), key


def _save_bin_shards(model, folder, per_shard=8):
    """The legacy Hugging Face layout (``pytorch_model-0000i-of-0000n.bin`` + index), which
    transformers >= 5 no longer writes."""
    items = list(model.state_dict().items())
    shards = [items[i:i + per_shard] for i in range(0, len(items), per_shard)]
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"pytorch_model-{i + 1:05d}-of-{len(shards):05d}.bin"
        torch.save({k: v.clone() for k, v in shard}, os.path.join(folder, name))
        weight_map.update({k: name for k, _ in shard})
    with open(os.path.join(folder, "pytorch_model.bin.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


@pytest.mark.parametrize("layout", ["safetensors", "bin"])
def test_hugging_face_sharded_folder(dist, tmp_path, layout):
    transformers = pytest.importorskip("transformers")
    import ds_patrickstar

    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=32)
    torch.manual_seed(0)
    ref = transformers.GPT2LMHeadModel(config)
    if layout == "safetensors":
        ref.save_pretrained(tmp_path, max_shard_size="50KB")
        assert os.path.isfile(tmp_path / "model.safetensors.index.json"), sorted(os.listdir(tmp_path))
    else:
        _save_bin_shards(ref, str(tmp_path))
    engine = _engine_under_init(lambda: transformers.GPT2LMHeadModel(config), _config("fp32"))
    ds_patrickstar.load_pretrained(engine, str(tmp_path))
    masters = engine.get_fp32_state_dict()
    for key, value in ref.named_parameters():
        assert torch.equal(masters[key], value.detach()), key
    x = torch.randint(0, 128, (2, 16))
    ref.eval()
    engine.module.eval()
    with torch.no_grad():
        assert torch.allclose(engine(input_ids=x).logits, ref(input_ids=x).logits, atol=1e-5)


def test_missing_path_is_a_clear_error(dist, tmp_path):
    import ds_patrickstar

    engine = _engine_under_init(lambda: GPT(TINY), _config("fp32"))
    with pytest.raises(ValueError, match="no weights in"):
        ds_patrickstar.load_pretrained(engine, str(tmp_path))
