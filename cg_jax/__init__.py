"""cg_jax: low-latency decoder inference in JAX/XLA.

Public entry points:
  Engine.from_pretrained(path_or_preset, dtype=...), engine.warmup(), engine.generate(...),
  engine.stream(...), engine.logits(...), engine.stats(); a request's SamplingParams (and its
  ParamError); the configuration tree EngineConfig, ForwardConfig and the flash kernel's
  FlashAttentionConfig.

They are imported on first use (`import cg_jax` alone imports no jax): `python -m cg_jax serve`
starts its engine-core process before it imports anything heavy (`cg_jax.core.prestart`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
  from cg_jax.core.buckets import Buckets
  from cg_jax.core.config import EngineConfig, ForwardConfig
  from cg_jax.engine import Engine
  from cg_jax.generation import GenerationResult, StreamChunk
  from cg_jax.kernels.flash_attention import FlashAttentionConfig
  from cg_jax.sampling_params import ParamError, SamplingParams

__version__ = "0.1.0"

# Each public name and the module that defines it.
_EXPORTS = {
    "Buckets": "cg_jax.core.buckets",
    "EngineConfig": "cg_jax.core.config",
    "ForwardConfig": "cg_jax.core.config",
    "Engine": "cg_jax.engine",
    "GenerationResult": "cg_jax.generation",
    "StreamChunk": "cg_jax.generation",
    "FlashAttentionConfig": "cg_jax.kernels.flash_attention",
    "ParamError": "cg_jax.sampling_params",
    "SamplingParams": "cg_jax.sampling_params",
}

__all__ = ["Buckets", "Engine", "EngineConfig", "FlashAttentionConfig", "ForwardConfig",
           "GenerationResult", "ParamError", "SamplingParams", "StreamChunk", "__version__"]


def __getattr__(name: str):
  if name not in _EXPORTS:
    raise AttributeError(f"module 'cg_jax' has no attribute {name!r}")
  value = getattr(importlib.import_module(_EXPORTS[name]), name)
  globals()[name] = value  # (once: later lookups find it without this function)
  return value


def __dir__() -> list[str]:
  return sorted({*globals(), *_EXPORTS})
