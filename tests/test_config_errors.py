"""Bad configurations and inputs for stage 'patrickstar' fail early with a message that names the
key, the value and what would work (issue 6). One in-process single-rank world, tiny models."""
from __future__ import annotations

import json
import logging
import math
import re
import types

import harness
import pytest
import torch
from harness import make_config


@pytest.fixture(autouse=True)
def _world():
    harness.ensure_distributed()


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 2))  # 178 params


def _config(optimizer_type="AdamW", **zero) -> dict:
    cfg = make_config("patrickstar", chunk_size=1024, optimizer_type=optimizer_type)
    cfg["zero_optimization"].update(zero)
    return cfg


def _init(config, model=None, **kwargs):
    import deepspeed

    import ds_patrickstar  # noqa: F401

    model = model if model is not None else _model()
    kwargs.setdefault("model_parameters", model.parameters())
    return deepspeed.initialize(model=model, config=config, **kwargs)[0]


def _train_step(engine, nan=False):
    loss = engine(torch.randn(8, 8)).pow(2).mean()
    if nan:
        loss = loss * float("nan")
    engine.backward(loss)
    engine.step()
    return loss.item()


# ---- zero_optimization: our keys ------------------------------------------------------
def test_unknown_key_lists_the_options():
    with pytest.raises(ValueError, match=r"zero_optimization\.chunk_sise=4096 is not an option of stage "
                                         r"'patrickstar'; the options are: chunk_size, "
                                         r".*max_consecutive_skipped_steps"):
        _init(_config(chunk_sise=4096))


@pytest.mark.parametrize("value,why", [
    (4096.5, r"got a number with a fractional part"),
    (1000, r"greater than or equal to 1024"),
    (2**31, r"less than or equal to 2147483647"),
    ("big", r"not a string"),
    ("4096", r"not a string"),  # a quoted number is a mistake too, not silently read as 4096
    (True, r"not a boolean"),
    (None, r"valid integer"),
])
def test_chunk_size_out_of_range_or_not_an_int(value, why):
    with pytest.raises(ValueError, match=rf"zero_optimization\.chunk_size={re.escape(repr(value))} is invalid: "
                                         rf".*{why}.*; use an integer from 1024 to 2147483647"):
        _init(_config(chunk_size=value))


def test_chunk_size_as_json_float_without_fraction_works():
    engine = _init(_config(chunk_size=4096.0))  # JSON configs often write 4e3-style numbers
    assert engine._patrickstar_config.chunk_size == 4096


def test_max_consecutive_skipped_steps_zero():
    with pytest.raises(ValueError, match=r"zero_optimization\.max_consecutive_skipped_steps=0 is invalid: "
                                         r"Input should be greater than or equal to 1; use an integer >= 1"):
        _init(_config(max_consecutive_skipped_steps=0))


def test_lockstep_takes_its_three_words_only():
    from ds_patrickstar.integration.config import parse_patrickstar_options

    with pytest.raises(ValueError, match=r"zero_optimization\.lockstep=True is invalid: Input should be 'on', 'off' "
                                         r"or 'first_steps' \(lockstep: Data parallel: whether the ranks check"):
        parse_patrickstar_options({"stage": "patrickstar", "lockstep": True})
    assert parse_patrickstar_options({"stage": "patrickstar", "lockstep": "first_steps"}).lockstep == "first_steps"


@pytest.mark.parametrize("value", [True, -1, "all", 2.5])
def test_host_adam_in_backward_is_auto_or_chunks(value):
    from ds_patrickstar.integration.config import parse_patrickstar_options

    with pytest.raises(ValueError, match=r'zero_optimization\.host_adam_in_backward=.* is invalid: .*expected "auto" '
                                         r"or a whole number of chunks >= 0"):
        parse_patrickstar_options({"stage": "patrickstar", "host_adam_in_backward": value})
    assert parse_patrickstar_options({"stage": "patrickstar", "host_adam_in_backward": 3}).host_adam_in_backward == 3


