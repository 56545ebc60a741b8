"""Construction straight into chunks: ``with ds_patrickstar.Init(config=ds_config): model = MyModel()``.

[Note: deferred init]
Inside :class:`Init` every parameter a module registers is replaced at once (torch's global
parameter-registration hook, removed when the block closes) by a parameter on the ``meta``
device (shape, dtype and ``requires_grad`` only, no memory; buffers stay
real, as ``accelerate.init_empty_weights(include_buffers=False)`` does), so a model of any
size is built in no memory and in no time. A model built on the ``meta`` device by other
means (``with torch.device("meta")``) is treated the same way, if its buffers are real.

At ``deepspeed.initialize`` (:class:`DeferredModel`):

1. before DeepSpeed casts the module, each meta parameter is swapped, in every module that
   holds it (tied parameters stay tied) and in the optimizer's param groups, for a parameter
   of the training dtype whose storage is empty;
2. binding (``store/binding.py``) makes it a view of its chunk as usual, but copies nothing
   (``_bind`` there);
3. :meth:`DeferredModel.materialize` then runs, one module at a time, the module's own init
   on a host scratch of that module's parameters (fp32): ``reset_parameters()`` if the
   module has one, then the root model's ``_init_weights(module)`` (the Hugging Face
   convention, also used by ``benchmarks/gpt_model.py``). The RNG is seeded from
   ``(seed, module name)`` and the values are written into the slices of the chunks this
   rank owns; chunks of other ranks are never materialized. Frozen parameters are in chunks
   too (see [Note: frozen chunks]); a deferred parameter in no chunk (not floating point, or
   trainable and in no param group) is materialized whole on every rank.

What "same seed" means: with the same ``seed`` (default: ``torch.initial_seed()`` when the
``Init`` block is entered) the values are the same on any world size and any
``chunk_size``; they are not the values a model built without ``Init`` gets (that one
draws every parameter from one RNG stream in construction order). Init code that runs in
``__init__`` on parameters other than through those two hooks (e.g. a loop over
``named_parameters()`` after construction) acts on meta tensors and is lost: put it in
``_init_weights``.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import threading
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn
from torch.nn.modules.module import register_module_parameter_registration_hook
from torch.utils.hooks import RemovableHandle

from ..chunks.chunk import Chunk
from ..chunks.chunk_map import ChunkMap
from ..disk.config import means_nvme
from ..memory.host_heap import BuildWindow, LargeAllocations, map_large_allocations

logger = logging.getLogger(__name__)

_SEED_ATTR = "_ds_patrickstar_init_seed"  # on the meta parameters Init creates (dropped at the swap)
_STATE = threading.local()


class _RegistrationHook:
    """torch's global parameter-registration hook, installed while any thread has an Init block open."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._users = 0
        self._handle: RemovableHandle | None = None

    def acquire(self) -> None:
        with self._lock:
            self._users += 1
            if self._handle is None:
                # torch annotates the hook as returning None; its documented contract (and code) take
                # a returned parameter as the replacement
                self._handle = register_module_parameter_registration_hook(cast(Callable[..., None], _meta_parameter))

    def release(self) -> None:
        with self._lock:
            self._users -= 1
            if self._users == 0 and self._handle is not None:
                self._handle.remove()
                self._handle = None


def _depth() -> int:
    return getattr(_STATE, "depth", 0)


def _meta_parameter(module: nn.Module, name: str, param: nn.Parameter | None) -> nn.Parameter | None:
    """torch's parameter-registration hook: inside an :class:`Init` block of this thread, the
    parameter a module registers is replaced by a ``meta`` one (returned; None keeps it)."""
    if param is None or param.is_meta or _depth() == 0:
        return None
    meta = type(param)(param.to("meta"), requires_grad=param.requires_grad)
    setattr(meta, _SEED_ATTR, _STATE.seed)
    return meta


_HOOK = _RegistrationHook()


def _config_zero(config: Any) -> dict | None:
    if config is None:
        return None
    if not isinstance(config, dict):
        from deepspeed.runtime.tensor_parallel.init_utils import load_ds_config

        config = load_ds_config(config)
    return config.get("zero_optimization", {})


