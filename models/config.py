"""One frozen configuration for the GPT-2 and Llama decoder families, and named presets.

A `DecoderConfig` holds every value that changes the math or sizes a weight. It is hashable, so it
can live inside an NNX graphdef (static) and key compiled executables.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

Family = Literal["gpt2", "llama"]
Activation = Literal["gelu_tanh", "gelu", "silu"]
RopeType = Literal["default", "linear", "llama3"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScaling:
  """RoPE frequency scaling (Hugging Face `rope_scaling` / `rope_parameters`).

  `linear` divides every frequency by `factor`; `llama3` is Llama-3.1's piecewise scaling of the
  low frequencies (long wavelengths) with a smooth band between `low_freq_factor` and
  `high_freq_factor`.
  """

  rope_type: RopeType = "default"
  factor: float = 1.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecoderConfig:
  """Shapes and math of one decoder-only transformer.

  `family` selects the block recipe:
    gpt2:  learned positions, LayerNorm with bias, fused QKV with bias, GELU MLP, biases everywhere.
    llama: RoPE, RMSNorm, SwiGLU MLP, grouped-query attention, optional biases.
  """

  family: Family
  vocab_size: int
  hidden_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  intermediate_size: int
  max_position_embeddings: int
  norm_eps: float
  tie_word_embeddings: bool
  attention_bias: bool
  mlp_bias: bool
  activation: Activation
  rope_theta: float = 10000.0
  rope_scaling: RopeScaling | None = None
  bos_token_id: int | None = None
  eos_token_id: tuple[int, ...] = ()

  def __post_init__(self):
    for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                 "head_dim", "intermediate_size", "max_position_embeddings"):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    if self.family not in ("gpt2", "llama"):
      raise ValueError(f"family must be 'gpt2' or 'llama', got {self.family!r}")
    if self.activation not in ("gelu_tanh", "gelu", "silu"):
      raise ValueError(f"activation must be one of gelu_tanh, gelu, silu, got {self.activation!r}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
          f"num_heads ({self.num_heads}) must be divisible by num_kv_heads ({self.num_kv_heads})")
    if self.family == "gpt2":
      if self.hidden_size != self.num_heads * self.head_dim:
        raise ValueError(
            f"gpt2 needs hidden_size ({self.hidden_size}) == num_heads ({self.num_heads}) x "
            f"head_dim ({self.head_dim})")
      if self.num_kv_heads != self.num_heads:
        raise ValueError("gpt2 has no grouped-query attention: num_kv_heads must equal num_heads")
    if self.head_dim % 2 and self.uses_rope:
      raise ValueError(f"RoPE needs an even head_dim, got {self.head_dim}")
    if not self.norm_eps > 0:
      raise ValueError(f"norm_eps must be > 0, got {self.norm_eps!r}")

  @property
  def uses_rope(self) -> bool:
    return self.family == "llama"

  @property
  def uses_layernorm(self) -> bool:
    """LayerNorm (with bias) for GPT-2, RMSNorm for Llama."""
    return self.family == "gpt2"

  @property
  def gated_mlp(self) -> bool:
    """SwiGLU: the first MLP projection is [gate | up], twice intermediate_size wide."""
    return self.family == "llama"

  @property
  def queries_per_kv_head(self) -> int:
    return self.num_heads // self.num_kv_heads

  @property
  def qkv_width(self) -> int:
    """Output width of the fused QKV projection: [q heads | k heads | v heads] x head_dim."""
    return (self.num_heads + 2 * self.num_kv_heads) * self.head_dim

  def num_parameters(self) -> int:
    """Parameter count, counting a tied embedding once (matches HF `num_parameters()`)."""
    d, f, layers = self.hidden_size, self.intermediate_size, self.num_layers
    mlp_in = 2 * f if self.gated_mlp else f
    per_layer = d * self.qkv_width + self.num_heads * self.head_dim * d + d * mlp_in + f * d
    per_layer += (2 if self.uses_layernorm else 1) * 2 * d  # two norms
    if self.attention_bias:
      per_layer += self.qkv_width + d
    if self.mlp_bias:
      per_layer += mlp_in + d
    total = layers * per_layer + self.vocab_size * d
    total += (2 if self.uses_layernorm else 1) * d  # final norm
    if not self.uses_rope:
      total += self.max_position_embeddings * d
    if not self.tie_word_embeddings:
      total += d * self.vocab_size
    return total


def _gpt2(hidden: int, layers: int, heads: int, *, vocab: int = 50257, positions: int = 1024):
  return DecoderConfig(
      family="gpt2", vocab_size=vocab, hidden_size=hidden, num_layers=layers, num_heads=heads,
      num_kv_heads=heads, head_dim=hidden // heads, intermediate_size=4 * hidden,
      max_position_embeddings=positions, norm_eps=1e-5, tie_word_embeddings=True,
      attention_bias=True, mlp_bias=True, activation="gelu_tanh", bos_token_id=50256,
      eos_token_id=(50256,))


def _llama(hidden: int, layers: int, heads: int, kv_heads: int, head_dim: int, ffn: int, *,
           tie: bool, rope_factor: float, vocab: int = 128256):
  return DecoderConfig(
      family="llama", vocab_size=vocab, hidden_size=hidden, num_layers=layers, num_heads=heads,
      num_kv_heads=kv_heads, head_dim=head_dim, intermediate_size=ffn,
      max_position_embeddings=131072, norm_eps=1e-5, tie_word_embeddings=tie,
      attention_bias=False, mlp_bias=False, activation="silu", rope_theta=500000.0,
      rope_scaling=RopeScaling(rope_type="llama3", factor=rope_factor, low_freq_factor=1.0,
                               high_freq_factor=4.0, original_max_position_embeddings=8192),
      bos_token_id=128000, eos_token_id=(128001, 128008, 128009))


PRESETS: dict[str, DecoderConfig] = {
    "gpt2": _gpt2(768, 12, 12),
    "gpt2-medium": _gpt2(1024, 24, 16),
    "gpt2-large": _gpt2(1280, 36, 20),
    "gpt2-xl": _gpt2(1600, 48, 25),
    "llama-3.2-1b": _llama(2048, 16, 32, 8, 64, 8192, tie=True, rope_factor=32.0),
    "llama-3.2-3b": _llama(3072, 28, 24, 8, 128, 8192, tie=True, rope_factor=32.0),
    "llama-3.1-8b": _llama(4096, 32, 32, 8, 128, 14336, tie=False, rope_factor=8.0),
    # Tiny presets for tests and CPU smoke runs.
    "tiny-gpt2": dataclasses.replace(_gpt2(64, 2, 4, vocab=263, positions=512), bos_token_id=262,
                                     eos_token_id=(262,)),
    "tiny-llama": dataclasses.replace(
        _llama(64, 2, 4, 2, 16, 160, tie=False, rope_factor=8.0, vocab=263),
        max_position_embeddings=512,
        rope_scaling=RopeScaling(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                 high_freq_factor=4.0, original_max_position_embeddings=64),
        bos_token_id=0, eos_token_id=(1,)),
}


def preset(name: str) -> DecoderConfig:
  """Return the named preset; raises ValueError listing the known names."""
  try:
    return PRESETS[name]
  except KeyError:
    raise ValueError(f"unknown preset {name!r}; known presets: {', '.join(PRESETS)}") from None