def test_stage_spelled_in_another_case():
    with pytest.raises(ValueError, match=r"zero_optimization\.stage='PatrickStar': write 'patrickstar' exactly"):
        _init(_config(stage="PatrickStar"))


# ---- zero_optimization: stock keys (see [Note: stock ZeRO keys]) -----------------------
@pytest.mark.parametrize("key,value,why", [
    ("zero_hpz_partition_size", 2, "hierarchical partitioning (hpZ) is not implemented; set it to 1"),
    ("zero_quantized_weights", True, "quantized communication is not implemented (it changes the values sent)"),
    ("zero_quantized_gradients", True, "quantized communication is not implemented (it changes the values sent)"),
    ("load_from_fp32_weights", False, "loads here always restore the fp32 masters; remove it"),
])
def test_stock_key_that_would_change_results_is_an_error(key, value, why):
    with pytest.raises(ValueError, match=rf"zero_optimization\.{key}={value!r} cannot be used with stage "
                                         rf"'patrickstar': {re.escape(why)}"):
        _init(_config(**{key: value}))


# a ZeRO-3 block as OpenRLHF and Hugging Face's template write it, with only the stage changed
STOCK_ZERO3_KEYS = {
    "offload_param": {"device": "cpu", "pin_memory": True},
    "offload_optimizer": {"device": "cpu", "pin_memory": True, "ratio": 0.3},  # ZeRO-Offload++'s partial offload
    "sub_group_size": 1e9,
    "reduce_bucket_size": 5e8,
    "overlap_comm": True,
    "contiguous_gradients": True,
    "stage3_prefetch_bucket_size": 5e7,
    "stage3_param_persistence_threshold": 1e4,
    "stage3_max_live_parameters": 1e9,
    "stage3_max_reuse_distance": 1e9,
    "stage3_gather_16bit_weights_on_model_save": True,
    "zero_hpz_partition_size": 1,
    "zero_quantized_weights": False,
    "zero_quantized_gradients": False,
}


def test_stock_zero3_keys_are_accepted_with_one_info_line(caplog):
    with caplog.at_level(logging.INFO, logger="ds_patrickstar.integration"):
        engine = _init(_config(**STOCK_ZERO3_KEYS))
    ours = [r for r in caplog.records if r.name == "ds_patrickstar.integration.stock_keys"]
    assert [r.levelname for r in ours] == ["INFO"], [r.getMessage() for r in ours]
    said = ours[0].getMessage()
    for key in STOCK_ZERO3_KEYS:  # the persistence threshold is ours (see [Note: persistent chunk groups])
        assert (key in said) is (key != "stage3_param_persistence_threshold"), key
    assert engine.optimizer.options.stage3_param_persistence_threshold == 10_000  # 1e4 read as a count
    assert "offload_param: placement may keep parameters (chunks) in host memory" in said
    # each setting of a "cpu" block says what it does here: the ratio is the placement's to choose
    assert "its ratio: placement chooses how many optimizer states stay on the accelerator" in said
    assert "sub_group_size: optimizer sub-groups are the chunks here (chunk_size)" in said
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and "zero_optimization" in r.getMessage()]
    assert math.isfinite(_train_step(engine))  # and training runs


def test_deepspeeds_offload_device_enum_reads_as_its_value():
    """DeepSpeed's own unit tests (test_zero_tensor_fragment.py) write ``OffloadDeviceEnum.cpu``, a str Enum whose
    ``str()`` is its class name: it reads as "cpu", as a config that went through DeepSpeed's model has it."""
    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum

    from ds_patrickstar.integration.stock_keys import offload_device

    assert offload_device("offload_optimizer", {"device": OffloadDeviceEnum.cpu}) == "cpu"
    assert offload_device("offload_param", {"device": OffloadDeviceEnum.none}) == "none"


def test_offload_device_not_none_cpu_or_nvme_is_an_error():
    with pytest.raises(ValueError, match=r"zero_optimization\.offload_param=\{'device': 'gpu'\}: write a block "
                                         r"with \"device\": \"none\" \(no offload\), \"cpu\""):
        _init(_config(offload_param={"device": "gpu"}))