class Init(contextlib.ContextDecorator):
    """Build a model without materializing it: parameters are created on the ``meta`` device
    and materialized at ``deepspeed.initialize``, each rank only in the chunks it owns; see
    [Note: deferred init].

    ``config``: the DeepSpeed config (dict or path) the model will be trained with; it must
    select stage ``"patrickstar"``. ``enabled=False`` makes the block a no-op. Blocks nest
    (the outermost one's ``seed`` applies). ``seed``: the base seed of the deferred init
    (default: ``torch.initial_seed()``, i.e. what ``torch.manual_seed`` last set).
    """

    def __init__(self, config: Any = None, enabled: bool = True, seed: int | None = None) -> None:
        zero = _config_zero(config)
        stage = None if zero is None else zero.get("stage", 0)
        if stage is not None and stage != "patrickstar":
            raise ValueError(
                f"ds_patrickstar.Init(config=...) got zero_optimization.stage={stage!r}; it builds "
                f"models for stage 'patrickstar' only (use deepspeed.zero.Init for stage 3)"
            )
        if seed is not None and not isinstance(seed, int):
            raise ValueError(f"ds_patrickstar.Init(seed={seed!r}): the seed must be an integer")
        self.enabled = enabled
        self.seed = seed
        self.disk = zero is not None and any(means_nvme(zero.get(k)) for k in ("offload_param", "offload_optimizer"))
        self._large: LargeAllocations | None = None  # the disk tier's threshold while the block is open

    def __enter__(self) -> Init:
        if not self.enabled:
            return self
        if self.disk:  # the construction's freed buffers stay out of the heap: see [Note: host heap]
            self._large = map_large_allocations()
        depth = _depth()
        if depth == 0:
            _STATE.seed = self.seed if self.seed is not None else torch.initial_seed()
            _STATE.window = BuildWindow()  # see [Note: host heap]
            _STATE.window.open()
            _HOOK.acquire()
        _STATE.depth = depth + 1
        return self

    def __exit__(self, *exc: object) -> None:
        large, self._large = self._large, None
        if large is not None:
            large.release()
        if self.enabled:
            _STATE.depth -= 1
            if _STATE.depth == 0:
                _HOOK.release()
                _STATE.window.close()


