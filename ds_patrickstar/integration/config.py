"""The ``zero_optimization`` block of a DeepSpeed config with ``"stage": "patrickstar"``.

[Note: config split]
DeepSpeed's own config model rejects a string stage and unknown zero keys, and its
engine compares the stage numerically. So :func:`split_config` validates our keys with
:class:`PatrickStarConfig`, and hands DeepSpeed a sanitized copy of the user's dict in
which ``zero_optimization`` is ``{"stage": 0}`` (plus the user's ``leaf_module`` block, which
DeepSpeed's engine applies to the model as for any stage: see [Note: leaf modules]). The engine
then runs DeepSpeed's stage-0 code paths for everything that is not ZeRO (precision flags, batch sizes, LR
schedulers, monitors, checkpoint layout) and our optimizer for the rest. The user's
original dict stays visible as ``engine.config``.
"""

from __future__ import annotations

import copy
import logging
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic.fields import FieldInfo
from pydantic_core import ErrorDetails

from ..disk.config import NvmeOffload, check_same_folder, means_nvme, parse_nvme, tier_settings
from .optimizer_keys import check_optimizer_block
from .sizes import parse_bytes
from .stock_keys import log_accepted
from .stock_keys import meaning as stock_keys_meaning

logger = logging.getLogger(__name__)

STAGE_NAME: Literal["patrickstar"] = "patrickstar"
DEFAULT_CHUNK_SIZE = 32 * 1024 * 1024

_OFFLOAD_BLOCKS = ("offload_param", "offload_optimizer")
# stock's short names of keys that are ours under their stage3_ names
_STOCK_ALIASES = {
    "param_persistence_threshold": "stage3_param_persistence_threshold",
    "model_persistence_threshold": "stage3_model_persistence_threshold",
}


class ProfileFigures(BaseModel):
    """``device_profile``: figures the step-time model prices a step with in place of those measured at
    initialize (see [Note: device profile]); each one left out is measured (on a GPU) or the H100's (on the
    emulated accelerator)."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    to_device_bytes_per_s: float | None = Field(default=None, gt=0)
    """Copies from pinned host memory to the accelerator, bytes per second (an H100 measured 5.4e10)."""
    to_host_bytes_per_s: float | None = Field(default=None, gt=0)
    """Copies from the accelerator to pinned host memory, bytes per second."""
    host_adam_elements_per_s: float | None = Field(default=None, gt=0)
    """The host Adam kernel, elements per second on this host's cores (an H100 machine's 16: 5.4e9)."""
    device_adam_elements_per_s: float | None = Field(default=None, gt=0)
    """The accelerator's Adam kernel, elements per second."""

    @field_validator("*", mode="before")
    @classmethod
    def _a_number(cls, value: Any) -> Any:
        if isinstance(value, (bool, str)):
            raise ValueError(f"expected a positive number (such as 5.4e10), not {value!r}")
        return value