@pytest.mark.parametrize("figures,said", [
    ({"to_device_bytes_per_s": 0}, r"device_profile\.to_device_bytes_per_s=0 is invalid: Input should be greater "
                                    r"than 0; use a number > 0 \(device_profile\.to_device_bytes_per_s: Copies"),
    ({"host_adam_elements_per_s": "fast"}, r"device_profile\.host_adam_elements_per_s='fast' is invalid: expected"),
    ({"host_adam_elements_per_s": True}, r"device_profile\.host_adam_elements_per_s=True is invalid: expected"),
    ({"to_device_GBps": 55}, r"device_profile\.to_device_GBps=55 is not an option of zero_optimization\."
                             r"device_profile; the options are: device_adam_elements_per_s, host_adam_elements_per_s"),
])
def test_device_profile_figures_are_positive_numbers_under_their_names(figures, said):
    from ds_patrickstar.integration.config import parse_patrickstar_options

    with pytest.raises(ValueError, match=rf"zero_optimization\.{said}"):
        parse_patrickstar_options({"stage": "patrickstar", "device_profile": figures})


def test_device_profile_figures_given_replace_those_measured():
    """[Note: device profile]: on the emulated accelerator the H100's figures, each one given in its place."""
    from ds_patrickstar.integration.config import ProfileFigures
    from ds_patrickstar.integration.device_profile import device_profile
    from ds_patrickstar.memory.emulated import EmulatedAccelerator
    from ds_patrickstar.placement.step_time import H100_PROFILE, DeviceProfile

    accel = EmulatedAccelerator(1 << 20)
    given = device_profile(accel, ProfileFigures(host_adam_elements_per_s=1e9))
    assert given.host_adam_elements_per_s == 1e9 and given.to_device_bytes_per_s == H100_PROFILE.to_device_bytes_per_s
    every = {"to_device_bytes_per_s": 1.0, "to_host_bytes_per_s": 2.0, "host_adam_elements_per_s": 3.0,
             "device_adam_elements_per_s": 4.0}
    assert device_profile(accel, ProfileFigures(**every)) == DeviceProfile(**every)


@pytest.mark.parametrize("key,value", [("device_budget", "4GB"), ("device_budget", "4GiB"), ("keep_gathered", "1 MiB")])
def test_sizes_accept_units(key, value):
    from ds_patrickstar.integration.config import parse_patrickstar_options

    options = parse_patrickstar_options({"stage": "patrickstar", key: value})
    assert getattr(options, key) == {"4GB": 4 * 10**9, "4GiB": 4 * 2**30, "1 MiB": 2**20}[value]


@pytest.mark.parametrize("value", ["4XB", "lots", [4]])
def test_a_size_that_is_not_one_gets_one_message(value):
    from ds_patrickstar.integration.config import parse_patrickstar_options

    with pytest.raises(ValueError) as err:
        parse_patrickstar_options({"stage": "patrickstar", "device_budget": value})
    said = str(err.value)
    assert said.count("zero_optimization.device_budget=") == 1, said  # one message, not one per int | float
    assert said.startswith(f"zero_optimization.device_budget={value!r} is invalid"), said
    if isinstance(value, str):
        assert f"{value!r} is not a size; write e.g. 4GiB" in said


# ---- optimizer ------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["SGD", "Lamb", "OneBitAdam"])
def test_config_optimizer_other_than_adam(kind):
    with pytest.raises(ValueError, match=rf"optimizer\.type='{kind}' is not supported by stage 'patrickstar', "
                                         r"which updates parameters with its own fused Adam: "
                                         r"use \"type\": \"Adam\" or \"AdamW\""):
        _init(_config(optimizer_type=kind))


def test_config_optimizer_type_case_insensitive_as_in_deepspeed():
    assert type(_init(_config(optimizer_type="adamw"))).__name__ == "PatrickStarEngine"


