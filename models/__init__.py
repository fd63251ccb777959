"""Model definitions, configurations and checkpoint converters for cg_jax."""

from models.config import PRESETS, DecoderConfig, RopeScaling, preset
from models.decoder import Decoder, KVCache, cache_bytes, init_cache

__all__ = [
    "PRESETS", "DecoderConfig", "RopeScaling", "preset", "Decoder", "KVCache", "cache_bytes",
    "init_cache",
]
