"""The decoder (GPT-2 and Llama families) as one Flax NNX module with weights stacked over layers.

Every per-layer weight kind is one `nnx.Param` with a leading layer axis, so the whole model is
about 15-20 arrays and the layer loop is a `lax.scan`. The KV cache is a separate pytree
(`KVCache`) passed in and returned, never module state, so a jitted step can donate it.

Forward paths, all pure in (weights, cache, inputs), each handed its attention implementation
(`models.attention`; the runtime's kernels in `cg_jax.core.attention`):
  logits(tokens):                       full-sequence logits, no cache.
  prefill(tokens, lengths, cache):      right-padded prompts; fills cache[:, :B, :S]; returns the
                                        logits of each row's last real token.
  decode(tokens, positions, cache):     one token per row, each at its own position
                                        (`decode_hidden`, then `unembed`).

Shape letters: the README's table.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.attention import XlaAttention, split_heads
from models.config import DecoderConfig

LAYER_WEIGHTS: tuple[str, ...] = (
    "attn_norm_scale", "attn_norm_bias", "qkv_kernel", "qkv_bias", "out_kernel", "out_bias",
    "mlp_norm_scale", "mlp_norm_bias", "mlp_in_kernel", "mlp_in_bias", "mlp_out_kernel",
    "mlp_out_bias")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
  """Keys and values of every layer: k, v [L, B, T, K, H]."""

  k: jax.Array
  v: jax.Array

  @property
  def batch_size(self) -> int:
    return self.k.shape[1]

  @property
  def max_len(self) -> int:
    return self.k.shape[2]


def init_cache(config: DecoderConfig, batch_size: int, max_len: int, dtype) -> KVCache:
  """A zero-filled cache (never `jnp.empty`: uninitialised memory since jax 0.11)."""
  shape = (config.num_layers, batch_size, max_len, config.num_kv_heads, config.head_dim)
  return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))


def cache_bytes(config: DecoderConfig, batch_size: int, max_len: int, dtype) -> int:
  """Bytes of one `KVCache` of this shape."""
  elements = config.num_layers * batch_size * max_len * config.num_kv_heads * config.head_dim
  return 2 * elements * jnp.dtype(dtype).itemsize


def rope_inverse_frequencies(config: DecoderConfig) -> np.ndarray:
  """float32 [H/2] RoPE inverse frequencies with the config's scaling (Hugging Face semantics)."""
  exponents = np.arange(0, config.head_dim, 2, dtype=np.float64) / config.head_dim
  inv_freq = (1.0 / (config.rope_theta ** exponents)).astype(np.float32).astype(np.float64)
  scaling = config.rope_scaling
  if scaling is None or scaling.rope_type == "default":
    pass
  elif scaling.rope_type == "linear":
    inv_freq = inv_freq / scaling.factor
  elif scaling.rope_type == "llama3":
    old_context = scaling.original_max_position_embeddings
    low_freq_wavelen = old_context / scaling.low_freq_factor
    high_freq_wavelen = old_context / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = ((old_context / wavelen - scaling.low_freq_factor)
              / (scaling.high_freq_factor - scaling.low_freq_factor))
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    inv_freq = np.where(is_medium, smoothed, scaled)
  else:
    raise ValueError(f"unsupported rope_type {scaling.rope_type!r}")
  return inv_freq.astype(np.float32)


def rope_cos_sin(positions, inv_freq):
  """cos and sin, float32 [..., H], of rotate-half RoPE at int positions [...]: the angles
  positions x inv_freq [H/2], repeated over both halves."""
  # [..., H/2]
  angles = positions.astype(jnp.float32)[..., None] * inv_freq
  # [..., H]
  angles = jnp.concatenate([angles, angles], axis=-1)
  return jnp.cos(angles), jnp.sin(angles)


