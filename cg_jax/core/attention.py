"""The attention implementations the runtime hands the model (`models.attention` has the method
contract and the plain-XLA reference).

  PallasAttention  the cache-free `causal` attention of fresh prompts as the Pallas flash kernel,
                   per device on its heads under tensor parallelism (`shard_map`: a Pallas call
                   is opaque to XLA's SPMD partitioner); the slot-cache methods are
                   `XlaAttention`'s (its prefill attends through this `causal`).
  RealRows         decode over the first `rows` rows of a step whose hidden state is padded to
                   more rows (`ForwardConfig.min_matmul_rows`): the padding rows get zeros and
                   never touch the cache or the attention kernel.
  PagedAttention   the same methods over a paged cache: k_all, v_all are pages
                   [L, M, C, K, H] and row b of a call reads and writes the blocks of its own
                   block table; the ragged paged kernel (one call per layer, the cache write
                   fused; its decode specialization for decode steps), except fresh prompts
                   (flash kernel, pages written by a scatter), or `ragged_attention_xla`.
                   The decode steps and the static prefill.
  RaggedAttention  an engine step's `extend`: one row of A tokens that holds many requests'
                   chunks end to end, each at its own cache offset over its own block table;
                   the ragged paged kernel, or `ragged_attention_xla` (XLA ops, block by
                   block).

`for_forward(config, mesh)` picks the cache-free implementation of a `ForwardConfig` and
`paged_for_forward(config, mesh)` its paged one (tables given per call).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from cg_jax.core.config import ForwardConfig
from cg_jax.kernels.flash_attention import FlashAttentionConfig, flash_attention
from cg_jax.kernels.ragged_paged_attention import (PREFILL, RaggedPagedAttentionConfig,
                                                   ragged_paged_attention, token_positions)
from models.attention import XlaAttention, fuse_heads, split_heads


def interpret_pallas() -> bool:
  """Pallas kernels compile for GPUs only; elsewhere they run in the interpreter."""
  return jax.default_backend() != "gpu"


def _heads(mesh, rank: int, head_axis: int) -> P:
  """The partition spec of a rank-`rank` array split over the mesh's axis along `head_axis`."""
  spec = [None] * rank
  spec[head_axis] = mesh.axis_names[0]
  return P(*spec)


def _per_device(kernel, mesh, in_specs, out_specs):
  """`kernel` run per device on its heads, or as it is without a mesh."""
  if mesh is None:
    return kernel
  return jax.shard_map(kernel, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                       check_vma=False)


@dataclasses.dataclass(frozen=True)
class PallasAttention(XlaAttention):
  """`causal` as the Pallas flash kernel (the slot-cache methods are `XlaAttention`'s, over
  this `causal`); `mesh` is the tensor-parallel mesh (heads split over it) or None."""

  prefill_config: FlashAttentionConfig = FlashAttentionConfig()
  mesh: Any = None
  interpret: bool = False

  def causal(self, q, k, v, lengths):
    def kernel(q, k, v, lengths):
      return flash_attention(q, k, v, lengths, causal=True, config=self.prefill_config,
                             interpret=self.interpret)

    heads = None if self.mesh is None else _heads(self.mesh, 4, 2)
    return _per_device(kernel, self.mesh, (heads, heads, heads, P()), heads)(q, k, v, lengths)


@dataclasses.dataclass(frozen=True)
class RealRows:
  """Decode over rows [0, rows) of a padded step; rows past them get zeros, write nothing."""

  inner: Any
  rows: int

  def causal(self, q, k, v, lengths):
    return self.inner.causal(q, k, v, lengths)

  def prefill(self, q, k, v, lengths, k_all, v_all, layer):
    return self.inner.prefill(q, k, v, lengths, k_all, v_all, layer)

  def decode(self, q, k, v, positions, k_all, v_all, layer):
    # q [P, N, H]; k, v [P, K, H]; positions [P] -> the real rows [0, rows)
    rows, padded = self.rows, q.shape[0]
    out, k_all, v_all = self.inner.decode(q[:rows], k[:rows], v[:rows], positions[:rows], k_all,
                                          v_all, layer)
    # [B, N, H] -> [P, N, H]
    return jnp.pad(out, ((0, padded - rows), (0, 0), (0, 0))), k_all, v_all