class PatrickStarConfig(BaseModel):
    """Options of the patrickstar backend, set inside ``zero_optimization``."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    stage: Literal["patrickstar"] = STAGE_NAME
    """Selects this backend. Any other stage runs stock DeepSpeed untouched."""

    chunk_size: int = Field(default=DEFAULT_CHUNK_SIZE, ge=1024, le=2**31 - 1)
    """Elements per chunk (not bytes). Parameters are packed into chunks of this many
    elements; a tensor larger than a chunk gets a chunk of its own, sized to fit. Larger
    chunks mean fewer, bigger transfers; smaller chunks let placement use memory more
    finely. 1M-64M is the useful range."""

    keep_gathered: int | None = Field(default=None, ge=0)
    """Data parallel: bytes (or a size such as "2GiB") of gathered chunk-group storage (the other
    ranks' chunks and the place this rank's chunk takes among them) that may stay gathered after a chunk group's
    forward use, until its backward use (and between gradient-accumulation micro-steps), instead
    of being released and all-gathered again. None (default): as much as the memory holds. On a
    run without placement that is decided from the host memory the ranks of this host share: each
    rank's share is the available memory at initialize divided by the ranks on the host
    (LOCAL_WORLD_SIZE / LOCAL_SIZE), and half of what is left of it after everything a step
    allocates with no group kept (the planner's model data per rank, the groups in use and
    prefetched, gradient-accumulation buffers, gradients, a tenth of the model data and 0.5 GiB of
    non-model memory) may stay gathered; near the cap that is nothing (release after use). When
    it covers every group, every group stays (as ZeRO-3's defaults
    keep every parameter of a model under 1e9 elements gathered: one all-gather per group and
    step, the full low-precision model on each rank), else the kept bytes are limited to it (the
    same limit on every rank; see [Note: default kept groups from host memory]). With placement,
    as many as the device budget holds beside the tide, agreed by the ranks once per step
    (placement releases the oldest kept groups before it would fail for lack of room). 0: release
    after the forward use (least memory, about twice the all-gather volume). An explicit value
    always wins. The groups kept are the last ones of the forward pass, the first ones backward
    needs."""

    prefetch_groups: int = Field(default=1, ge=0, le=8)
    """Data parallel: chunk groups all-gathered ahead of use, asynchronously, in the order the
    previous step gathered them, and waited on just before use; with placement only when they fit
    the budget without evicting anything. 0: every all-gather waits at the moment of use."""

    stage3_param_persistence_threshold: int = Field(default=100_000, ge=0)
    """Data parallel without a device budget (ranks on the host): a chunk group whose tensors all have at most
    this many elements stays gathered between steps, all-gathered again after each update, so its parameters
    read their full values between iterations, as ZeRO-3's persistent parameters do (``ds_persist`` True;
    DeepSpeed's default, 1e5, here too; the alias ``param_persistence_threshold`` works). Groups holding a
    larger tensor are released as before. With a device budget (every GPU run) placement decides what stays
    gathered and this key does nothing (see [Note: persistent chunk groups])."""

    stage3_model_persistence_threshold: int = Field(default=2**63 - 1, ge=0)
    """With ``stage3_param_persistence_threshold``: the most elements the persistent groups hold in all, in
    group order (DeepSpeed's default: no limit)."""

    max_consecutive_skipped_steps: int = Field(default=50, ge=1)
    """A run of this many consecutive skipped steps (non-finite gradients: an inf/NaN loss, or
    fp16 overflow that lowering the loss scale does not cure) ends training with an error."""

    placement: Literal["auto", "static"] = "auto"
    """How chunks are placed between the accelerator and the host. "auto": tide-aware (a warm-up
    iteration traces the activation memory; chunks fill what it leaves, evicting by farthest
    next use and prefetching the next moment's chunks; optimizer states of the chunks that fit
    are updated on the accelerator, the rest on the host). "static": a fixed fraction of the
    chunks stays on the accelerator (like ZeRO-3 offload), all optimizer states on the host."""

    device_budget: int | float | None = None
    """Accelerator memory ds_patrickstar may use for model data plus activations: bytes (an
    integer, or a size such as "4GiB" or "4GB") or a fraction of the device's total memory (a number
    in (0, 1]). Default: the GPU's free memory at initialize (``torch.cuda.mem_get_info``: the CUDA
    context and other processes already taken out) less a 1 GiB reserve for what comes later (NCCL's buffers, cuBLAS
    workspaces, allocator rounding). Required with emulate_accelerator (a fraction then means of
    the host's memory)."""

    static_fraction: float = Field(default=0.5, ge=0.0, le=1.0)
    """With placement "static": the fraction of chunks that always stays on the accelerator."""

    host_budget: int | float | None = None
    """With the disk tier (``offload_optimizer: {"device": "nvme"}``): host memory the model data may
    keep in RAM, bytes (an integer, or a size such as "64GiB") or a fraction of the host's total
    memory (a number in (0, 1]); the optimizer states of the chunks that do not fit go to disk.
    Default: the host's available memory at initialize less a margin of 10% of its total memory (at
    least 1 GiB) for activations, the framework and the page cache, divided among the ranks on this
    host."""

    offload_optimizer: NvmeOffload | None = None
    """The disk tier, from DeepSpeed's ``offload_optimizer`` block with ``"device": "nvme"`` and its
    ``aio`` block (see [Note: disk tier configuration]); None: no disk tier."""

    offload_param: NvmeOffload | None = None
    """The disk tier, from DeepSpeed's ``offload_param`` block with ``"device": "nvme"``: frozen chunks
    that ``host_budget`` cannot hold live on disk (see [Note: frozen chunks on disk]); with
    ``offload_optimizer`` too, both name the same ``nvme_path``."""

    offload_activations: Literal["none", "all", "auto"] | None = None
    """What autograd saves inside the model's blocks (the entries of its longest ModuleList or
    Sequential, e.g. the transformer layers; with activation checkpointing, what the checkpoints
    keep) moves to pinned host memory once forward is past the block, and comes back, ahead of use,
    in backward (see [Note: activation offload]). "none": activations stay on the accelerator (a
    budget the chunks cannot fit beside them is refused, naming the remedies). "all": every
    block's, every step. "auto": the fewest bytes that let the chunks fit beside the traced tide
    under device_budget (see [Note: auto activation offload]); the traced iteration offloads the
    blocks that may not fit (see [Note: the traced iteration's offload]). Left out: "auto" (the plan
    offloads nothing where nothing is needed; see [Note: activations by default]). Needs placement (a
    CUDA device or emulate_accelerator)."""

    overlap_host_adam: bool = True
    """The CPU Adam of the chunks whose optimizer states live on the host runs on a worker thread,
    in the order the next forward needs the chunks, and the next forward waits per chunk for its
    update instead of the whole step waiting for the last one; exact, with gradient clipping too
    (see [Note: overlapped host Adam]). false: every chunk is updated before ``step()`` returns.
    Needs placement (a CUDA device or emulate_accelerator); without it no chunk is updated on the host."""

    host_adam_in_backward: Literal["auto"] | int = "auto"
    """With ``overlap_host_adam``: the host updates that may begin during backward, once a chunk's final gradient
    is on the host, into spare buffers (the chunk's capacity times 12 B plus the parameters' bytes, kept on the
    host), kept at ``step()`` where the step neither clipped nor was skipped and nothing they read changed, else
    redone: exact (see [Note: host updates in backward]). An integer: at most that many chunks a step; 0: none.
    "auto": while the host worker is idle, with spare sets in at most a quarter of the available host memory;
    none with the disk tier (its host memory is budgeted)."""

    optimizer_placement: Literal["time", "fill"] = "time"
    """With placement "auto": how many of the chunks whose optimizer states fit on the accelerator (beside
    the traced tide) keep them there. "time" (default): as many as the step-time model predicts fastest, from
    none to all of them, so that the room goes to low-precision payloads where that saves more transfers
    than updating on the accelerator saves (see [Note: optimizer states by step time]), at any number of
    ranks, with or without gradient accumulation. "fill": all of them."""

    lockstep: Literal["on", "off", "first_steps"] = "on"
    """Data parallel: whether the ranks check, before each chunk-group collective, that every rank is
    about to issue the same one, so that ranks running different modules raise an error naming the
    module instead of hanging or mixing data (see [Note: ranks in lockstep]). "on" (default): always.
    "first_steps": during the first three optimizer steps only, then no cost. "off": never (as stock
    ZeRO-3), and no gloo side group is made (with NCCL, no gloo networking). Its cost is the
    ``lockstep_checks`` and ``agreement_seconds`` counters (see [Note: lockstep modes])."""

    device_profile: ProfileFigures | None = None
    """With placement: the step-time model's figures (bandwidth each way, the host and the accelerator Adam's
    rates) given instead of measured at initialize, any of them (see [Note: device profile]): for a machine
    whose probe misreads, or to price the emulated accelerator as another GPU would be. Left out: measured on
    a GPU (about 0.1 s at initialize), an H100's on the emulated accelerator."""

    emulate_accelerator: bool = False
    """On a CPU-only machine, run the placement machinery against an emulated accelerator of
    device_budget bytes: separate buffers, real copies, an enforced budget. For testing."""

    leaf_module: dict[str, Any] | None = None
    """Leaf modules, as DeepSpeed reads them for ZeRO-3. ``classes`` (class names,
    plain or qualified), ``names`` (module names as ``named_modules()`` gives them) and
    ``name_suffixes`` (the ends of such names); a string counts as a list of one. A leaf module's
    whole subtree is gathered at its forward on every rank and its gradients are reduced at the end
    of its backward, zero for what a rank did not run: for mixture-of-experts blocks whose ranks
    route their tokens to different experts (see [Note: leaf modules]).
    ``deepspeed.utils.set_z3_leaf_modules(model, [cls])`` before ``deepspeed.initialize`` does the
    same from code. Left out: DeepSpeed's default classes (the sparse MoE blocks of Hugging Face's
    Mixtral, Qwen2-MoE and Qwen3-MoE); ``{"classes": []}``: none."""

    @property
    def nvme(self) -> NvmeOffload | None:
        """The disk tier's settings, when either offload block turns it on (see [Note: disk tier configuration])."""
        return tier_settings(self.offload_optimizer, self.offload_param)

    def ineffective_keys(self, placement_runs: bool) -> list[str]:
        """The keys the user set that do nothing in a run with (or without) placement: placement runs
        on a CUDA device or with ``emulate_accelerator``; ``static_fraction`` only with ``placement:
        "static"``."""
        set_keys = self.model_fields_set
        idle = ["host_budget"] if self.nvme is None and "host_budget" in set_keys else []
        if not self.overlap_host_adam and "host_adam_in_backward" in set_keys:
            idle.append("host_adam_in_backward")  # the updates begin on the host worker
        return idle + self._idle_placement_keys(placement_runs, set_keys)

    def _idle_placement_keys(self, placement_runs: bool, set_keys: set[str]) -> list[str]:
        if not placement_runs:
            keys = (
                "placement",
                "static_fraction",
                "device_budget",
                "offload_activations",
                "overlap_host_adam",
                "host_adam_in_backward",
                "device_profile",
            )
            return [k for k in (*keys, "optimizer_placement") if k in set_keys]
        idle = ("static_fraction",) if self.placement == "auto" else ("optimizer_placement", "device_profile")
        return [key for key in idle if key in set_keys]

    @field_validator("host_adam_in_backward", mode="before")
    @classmethod
    def _chunks_or_auto(cls, value: Any) -> Any:
        if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
            return value
        raise ValueError(f'expected "auto" or a whole number of chunks >= 0 (0: none), not {value!r}')

    @field_validator("leaf_module", mode="before")
    @classmethod
    def _leaf_module(cls, value: Any) -> Any:
        """Checked by DeepSpeed's own model of the block; kept as written, for DeepSpeed to apply."""
        if value is None:
            return value
        from deepspeed.runtime.zero.leaf_module_config import DeepSpeedZeroLeafModuleConfig

        try:
            DeepSpeedZeroLeafModuleConfig.model_validate(value)
        except ValidationError as err:
            said = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'the block'}: {e['msg']}" for e in err.errors())
        except TypeError as err:
            said = str(err)
        else:
            return value
        raise ValueError(
            f'{said}; write {{"classes": [...], "names": [...], "name_suffixes": [...]}} (lists of strings)'
        )

    @field_validator("device_budget", "host_budget", "keep_gathered", mode="before")
    @classmethod
    def _size_text(cls, value: Any) -> Any:
        """Bytes may be written as a size: "4GiB", "4GB", "512MiB" (see :func:`parse_bytes`)."""
        if isinstance(value, bool):
            raise ValueError('expected bytes (an integer, or a size such as "4GiB"), not a boolean')
        return parse_bytes(value) if isinstance(value, str) else value

    @field_validator("device_budget", "host_budget")
    @classmethod
    def _budget(cls, value: Any) -> Any:
        if isinstance(value, float) and not 0.0 < value <= 1.0:
            raise ValueError("a fraction of the memory must be in (0, 1]; for bytes write an integer")
        if isinstance(value, int) and value < 2**12:
            raise ValueError("a budget in bytes must be at least 4 KiB (4096); for a fraction write e.g. 0.5")
        return value

    @field_validator(
        "chunk_size",
        "max_consecutive_skipped_steps",
        "prefetch_groups",
        "stage3_param_persistence_threshold",
        "stage3_model_persistence_threshold",
        mode="before",
    )
    @classmethod
    def _a_number(cls, value: Any) -> Any:
        # pydantic would read "4096" as 4096 and True as 1: a quoted number or a flag here is a mistake
        if isinstance(value, (bool, str)):
            raise ValueError(
                f"expected an integer (a JSON number, not {'a boolean' if isinstance(value, bool) else 'a string'})"
            )
        return value