def _apply_rope(qkv, positions, inv_freq, rotated: int):
  """Rotate-half RoPE (Hugging Face Llama convention) on the first `rotated` heads of each group
  of qkv (its queries and keys; the values pass unchanged), as one elementwise pass.

  Args:
    qkv: [B, S, Z, J, H] (`Decoder._layer`); positions: int32 [B, S]; inv_freq: f32 [H/2].
  """
  # [B, S, 1, 1, H]
  cos, sin = (part[:, :, None, None, :] for part in rope_cos_sin(positions, inv_freq))
  x32 = qkv.astype(jnp.float32)
  half = qkv.shape[-1] // 2
  turned = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
  roped = (x32 * cos + turned * sin).astype(qkv.dtype)
  # [J, 1]: the heads RoPE turns
  head = jnp.arange(qkv.shape[3])[:, None]
  return jnp.where(head < rotated, roped, qkv)


def _matmul(x, w):
  """x [..., I] @ w [I, O], true float32 on GPU for float32 weights (no TF32)."""
  precision = jax.lax.Precision.HIGHEST if w.dtype == jnp.float32 else None
  return jnp.matmul(x, w, precision=precision)


def _norm(x, scale, bias, eps: float):
  """LayerNorm when `bias` is given, else RMSNorm; computed in float32, returned in x.dtype."""
  x32 = x.astype(jnp.float32)
  if bias is not None:
    x32 = x32 - jnp.mean(x32, axis=-1, keepdims=True)
  normed = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)
  if bias is not None:
    return (normed * scale.astype(jnp.float32) + bias.astype(jnp.float32)).astype(x.dtype)
  # Llama casts back to the activation dtype before the weight multiply.
  return scale * normed.astype(x.dtype)


def projection(x, w, *, norm=None, norm_scale=None, norm_bias=None, eps=1e-5, bias=None,
                   activation=None, gated=False, residual=None, shards: int = 1):
  """residual + act(norm(x) @ w + bias) (act(gate) * up when gated), x [R, I], as XLA ops.

  With `shards` > 1 a gated w's columns are shard-major, [gate_0 | up_0 | gate_1 | up_1 | ...]
  (`cg_jax.core.sharding`); 1 is the plain [gate | up]."""
  if norm is not None:
    x = _norm(x, norm_scale, norm_bias if norm == "layer" else None, eps)
  y = _matmul(x, w)
  if bias is not None:
    y = y + bias
  if gated:
    # [R, shards, 2, F / shards]
    parts = y.reshape(*y.shape[:-1], shards, 2, -1)
    y = (_ACTIVATIONS[activation](parts[..., 0, :]) * parts[..., 1, :]).reshape(
        *y.shape[:-1], -1)
  elif activation is not None:
    y = _ACTIVATIONS[activation](y)
  return y if residual is None else residual + y


LAYER_LOOPS = ("scan", "unroll")


def _over_layers(body, carry, weights, num_layers: int, layer_loop: str):
  """carry = body(carry, weights[layer], layer) for every layer.

  "scan" is one `lax.scan` (a while loop in XLA: small program, fast compile); "unroll" traces
  each layer with static slices of the stacked weights and a Python-int layer index
  (straight-line code, which XLA's command buffers can capture without the WHILE command).
  """
  if layer_loop == "scan":
    def step(carry, xs):
      return body(carry, *xs), None
    layers = jnp.arange(num_layers, dtype=jnp.int32)
    carry, _ = jax.lax.scan(step, carry, (weights, layers))
    return carry
  if layer_loop != "unroll":
    raise ValueError(f"layer_loop must be one of {LAYER_LOOPS}, got {layer_loop!r}")
  for layer in range(num_layers):
    carry = body(carry, jax.tree.map(lambda a: a[layer], weights), layer)
  return carry


_ACTIVATIONS = {
    "gelu_tanh": lambda u: jax.nn.gelu(u, approximate=True),
    "gelu": lambda u: jax.nn.gelu(u, approximate=False),
    "silu": jax.nn.silu,
}


