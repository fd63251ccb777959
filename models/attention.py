"""Attention backends behind one switch.

Two entry points, with the shapes the Pallas kernels of `cg_jax.kernels` will take:
  prefill_attention(q, k, v, lengths):        causal self-attention over right-padded sequences.
  decode_attention(q, k_cache, v_cache, lengths): one query per sequence against its cache.

`backend="xla"` is plain jnp (einsum, mask, softmax, einsum) and runs everywhere.
`backend="pallas"` runs the fused kernels of `cg_jax.kernels` (flash attention for prefill,
split-K decode attention); on a CPU backend they run in the Pallas interpreter (tests).
Einsum letters: B batch, T query positions, S key positions, K kv heads, G queries per kv head,
H head_dim.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

Backend = Literal["xla", "pallas"]
BACKENDS: tuple[str, ...] = ("xla", "pallas")


def check_backend(backend: str) -> None:
  """Raise ValueError for an unknown attention backend."""
  if backend not in BACKENDS:
    raise ValueError(f"attention must be one of {BACKENDS}, got {backend!r}")


def default_backend() -> str:
  """"pallas" on GPU, "xla" elsewhere."""
  return "pallas" if jax.default_backend() == "gpu" else "xla"


def interpret_pallas() -> bool:
  """Pallas kernels compile for GPUs only; elsewhere they run in the interpreter."""
  return jax.default_backend() != "gpu"


def _softmax_attention(q, k, v, mask, sm_scale):
  """Masked softmax attention with GQA, f32 scores and softmax.

  Args:
    q: [B, T, K*G, H]; k, v: [B, S, K, H]; mask: bool [B, T, S] (True = attend).
  Returns:
    [B, T, K*G, H] in q.dtype.
  """
  batch, q_len, num_heads, head_dim = q.shape
  num_kv_heads = k.shape[2]
  group = num_heads // num_kv_heads
  # [B, T, K, G, H]
  q = q.reshape(batch, q_len, num_kv_heads, group, head_dim)
  precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
  # [B, K, G, T, S]
  scores = jnp.einsum("btkgh,bskh->bkgts", q, k, precision=precision,
                      preferred_element_type=jnp.float32) * sm_scale
  scores = jnp.where(mask[:, None, None, :, :], scores, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=-1)
  # [B, T, K, G, H]
  out = jnp.einsum("bkgts,bskh->btkgh", probs.astype(v.dtype), v, precision=precision,
                   preferred_element_type=jnp.float32)
  return out.reshape(batch, q_len, num_heads, head_dim).astype(q.dtype)


def prefill_attention(q, k, v, lengths, *, sm_scale: float, backend: Backend = "xla", mesh=None):
  """Causal attention over right-padded sequences.

  Args:
    q: [B, S, Hq, D]; k, v: [B, S, Hkv, D]; lengths: int32 [B], valid tokens per row.
  Returns:
    [B, S, Hq, D]. Rows past a sequence's length hold unspecified (finite) values.
  """
  if backend == "pallas":
    from cg_jax.kernels.flash_attention import flash_attention

    def kernel(q, k, v, lengths):
      return flash_attention(q, k, v, lengths, causal=True, sm_scale=sm_scale,
                             interpret=interpret_pallas())
    if mesh is not None:
      heads = _heads(mesh, 4, 2)
      kernel = _over_head_shards(kernel, mesh, (heads, heads, heads, P()), heads)
    return kernel(q, k, v, lengths)
  seq_len = q.shape[1]
  positions = jnp.arange(seq_len)
  # [B, S(query), S(key)]
  causal = positions[None, :, None] >= positions[None, None, :]
  valid_key = positions[None, None, :] < lengths[:, None, None]
  return _softmax_attention(q, k, v, causal & valid_key, sm_scale)


def _over_head_shards(kernel, mesh, in_specs, out_spec):
  """`kernel` run per device on its heads (a Pallas call is opaque to XLA's SPMD partitioner,
  which would otherwise gather every head onto each device)."""
  return jax.shard_map(kernel, mesh=mesh, in_specs=in_specs, out_specs=out_spec, check_vma=False)


def _heads(mesh, rank: int, head_axis: int) -> P:
  """The partition spec of a rank-`rank` array split over the mesh's axis along `head_axis`."""
  spec = [None] * rank
  spec[head_axis] = mesh.axis_names[0]
  return P(*spec)