def _field_at(loc: list[str]) -> tuple[type[BaseModel], FieldInfo | None]:
    """The model holding the last key of ``loc`` (a block such as ``device_profile`` has its own) and its field."""
    model: type[BaseModel] = PatrickStarConfig
    for depth, part in enumerate(loc):
        field = model.model_fields.get(part)
        if field is None or depth == len(loc) - 1:
            return model, field
        nested = [t for t in get_args(field.annotation) if isinstance(t, type) and issubclass(t, BaseModel)]
        if not nested:
            return model, field
        model = nested[0]
    return model, None


def _describe(error: ErrorDetails) -> str:
    loc = [str(p) for p in error["loc"] if p not in ("int", "float")]  # int | float: the key, not the member
    key = ".".join(loc) or "zero_optimization"
    value = error.get("input")
    model, field = _field_at(loc)
    if error["type"] == "extra_forbidden":
        allowed = ", ".join(sorted(model.model_fields))
        where = "stage 'patrickstar'" if model is PatrickStarConfig else f"zero_optimization.{'.'.join(loc[:-1])}"
        return f"zero_optimization.{key}={value!r} is not an option of {where}; the options are: {allowed}"
    if field is None:
        return f"zero_optimization.{key}={value!r}: {error['msg']}"
    low = next((m.ge for m in field.metadata if hasattr(m, "ge")), None)
    high = next((m.le for m in field.metadata if hasattr(m, "le")), None)
    kind = "an integer" if field.annotation is int else "a number"
    use = f"; use {kind} {f'>= {low}' if high is None else f'from {low} to {high}'}" if low is not None else ""
    above = next((m.gt for m in field.metadata if hasattr(m, "gt")), None)
    use = use or (f"; use a number > {above}" if above is not None else "")
    doc = " ".join((field.description or "").split()).split(". ")[0].rstrip(".")
    msg = error["msg"].removeprefix("Value error, ")
    return f"zero_optimization.{key}={value!r} is invalid: {msg}{use} ({key}: {doc})"


