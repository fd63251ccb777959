"""cg_jax: low-latency decoder inference in JAX/XLA.

Public entry points:
  Engine.from_pretrained(path_or_preset, dtype=...), engine.warmup(), engine.generate(...),
  engine.stream(...), engine.logits(...), engine.stats(); a request's SamplingParams (and its
  ParamError); the configuration tree EngineConfig, ForwardConfig and the flash kernel's
  FlashAttentionConfig.
"""

from cg_jax.core.buckets import Buckets
from cg_jax.core.config import EngineConfig, ForwardConfig
from cg_jax.engine import Engine
from cg_jax.generation import GenerationResult, StreamChunk
from cg_jax.kernels.flash_attention import FlashAttentionConfig
from cg_jax.sampling_params import ParamError, SamplingParams

__version__ = "0.1.0"

__all__ = ["Buckets", "Engine", "EngineConfig", "FlashAttentionConfig", "ForwardConfig",
           "GenerationResult", "ParamError", "SamplingParams", "StreamChunk", "__version__"]
