"""The decoder (GPT-2 and Llama families) as one Flax NNX module with weights stacked over layers.

Every per-layer weight kind is one `nnx.Param` with a leading layer axis, so the whole model is
about 15-20 arrays and the layer loop is a `lax.scan`. The KV cache is a separate pytree
(`KVCache`) passed in and returned, never module state, so a jitted step can donate it.

Three forward paths, all pure in (weights, cache, inputs):
  logits(tokens):                       full-sequence logits, no cache.
  prefill(tokens, lengths, cache):      right-padded prompts; fills cache[:, :, :S]; returns the
                                        logits of each row's last real token.
  decode(tokens, positions, cache):     one token per row, each at its own position.

Einsum letters: B batch, S sequence, D hidden, F mlp width, V vocab, L layers, T cache length,
K kv heads, H head_dim.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.attention import (Backend, decode_attention_and_write,
                              decode_attention_and_write_qkv, interpret_pallas, prefill_attention)
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


def _apply_rope(x, positions, inv_freq):
  """Rotate-half RoPE (Hugging Face Llama convention).

  Args:
    x: [B, S, N, H]; positions: int32 [B, S]; inv_freq: f32 [H/2].
  """
  # [B, S, 1, H]
  cos, sin = (part[:, :, None, :] for part in rope_cos_sin(positions, inv_freq))
  x32 = x.astype(jnp.float32)
  half = x.shape[-1] // 2
  rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
  return (x32 * cos + rotated * sin).astype(x.dtype)


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


def xla_projection(x, w, *, norm=None, norm_scale=None, norm_bias=None, eps=1e-5, bias=None,
                   activation=None, gated=False, residual=None, shards: int = 1):
  """residual + act(norm(x) @ w + bias) (act(gate) * up when gated), x [R, I], as XLA ops.

  With `shards` > 1 a gated w's columns are shard-major, [gate_0 | up_0 | gate_1 | up_1 | ...]
  (`cg_jax.sharding`); 1 is the plain [gate | up]."""
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


def _fused_projection(x, w, shards: int = 1, **options):
  """The same as one `cg_jax.kernels.fused_linear` kernel (interpreted off the GPU), on one
  device's canonical column layout only (`shards` 1)."""
  from cg_jax.kernels.fused_linear import fused_linear

  if shards != 1:
    raise ValueError(f"the fused Pallas projections take unsplit weights, got shards={shards}")

  return fused_linear(x, w, interpret=interpret_pallas(), **options)


LINEAR_BACKENDS = ("xla", "pallas")


def check_linear_backend(config: DecoderConfig, linear: str) -> None:
  """ValueError for an unknown projection backend, or "pallas" on widths it cannot take."""
  if linear not in LINEAR_BACKENDS:
    raise ValueError(f"linear must be one of {LINEAR_BACKENDS}, got {linear!r}")
  if linear == "pallas":
    widths = {"hidden_size": config.hidden_size, "qkv width": config.qkv_width,
              "num_heads * head_dim": config.num_heads * config.head_dim,
              "intermediate_size": config.intermediate_size}
    odd = {name: value for name, value in widths.items() if value % 16}
    if odd:
      raise ValueError(f"linear='pallas' needs multiples of 16; got {odd}")


LAYER_LOOPS = ("scan", "unroll")


