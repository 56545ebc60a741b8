"""ds_patrickstar: PatrickStar-style chunk-based memory management as a DeepSpeed backend.

``import ds_patrickstar`` and set ``"zero_optimization": {"stage": "patrickstar"}`` in a
DeepSpeed config; see README.md.

The sub-packages, bottom to top; each imports only from those below it (``tests/test_layers.py``
checks it):

* ``chunks``: the layout, chunks, tensor states and the chunk map (no memory of its own);
* ``memory``: accelerator primitives and the strict CPU twin, the device ledger, the host pool, the
  pre-flight arithmetic;
* ``disk``: the disk tier (spilled optimizer states, frozen chunks on disk, their files and I/O, its
  config and set-up);
* ``store``: the chunk store (where each chunk's values live: accelerator, host or disk record) and
  binding parameters to chunks;
* ``placement``: the memory tracer, the placement policy, the runtime that carries it out;
* ``activations``: activation offload (saved tensors and held inputs to host memory and back);
* ``groups``: collectives and chunk groups (gather, keep, prefetch, release, reduce-scatter), the
  chunk manager: the core runtime, also with one rank;
* ``optim``: Adam math, kernels, optimizer states, per-chunk Adam;
* ``io``: checkpoints, state-dict streaming, ``Init``, ``load_pretrained``;
* ``integration``: DeepSpeed registration, config, engine, ZeRO-optimizer adapter, assembly,
  hooks, Hugging Face.

``counters`` (the per-step counters) and ``autograd_state`` (is a backward running?) are leaf
modules every layer may import; ``plan``, ``zero_to_fp32`` and ``__main__`` (``python -m ds_patrickstar
SCRIPT``) are the command-line entry points. ``ds_patrickstar_autoload`` (a top-level module, installed
with a ``.pth`` file) imports this package when DeepSpeed is imported.
"""

from .chunks.state import ChunkState, IllegalTransition, TensorState
from .integration import jit_builds
from .integration.config import PatrickStarConfig
from .integration.engine import PatrickStarEngine, gathered_parameters
from .integration.registration import install
from .io.checkpoint import consolidate_fp32_state_dict
from .io.init import Init
from .io.pretrained import load_pretrained

__all__ = [
    "ChunkState",
    "IllegalTransition",
    "Init",
    "PatrickStarConfig",
    "PatrickStarEngine",
    "TensorState",
    "consolidate_fp32_state_dict",
    "gathered_parameters",
    "install",
    "load_pretrained",
]
__version__ = "0.1.0"

install()
jit_builds.report_stale_locks(jit_builds.default_extensions_dir())  # see [Note: JIT build folder]
