"""The one registration point: ``import ds_patrickstar`` wraps ``deepspeed.initialize``.

[Note: registration]
:func:`install` replaces the attribute ``deepspeed.initialize`` with a wrapper, once. The
wrapper resolves the config exactly as DeepSpeed does (``config``, ``config_params`` or
``args.deepspeed_config``; a dict or a JSON path). Any config whose
``zero_optimization.stage`` is not ``"patrickstar"`` goes to the original function with
the original arguments, untouched. Code that did ``from deepspeed import initialize``
before importing ds_patrickstar keeps the original function, so import ds_patrickstar
first. For a "patrickstar" run the wrapper also adapts the ZeRO stage accelerate copied out
of the config (see [Note: accelerate's zero_stage]) and, with more than one rank, has Hugging
Face's ``generate`` keep the ranks together (see [Note: generation in step]). A single process started without a
launcher gets the environment ``torch.distributed`` needs (see [Note: no launcher]). A
"patrickstar" initialize that fails leaves the model as it was (see
[Note: initialize as a transaction]); one that succeeds has the process wait at exit for gloo's
worker threads to let go of the last collective (see [Note: gloo workers idle at exit]).

The same call installs the only other four wrappers ds_patrickstar puts on another library,
each a no-op for every other stage: DeepSpeed's ``get_fp32_state_dict_from_zero_checkpoint`` reads a
checkpoint folder of this stage with our reader, and with it stock's ``convert_*`` and
``load_state_dict_from_zero_checkpoint``, which call it by name (see [Note: DeepSpeed's fp32 readers] in
fp32_readers.py); DeepSpeed's ``clone_tensors_for_torch_save`` returns our
``state_dict`` host copies as they are, so tied weights stay one tensor through accelerate's
save path (see [Note: tied weights saved once]); Hugging Face's ``deepspeed_init`` refuses an
evaluation-only run of a "patrickstar" config with what to do instead (see
[Note: evaluation without training]); ``deepspeed.checkpointing.configure`` reads the
``activation_checkpointing`` block of a "patrickstar" config from its sanitized copy (see
[Note: DeepSpeed's checkpointing configured from our config]). And two for DeepSpeed's ``zero.Init`` (see
[Note: stock zero.Init] in stock_zero_init.py): ``Init.__new__`` routes a construction whose config selects
"patrickstar" to ``ds_patrickstar.Init`` (any other goes to stock's constructor), and a "patrickstar"
initialize that took over a model stock's ``zero.Init`` partitioned puts torch's ``F.linear`` back where
stock's ``zero.Init`` left its replacement.

[Note: conformance stage rewrite]
Test-only: with ``DS_PATRICKSTAR_CONFORMANCE_STAGE=patrickstar`` in the environment, the wrapper
reads a config whose ``zero_optimization.stage`` is ``3`` as if it said ``"patrickstar"`` (on a
copy; the caller's dict is untouched). That is how ``benchmarks/conformance.py`` runs DeepSpeed's
own ZeRO-3 unit tests for our stage: the variable reaches the ranks those tests start through a
multiprocessing forkserver, where a conftest cannot. Nothing else reads it; unset (as in any
real run), every config goes through as written.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

import deepspeed
import torch

from .config import is_patrickstar, split_config
from .ds_checkpointing import configure_from_our_config
from .fp32_readers import read_ours_in_deepspeeds_readers
from .hf_compat import accelerate_num_processes, adapt_accelerate, synchronize_generation, unsynchronize_generation
from .hf_eval import guard_eval_only
from .launch_env import fill_single_process_env
from .process_exit import register_wait_at_exit
from .save_compat import keep_host_copies
from .stock_zero_init import our_init, take_over_stock_model

logger = logging.getLogger(__name__)

_MARK = "_ds_patrickstar_wrapper"
CONFORMANCE_ENV = "DS_PATRICKSTAR_CONFORMANCE_STAGE"  # see [Note: conformance stage rewrite]


def _resolve_config(args: Any, config: Any, config_params: Any) -> Any:
    if config is None and config_params is not None:
        config = config_params
    from_args = getattr(args, "deepspeed_config", None)
    if from_args is not None:
        if config is not None:
            raise ValueError("a DeepSpeed config was given both as args.deepspeed_config and as config=; give one")
        config = from_args
    return config


def _load(config: Any) -> Any:
    if config is None or isinstance(config, dict):
        return config
    from deepspeed.runtime.tensor_parallel.init_utils import load_ds_config

    return load_ds_config(config)


def conformance_stage(config: Any) -> Any:
    """``config`` with stage 3 read as "patrickstar" when the test-only variable asks for it; see
    [Note: conformance stage rewrite]."""
    if os.environ.get(CONFORMANCE_ENV) != "patrickstar" or not isinstance(config, dict):
        return config
    zero = config.get("zero_optimization")
    if not isinstance(zero, dict) or zero.get("stage") != 3:
        return config
    logger.info("ds_patrickstar: %s=patrickstar: stage 3 run as stage 'patrickstar' (test-only)", CONFORMANCE_ENV)
    return {**config, "zero_optimization": {**zero, "stage": "patrickstar"}}


def _initialize_patrickstar(
    user_config: dict,
    args=None,
    model=None,
    optimizer=None,
    model_parameters=None,
    training_data=None,
    lr_scheduler=None,
    distributed_port=deepspeed.TORCH_DISTRIBUTED_DEFAULT_PORT,
    mpu=None,
    dist_init_required=None,
    collate_fn=None,
    mesh_param=None,
):
    from deepspeed import comm as dist
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.config import DeepSpeedConfig

    from .engine import PatrickStarEngine
    from .planning import check_values_held
    from .take_over import take_over
    from .transaction import ModelState, roll_back

    if model is None:
        raise ValueError("deepspeed.initialize requires a model")
    if isinstance(model, deepspeed.PipelineModule) or mesh_param is not None:
        raise ValueError("stage 'patrickstar' supports data parallelism only (no pipeline or mesh parallelism)")
    options, sanitized = split_config(user_config)
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError(
            "the model has no trainable parameters (requires_grad=True); stage 'patrickstar' has nothing to train"
        )
    take_over(model)  # see [Note: a second initialize on a live model]
    check_values_held(model)
    if not dist.is_initialized():
        fill_single_process_env()  # see [Note: no launcher]
    dist.init_distributed(
        dist_backend=get_accelerator().communication_backend_name(),
        distributed_port=distributed_port,
        dist_init_required=dist_init_required,
    )
    if take_over_stock_model(model):  # built under stock's zero.Init: see [Note: stock zero.Init]
        _restore_torch_linear()
    _warn_if_world_lost(dist.get_world_size())  # before DeepSpeed's batch-size check can fail on it
    refuse_model_parallelism(mpu)

    config_class = DeepSpeedConfig(sanitized, mpu)
    saved = ModelState.of(model, optimizer)  # see [Note: initialize as a transaction]
    # built in two steps so that a failed __init__ leaves an engine to tear down
    engine = PatrickStarEngine.__new__(PatrickStarEngine)
    try:
        PatrickStarEngine.__init__(
            engine,
            args=args,
            model=model,
            optimizer=optimizer,
            model_parameters=model_parameters,
            training_data=training_data,
            lr_scheduler=lr_scheduler,
            mpu=mpu,
            dist_init_required=dist_init_required,
            collate_fn=collate_fn,
            config=sanitized,
            config_class=config_class,
            patrickstar_config=options,
        )
        engine.config = user_config  # Hugging Face and users read the config they wrote
        adapt_accelerate()  # see [Note: accelerate's zero_stage]
        configure_gc = getattr(engine, "_configure_python_gc", None)  # DeepSpeed >= 0.19.8 (disable_python_gc)
        if configure_gc is not None:
            configure_gc()
        synced = synchronize_generation(model, dist.get_world_size())  # see [Note: generation in step]
        engine.process_effects.record("generate keeps the ranks together", lambda: unsynchronize_generation(synced))
    except BaseException:
        roll_back(engine, saved)
        raise
    register_wait_at_exit()  # see [Note: gloo workers idle at exit]
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler


def model_parallel_size(mpu: Any) -> int:
    """The model-parallel world size of a Megatron-style ``mpu`` (1 without one)."""
    if mpu is None:
        return 1
    for name in ("get_model_parallel_world_size", "get_tensor_model_parallel_world_size"):
        getter = getattr(mpu, name, None)
        if getter is not None:
            return int(getter())
    return 1


def refuse_model_parallelism(mpu: Any) -> None:
    """Stage "patrickstar" keys every file and folder (checkpoints, optimizer states, swap folders)
    by data-parallel rank only: model-parallel ranks would overwrite each other's states."""
    size = model_parallel_size(mpu)
    if size > 1:
        raise ValueError(
            f"deepspeed.initialize(mpu=...) with a model-parallel world size of {size} is not supported by "
            "stage 'patrickstar': its checkpoints, optimizer-state files and swap folders are named by "
            "data-parallel rank only, so model-parallel ranks would overwrite each other's states. Train a "
            "tensor- or pipeline-parallel model with ZeRO stage 1-3, or pass no mpu (data parallelism only)"
        )


