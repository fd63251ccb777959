"""Attention as the model sees it: an object handed to every forward path.

The model never picks a kernel. It calls three methods of the attention implementation it is
given; `XlaAttention` here is the plain-jnp one (it runs everywhere and is the reference), and
the runtime hands the model its own implementations (`cg_jax.core.attention`: Pallas kernels, tensor
parallelism, padded rows) with the same methods:

  causal(q, k, v, lengths) -> out
      q [B, S, N, H]; k, v [B, S, K, H]; lengths int32 [B]: causal attention over right-padded
      rows, keys at or past a row's length ignored. Rows past a length hold unspecified (finite)
      values. Used without a cache (`Decoder.logits`).
  prefill(q, k, v, lengths, k_all, v_all, layer) -> (out, k_all, v_all)
      as `causal`, and k, v written to cache layer `layer`, rows [0, B), positions [0, S).
  decode(q, k, v, positions, k_all, v_all, layer) -> (out, k_all, v_all)
      one new token per row: q [B, N, H]; k, v [B, K, H] are written at (layer, b, positions[b])
      and q attends to keys 0..positions[b] of its row, the new one included. out [B, N, H]. A
      negative position marks an idle row: nothing is written and its output is zeros.
  extend(qkv, positions, rows, k_all, v_all, layer) -> (out, k_all, v_all)
      a chunk of C tokens per row at any cache offset, its heads as the fused QKV projection
      leaves them: qkv [B, C, Z, J, H] (`split_heads` says where q, k and v lie: a kernel reads
      them in place); k, v are written at (layer, rows[b], positions[b, c]) and each query
      attends to the keys of cache row rows[b] up to its own position. Negative positions
      (padding) write nothing. out [B, C, N, H].

k_all, v_all are the stacked caches [L, B', T, K, H] (B' >= B). `layer` is a Python int (layers
unrolled) or a traced int32 scalar (`lax.scan`). Shape letters: the README's table.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp


def split_heads(qkv, kv_heads: int):
  """The fused projection's heads apart: qkv [B, S, Z, J, H] (Z groups of J = (N + 2K) / Z heads,
  each group's query heads, then its key heads, then its value heads: one group per tensor-
  parallel shard) -> q [B, S, N, H], k, v [B, S, K, H], heads in group order."""
  batch, seq, groups, _, head_dim = qkv.shape
  kv = kv_heads // groups
  queries = qkv.shape[3] - 2 * kv
  parts = (qkv[..., :queries, :], qkv[..., queries:queries + kv, :], qkv[..., queries + kv:, :])
  return tuple(x.reshape(batch, seq, -1, head_dim) for x in parts)


def fuse_heads(q, k, v, groups: int):
  """`split_heads` undone: q [..., N, H], k, v [..., K, H] -> [..., Z, J, H] for Z = `groups`."""
  grouped = [x.reshape(*x.shape[:-2], groups, -1, x.shape[-1]) for x in (q, k, v)]
  return jnp.concatenate(grouped, axis=-2)


def softmax_attention(q, k, v, mask):
  """Masked softmax attention with GQA, float32 scores and softmax, scale 1/sqrt(H).

  Args:
    q: [B, S, N, H]; k, v: [B, T, K, H]; mask: bool [B, S, T] (True = attend).
  Returns:
    [B, S, N, H] in q.dtype.
  """
  batch, q_len, num_heads, head_dim = q.shape
  num_kv_heads = k.shape[2]
  group = num_heads // num_kv_heads
  # [B, S, K, G, H]
  q = q.reshape(batch, q_len, num_kv_heads, group, head_dim)
  precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
  # [B, K, G, S, T]
  scores = jnp.einsum("bskgh,btkh->bkgst", q, k, precision=precision,
                      preferred_element_type=jnp.float32) * (1.0 / math.sqrt(head_dim))
  scores = jnp.where(mask[:, None, None, :, :], scores, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=-1)
  # [B, S, K, G, H]
  out = jnp.einsum("bkgst,btkh->bskgh", probs.astype(v.dtype), v, precision=precision,
                   preferred_element_type=jnp.float32)
  return out.reshape(batch, q_len, num_heads, head_dim).astype(q.dtype)


def write_prompt(k, v, k_all, v_all, layer, row=0):
  """k, v [B, S, K, H] -> k_all, v_all [L, B', T, K, H] at (layer, row, 0): rows
  [row, row + B), positions [0, S)."""
  start = (layer, row, 0, 0, 0)
  k_all = jax.lax.dynamic_update_slice(k_all, k[None].astype(k_all.dtype), start)
  v_all = jax.lax.dynamic_update_slice(v_all, v[None].astype(v_all.dtype), start)
  return k_all, v_all


def write_token(k, v, positions, k_all, v_all, layer):
  """k, v [B, K, H] -> k_all, v_all [L, B', T, K, H] at (layer, b, positions[b]) (a scatter;
  rows with a negative position write nothing)."""
  rows = jnp.arange(k.shape[0])
  # Out of range (T) is dropped; a negative index would wrap.
  positions = jnp.where(positions < 0, k_all.shape[2], positions)
  k_all = k_all.at[layer, rows, positions].set(k.astype(k_all.dtype), mode="drop")
  v_all = v_all.at[layer, rows, positions].set(v.astype(v_all.dtype), mode="drop")
  return k_all, v_all


def write_chunk(k, v, positions, rows, k_all, v_all, layer):
  """k, v [B, C, K, H] -> k_all, v_all [L, B', T, K, H] at (layer, rows[b], positions[b, c])
  (negative positions write nothing)."""
  positions = jnp.where(positions < 0, k_all.shape[2], positions)
  k_all = k_all.at[layer, rows[:, None], positions].set(k.astype(k_all.dtype), mode="drop")
  v_all = v_all.at[layer, rows[:, None], positions].set(v.astype(v_all.dtype), mode="drop")
  return k_all, v_all


@dataclasses.dataclass(frozen=True)
class XlaAttention:
  """Attention as plain XLA ops (einsum, mask, softmax, einsum), the reference implementation."""

  def causal(self, q, k, v, lengths):
    seq_len = q.shape[1]
    positions = jnp.arange(seq_len)
    # [B, S(query), S(key)]
    causal = positions[None, :, None] >= positions[None, None, :]
    valid_key = positions[None, None, :] < lengths[:, None, None]
    return softmax_attention(q, k, v, causal & valid_key)

  def prefill(self, q, k, v, lengths, k_all, v_all, layer):
    k_all, v_all = write_prompt(k, v, k_all, v_all, layer)
    return self.causal(q, k, v, lengths), k_all, v_all

  def decode(self, q, k, v, positions, k_all, v_all, layer):
    k_all, v_all = write_token(k, v, positions, k_all, v_all, layer)
    batch, cache_len = q.shape[0], k_all.shape[2]
    # [B, 1, T]; an idle row (negative position) sees no key
    mask = (jnp.arange(cache_len)[None, :] <= positions[:, None])[:, None, :]
    out = softmax_attention(q[:, None], k_all[layer, :batch], v_all[layer, :batch], mask)[:, 0]
    return jnp.where((positions >= 0)[:, None, None], out, 0), k_all, v_all

  def extend(self, qkv, positions, rows, k_all, v_all, layer):
    q, k, v = split_heads(qkv, k_all.shape[3])
    k_all, v_all = write_chunk(k, v, positions, rows, k_all, v_all, layer)
    cache_len = k_all.shape[2]
    # [B, C, T]: keys of the row up to each query's position
    mask = jnp.arange(cache_len)[None, None, :] <= positions[:, :, None]
    out = softmax_attention(q, k_all[layer, rows], v_all[layer, rows], mask)
    return out, k_all, v_all