def decode_attention(q, k_cache, v_cache, lengths, *, sm_scale: float, backend: Backend = "xla",
                     layer=None, mesh=None):
  """One query token per sequence against the first `lengths[b]` cache entries.

  Args:
    q: [B, Hq, D]; k_cache, v_cache: [B, T, Hkv, D], or with `layer` the stacked caches
      [L, B', T, Hkv, D] (B' >= B) of which rows [0, B) of that layer are used;
      lengths: int32 [B] (>= 1 for real rows).
    layer: None, a Python int (the Pallas kernel then reads the stacked cache in place) or a
      traced index (the layer is sliced out first).
    mesh: a 1-D tensor-parallel mesh over which q's and the cache's heads are split (the
      Pallas kernel then runs per device on its heads); None on one device.
  Returns:
    [B, Hq, D].
  """
  if layer is not None and (backend != "pallas" or not isinstance(layer, int)):
    batch = q.shape[0]
    k_cache, v_cache, layer = k_cache[layer, :batch], v_cache[layer, :batch], None
  if backend == "pallas":
    from cg_jax.kernels.decode_attention import decode_attention as decode_kernel

    def kernel(q, k_cache, v_cache, lengths):
      return decode_kernel(q, k_cache, v_cache, lengths, layer=layer, sm_scale=sm_scale,
                           interpret=interpret_pallas())
    if mesh is not None:
      cache_spec = _heads(mesh, k_cache.ndim, k_cache.ndim - 2)
      kernel = _over_head_shards(kernel, mesh, (_heads(mesh, 3, 1), cache_spec, cache_spec, P()),
                                 _heads(mesh, 3, 1))
    return kernel(q, k_cache, v_cache, lengths)
  cache_len = k_cache.shape[1]
  # [B, 1, T]
  mask = (jnp.arange(cache_len)[None, :] < lengths[:, None])[:, None, :]
  return _softmax_attention(q[:, None], k_cache, v_cache, mask, sm_scale)[:, 0]


CACHE_WRITES = ("fused", "scatter")
# How the fused decode kernel spreads a row's keys over its split-K programs.
DECODE_SPLITS = ("fixed", "length")
# What merges the decode kernel's split-K partials: two XLA kernels, or one Pallas kernel.
DECODE_COMBINES = ("xla", "pallas")
# Who slices the decode step's fused QKV output and applies RoPE: XLA ops before the attention,
# or the fused decode kernel itself.
DECODE_QKV = ("xla", "kernel")


