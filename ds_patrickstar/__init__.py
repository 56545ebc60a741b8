"""ds_patrickstar: PatrickStar-style chunk-based memory management as a DeepSpeed backend.

``import ds_patrickstar`` and set ``"zero_optimization": {"stage": "patrickstar"}`` in a
DeepSpeed config; see README.md.
"""
from .chunk import ChunkState, IllegalTransition, TensorState
from .config import PatrickStarConfig
from .engine import PatrickStarEngine, gathered_parameters
from .init import Init
from .pretrained import load_pretrained
from .registration import install

__all__ = ["ChunkState", "IllegalTransition", "Init", "PatrickStarConfig", "PatrickStarEngine", "TensorState",
           "gathered_parameters", "install", "load_pretrained"]
__version__ = "0.1.0"

install()