class Decoder(nnx.Module):
  """GPT-2 / Llama decoder with weights stacked over layers.

  Args:
    config: the model's `DecoderConfig`.
    dtype: parameter and activation dtype (float32, bfloat16, float16).
    rngs: random streams for initialisation (normal(0.02), as Hugging Face does).
  """

  def __init__(self, config: DecoderConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
    self.config = config
    c = config
    layers, hidden = c.num_layers, c.hidden_size
    mlp_in_width = (2 if c.gated_mlp else 1) * c.intermediate_size
    normal = nnx.initializers.normal(0.02)

    def random(*shape):
      return nnx.Param(normal(rngs.params(), shape, dtype))

    def ones(*shape):
      return nnx.Param(jnp.ones(shape, dtype))

    def zeros(*shape):
      return nnx.Param(jnp.zeros(shape, dtype))

    self.embed = random(c.vocab_size, hidden)
    self.position_embed = None if c.uses_rope else random(c.max_position_embeddings, hidden)
    self.attn_norm_scale = ones(layers, hidden)
    self.attn_norm_bias = zeros(layers, hidden) if c.uses_layernorm else None
    self.qkv_kernel = random(layers, hidden, c.qkv_width)
    self.qkv_bias = zeros(layers, c.qkv_width) if c.attention_bias else None
    self.out_kernel = random(layers, c.num_heads * c.head_dim, hidden)
    self.out_bias = zeros(layers, hidden) if c.attention_bias else None
    self.mlp_norm_scale = ones(layers, hidden)
    self.mlp_norm_bias = zeros(layers, hidden) if c.uses_layernorm else None
    self.mlp_in_kernel = random(layers, hidden, mlp_in_width)
    self.mlp_in_bias = zeros(layers, mlp_in_width) if c.mlp_bias else None
    self.mlp_out_kernel = random(layers, c.intermediate_size, hidden)
    self.mlp_out_bias = zeros(layers, hidden) if c.mlp_bias else None
    self.final_norm_scale = ones(hidden)
    self.final_norm_bias = zeros(hidden) if c.uses_layernorm else None
    self.lm_head = None if c.tie_word_embeddings else random(hidden, c.vocab_size)

  # ----------------------------------------------------------------------------------------------
  # Pieces

  def _value(self, name: str):
    param = getattr(self, name)
    return None if param is None else param[...]

  def _layer_weights(self) -> dict[str, jax.Array]:
    """The stacked per-layer weights that exist for this family, each [L, ...]."""
    return {n: self._value(n) for n in LAYER_WEIGHTS if getattr(self, n) is not None}

  def _embed(self, tokens, positions):
    # [B, S, D]
    x = jnp.take(self.embed[...], tokens, axis=0)
    if self.position_embed is not None:
      x = x + jnp.take(self.position_embed[...], positions, axis=0)
    return x

  def unembed(self, x):
    """Final norm and vocabulary projection: x [..., D] -> float32 logits [..., V]."""
    x = _norm(x, self.final_norm_scale[...], self._value("final_norm_bias"), self.config.norm_eps)
    # [D, V]
    head = self.embed[...].T if self.lm_head is None else self.lm_head[...]
    precision = jax.lax.Precision.HIGHEST if head.dtype == jnp.float32 else None
    return jnp.matmul(x, head, precision=precision, preferred_element_type=jnp.float32)

  def _layer(self, x, w, positions, kv, attend, shards: int):
    """One transformer block: the new hidden state and the layer's new K/V.

    Args:
      x: [B, S, D]; w: this layer's weights {kind: array}; positions: int32 [B, S].
      kv: the attention's cache state, passed through `attend` (None without a cache).
      attend: attend(qkv [B, S, Z, J, H], kv) -> (out [B, S, N, H], kv): the fused projection's
        heads after RoPE, Z = `shards` groups of J = (N + 2K) / Z heads, each group its own
        query heads, then key heads, then value heads (`models.attention.split_heads`).
      shards: column groups of the QKV and gated MLP-in weights (1: the canonical layout; more:
        shard-major, each group holding its own heads' [q | k | v] and [gate | up]).
    Returns:
      (x [B, S, D], kv).
    """
    c = self.config
    batch, seq, hidden = x.shape
    rows = batch * seq
    norm = "layer" if c.uses_layernorm else "rms"
    # [B*S, D]
    flat = x.reshape(rows, hidden)
    # [B*S, (N + 2K) H]
    qkv = projection(flat, w["qkv_kernel"], norm=norm, norm_scale=w["attn_norm_scale"],
                     norm_bias=w.get("attn_norm_bias"), eps=c.norm_eps, bias=w.get("qkv_bias"))
    q_width = c.num_heads * c.head_dim
    # [B, S, Z, J, H]: each shard group's [q | k | v] heads
    qkv = qkv.reshape(batch, seq, shards, -1, c.head_dim)
    if c.uses_rope:
      inv_freq = jnp.asarray(rope_inverse_frequencies(c))
      qkv = _apply_rope(qkv, positions, inv_freq, (c.num_heads + c.num_kv_heads) // shards)
    attn, kv = attend(qkv, kv)
    flat = projection(attn.reshape(rows, q_width), w["out_kernel"], bias=w.get("out_bias"),
                      residual=flat)
    # [B*S, F]: act(h W + b), or act(gate) * up for the gated (SwiGLU) MLP
    mlp = projection(flat, w["mlp_in_kernel"], norm=norm, norm_scale=w["mlp_norm_scale"],
                     norm_bias=w.get("mlp_norm_bias"), eps=c.norm_eps, bias=w.get("mlp_in_bias"),
                     activation=c.activation, gated=c.gated_mlp, shards=shards)
    flat = projection(mlp, w["mlp_out_kernel"], bias=w.get("mlp_out_bias"), residual=flat)
    return flat.reshape(batch, seq, hidden), kv

  def _layers(self, x, positions, cache: KVCache | None, attend, layer_loop: str, shards: int):
    """Every layer over x [B, S, D]; attend(qkv, k_all, v_all, layer) -> (out, k_all, v_all)
    (qkv [B, S, Z, J, H]: `_layer`) updates the stacked cache (k_all, v_all None without one).
    Returns (x, k_all, v_all)."""

    def body(carry, w, layer):
      x, k_all, v_all = carry

      def layer_attend(qkv, kv):
        out, k_all, v_all = attend(qkv, *kv, layer)
        return out, (k_all, v_all)

      x, (k_all, v_all) = self._layer(x, w, positions, (k_all, v_all), layer_attend, shards)
      return x, k_all, v_all

    carry = (x, None, None) if cache is None else (x, cache.k, cache.v)
    return _over_layers(body, carry, self._layer_weights(), self.config.num_layers, layer_loop)

  # ----------------------------------------------------------------------------------------------
  # Forward paths. `attention`: the implementation (`models.attention`); `layer_loop`: "scan" or
  # "unroll" (`_over_layers`); `shards`: the weights' column groups (`_layer`).

  def logits(self, tokens, *, attention=XlaAttention(), layer_loop: str = "scan",
             shards: int = 1):
    """Full-sequence logits without cache: tokens int32 [B, S] -> float32 [B, S, V]."""
    batch, seq = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq))
    lengths = jnp.full((batch,), seq, jnp.int32)

    def attend(qkv, k_all, v_all, layer):
      q, k, v = split_heads(qkv, self.config.num_kv_heads)
      return attention.causal(q, k, v, lengths), k_all, v_all

    x, _, _ = self._layers(self._embed(tokens, positions), positions, None, attend, layer_loop,
                           shards)
    return self.unembed(x)

  def prefill(self, tokens, lengths, cache: KVCache, *, attention=XlaAttention(),
              layer_loop: str = "scan", shards: int = 1):
    """`prefill_hidden` and `unembed`: (float32 [B, V] logits of each row's last real token,
    updated cache)."""
    x_last, cache = self.prefill_hidden(tokens, lengths, cache, attention=attention,
                                        layer_loop=layer_loop, shards=shards)
    return self.unembed(x_last), cache

  def prefill_hidden(self, tokens, lengths, cache: KVCache, *, attention=XlaAttention(),
                     layer_loop: str = "scan", shards: int = 1):
    """Run right-padded prompts, writing their keys and values to cache[:, :B, :S].

    Args:
      tokens: int32 [B, S], right-padded; lengths: int32 [B], real tokens per row (0 for an
        unused padding row); cache: a `KVCache` with at least B rows and T >= S; rows [0, B)
        are written, the others are left as they are.
    Returns:
      (hidden state [B, D] of each row's last real token before the final norm, updated cache).
    """
    batch, seq = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq))

    def attend(qkv, k_all, v_all, layer):
      q, k, v = split_heads(qkv, self.config.num_kv_heads)
      return attention.prefill(q, k, v, lengths, k_all, v_all, layer)

    x, k_all, v_all = self._layers(self._embed(tokens, positions), positions, cache, attend,
                                   layer_loop, shards)
    # [B, D]: the hidden state of each row's last real token.
    last = jnp.maximum(lengths - 1, 0)
    x_last = jnp.take_along_axis(x, last[:, None, None], axis=1)[:, 0]
    return x_last, KVCache(k=k_all, v=v_all)

  def decode_hidden(self, tokens, positions, cache: KVCache, *, attention=XlaAttention(),
                    layer_loop: str = "scan", shards: int = 1):
    """One decode step up to the last layer: each row's token is written at its own position and
    attends to the cache up to and including it.

    Args:
      tokens: int32 [B]; positions: int32 [B], each < T; cache: `KVCache` [L, B', T, K, H] with
        B' >= B; rows [0, B) are used and written.
    Returns:
      (hidden state [B, D] before the final norm, updated cache).
    """

    def attend(qkv, k_all, v_all, layer):
      # q [B, 1, N, H]; k, v [B, 1, K, H] -> cache[layer, b, positions[b]]
      q, k, v = split_heads(qkv, self.config.num_kv_heads)
      out, k_all, v_all = attention.decode(q[:, 0], k[:, 0], v[:, 0], positions, k_all, v_all,
                                           layer)
      return out[:, None], k_all, v_all

    # [B, 1, D]
    x = self._embed(tokens[:, None], positions[:, None])
    x, k_all, v_all = self._layers(x, positions[:, None], cache, attend, layer_loop, shards)
    return x[:, 0], KVCache(k=k_all, v=v_all)

  def extend_hidden(self, tokens, positions, rows, cache: KVCache, *, attention=XlaAttention(),
                    layer_loop: str = "scan", shards: int = 1):
    """A chunk of tokens per row at any cache offset (chunked prefill): each token is written at
    its position in cache row rows[b] and attends to that row's keys up to its own position.

    Args:
      tokens: int32 [B, C]; positions: int32 [B, C] (negative: padding, nothing written);
      rows: int32 [B], the cache rows; cache: `KVCache` [L, B', T, K, H].
    Returns:
      (hidden states [B, C, D] before the final norm, updated cache).
    """

    def attend(qkv, k_all, v_all, layer):
      return attention.extend(qkv, positions, rows, k_all, v_all, layer)

    x = self._embed(tokens, jnp.maximum(positions, 0))
    x, k_all, v_all = self._layers(x, jnp.maximum(positions, 0), cache, attend, layer_loop,
                                   shards)
    return x, KVCache(k=k_all, v=v_all)

  def decode(self, tokens, positions, cache: KVCache, *, attention=XlaAttention(),
             layer_loop: str = "scan", shards: int = 1):
    """`decode_hidden` and `unembed`: (float32 [B, V] next-token logits, updated cache)."""
    x, cache = self.decode_hidden(tokens, positions, cache, attention=attention,
                                  layer_loop=layer_loop, shards=shards)
    return self.unembed(x), cache