@pytest.mark.parametrize("flag", ["amsgrad", "maximize"])
def test_config_adam_flag(flag):
    cfg = _config()
    cfg["optimizer"]["params"][flag] = True
    with pytest.raises(ValueError, match=rf"optimizer\.params\.{flag}=True is not supported by stage "
                                         r"'patrickstar'; remove it or set it to false"):
        _init(cfg)


def test_client_adagrad():
    model = _model()
    with pytest.raises(ValueError, match=r"supports Adam, AdamW and SGD only, got optimizer Adagrad\. Use \"type\": "
                                         r"\"Adam\" or \"AdamW\" in the optimizer block, or pass torch\.optim\.Adam, "
                                         r"torch\.optim\.AdamW or torch\.optim\.SGD"):
        _init(_config(optimizer_type=None), model, optimizer=torch.optim.Adagrad(model.parameters(), lr=0.1))


def test_client_sgd_differentiable():
    model = _model()
    with pytest.raises(ValueError, match=r"SGD\(differentiable=True\) is not supported by stage 'patrickstar'"):
        _init(_config(optimizer_type=None), model,
              optimizer=torch.optim.SGD(model.parameters(), lr=0.1, differentiable=True))


def test_client_adam_amsgrad():
    model = _model()
    with pytest.raises(ValueError, match=r"Adam\(amsgrad=True\) is not supported by stage 'patrickstar'; "
                                         r"set amsgrad=False"):
        _init(_config(optimizer_type=None), model,
              optimizer=torch.optim.Adam(model.parameters(), lr=0.1, amsgrad=True))


def test_no_optimizer_at_all_is_a_reference_model(caplog):
    """No optimizer block and no optimizer=: every parameter frozen into frozen chunks, said once (see
    [Note: engine without an optimizer]; tests/test_zero3_api.py checks its forwards against ZeRO-3)."""
    with caplog.at_level(logging.INFO, logger="ds_patrickstar.integration.stage_answers"):
        engine = _init(_config(optimizer_type=None))
    assert "no optimizer: the 4 parameters that required gradients are frozen" in caplog.text
    assert not any(p.requires_grad for p in engine.module.parameters())
    with torch.no_grad():
        assert torch.isfinite(engine(torch.randn(8, 8))).all()


# ---- model and parameters -------------------------------------------------------------
NO_TRAINABLE = r"the model has no trainable parameters \(requires_grad=True\); stage 'patrickstar' has nothing"


def test_model_with_only_frozen_parameters():
    model = _model()
    model.requires_grad_(False)
    with pytest.raises(ValueError, match=NO_TRAINABLE):
        _init(_config(), model)


def test_model_without_parameters():
    with pytest.raises(ValueError, match=NO_TRAINABLE):  # not torch's "optimizer got an empty parameter list"
        _init(_config(), torch.nn.ReLU(), model_parameters=None)


def test_model_parameters_that_are_not_the_models():
    model, other = _model(), torch.nn.Linear(3, 5)
    with pytest.raises(ValueError, match=r"optimizer param group 0 holds a tensor of shape \(5, 3\) that is not a "
                                         r"parameter of the model; pass model_parameters=model\.parameters\(\)"):
        _init(_config(), model, model_parameters=list(model.parameters()) + [other.weight])


def test_non_float_trainable_parameter():
    # torch refuses requires_grad on integer tensors, but allows it on complex ones
    model = _model()
    model.phase = torch.nn.Parameter(torch.zeros(4, dtype=torch.complex64))
    with pytest.raises(ValueError, match=r"parameter phase has dtype torch\.complex64; only floating point "
                                         r"parameters can be trained: make it float or set requires_grad=False"):
        _init(_config(), model)


# ---- where the config comes from ------------------------------------------------------
def test_config_in_args_and_config_argument(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(_config()))
    with pytest.raises(ValueError, match=r"a DeepSpeed config was given both as args\.deepspeed_config and as "
                                         r"config=; give one"):
        _init(_config(), args=types.SimpleNamespace(deepspeed_config=str(path)))