def _warn_if_world_lost(world_size: int) -> None:
    """A launcher started several processes but Hugging Face set each up as a single one (on a
    CPU-only machine without being told to use the CPU; stock stage 3 behaves the same)."""
    launched = os.environ.get("WORLD_SIZE", "1")
    seen = accelerate_num_processes()
    if not (
        (seen is not None and seen != world_size) or (launched.isdigit() and int(launched) > 1 and world_size == 1)
    ):
        return
    logger.warning(
        "Hugging Face sees %s process(es) but DeepSpeed's data-parallel world size is %d (WORLD_SIZE=%s): "
        "batch sizes and data sharding are computed for the wrong world. On a CPU-only machine tell "
        "Hugging Face to use the CPU: pass --use_cpu to a Trainer script (TrainingArguments(use_cpu=True, ...) "
        "in code); for accelerate, call PartialState(cpu=True) before Accelerator(...) (see README, Hugging Face).",
        seen if seen is not None else 1,
        world_size,
        launched,
    )


def _restore_torch_linear() -> None:
    """Put torch's ``F.linear`` back where stock's ``zero.Init`` left ``zero3_linear_wrap``."""
    from deepspeed.runtime.zero.linear import zero3_linear_wrap
    from deepspeed.runtime.zero.partition_parameters import InsertPostInitMethodToModuleSubClasses as Patcher

    original = getattr(Patcher, "linear_bk", None)
    if original is not None and torch.nn.functional.linear is zero3_linear_wrap:
        torch.nn.functional.linear = original
        logger.info("ds_patrickstar: torch.nn.functional.linear restored (stock's zero.Init had replaced it)")