def parse_patrickstar_options(zero_block: dict[str, Any], aio: dict[str, Any] | None = None) -> PatrickStarConfig:
    """Validate our keys; stock keys that would change results raise, the others are accepted with one info
    line (see [Note: stock ZeRO keys]); ``offload_optimizer``
    with ``"device": "nvme"`` (and DeepSpeed's top-level ``aio`` block) set up the disk tier."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    stock_keys = set(DeepSpeedZeroConfig.model_fields)
    stock_keys |= {f.alias for f in DeepSpeedZeroConfig.model_fields.values() if f.alias}
    ours: dict[str, Any] = {}
    accepted: dict[str, str] = {}  # stock keys and what they do here (see [Note: stock ZeRO keys])
    for key, value in zero_block.items():
        key = _STOCK_ALIASES.get(key, key)
        if key in _OFFLOAD_BLOCKS and means_nvme(value):
            ours[key] = parse_nvme(value, aio, key)
        elif key in stock_keys and (key in _OFFLOAD_BLOCKS or key not in PatrickStarConfig.model_fields):
            accepted[key] = stock_keys_meaning(key, value)
        else:
            ours[key] = value  # ours, or unknown: refused below naming the options
    log_accepted(accepted)
    check_same_folder(ours.get("offload_optimizer"), ours.get("offload_param"))
    try:
        return PatrickStarConfig(**ours)
    except ValidationError as err:
        # one message per key: a value that fits no member of a union (int | float) fails each of them
        first = {str(e["loc"][:1]): e for e in reversed(err.errors())}
        raise ValueError("; ".join(_describe(e) for e in reversed(first.values()))) from None


def is_patrickstar(config: dict[str, Any]) -> bool:
    zero = config.get("zero_optimization")
    stage = zero.get("stage") if isinstance(zero, dict) else None
    if isinstance(stage, str) and stage != STAGE_NAME and stage.strip().lower() == STAGE_NAME:
        raise ValueError(
            f"zero_optimization.stage={stage!r}: write {STAGE_NAME!r} exactly (lower case) to select this backend"
        )
    return stage == STAGE_NAME


def split_config(config: dict[str, Any]) -> tuple[PatrickStarConfig, dict[str, Any]]:
    """Return our options and the sanitized dict DeepSpeed sees; see [Note: config split]."""
    aio = config.get("aio") if isinstance(config.get("aio"), dict) else None
    options = parse_patrickstar_options(config["zero_optimization"], aio)
    check_optimizer_block(config)
    sanitized = copy.deepcopy(config)
    sanitized["zero_optimization"] = {"stage": 0}
    if options.leaf_module is not None:  # DeepSpeed's engine marks the leaf modules (see [Note: leaf modules])
        sanitized["zero_optimization"]["leaf_module"] = copy.deepcopy(options.leaf_module)
    return options, sanitized
