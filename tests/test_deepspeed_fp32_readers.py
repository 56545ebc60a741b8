"""DeepSpeed's own fp32 readers (``deepspeed.utils.zero_to_fp32``) on stage "patrickstar" checkpoints, with
stock ZeRO-3's checkpoint of the same training (seed, data, steps) as the oracle; a stock folder still goes to
stock's function. See [Note: DeepSpeed's fp32 readers] (ds_patrickstar/integration/fp32_readers.py)."""
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from multiproc import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOL = dict(rtol=1e-5, atol=1e-6)  # fp32 on the CPU, as test_checkpoint.py and test_vs_zero3.py
VOCAB, HID, STEPS = 24, 16, 3


class TiedFrozen(torch.nn.Module):
    """A head tied to the embedding (unless ``tied=False``), a frozen layer, a float and an integer buffer."""

    def __init__(self, tied=True):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, HID)
        self.mid = torch.nn.Linear(HID, HID)
        self.frozen = torch.nn.Linear(HID, HID)
        self.norm = torch.nn.LayerNorm(HID)
        self.head = torch.nn.Linear(HID, VOCAB, bias=False)
        if tied:
            self.head.weight = self.embed.weight
        self.frozen.requires_grad_(False)
        self.register_buffer("scale", torch.full((HID,), 0.5))
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))

    def forward(self, tok, y):
        h = self.embed(tok) * self.scale
        h = h + F.gelu(self.mid(h)) + self.frozen(h)
        return F.cross_entropy(self.head(self.norm(h)).view(-1, VOCAB), y.view(-1))


def _model(tied=True):
    torch.manual_seed(0)
    return TiedFrozen(tied)


def _save(rank, world_size, ckpt_dir, stage, tied=True):
    import deepspeed

    import ds_patrickstar  # noqa: F401

    zero = {"stage": stage, "chunk_size": 1024} if stage == "patrickstar" else {"stage": stage}
    cfg = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": zero, "gradient_clipping": 1.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}}
    model = _model(tied)
    engine = deepspeed.initialize(model=model, config=cfg,
                                  model_parameters=[p for p in model.parameters() if p.requires_grad])[0]
    gen = torch.Generator().manual_seed(1)  # the same batches on every rank and for both stages
    for _ in range(STEPS):
        tok, y = torch.randint(0, VOCAB, (4, 6), generator=gen), torch.randint(0, VOCAB, (4, 6), generator=gen)
        loss = engine(tok, y)
        engine.backward(loss)
        engine.step()
    engine.save_checkpoint(ckpt_dir)


def _saved_pair(tmp_path, world_size, tied=True):
    ours, stock = tmp_path / "ours", tmp_path / "stock"
    run_ranks(_save, world_size, str(ours), "patrickstar", tied, timeout=300)
    run_ranks(_save, world_size, str(stock), 3, tied, timeout=300)
    return str(ours), str(stock)


def _same(got, want):
    """Same names, dtypes and shapes, values within the fp32 tolerance, tied names one tensor where stock's are."""
    assert list(sorted(got)) == list(sorted(want))
    for name, value in want.items():
        assert got[name].shape == value.shape, name
        if got[name].dtype != value.dtype:  # DeepSpeed 0.19.6's reader casts integer buffers to float (0.19.8 not)
            assert not got[name].is_floating_point() and value.dtype == torch.float32, name
        torch.testing.assert_close(got[name].to(value.dtype), value, **TOL, msg=name)
    if "head.weight" in want:
        assert (got["head.weight"] is got["embed.weight"]) == (want["head.weight"] is want["embed.weight"])


@pytest.mark.parametrize("world_size", [1, 2])
def test_deepspeeds_reader_reads_ours_as_it_reads_zero3(tmp_path, world_size):
    ours, stock = _saved_pair(tmp_path, world_size)
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint as read

    want = read(stock)
    assert want["head.weight"] is want["embed.weight"] and "frozen.weight" in want  # what the oracle holds
    for folder in (ours, stock):  # the model file names the tied weights as stock's stage 3 does, and only them
        tag = open(os.path.join(folder, "latest")).read().strip()
        model_file = next(f for f in sorted(os.listdir(os.path.join(folder, tag))) if f.endswith("model_states.pt"))
        state = torch.load(os.path.join(folder, tag, model_file), weights_only=False)
        assert state["shared_params"] == {"head.weight": "embed.weight"}, (folder, state["shared_params"])
    _same(read(ours), want)
    _same(read(ours, exclude_frozen_parameters=True), read(stock, exclude_frozen_parameters=True))
    assert "frozen.weight" not in read(ours, exclude_frozen_parameters=True)
    tag = open(os.path.join(ours, "latest")).read().strip()
    _same(read(ours, tag), want)  # the tag given positionally, as stock's convert_* passes it
    lazy = read(ours, tag=tag, lazy_mode=True)  # a lazy caller turns each value into a tensor with .contiguous()
    _same({name: value.contiguous() for name, value in lazy.items()}, want)

    from deepspeed.utils.zero_to_fp32 import load_state_dict_from_zero_checkpoint

    loaded = load_state_dict_from_zero_checkpoint(_model(), ours).state_dict()
    for name, value in want.items():
        torch.testing.assert_close(loaded[name].to(value.dtype), value, **TOL, msg=name)