def _shards(mesh) -> int:
  """Devices of a tensor-parallel mesh (1 without one)."""
  return 1 if mesh is None else mesh.devices.size


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

  def _lm_head(self, x):
    """Final norm and vocabulary projection, float32 logits [..., V]."""
    x = _norm(x, self.final_norm_scale[...], self._value("final_norm_bias"), self.config.norm_eps)
    # [D, V]
    head = self.embed[...].T if self.lm_head is None else self.lm_head[...]
    precision = jax.lax.Precision.HIGHEST if head.dtype == jnp.float32 else None
    return jnp.matmul(x, head, precision=precision, preferred_element_type=jnp.float32)

  def _block(self, x, w, positions, attend, project=xla_projection, shards: int = 1,
             attend_qkv=None):
    """One transformer block. x [B, S, D]; `attend(q, k, v)` returns [B, S, N*H]. With
    `attend_qkv` (one device), `attend_qkv(qkv [B*S, Nq + 2K, H])` replaces the slicing, the
    RoPE and `attend`, and returns [B*S, Nq, H].

    `shards` > 1: the QKV and gated MLP-in columns are shard-major (`cg_jax.sharding`), each of
    the `shards` column groups holding its own heads' [q | k | v] (and [gate | up]).

    The four projections (norm + QKV, output + residual, norm + MLP in + activation, MLP out +
    residual) run through `project(x, w[kind], **options)`: `xla_projection` (plain XLA ops) or
    a fused Pallas kernel per projection (`_fused_projection`, for the few rows of a decode
    step), which may take `w` as the weights stacked over layers with the layer bound in.
    """
    c = self.config
    batch, seq, hidden = x.shape
    rows = batch * seq
    norm = "layer" if c.uses_layernorm else "rms"
    # [B*S, D]
    flat = x.reshape(rows, hidden)
    # [B*S, (Nq + 2K) * H]
    qkv = project(flat, w["qkv_kernel"], norm=norm, norm_scale=w["attn_norm_scale"],
                  norm_bias=w.get("attn_norm_bias"), eps=c.norm_eps, bias=w.get("qkv_bias"))
    q_width, kv_width = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    if attend_qkv is not None:
      # [B*S, Nq + 2K, H]: a free reshape of the projection's output
      attn = attend_qkv(qkv.reshape(rows, -1, c.head_dim)).reshape(rows, q_width)
    else:
      # [B*S, shards, per-shard [q | k | v] columns]
      qkv = qkv.reshape(rows, shards, -1)
      q_part, kv_part = q_width // shards, kv_width // shards
      q = qkv[..., :q_part].reshape(batch, seq, c.num_heads, c.head_dim)
      k = qkv[..., q_part:q_part + kv_part].reshape(batch, seq, c.num_kv_heads, c.head_dim)
      v = qkv[..., q_part + kv_part:].reshape(batch, seq, c.num_kv_heads, c.head_dim)
      if c.uses_rope:
        inv_freq = jnp.asarray(rope_inverse_frequencies(c))
        q, k = _apply_rope(q, positions, inv_freq), _apply_rope(k, positions, inv_freq)
      attn = attend(q, k, v).reshape(rows, q_width)
    flat = project(attn, w["out_kernel"], bias=w.get("out_bias"), residual=flat)
    # [B*S, F]: act(h W + b), or act(gate) * up for the gated (SwiGLU) MLP
    mlp = project(flat, w["mlp_in_kernel"], norm=norm, norm_scale=w["mlp_norm_scale"],
                  norm_bias=w.get("mlp_norm_bias"), eps=c.norm_eps, bias=w.get("mlp_in_bias"),
                  activation=c.activation, gated=c.gated_mlp, shards=shards)
    flat = project(mlp, w["mlp_out_kernel"], bias=w.get("mlp_out_bias"), residual=flat)
    return flat.reshape(batch, seq, hidden)

  @property
  def _sm_scale(self) -> float:
    return 1.0 / math.sqrt(self.config.head_dim)

  # ----------------------------------------------------------------------------------------------
  # Forward paths

  def logits(self, tokens, *, attention: Backend = "xla", layer_loop: str = "scan", mesh=None):
    """Full-sequence logits without cache. (`mesh`: see `decode`.)

    Args:
      tokens: int32 [B, S].
    Returns:
      float32 [B, S, V].
    """
    batch, seq = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq))
    lengths = jnp.full((batch,), seq, jnp.int32)

    def attend(q, k, v):
      return prefill_attention(q, k, v, lengths, sm_scale=self._sm_scale, backend=attention,
                               mesh=mesh)

    def body(x, w, layer):
      return self._block(x, w, positions, attend, shards=_shards(mesh))

    x = _over_layers(body, self._embed(tokens, positions), self._layer_weights(),
                     self.config.num_layers, layer_loop)
    return self._lm_head(x)

  def prefill(self, tokens, lengths, cache: KVCache, *, attention: Backend = "xla",
              layer_loop: str = "scan", mesh=None):
    """Run right-padded prompts, writing their keys and values to cache[:, :, :S].
    (`mesh`: see `decode`.)

    Args:
      tokens: int32 [B, S], right-padded; lengths: int32 [B], real tokens per row (0 for an
        unused padding row); cache: a `KVCache` with at least B rows and T >= S; rows [0, B)
        are written, the others are left as they are.
    Returns:
      (float32 [B, V] logits of each row's last real token, updated cache).
    """
    batch, seq = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq))

    def body(carry, w, layer):
      x, k_all, v_all = carry
      written = {}

      def attend(q, k, v):
        written["k"], written["v"] = k, v
        return prefill_attention(q, k, v, lengths, sm_scale=self._sm_scale, backend=attention,
                                 mesh=mesh)

      x = self._block(x, w, positions, attend, shards=_shards(mesh))
      start = (layer, 0, 0, 0, 0)
      # [L, B, T, K, H] <- [1, B, S, K, H] at (layer, 0, 0)
      k_all = jax.lax.dynamic_update_slice(k_all, written["k"][None].astype(k_all.dtype), start)
      v_all = jax.lax.dynamic_update_slice(v_all, written["v"][None].astype(v_all.dtype), start)
      return x, k_all, v_all

    carry = (self._embed(tokens, positions), cache.k, cache.v)
    x, k_all, v_all = _over_layers(body, carry, self._layer_weights(), self.config.num_layers,
                                   layer_loop)
    # [B, D]: the hidden state of each row's last real token.
    last = jnp.maximum(lengths - 1, 0)
    x_last = jnp.take_along_axis(x, last[:, None, None], axis=1)[:, 0]
    return self._lm_head(x_last), KVCache(k=k_all, v=v_all)

  def decode(self, tokens, positions, cache: KVCache, *, attention: Backend = "xla",
             layer_loop: str = "scan", min_matmul_rows: int = 1, linear: str = "xla",
             mesh=None, cache_write: str = "fused", decode_splits: str = "fixed",
             decode_combine: str = "xla", decode_qkv: str = "xla"):
    """One decode step: each row's token is written at its own position and attends to the
    cache up to and including it.

    Args:
      tokens: int32 [B]; positions: int32 [B], each < T; cache: `KVCache` [L, B', T, K, H] with
        B' >= B; rows [0, B) are used and written.
      min_matmul_rows: with fewer batch rows than this, the hidden state is zero-padded to this
        many rows for the whole step (the padding rows never reach the cache or attention):
        XLA rewrites a single-row product as a multiply-and-reduce pair of fusions, and a few
        padded rows keep every projection a GEMM. The real rows' results do not depend on the
        padding. XLA projections only (the Pallas ones mask their rows).
      linear: "xla" or "pallas" projections (see `_block`). The Pallas kernels read each
        layer's weights in place from the stacked arrays.
      mesh: a 1-D tensor-parallel mesh (`cg_jax.sharding`): the weights are in its shard-major
        layout and split over it, the cache by KV head; the Pallas attention kernels then run per
        device. None on one device.
      cache_write: "fused" (the Pallas attention kernel stores the new key/value itself, in
        place) or "scatter" (an XLA scatter per layer before attention); see
        `models.attention.decode_attention_and_write`.
      decode_splits, decode_combine: the fused kernel's split of each row's keys ("fixed" or
        "length") and what merges its splits ("xla" or "pallas"); see
        `models.attention.decode_kernel_config`.
      decode_qkv: "xla" (XLA slices the fused QKV output and applies RoPE) or "kernel": with the
        Pallas backend, unrolled layers, the fused cache write and one device, the attention
        kernel reads q, k and v from the QKV output in place and applies RoPE itself
        (`models.attention.decode_attention_and_write_qkv`); otherwise as "xla".
    Returns:
      (float32 [B, V] next-token logits, updated cache).
    """
    batch = tokens.shape[0]
    padded = max(batch, min_matmul_rows) if linear == "xla" else batch
    stacked = self._layer_weights()

    c = self.config
    # (cos, sin) float32 [B, H] at the rows' positions, shared by every layer's kernel
    rope = (rope_cos_sin(positions, jnp.asarray(rope_inverse_frequencies(c)))
            if c.uses_rope and decode_qkv == "kernel" else None)

    def body(carry, w, layer):
      x, k_all, v_all = carry
      cache_out = {}

      def attend_in_kernel(qkv):
        # qkv [P, Nq + 2K, H] -> [P, Nq, H]; the real rows' new K/V -> cache[layer, b, pos]
        out, cache_out["k"], cache_out["v"] = decode_attention_and_write_qkv(
            qkv, k_all, v_all, positions, rope, layer=layer, sm_scale=self._sm_scale,
            decode_splits=decode_splits, decode_combine=decode_combine)
        return out

      in_kernel = (decode_qkv == "kernel" and attention == "pallas" and isinstance(layer, int)
                   and cache_write == "fused" and mesh is None)

      def attend(q, k, v):
        # q [P, 1, N, H]; k, v [P, 1, K, H]: the real rows [0, B) -> cache[layer, b, positions[b]];
        # the padding rows' outputs are zero
        out, cache_out["k"], cache_out["v"] = decode_attention_and_write(
            q[:, 0], k[:, 0], v[:, 0], k_all, v_all, positions, layer=layer,
            sm_scale=self._sm_scale, backend=attention, mesh=mesh, cache_write=cache_write,
            decode_splits=decode_splits, decode_combine=decode_combine)
        return out[:, None]

      if linear == "pallas":
        w, project = stacked, functools.partial(_fused_projection, layer=layer)
      else:
        project = xla_projection
      x = self._block(x, w, padded_positions[:, None], attend, project, _shards(mesh),
                      attend_in_kernel if in_kernel else None)
      return x, cache_out["k"], cache_out["v"]

    # [P]: the padding rows take position 0 (their values never reach a real row)
    padded_positions = jnp.pad(positions, (0, padded - batch))
    x = self._embed(tokens[:, None], positions[:, None])
    # [B, 1, D] -> [P, 1, D]
    x = jnp.pad(x, ((0, padded - batch), (0, 0), (0, 0)))
    x, k_all, v_all = _over_layers(body, (x, cache.k, cache.v), stacked, self.config.num_layers,
                                   layer_loop)
    return self._lm_head(x[:batch, 0]), KVCache(k=k_all, v=v_all)
