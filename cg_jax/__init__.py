"""cg_jax: low-latency decoder inference in JAX/XLA.

Public entry points:
  Engine.from_pretrained(path_or_preset, dtype=...), engine.warmup(), engine.generate(...),
  engine.stream(...), engine.logits(...), engine.stats().
"""

from cg_jax.buckets import Buckets
from cg_jax.engine import Engine, EngineConfig, GenerationResult, StreamChunk

__version__ = "0.1.0"

__all__ = ["Buckets", "Engine", "EngineConfig", "GenerationResult", "StreamChunk", "__version__"]