def _module_seed(base: int, name: str) -> int:
    digest = hashlib.sha256(f"{base}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _storage_less(param: nn.Parameter, dtype: torch.dtype | None) -> nn.Parameter:
    dtype = dtype if dtype is not None and param.is_floating_point() else param.dtype
    data = torch.empty(param.shape, dtype=dtype)
    data.untyped_storage().resize_(0)
    return type(param)(data, requires_grad=param.requires_grad)


class DeferredModel:
    """The meta parameters of one model between ``deepspeed.initialize`` and the chunks; see
    [Note: deferred init]."""

    def __init__(self, module: nn.Module, dtype: torch.dtype | None) -> None:
        self.module = module
        self.swapped: dict[torch.Tensor, nn.Parameter] = {}  # meta -> storage-less
        self.seeds: dict[nn.Parameter, int] = {}  # storage-less -> base seed
        self._values: Callable[[Chunk], torch.Tensor] = Chunk.ready  # see materialize
        for name, buf in module.named_buffers():
            if buf.is_meta:
                raise ValueError(
                    f"buffer {name} is on the meta device, so its values are lost; build the model "
                    f"under ds_patrickstar.Init (which keeps buffers real) instead of torch.device"
                    f"('meta'), or materialize the buffers before deepspeed.initialize"
                )
        default_seed = torch.initial_seed()
        for mod in module.modules():
            for key, param in mod._parameters.items():
                if param is None or not param.is_meta:
                    continue
                if param not in self.swapped:
                    new = _storage_less(param, dtype)
                    self.swapped[param] = new
                    self.seeds[new] = getattr(param, _SEED_ATTR, default_seed)
                mod._parameters[key] = self.swapped[param]
        if self.swapped:
            logger.info("ds_patrickstar: %d parameters built without values (deferred init)", len(self.swapped))

    def __bool__(self) -> bool:
        return bool(self.swapped)

    def is_deferred(self, param: torch.Tensor) -> bool:
        return param in self.seeds

    def remap(self, params: Any) -> Any:
        """``model_parameters`` (tensors or param-group dicts, any iterable) with meta parameters
        replaced by their swapped ones."""
        if params is None or not self.swapped:
            return params
        out = []
        for item in params:
            if isinstance(item, dict):
                item = {
                    **item,
                    "params": self.remap(
                        [item["params"]] if isinstance(item["params"], torch.Tensor) else item["params"]
                    ),
                }
            elif isinstance(item, torch.Tensor):
                item = self.swapped.get(item, item)
            out.append(item)
        return out

    def remap_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        for group in optimizer.param_groups:
            group["params"] = [self.swapped.get(p, p) for p in group["params"]]

    # ---- materialization --------------------------------------------------------------
    @torch.no_grad()
    def materialize(self, chunk_map: ChunkMap, values: Callable[[Chunk], torch.Tensor] = Chunk.ready) -> None:
        """Fill the owned chunk slices (and the whole of non-chunk parameters) from each module's
        own init, one module at a time; see [Note: deferred init]. ``values``: a chunk's values to write
        into (the store's accessor, which reaches the disk tier's records too)."""
        if not self.swapped:
            return
        self._values = values
        owner: dict[nn.Parameter, tuple[str, str]] = {}  # param -> (module name, key) of its first holder
        for mod_name, mod in self.module.named_modules():
            for key, param in mod._parameters.items():
                if param is not None and self.is_deferred(param):
                    owner.setdefault(param, (mod_name, key))
        root_init = getattr(self.module, "_init_weights", None)
        for mod_name, mod in self.module.named_modules():
            mine = [
                (key, p)
                for key, p in mod._parameters.items()
                if p is not None and owner.get(p) == (mod_name, key) and self._wanted(p, chunk_map)
            ]
            if mine:
                self._init_module(mod, mod_name, mine, root_init, chunk_map)
        self.seeds.clear()
        self.swapped.clear()

    def _wanted(self, param: nn.Parameter, chunk_map: ChunkMap) -> bool:
        info = chunk_map.info(param)
        return info is None or chunk_map.owns_any(info)

    def _init_module(self, mod: nn.Module, mod_name: str, mine: list, root_init: Any, chunk_map: ChunkMap) -> None:
        originals = dict(mod._parameters)
        scratch = {  # a chunk parameter's own shape may read empty (see [Note: released parameters read as empty])
            key: nn.Parameter(torch.empty(_shape(p, chunk_map), dtype=torch.float32), requires_grad=p.requires_grad)
            for key, p in originals.items()
            if p is not None and p in self.seeds
        }
        base = self.seeds[mine[0][1]]
        try:
            mod._parameters.update(scratch)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(_module_seed(base, mod_name))
                reset = getattr(mod, "reset_parameters", None)
                if callable(reset):
                    reset()
                if root_init is not None:
                    root_init(mod)
        finally:
            mod._parameters.update(originals)
        for key, param in mine:
            self._write(param, scratch[key], chunk_map)

    def _write(self, param: nn.Parameter, value: torch.Tensor, chunk_map: ChunkMap) -> None:
        info = chunk_map.info(param)
        if info is None:  # in no chunk: whole, on every rank
            param.data = value.detach().to(param.dtype)
            return
        chunk_map.write_pieces(info, value.detach().reshape(-1), self._values)


def _shape(param: nn.Parameter, chunk_map: ChunkMap) -> torch.Size:
    info = chunk_map.info(param)
    return param.shape if info is None else info.shape


def swap_deferred(module: nn.Module, dtype: torch.dtype | None) -> DeferredModel:
    """Swap the meta parameters of ``module`` (see [Note: deferred init]); a no-op object when none."""
    return DeferredModel(module, dtype)