def _route_zero_init() -> None:
    """``deepspeed.zero.Init(config_dict_or_path=<a "patrickstar" config>)`` builds with ``ds_patrickstar.Init``;
    see [Note: stock zero.Init]."""
    from deepspeed.runtime.zero.partition_parameters import Init as StockInit

    if getattr(StockInit.__new__, _MARK, False):
        return
    stock_new = StockInit.__new__

    def __new__(cls, *args, **kwargs):
        ours = our_init(StockInit, args, kwargs) if issubclass(cls, StockInit) else None
        if ours is not None:
            return ours  # not a StockInit: Python does not run stock's __init__ on it
        return stock_new(cls) if stock_new is object.__new__ else stock_new(cls, *args, **kwargs)

    setattr(__new__, _MARK, True)
    StockInit.__new__ = staticmethod(__new__)


def install() -> None:
    """Wrap ``deepspeed.initialize`` once; see [Note: registration]."""
    _route_zero_init()  # see [Note: stock zero.Init]
    keep_host_copies()  # see [Note: tied weights saved once]
    guard_eval_only()  # see [Note: evaluation without training]
    configure_from_our_config()  # see [Note: DeepSpeed's checkpointing configured from our config]
    read_ours_in_deepspeeds_readers()  # see [Note: DeepSpeed's fp32 readers]
    original = deepspeed.initialize
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def initialize(
        args=None,
        model=None,
        optimizer=None,
        model_parameters=None,
        training_data=None,
        lr_scheduler=None,
        distributed_port=deepspeed.TORCH_DISTRIBUTED_DEFAULT_PORT,
        mpu=None,
        dist_init_required=None,
        collate_fn=None,
        config=None,
        mesh_param=None,
        config_params=None,
    ):
        loaded = conformance_stage(_load(_resolve_config(args, config, config_params)))
        kwargs = dict(
            args=args,
            model=model,
            optimizer=optimizer,
            model_parameters=model_parameters,
            training_data=training_data,
            lr_scheduler=lr_scheduler,
            distributed_port=distributed_port,
            mpu=mpu,
            dist_init_required=dist_init_required,
            collate_fn=collate_fn,
            mesh_param=mesh_param,
        )
        if not (isinstance(loaded, dict) and is_patrickstar(loaded)):
            return original(**kwargs, config=config, config_params=config_params)
        from deepspeed.runtime.zero import partition_parameters

        partition_parameters.shutdown_init_context()  # as stock's: an open zero.Init block is paused meanwhile
        try:
            return _initialize_patrickstar(loaded, **kwargs)
        finally:
            partition_parameters.restore_init_context()

    setattr(initialize, _MARK, True)
    deepspeed.initialize = initialize