def _written(folder):
    """The state dict in what convert_* wrote into ``folder`` (every shard), and its file names."""
    from safetensors.torch import load_file

    state = {}
    names = sorted(os.listdir(folder))
    for name in names:
        path = os.path.join(folder, name)
        if name.endswith(".safetensors"):
            state.update(load_file(path))
        elif name.endswith(".bin"):
            state.update(torch.load(path, weights_only=True))
        else:
            assert name.endswith(".index.json"), name
            assert set(json.load(open(path))["weight_map"].values()) <= set(names)
    return state, names


def test_deepspeeds_convert_writes_for_ours_what_it_writes_for_zero3(tmp_path):
    ours, stock = _saved_pair(tmp_path, 1, tied=False)  # safetensors refuses tied names (stock's and ours alike)
    from deepspeed.utils import zero_to_fp32

    want = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(stock)
    runs = [(zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict, {}),
            (zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict, {"max_shard_size": "3KB"}),  # shards, an index
            (zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict, {"exclude_frozen_parameters": True}),
            (zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict, {"safe_serialization": True})]
    if hasattr(zero_to_fp32, "convert_zero_checkpoint_to_state_dict"):  # DeepSpeed >= 0.19.8
        runs.append((zero_to_fp32.convert_zero_checkpoint_to_state_dict, {"dtype": "bf16", "max_shard_size": None}))
    for i, (convert, options) in enumerate(runs):
        convert(ours, str(tmp_path / f"ours_{i}"), **options)
        convert(stock, str(tmp_path / f"stock_{i}"), **options)
        (got, got_files), (expected, expected_files) = (_written(tmp_path / f"{n}_{i}") for n in ("ours", "stock"))
        assert got_files == expected_files, options
        _same(got, expected)
        if options in ({}, {"max_shard_size": "3KB"}, {"safe_serialization": True}):
            _same(got, want)
    assert len(_written(str(tmp_path / "ours_1"))[1]) > 2, "the 3KB run wrote no shards: the check needs them"


_STOCK_ONLY = """import os, sys, torch
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
assert "ds_patrickstar" not in sys.modules and not hasattr(get_fp32_state_dict_from_zero_checkpoint,
                                                             "_ds_patrickstar_reads_ours")
torch.save(get_fp32_state_dict_from_zero_checkpoint(sys.argv[1]), sys.argv[2])
"""

_AFTER_IMPORT = """import site, sys, torch
site.addsitedir(sys.argv[1])  # as site-packages: runs ds_patrickstar_autoload.pth
import deepspeed
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint, load_state_dict_from_zero_checkpoint
assert getattr(get_fp32_state_dict_from_zero_checkpoint, "_ds_patrickstar_reads_ours", False)
torch.save(get_fp32_state_dict_from_zero_checkpoint(sys.argv[2]), sys.argv[3])
"""


def _python(script, *args, **env):
    run = subprocess.run([sys.executable, "-c", script, *map(str, args)], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "PYTHONPATH": ROOT, **env}, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]


def test_a_stock_folder_reads_as_without_ds_patrickstar_and_a_later_import_sees_the_wrapper(tmp_path):
    ours, stock = _saved_pair(tmp_path, 1)
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint as read

    assert getattr(read, "_ds_patrickstar_reads_ours", False)  # the stock folder below goes through the wrapper
    _python(_STOCK_ONLY, stock, tmp_path / "stock.pt", DS_PATRICKSTAR_AUTOLOAD="0")
    before, now = torch.load(tmp_path / "stock.pt", weights_only=True), read(stock)
    assert list(now) == list(before) and all(torch.equal(now[n], before[n]) for n in before)
    assert (now["head.weight"] is now["embed.weight"]) and (before["head.weight"] is before["embed.weight"])

    site_dir = tmp_path / "site"
    site_dir.mkdir()
    with open(os.path.join(ROOT, "ds_patrickstar_autoload.pth")) as f:
        (site_dir / "ds_patrickstar_autoload.pth").write_text(f.read())
    _python(_AFTER_IMPORT, site_dir, ours, tmp_path / "ours.pt", DS_PATRICKSTAR_AUTOLOAD="1")
    _same(torch.load(tmp_path / "ours.pt", weights_only=True), read(ours))