@dataclasses.dataclass(frozen=True)
class PagedAttention:
  """Attention over a paged KV cache (k_all, v_all [L, M, C, K, H]): row b of a prefill or
  decode call owns the blocks `tables[b]` (int32 [B, W]; position p of the row lives in slot
  p % C of block tables[b, p // C]); an engine step's flat batch of chunks attends through
  `ragged` (`RaggedAttention`). Idle and padding rows write nothing.

  Args:
    inner: the cache-free `causal` attention (XLA or the Pallas flash kernel).
    tables: int32 [B, W], the call's rows' block tables (traced).
    kernel: the ragged paged kernel (else XLA ops: `ragged_attention_xla`).
    config: the kernel's block config for decode steps; prefill_config: for prompt chunks.
    mesh: the tensor-parallel mesh (heads split over it) or None.
    interpret: run the kernel in the Pallas interpreter.
  """

  inner: Any
  tables: Any
  kernel: bool = False
  config: RaggedPagedAttentionConfig = RaggedPagedAttentionConfig()
  prefill_config: RaggedPagedAttentionConfig = PREFILL
  mesh: Any = None
  interpret: bool = False

  def causal(self, q, k, v, lengths):
    return self.inner.causal(q, k, v, lengths)

  def prefill(self, q, k, v, lengths, k_all, v_all, layer):
    # q [B, S, N, H]: row b's first lengths[b] tokens at positions 0..
    if self.kernel:
      # Fresh prompts read nothing from the cache: the flash kernel attends them (the ragged
      # kernel is slower there: results/ragged_paged_attention_v3_h200.md) and their keys and
      # values go into their pages a block at a time.
      k_all, v_all = self._write_blocks(k, v, lengths, k_all, v_all, layer)
      return self.inner.causal(q, k, v, lengths), k_all, v_all
    return self._rows(q, k, v, jnp.zeros_like(lengths), lengths, k_all, v_all, layer,
                      self.prefill_config)

  def decode(self, q, k, v, positions, k_all, v_all, layer):
    # q [B, N, H] -> [B, 1, N, H]; a negative position is an idle row (no token)
    out, k_all, v_all = self._rows(q[:, None], k[:, None], v[:, None],
                                   jnp.maximum(positions, 0), (positions >= 0).astype(jnp.int32),
                                   k_all, v_all, layer, self.config, decode_only=True)
    return out[:, 0], k_all, v_all

  def _rows(self, q, k, v, starts, counts, k_all, v_all, layer, config, decode_only=False):
    """Row b's first counts[b] tokens of q [B, S, N, H] (k, v [B, S, K, H]) at positions
    starts[b].., attending causally to its keys; the other tokens are padding (zeros out)."""
    batch, size, heads, head_dim = q.shape
    # A [B, S] grid of right-padded rows: regions of S tokens, counts[b] of them real.
    region_starts = jnp.arange(batch + 1, dtype=jnp.int32) * size
    # [B S, Z, J, H]
    qkv = fuse_heads(q, k, v, self._groups).reshape(batch * size, self._groups, -1, head_dim)
    out, k_all, v_all = self.ragged(qkv, k_all, v_all, layer, starts + counts, region_starts,
                                    counts, config, decode_only)
    return out.reshape(batch, size, heads, head_dim), k_all, v_all

  def _write_blocks(self, k, v, lengths, k_all, v_all, layer):
    """Fresh prompts' keys and values k, v [B, S, K, H] (row b's first lengths[b] tokens at
    positions 0..) stored a block at a time: each block holding a real token gets one
    contiguous [C, K, H] slice (zeros past the row's length); the others are not written."""
    batch, size = k.shape[:2]
    num_blocks, page_size = k_all.shape[1], k_all.shape[2]
    pages = -(-size // page_size)
    # [B, S]: the row's real tokens
    real = jnp.arange(size)[None, :] < lengths[:, None]

    def blocks(x):
      # [B, S, K, H] -> [B, P, C, K, H]
      x = jnp.where(real[:, :, None, None], x, 0).astype(k_all.dtype)
      x = jnp.pad(x, ((0, 0), (0, pages * page_size - size), (0, 0), (0, 0)))
      return x.reshape(batch, pages, page_size, *x.shape[2:])

    # [B, P]: the block of each page that holds a real token (a fresh prompt's own: no two rows
    # share one), else an index past the cache of its own (dropped). Unique indices let XLA
    # store without atomics.
    used = jnp.arange(pages)[None, :] * page_size < lengths[:, None]
    past = num_blocks + jnp.arange(batch * pages, dtype=jnp.int32).reshape(batch, pages)
    table = jnp.where(used, self.tables[:, :pages], past)
    return (k_all.at[layer, table].set(blocks(k), mode="drop", unique_indices=True),
            v_all.at[layer, table].set(blocks(v), mode="drop", unique_indices=True))

  @property
  def _groups(self) -> int:
    """Z: the head groups of the fused heads (one per tensor-parallel device)."""
    return 1 if self.mesh is None else self.mesh.size

  def ragged(self, qkv, k_all, v_all, layer, seq_lens, query_starts, query_lens, config,
             decode_only=False):
    """`ragged_paged_attention` of a flat batch qkv [A, Z, J, H] (the fused heads,
    `models.attention.split_heads`) over this call's tables, per device on its group of heads
    under tensor parallelism; `ragged_attention_xla` without the kernel. out [A, N, H]."""
    layer = jnp.asarray(layer, jnp.int32)
    if not self.kernel:
      q, k, v = (x[0] for x in split_heads(qkv[None], k_all.shape[3]))
      return ragged_attention_xla(q, k, v, k_all, v_all, layer, self.tables, seq_lens,
                                  query_starts, query_lens)
    mesh = self.mesh
    groups = None if mesh is None else _heads(mesh, 4, 1)
    heads = None if mesh is None else _heads(mesh, 3, 1)
    cache = None if mesh is None else _heads(mesh, 5, 3)

    def kernel(qkv, k_all, v_all, layer, tables, seq_lens, query_starts, query_lens):
      # [A, 1, J, H] (this device's group) -> [A, J, H]
      fused = qkv.reshape(qkv.shape[0], -1, qkv.shape[-1])
      return ragged_paged_attention(fused, k_all, v_all, layer, tables, seq_lens, query_starts,
                                    query_lens, config=config, decode_only=decode_only,
                                    interpret=self.interpret)

    return _per_device(kernel, mesh, (groups, cache, cache) + (P(),) * 5, (heads, cache, cache))(
        qkv, k_all, v_all, layer, self.tables, seq_lens, query_starts, query_lens)


@dataclasses.dataclass(frozen=True)
class RaggedAttention:
  """The attention of an engine step (`cg_jax.core.steps`): the model sees one row of A tokens
  (`extend`, qkv [1, A, Z, J, H]) that holds R requests end to end: request r's query_lens[r]
  tokens start at query_starts[r] and sit at positions seq_lens[r] - query_lens[r] ..
  seq_lens[r] - 1 of its block table `paged.tables[r]`, attending causally to its cached keys
  and to each other; tokens past query_starts[R] are padding (zeros out, nothing written).
  Int32 [R + 1], [R], [R] arrays (traced); `config`: the kernel's block config for this step's
  bucket."""

  paged: PagedAttention
  query_starts: Any
  query_lens: Any
  seq_lens: Any
  config: RaggedPagedAttentionConfig = PREFILL

  def extend(self, qkv, positions, rows, k_all, v_all, layer):
    # qkv [1, A, Z, J, H]; positions and rows: the metadata above says it all.
    out, k_all, v_all = self.paged.ragged(qkv[0], k_all, v_all, layer, self.seq_lens,
                                          self.query_starts, self.query_lens, self.config)
    return out[None], k_all, v_all


def ragged_attention_xla(q, k, v, k_all, v_all, layer, tables, seq_lens, query_starts,
                         query_lens):
  """`ragged_paged_attention` with XLA ops, a block of keys at a time: the tokens' keys and
  values scattered into their pages, then an online softmax (float32) over the blocks of each
  token's block table up to the step's longest sequence (a while loop: a step of short prompts
  reads few blocks, whatever the table's width). Memory: one block per token, A x C x K x H.
  Same arguments and results as the kernel (query_lens given)."""
  tokens, heads, head_dim = q.shape
  _, num_pages, page_size, kv_heads, _ = k_all.shape
  width = tables.shape[1]
  group = heads // kv_heads
  # [A]: each token's sequence, whether it is a query token (else padding) and its position
  seq, real, position = token_positions(query_starts, query_lens, seq_lens, tokens)
  page = jnp.where(real, tables[seq, jnp.clip(position // page_size, 0, width - 1)], num_pages)
  k_all = k_all.at[layer, page, position % page_size].set(k.astype(k_all.dtype), mode="drop")
  v_all = v_all.at[layer, page, position % page_size].set(v.astype(v_all.dtype), mode="drop")
  highest = jax.lax.Precision.HIGHEST
  # [A, K, G, H]
  query = q.reshape(tokens, kv_heads, group, head_dim).astype(jnp.float32) / math.sqrt(head_dim)
  blocks = jnp.max(jnp.where(real, position // page_size + 1, 0))

  def block(j, carry):
    acc, row_max, denom = carry
    # [A, C, K, H]: block j of each token's table
    at = tables[seq, jnp.minimum(j, width - 1)]
    keys, values = (x[layer, at].astype(jnp.float32) for x in (k_all, v_all))
    # [A, K, G, C]
    scores = jnp.einsum("akgh,ackh->akgc", query, keys, precision=highest)
    visible = (j * page_size + jnp.arange(page_size)[None, :] <= position[:, None]) & real[:, None]
    scores = jnp.where(visible[:, None, None, :], scores, -jnp.inf)
    new_max = jnp.maximum(row_max, jnp.max(scores, axis=-1))
    safe = jnp.where(jnp.isfinite(new_max), new_max, 0.0)
    probs = jnp.exp(scores - safe[..., None])
    rescale = jnp.exp(row_max - safe)
    acc = acc * rescale[..., None] + jnp.einsum("akgc,ackh->akgh", probs, values,
                                                precision=highest)
    return acc, new_max, denom * rescale + jnp.sum(probs, axis=-1)

  shape = (tokens, kv_heads, group)
  acc, _, denom = jax.lax.fori_loop(
      0, blocks, block, (jnp.zeros((*shape, head_dim), jnp.float32),
                         jnp.full(shape, -jnp.inf, jnp.float32), jnp.zeros(shape, jnp.float32)))
  out = acc / jnp.where(denom > 0, denom, 1.0)[..., None]
  return out.reshape(tokens, heads, head_dim).astype(q.dtype), k_all, v_all


def for_forward(config: ForwardConfig, mesh=None):
  """The attention implementation of a forward config (`mesh`: tensor-parallel mesh or None)."""
  if config.attention == "xla":
    return XlaAttention()
  return PallasAttention(prefill_config=config.prefill_attention, mesh=mesh,
                         interpret=interpret_pallas())


def paged_for_forward(config: ForwardConfig, mesh=None) -> PagedAttention:
  """The paged attention of a forward config, without tables (`dataclasses.replace` them in per
  call): the ragged paged kernel with Pallas attention, `ragged_attention_xla` with XLA.
  Batch-invariant configs fix the kernel's split count by the block table alone (min_programs
  0)."""
  decode, prefill = RaggedPagedAttentionConfig(), PREFILL
  if config.batch_invariant:
    decode, prefill = (dataclasses.replace(c, min_programs=0) for c in (decode, prefill))
  return PagedAttention(inner=for_forward(config, mesh), tables=None,
                        kernel=config.attention == "pallas", config=decode,
                        prefill_config=prefill, mesh=mesh, interpret=interpret_pallas())