def test_json_path_config_works(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(_config(chunk_size=2048)))
    engine = _init(str(path))
    assert type(engine).__name__ == "PatrickStarEngine" and engine._patrickstar_config.chunk_size == 2048
    engine = _init(None, args=types.SimpleNamespace(deepspeed_config=str(path)))
    assert type(engine).__name__ == "PatrickStarEngine"


def test_missing_json_path_is_deepspeeds_error(tmp_path):
    missing = str(tmp_path / "nope.json")
    with pytest.raises(ValueError, match=rf"Expected a string path to an existing deepspeed config.*"
                                         rf"{re.escape(missing)}"):
        _init(missing)


# ---- training-time errors -------------------------------------------------------------
def test_every_loss_nan_stops_after_max_consecutive_skipped_steps():
    engine = _init(_config(max_consecutive_skipped_steps=3))
    for _ in range(2):
        _train_step(engine, nan=True)
    assert engine.skipped_steps == 2
    with pytest.raises(RuntimeError, match=r"^3 consecutive steps were skipped because the gradients were not "
                                           r"finite .*raise zero_optimization\.max_consecutive_skipped_steps "
                                           r"\(now 3\)"):
        _train_step(engine, nan=True)


def test_one_nan_step_is_skipped_and_training_continues():
    engine = _init(_config(max_consecutive_skipped_steps=3))
    losses = [_train_step(engine, nan=(i == 1)) for i in range(5)]
    assert math.isnan(losses[1]) and all(math.isfinite(x) for i, x in enumerate(losses) if i != 1)
    assert engine.skipped_steps == 1
    assert engine.optimizer.consecutive_skipped_steps == 0
    assert all(torch.isfinite(v).all() for v in engine.get_fp32_state_dict().values())


def test_two_nan_runs_below_the_limit_do_not_add_up():
    engine = _init(_config(max_consecutive_skipped_steps=3))
    for nan in (True, True, False, True, True, False):
        _train_step(engine, nan=nan)
    assert engine.skipped_steps == 4


def test_load_checkpoint_from_empty_dir(tmp_path, caplog):
    engine = _init(_config())
    with caplog.at_level(logging.WARNING):
        assert engine.load_checkpoint(str(tmp_path)) == (None, None)  # as stock: a warning, nothing loaded
    assert f"no checkpoint loaded: there is no 'latest' file at {tmp_path / 'latest'}" in caplog.text


def test_load_checkpoint_missing_tag(tmp_path):
    engine = _init(_config())
    with pytest.raises(ValueError, match=r"checkpoint tag 'global_step7' does not exist in "):
        engine.load_checkpoint(str(tmp_path), tag="global_step7")


def test_a_model_parallel_mpu_is_refused_naming_it():
    """Files and swap folders are keyed by data-parallel rank only (issue 32, item 4): a Megatron-style
    mpu with model parallelism is refused before anything is built; the model keeps its tensors."""
    mpu = types.SimpleNamespace(get_model_parallel_world_size=lambda: 2)
    model = _model()
    before = [(p.data_ptr(), p.detach().clone()) for p in model.parameters()]
    with pytest.raises(ValueError, match=r"mpu=\.\.\.\) with a model-parallel world size of 2 .* pass no mpu"):
        _init(_config(), model=model, mpu=mpu)
    assert all(p.data_ptr() == ptr and torch.equal(p, v) for p, (ptr, v) in zip(model.parameters(), before))


def test_a_trainable_parameter_in_no_param_group_is_named_in_a_warning(caplog):
    """It is never updated (issue 32, item 3): initialize says which, and how to include or freeze it."""
    model = _model()
    with caplog.at_level(logging.WARNING):
        engine = _init(_config(), model=model, model_parameters=model[0].parameters())
    warned = [r.getMessage() for r in caplog.records if "in no optimizer param group" in r.getMessage()]
    assert len(warned) == 1 and "2.weight, 2.bias" in warned[0] and "2 trainable" in warned[0], warned
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        _init(_config())  # every parameter in the optimizer: no warning
    assert not [r for r in caplog.records if "in no optimizer param group" in r.getMessage()]
    engine.destroy()