def decode_attention_and_write(q, k_new, v_new, k_all, v_all, positions, *, layer,
                               sm_scale: float, backend: Backend = "xla", mesh=None,
                               cache_write: str = "fused", decode_splits: str = "fixed",
                               decode_combine: str = "xla"):
  """Write one new token's key and value per row into layer `layer` of the stacked caches and
  attend to the cache up to and including it.

  Args:
    q: [P, Hq, D]; k_new, v_new: [P, Hkv, D]; k_all, v_all: [L, B', T, Hkv, D] (B' >= B);
      rows [B, P) are padding (the decode step's hidden state padded to P rows): they get zeros
      and write nothing.
    positions: int32 [B], where real row b's new token goes (< T).
    layer: a Python int, or a traced index (scan).
  Returns:
    (out [P, Hq, D], k_all, v_all) with the new keys and values written.

  decode_splits, decode_combine (fused kernel only): see `decode_kernel_config`.

  With the Pallas backend, a static layer and cache_write="fused", one kernel does both
  (`decode_attention_with_write`: the caches are updated in place, no scatter kernels); otherwise
  (cache_write="scatter") the write is an XLA scatter followed by `decode_attention`. Either way
  the kernel runs over the real rows only and the output is zero-padded back to P rows: XLA fuses
  that pad into the split combine, so it costs no kernel, whereas padding rows in the launch
  (length 0) cost programs (H200, B=1 padded to 8: gpt2 374 -> 399 us per step).
  """
  padded, batch = q.shape[0], positions.shape[0]
  if backend == "pallas" and isinstance(layer, int) and cache_write == "fused":
    from cg_jax.kernels.decode_attention import decode_attention_with_write

    def kernel(q, k_new, v_new, k_all, v_all, lengths):
      return decode_attention_with_write(q, k_new, v_new, k_all, v_all, lengths, layer=layer,
                                         sm_scale=sm_scale,
                                         config=decode_kernel_config(decode_splits,
                                                                     decode_combine),
                                         interpret=interpret_pallas())
    if mesh is not None:
      heads, cache = _heads(mesh, 3, 1), _heads(mesh, 5, 3)
      kernel = _over_head_shards(kernel, mesh, (heads, heads, heads, cache, cache, P()),
                                 (heads, cache, cache))
    out, k_all, v_all = kernel(q[:batch], k_new[:batch], v_new[:batch], k_all, v_all,
                               positions + 1)
  else:
    index = jnp.arange(batch)
    k_all = k_all.at[layer, index, positions].set(k_new[:batch].astype(k_all.dtype))
    v_all = v_all.at[layer, index, positions].set(v_new[:batch].astype(v_all.dtype))
    out = decode_attention(q[:batch], k_all, v_all, positions + 1, sm_scale=sm_scale,
                           backend=backend, layer=layer, mesh=mesh)
  if out.shape[0] < padded:  # [B, Hq, D] -> [P, Hq, D]
    out = jnp.pad(out, ((0, padded - out.shape[0]), (0, 0), (0, 0)))
  return out, k_all, v_all


def decode_kernel_config(decode_splits: str = "fixed", decode_combine: str = "xla"):
  """The fused decode kernel's `DecodeAttentionConfig`: "fixed" cuts the cache into fixed
  windows per split-K program, "length" shares each row's valid keys among the same programs
  (`length_splits`); their partials are merged by XLA or by one Pallas kernel (`combine`)."""
  from cg_jax.kernels.decode_attention import DecodeAttentionConfig

  return DecodeAttentionConfig(length_splits=decode_splits == "length", combine=decode_combine)


def decode_attention_and_write_qkv(qkv, k_all, v_all, positions, rope, *, layer: int,
                                   sm_scale: float, decode_splits: str = "fixed",
                                   decode_combine: str = "xla"):
  """`decode_attention_and_write` for the fused Pallas kernel fed by the unsliced QKV output.

  Args:
    qkv: [P, Hq + 2 Hkv, D]: the step's query heads, new keys and new values per row; rows
      [B, P) are padding (zeros out, nothing written).
    k_all, v_all: [L, B', T, Hkv, D] (B' >= B); positions: int32 [B]; layer: a Python int.
    rope: None, or (cos, sin) float32 [B, D] at `positions`: the kernel rotates the query and the
      new key (the XLA path's `_apply_rope`), so no slice or rotation runs outside it.
  Returns:
    (out [P, Hq, D], k_all, v_all).
  """
  from cg_jax.kernels.decode_attention import decode_attention_with_write_qkv

  padded, batch = qkv.shape[0], positions.shape[0]
  out, k_all, v_all = decode_attention_with_write_qkv(
      qkv[:batch], k_all, v_all, positions + 1, rope, layer=layer, sm_scale=sm_scale,
      config=decode_kernel_config(decode_splits, decode_combine), interpret=interpret_pallas())
  # [B, Hq, D] -> [P, Hq, D]
  return jnp.pad(out, ((0, padded - batch), (0, 0), (0, 0))), k_all, v_all

