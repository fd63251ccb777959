"""Ragged paged attention: one kernel for a flat batch of query tokens from many sequences over a
paged KV cache, with the new tokens' keys and values written into their pages (Pallas, Triton).

The batch is A query tokens laid end to end: sequence r owns the region
query_starts[r] .. query_starts[r + 1] - 1, whose first q_len = query_lens[r] tokens are its
query tokens (a decode row has one, a prefill chunk many; the rest of the region, and every
token past query_starts[R], is padding: a fixed [B, S] grid of right-padded rows is the region
layout query_starts = S r). Its cache holds seq_lens[r] positions after this call, the query
tokens being the last of them, so query token i sits at position seq_lens[r] - q_len + i and
attends causally to positions 0 .. its own. Position p of
sequence r lives in slot p % C of block block_tables[r, p // C] of the paged cache
[L, M, C, K, H] (one layer of it is attended, `layer`). The tokens' queries, keys and values
come as one array, qkv [A, N + 2K, H] (N query heads, then K key and K value heads: the fused
QKV projection's output after RoPE), read in place: no slices of it are copied first.

  1. Tiles. Each sequence's query tokens are cut into tiles of Q tokens (a tile never holds two
     sequences; `tile_layout`, plain jnp). One Triton program runs per (tile, KV head, split):
     its rows are the tile's Q tokens x the G_pad query heads of one KV group, one [Q G_pad, H]
     tile, so each key/value block it loads serves all of them (GQA without repeating K/V).
  2. Keys. A program walks its split of the positions below the tile's last position with an
     online softmax, in two loops: the keys before the sequence's first query position from the
     pages, in blocks of `block_k` (at multiples of block_k, a divisor of C, so a block lies in
     one page), then the query tokens' own keys from qkv as contiguous windows of
     tokens (gathered rows when A < block_k, in one block of A rounded up to a power of two).
     Blocks that every row of the tile sees whole (the cached keys, the own keys before the
     tile's first token) load unmasked and skip the mask; only a loop's last blocks are masked.
     No program reads a slot this call writes.
  3. The write. The split-0 program of each (tile, KV head) stores its tokens' new keys and
     values into their pages (the caches are aliased to the outputs): one writer per slot.
  4. Splits. Long caches are cut into splits of keys only while the programs would not fill the
     GPU (`min_programs`: small decode batches; prompt chunks keep one split); the partials are
     merged by one more kernel (`cg_jax.kernels.split_combine`). With one split the program
     normalises and writes the result itself.
  5. Decode steps (`decode_only`: one query token per sequence, token r of sequence r) skip the
     tile layout: one program per (sequence, KV head, split) reads its pages and folds the
     token's own key in elementwise (no second key loop), so a decode row's chain of dependent
     loads is a contiguous cache's plus one page lookup per block.

Loads and stores of rows past a sequence's tokens, heads past G and keys past the causal limit
are masked; their indices point past the arrays (a masked store is dropped, in the interpreter
too). Nothing is padded or copied outside the kernel. Padding tokens write no key and get zeros
(those past query_starts[R] in tiles of their own), so every output element is written.

`ragged_paged_attention_reference` is the same computation in plain jnp (tests; the CPU path).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from cg_jax.kernels.blocks import MIN_DOT_DIM, check_split_config, is_power_of_two
from cg_jax.kernels.split_combine import split_combine

_KERNEL_DTYPES = (jnp.float32, jnp.bfloat16)


@dataclasses.dataclass(frozen=True)
class RaggedPagedAttentionConfig:
  """Block sizes and launch settings of the ragged paged-attention kernel.

  Attributes:
    tile_rows: query rows per program (tokens x padded group heads; a power of two >= 16): a
      tile holds tile_rows // G_pad tokens of one sequence.
    block_k: keys per inner-loop step (a power of two >= 16); clamped to the page size C,
      which it must divide.
    split_size: the most keys per split-K program (a power of two, a multiple of block_k),
      clamped to the block table's positions rounded up to a power of two. Prompt chunks fill
      the GPU with their tiles: their calls keep one split, no partials to combine.
    min_programs: the split is halved (down to block_k) while tiles x KV heads x splits would
      give fewer programs than this. 0 keeps `split_size`.
    num_warps, num_stages: Triton launch settings.

  The defaults suit decode rows; prompt chunks run best with 64-row tiles (`PREFILL`). Both
  from the H200 rows in benchmarks/results/ragged_paged_attention_v3_h200.md.
  """

  tile_rows: int = 16
  block_k: int = 64
  split_size: int = 4096
  min_programs: int = 1024
  num_warps: int = 4
  num_stages: int = 2

  def __post_init__(self):
    check_split_config(self, ("tile_rows", "block_k", "split_size", "num_warps"),
                       ("tile_rows", "block_k"))


# The config of prompt-chunk calls (many query tokens per sequence).
PREFILL = RaggedPagedAttentionConfig(tile_rows=64, block_k=64)


def _check(qkv, k_pages, v_pages, block_tables, seq_lens, query_starts, query_lens) -> None:
  """Raises ValueError naming the argument and the shapes for inconsistent inputs."""
  shapes = (f"qkv {tuple(qkv.shape)}, k_pages {tuple(k_pages.shape)}, "
            f"block_tables {tuple(block_tables.shape)}, seq_lens {tuple(seq_lens.shape)}, "
            f"query_starts {tuple(query_starts.shape)}, query_lens {tuple(query_lens.shape)}")
  if qkv.ndim != 3:
    raise ValueError(f"qkv must be [A, N + 2K, H]; got {shapes}")
  if k_pages.ndim != 5 or v_pages.shape != k_pages.shape:
    raise ValueError(f"k_pages and v_pages must be [L, M, C, K, H] alike; got {shapes}, "
                     f"v_pages {tuple(v_pages.shape)}")
  kv_heads = k_pages.shape[3]
  heads = qkv.shape[1] - 2 * kv_heads
  if k_pages.shape[4] != qkv.shape[2]:
    raise ValueError(f"k_pages head_dim must equal qkv's; got {shapes}")
  if kv_heads < 1 or heads < kv_heads or heads % kv_heads:
    raise ValueError(f"qkv must hold N query heads, a multiple of the pages' K KV heads, then K "
                     f"key and K value heads (N + 2K); got {shapes}")
  if block_tables.ndim != 2 or seq_lens.shape != block_tables.shape[:1] or (
      query_starts.shape != (block_tables.shape[0] + 1,)) or (
      query_lens.shape != seq_lens.shape):
    raise ValueError(f"block_tables must be [R, W], seq_lens and query_lens [R] and query_starts "
                     f"[R + 1]; got {shapes}")
  for name, array in (("block_tables", block_tables), ("seq_lens", seq_lens),
                      ("query_starts", query_starts), ("query_lens", query_lens)):
    if not jnp.issubdtype(array.dtype, jnp.integer):
      raise ValueError(f"{name} must be an integer array; got dtype {array.dtype}")
  if not (qkv.dtype == k_pages.dtype == v_pages.dtype):
    raise ValueError(f"qkv, k_pages and v_pages must share a dtype; got qkv {qkv.dtype}, k_pages "
                     f"{k_pages.dtype}, v_pages {v_pages.dtype}")


def checked_layout(qkv, k_pages, v_pages, block_tables, seq_lens, query_starts, query_lens):
  """The arguments checked (`_check`) and read: (query_starts int32, query_lens int32 (each
  region's length when None), A tokens, H head_dim, C page size, K KV heads, N query heads)."""
  query_starts = query_starts.astype(jnp.int32)
  query_lens = _query_lens(query_starts, query_lens)
  _check(qkv, k_pages, v_pages, block_tables, seq_lens, query_starts, query_lens)
  tokens, _, head_dim = qkv.shape
  page_size, kv_heads = k_pages.shape[2], k_pages.shape[3]
  return (query_starts, query_lens, tokens, head_dim, page_size, kv_heads,
          qkv.shape[1] - 2 * kv_heads)


def split_qkv(qkv, kv_heads: int):
  """qkv [..., N + 2K, H] -> (q [..., N, H], k [..., K, H], v [..., K, H])."""
  heads = qkv.shape[-2] - 2 * kv_heads
  return qkv[..., :heads, :], qkv[..., heads:heads + kv_heads, :], qkv[..., heads + kv_heads:, :]


def _query_lens(query_starts, query_lens):
  """int32 [R]: the given query lengths, or each region's length."""
  if query_lens is None:
    return jnp.diff(query_starts)
  return jnp.asarray(query_lens).astype(jnp.int32)


def token_positions(query_starts, query_lens, seq_lens, tokens: int):
  """Each token's place in a flat batch: (seq [A], the sequence whose region holds it (the last
  for tokens past query_starts[R]); real [A], whether it is one of that sequence's query tokens
  (else padding); position [A], its position in the sequence (meaningful where real)).

  Args:
    query_starts: int32 [R + 1]; query_lens, seq_lens: int32 [R]; tokens: A (static).
  """
  sequences = query_lens.shape[0]
  token = jnp.arange(tokens, dtype=jnp.int32)
  # (method "compare_all": an [A, R] comparison, no loop: the default search is a while loop of
  # small kernels, with which a decode step ran 5-6% longer: results/unified_step_h200.md)
  seq = jnp.minimum(jnp.searchsorted(query_starts[1:], token, side="right",
                                     method="compare_all"), sequences - 1)
  offset = token - query_starts[seq]
  real = (offset >= 0) & (offset < query_lens[seq])
  return seq, real, seq_lens[seq] - query_lens[seq] + offset


def tile_layout(query_starts, tokens: int, tile_tokens: int):
  """Tiles of at most `tile_tokens` query tokens, none holding two sequences; the padding tokens
  past query_starts[R] get tiles of their own (sequence R) so every output row is written.

  Args:
    query_starts: int32 [R + 1], non-decreasing, query_starts[R] <= tokens.
    tokens: A, the flat batch's length (static).
    tile_tokens: Q (static).
  Returns:
    (tile_seq [X] int32: each tile's sequence, R for padding, R + 1 for a tile past them all;
     tile_start [X] int32: its first token), X = min(A, cdiv(A, Q) + R + 1) tiles, an upper
    bound of the tiles needed.
  """
  sequences = query_starts.shape[0] - 1
  count = min(tokens, pl.cdiv(tokens, tile_tokens) + sequences + 1)
  # [R + 1]: the sequences, then the padding
  starts = query_starts.astype(jnp.int32)
  lengths = jnp.append(starts[1:], tokens) - starts
  ends = jnp.cumsum((lengths + tile_tokens - 1) // tile_tokens)
  # [X]
  tile = jnp.arange(count, dtype=jnp.int32)
  tile_seq = jnp.searchsorted(ends, tile, side="right", method="compare_all").astype(jnp.int32)
  first_tile = jnp.where(tile_seq > 0, ends[jnp.maximum(tile_seq - 1, 0)], 0)
  start = starts[jnp.minimum(tile_seq, sequences)] + (tile - first_tile) * tile_tokens
  return tile_seq, start.astype(jnp.int32)


# The fields of `tile_meta`'s first result, one row each.
TILE_FIELDS = 6


def tile_meta(query_starts, query_lens, seq_lens, block_tables, tokens: int, tile_tokens: int):
  """What each tile's program reads before its keys, gathered per tile (`tile_layout`), so
  that it needs no load to find them: (meta [TILE_FIELDS, X] int32: the tile's first token,
  its sequence's first query token, query tokens (0 when inactive), sequence length, the end
  of its region (padding tiles: A; tiles past them all: 0), 1 if it holds a sequence's tokens;
  tables [X, W]: its sequence's block table)."""
  sequences = query_starts.shape[0] - 1
  tile_seq, tile_start = tile_layout(query_starts, tokens, tile_tokens)
  active = tile_seq < sequences
  seq = jnp.minimum(tile_seq, sequences - 1)
  region_end = jnp.where(active, query_starts[seq + 1],
                         (tile_seq == sequences).astype(jnp.int32) * tokens)
  meta = jnp.stack([tile_start, query_starts[seq], jnp.where(active, query_lens[seq], 0),
                    seq_lens[seq], region_end, active.astype(jnp.int32)]).astype(jnp.int32)
  return meta, block_tables[seq]


def split_layout(tiles: int, kv_heads: int, positions: int,
                 config: RaggedPagedAttentionConfig, block_k: int) -> tuple[int, int]:
  """(keys per split, number of splits) for tiles x kv_heads x splits programs over a block
  table of `positions` positions (W C)."""
  split = min(config.split_size, max(block_k, pl.next_power_of_2(positions)))
  while split > block_k and tiles * kv_heads * pl.cdiv(positions, split) < config.min_programs:
    split //= 2
  return split, pl.cdiv(positions, split)


def _online(carry, query, keys, values, sm_scale: float, visible=None):
  """The online-softmax update of (acc [rows, H], max [rows], denom [rows]) by one block of keys
  and values [block, H] for query [rows, H]; `visible` [rows, block] masks it (None: every row
  sees every key, an interior block)."""
  acc, row_max, denom = carry
  # [rows, block] = query [rows, H] . keys [block, H]^T; HIGHEST keeps f32 off TF32.
  scores = lax.dot_general(query, keys, (((1,), (1,)), ((), ())),
                           precision=lax.Precision.HIGHEST,
                           preferred_element_type=jnp.float32) * sm_scale
  if visible is not None:
    scores = jnp.where(visible, scores, -jnp.inf)
  # [rows]; a row may see no key in a masked block: its max stays -inf, exp uses 0.
  new_max = jnp.maximum(row_max, jnp.max(scores, axis=1))
  safe_max = jnp.where(jnp.isfinite(new_max), new_max, 0.0)
  rescale = jnp.exp(row_max - safe_max)
  probs = jnp.exp(scores - safe_max[:, None])
  denom = denom * rescale + jnp.sum(probs, axis=1)
  # [rows, H] = probs [rows, block] . values [block, H]
  block_out = lax.dot_general(probs.astype(values.dtype), values, (((1,), (0,)), ((), ())),
                              precision=lax.Precision.HIGHEST,
                              preferred_element_type=jnp.float32)
  return acc * rescale[:, None] + block_out, new_max, denom


def _cached_keys(carry, query, tables_ref, k_pages_ref, v_pages_ref, layer, seq, kv_head,
                 start, end, block_k: int, sm_scale: float, first_page=None):
  """`_online` over sequence `seq`'s cached keys at positions [start, end), read from its pages
  (block table row `seq` of tables_ref) in blocks of block_k from `start` (a multiple of
  block_k, a divisor of C: each block lies in one page): whole blocks load unmasked, the last
  partial one masked. Every query row sees every one of these keys (all are below its
  position). `first_page`: the page of `start`, loaded by the caller before anything it
  depends on (a one-block program then waits for one load before its keys, not two)."""
  page_size, width = k_pages_ref.shape[2], tables_ref.shape[1]
  count = jnp.maximum(end - start, 0)

  def block(block_index, carry, masked: bool):
    block_start = start + block_index * block_k
    at_page = tables_ref.at[seq, jnp.minimum(block_start // page_size, width - 1)]
    if first_page is None:
      page = pltriton.load(at_page)
    else:  # (the first block's lookup is masked off: no load to wait for)
      page = jnp.where(block_index == 0, first_page,
                       pltriton.load(at_page, mask=block_index > 0, other=0))

    def at(ref):
      return ref.at[layer, page, pl.ds(block_start % page_size, block_k), kv_head, :]
    if not masked:
      return _online(carry, query, pltriton.load(at(k_pages_ref)), pltriton.load(at(v_pages_ref)),
                     sm_scale)
    valid = block_start + jnp.arange(block_k) < end
    keys, values = (pltriton.load(at(ref), mask=valid[:, None], other=0.0)
                    for ref in (k_pages_ref, v_pages_ref))
    return _online(carry, query, keys, values, sm_scale, valid[None, :])

  carry = lax.fori_loop(0, count // block_k, functools.partial(block, masked=False), carry)
  return lax.fori_loop(count // block_k, pl.cdiv(count, block_k),
                       functools.partial(block, masked=True), carry)


def _store(out_refs, carry, valid, stored, token_at, head_at, split_index) -> None:
  """A program's rows out: zeros for rows without a query token (not `valid`); with one split the
  normalised output [A, N, H], else the partials for `split_combine` ([A, splits, N(, H)]).
  Row i goes to token token_at[i], head head_at[i]; rows not `stored` are dropped."""
  acc, row_max, denom = carry
  acc = jnp.where(valid[:, None], acc, 0.0)
  row_max = jnp.where(valid, row_max, -jnp.inf)
  denom = jnp.where(valid, denom, 0.0)
  dims = jnp.arange(acc.shape[1])
  if len(out_refs) == 1:  # one split: normalise here
    (out_ref,) = out_refs
    out = acc / jnp.where(denom > 0, denom, 1.0)[:, None]
    pltriton.store(out_ref.at[token_at[:, None], head_at[:, None], dims[None, :]],
                   out.astype(out_ref.dtype), mask=stored[:, None])
    return
  acc_ref, max_ref, denom_ref = out_refs
  pltriton.store(acc_ref.at[token_at[:, None], split_index, head_at[:, None], dims[None, :]], acc,
                 mask=stored[:, None])
  pltriton.store(max_ref.at[token_at, split_index, head_at], row_max, mask=stored)
  pltriton.store(denom_ref.at[token_at, split_index, head_at], denom, mask=stored)


def new_heads(heads: int, kv_heads: int, kv_head):
  """Where KV head `kv_head`'s new key and value lie among the fused heads of qkv [A, N + 2K, H]:
  (N + kv_head, N + K + kv_head)."""
  return heads + kv_head, heads + kv_heads + kv_head


def _decode_kernel(q_lens_ref, lens_ref, tables_ref, layer_ref, qkv_ref, k_pages_ref, v_pages_ref,
                   *out_refs, sm_scale: float, rows: int, group: int, block_k: int, split: int,
                   heads: int):
  """One (sequence, KV head, split) program of a decode-only call: sequence r's one query token
  (if q_lens[r] > 0) is token r, at position seq_lens[r] - 1. Refs as `_kernel`'s, without the
  tile layout and query_starts."""
  *out_refs, k_out_ref, v_out_ref = out_refs
  num_blocks_table = tables_ref.shape[1]
  head_dim = qkv_ref.shape[2]
  page_size = k_pages_ref.shape[2]
  seq, kv_head, split_index = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  layer = layer_ref[0]
  active = q_lens_ref[seq] > 0
  position = jnp.where(active, lens_ref[seq], 0) - 1  # the token's own key (-1: idle)

  # [rows] = the padded group heads of this KV head
  row = jnp.arange(rows)
  stored = row < group
  head = kv_head * group + jnp.minimum(row, group - 1)
  token = jnp.full((rows,), seq, jnp.int32)
  dims = jnp.arange(head_dim)
  # [rows, H]
  query = pltriton.load(qkv_ref.at[token[:, None], head[:, None], dims[None, :]],
                        mask=(stored & active)[:, None], other=0.0)
  key_head, value_head = new_heads(heads, k_pages_ref.shape[3], kv_head)
  split_start = split_index * split
  carry = (jnp.zeros((rows, head_dim), jnp.float32), jnp.full((rows,), -jnp.inf, jnp.float32),
           jnp.zeros((rows,), jnp.float32))
  acc, row_max, denom = _cached_keys(carry, query, tables_ref, k_pages_ref, v_pages_ref, layer,
                                     seq, kv_head, split_start,
                                     jnp.minimum(position, split_start + split), block_k,
                                     sm_scale)

  # The token's own key, in the split that holds its position: one key, elementwise.
  own = active & (position >= split_start) & (position < split_start + split)
  # [H]
  key, value = (pltriton.load(qkv_ref.at[seq, at, :]).astype(jnp.float32)
                for at in (key_head, value_head))
  # [rows]
  score = jnp.sum(query.astype(jnp.float32) * key[None, :], axis=1) * sm_scale
  new_max = jnp.where(own, jnp.maximum(row_max, score), row_max)
  safe_max = jnp.where(jnp.isfinite(new_max), new_max, 0.0)
  rescale = jnp.exp(row_max - safe_max)
  prob = jnp.where(own, jnp.exp(score - safe_max), 0.0)
  acc = acc * rescale[:, None] + prob[:, None] * value[None, :]
  denom, row_max = denom * rescale + prob, new_max
  head_at = jnp.where(stored, head, heads)  # rows past the group: dropped
  _store(out_refs, (acc, row_max, denom), stored & active, stored, token, head_at, split_index)

  @pl.when((split_index == 0) & active)
  def _write_new():
    page = tables_ref[seq, jnp.clip(position // page_size, 0, num_blocks_table - 1)]
    slot = position % page_size
    for at, out_ref in ((key_head, k_out_ref), (value_head, v_out_ref)):
      pltriton.store(out_ref.at[layer, page, slot, kv_head, :],
                     pltriton.load(qkv_ref.at[seq, at, :]).astype(out_ref.dtype))


def _kernel(meta_ref, tables_ref, layer_ref, qkv_ref, k_pages_ref, v_pages_ref, *out_refs,
            sm_scale: float, tile_tokens: int, padded_group: int, group: int, block_k: int,
            split: int, heads: int):
  """One (tile, KV head, split) program. Every ref is a whole array (indexed in place):
  meta_ref [TILE_FIELDS, X] (`tile_meta`: each tile's first token, its sequence's first query
  token, query tokens, length and region end, whether it is active); tables_ref [X, W] (each
  tile's sequence's block table); layer_ref [1]; qkv_ref [A, N + 2K, H] (queries, keys,
  values: `new_heads`); k_pages_ref, v_pages_ref [L, M, C, K, H]. Outputs: with one split
  out_ref [A, N, H], with several the partials acc_ref [A, splits, N, H] f32 and max_ref,
  denom_ref [A, splits, N] f32; then the aliased pages. Every load before the keys' depends on
  the program's ids alone: the first key block waits for one load, its page."""
  *out_refs, k_out_ref, v_out_ref = out_refs
  tokens, _, head_dim = qkv_ref.shape
  num_blocks_table = tables_ref.shape[1]
  page_size = k_pages_ref.shape[2]
  tile, kv_head, split_index = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  layer = layer_ref[0]

  tile_start, q_begin, q_len, seq_len, region_end, active = (meta_ref[field, tile]
                                                             for field in range(TILE_FIELDS))
  active = active > 0  # else padding tokens (zeros written) or no token at all
  q_end = q_begin + q_len
  first_position = seq_len - q_len
  split_start = split_index * split
  first_page = tables_ref[tile, jnp.minimum(split_start // page_size, num_blocks_table - 1)]

  # [Q G_pad] rows: token tile_start + row // G_pad, query head kv_head G + row % G_pad.
  rows = jnp.arange(tile_tokens * padded_group)
  row_token = tile_start + rows // padded_group
  row_in_group = rows % padded_group
  row_stored = (row_token < region_end) & (row_in_group < group)
  row_valid = row_stored & (row_token < q_end)
  row_position = first_position + row_token - q_begin
  # Rows not stored index past the arrays: their stores are dropped.
  row_token_at = jnp.where(row_stored, row_token, tokens)
  row_head = kv_head * group + jnp.minimum(row_in_group, group - 1)
  dims = jnp.arange(head_dim)
  # Keys the tile attends: positions below its last token's position + 1.
  tile_keys = jnp.where(active, jnp.minimum(seq_len, first_position + tile_start - q_begin
                                            + tile_tokens), 0)
  # This split's keys: positions [split_start, split_end) below tile_keys, those before the
  # first query position from the pages, the others from qkv (one loop each).
  split_end = split_start + split
  cached_end = jnp.minimum(jnp.minimum(first_position, tile_keys), split_end)
  new_start = jnp.maximum(first_position, split_start)
  new_end = jnp.minimum(tile_keys, split_end)

  # [Q G_pad, H]
  key_head, value_head = new_heads(heads, k_pages_ref.shape[3], kv_head)
  query = pltriton.load(qkv_ref.at[row_token_at[:, None], row_head[:, None], dims[None, :]],
                        mask=row_valid[:, None], other=0.0)

  def online(carry, keys, values, visible=None):
    return _online(carry, query, keys, values, sm_scale, visible)

  # Loop 1: the cached keys. Each is below every query position of the tile (no causal mask).
  rows = tile_tokens * padded_group
  initial = (jnp.zeros((rows, head_dim), jnp.float32), jnp.full((rows,), -jnp.inf, jnp.float32),
             jnp.zeros((rows,), jnp.float32))
  carry = _cached_keys(initial, query, tables_ref, k_pages_ref, v_pages_ref, layer, tile,
                       kv_head, split_start, cached_end, block_k, sm_scale, first_page)

  # Loop 2: the call's own keys, from qkv. Keys below the tile's first position are
  # seen by every row (interior blocks: contiguous token windows, unmasked); the blocks from
  # there on are masked causally.
  def own_block(block_start, masked: bool, size: int):
    token = q_begin + block_start - first_position  # the block's first key among the tokens
    if not masked:
      keys, values = (pltriton.load(qkv_ref.at[pl.ds(token, size), at, :])
                      for at in (key_head, value_head))
      return keys, values, None
    block_end = jnp.minimum(block_start + size, new_end)
    if tokens >= size:
      # A contiguous window of tokens, its start held inside the array (the keys a clamped
      # window also covers before block_start are masked: an earlier block had them).
      window = jnp.minimum(token, tokens - size)
      # [size]
      position = first_position + window - q_begin + jnp.arange(size)
      valid = (position >= block_start) & (position < block_end)
      keys, values = (pltriton.load(qkv_ref.at[pl.ds(window, size), at, :],
                                    mask=valid[:, None], other=0.0)
                      for at in (key_head, value_head))
    else:  # fewer tokens than a block: gathered rows
      position = block_start + jnp.arange(size)
      valid = position < block_end
      at = jnp.where(valid, token + jnp.arange(size), tokens)
      keys, values = (pltriton.load(qkv_ref.at[at[:, None], head, dims[None, :]],
                                    mask=valid[:, None], other=0.0)
                      for head in (key_head, value_head))
    visible = (position[None, :] <= row_position[:, None]) & valid[None, :]
    return keys, values, visible

  # A call of fewer tokens than block_k (small decode batches) has at most `tokens` own keys:
  # one block of the next power of two (>= MIN_DOT_DIM) holds them all.
  own_size = min(block_k, max(MIN_DOT_DIM, pl.next_power_of_2(tokens)))
  tile_first = first_position + tile_start - q_begin  # the tile's first query position
  interior = (jnp.maximum(jnp.minimum(new_end, tile_first) - new_start, 0) // own_size
              if tokens >= own_size else 0)

  def full_own(block_index, carry):
    keys, values, _ = own_block(new_start + block_index * own_size, False, own_size)
    return online(carry, keys, values)

  def masked_own(block_index, carry):
    keys, values, visible = own_block(new_start + block_index * own_size, True, own_size)
    return online(carry, keys, values, visible)

  carry = lax.fori_loop(0, interior, full_own, carry)
  acc, row_max, denom = lax.fori_loop(
      interior, pl.cdiv(jnp.maximum(new_end - new_start, 0), own_size), masked_own, carry)
  # Padding rows of a region saw the keys unmasked: they output nothing (zeros).
  _store(out_refs, (acc, row_max, denom), row_valid, row_stored, row_token_at, row_head,
         split_index)

  @pl.when(split_index == 0)
  def _write_new():
    # [Q] this tile's tokens, their positions, pages and slots
    token = tile_start + jnp.arange(tile_tokens)
    valid = active & (token < q_end)
    position = first_position + token - q_begin
    page = tables_ref[tile, jnp.clip(position // page_size, 0, num_blocks_table - 1)]
    page = jnp.where(valid, page, k_out_ref.shape[1])
    slot = position % page_size
    token_at = jnp.where(valid, token, 0)
    for at, out_ref in ((key_head, k_out_ref), (value_head, v_out_ref)):
      # [Q, H]
      new = pltriton.load(qkv_ref.at[token_at[:, None], at, dims[None, :]],
                          mask=valid[:, None], other=0.0)
      pltriton.store(out_ref.at[layer, page[:, None], slot[:, None], kv_head, dims[None, :]],
                     new.astype(out_ref.dtype), mask=valid[:, None])


@functools.partial(jax.jit, static_argnames=("sm_scale", "config", "decode_only", "interpret"),
                   donate_argnames=("k_pages", "v_pages"))
def ragged_paged_attention(qkv, k_pages, v_pages, layer, block_tables, seq_lens, query_starts,
                           query_lens=None, *, sm_scale: float | None = None,
                           config: RaggedPagedAttentionConfig = RaggedPagedAttentionConfig(),
                           decode_only: bool = False, interpret: bool = False):
  """Attention of a flat batch of query tokens over their sequences' pages (module docstring),
  writing the tokens' keys and values into the pages in place.

  Args:
    qkv: [A, N + 2K, H] the tokens' N query heads, then their K keys and K values (as the fused
      QKV projection leaves them: read in place, no slices), the pages' dtype, float32 or
      bfloat16; H a power of two >= 16.
    k_pages, v_pages: [L, M, C, K, H] the paged cache, donated; C a power of two >= 16.
    layer: int32 scalar, the layer attended and written.
    block_tables: int32 [R, W]; seq_lens: int32 [R], each <= W C; query_starts: int32 [R + 1],
      non-decreasing, query_starts[R] <= A; query_lens: int32 [R], query_lens[r] <=
      min(query_starts[r + 1] - query_starts[r], seq_lens[r]), or None: the whole regions. A
      sequence with no query token (an idle row) is neither read nor written.
    sm_scale: softmax scale, 1/sqrt(H) when None.
    config: block sizes and launch settings.
    decode_only: the caller promises a decode step's layout, query_starts = arange(R + 1) (A =
      R; sequence r's query token, if query_lens[r] is 1, is token r): one program per
      (sequence, KV head, split), no tile layout, the token's own key folded in elementwise.
    interpret: run in the Pallas interpreter (CPU tests).
  Returns:
    (out [A, N, H] in qkv's dtype, zeros for padding tokens; k_pages; v_pages).
  """
  query_starts, query_lens, tokens, head_dim, page_size, kv_heads, heads = checked_layout(
      qkv, k_pages, v_pages, block_tables, seq_lens, query_starts, query_lens)
  if qkv.dtype not in _KERNEL_DTYPES:
    raise ValueError(f"qkv dtype must be float32 or bfloat16 for the kernel; got {qkv.dtype}")
  if not is_power_of_two(head_dim) or head_dim < MIN_DOT_DIM:
    raise ValueError(f"qkv head_dim must be a power of two >= {MIN_DOT_DIM} for the kernel; got "
                     f"qkv {tuple(qkv.shape)} (use ragged_paged_attention_reference)")
  block_k = min(config.block_k, page_size)
  if not is_power_of_two(page_size) or page_size < MIN_DOT_DIM:
    raise ValueError(f"the page size C must be a power of two >= {MIN_DOT_DIM} for the kernel; "
                     f"got k_pages {tuple(k_pages.shape)}")
  if sm_scale is None:
    sm_scale = 1.0 / math.sqrt(head_dim)
  group = heads // kv_heads
  padded_group = pl.next_power_of_2(group)
  tile_tokens = max(1, config.tile_rows // padded_group)

  positions = block_tables.shape[1] * page_size
  seq_lens, block_tables = seq_lens.astype(jnp.int32), block_tables.astype(jnp.int32)
  arrays = [jnp.asarray(layer, jnp.int32).reshape(1), qkv, k_pages, v_pages]
  if decode_only:
    if tokens != block_tables.shape[0]:
      raise ValueError(f"decode_only needs one token per sequence (A = R); got qkv "
                       f"{tuple(qkv.shape)}, block_tables {tuple(block_tables.shape)}")
    programs = tokens
    split, num_splits = split_layout(programs, kv_heads, positions, config, block_k)
    kernel = functools.partial(_decode_kernel, sm_scale=float(sm_scale),
                               rows=max(MIN_DOT_DIM, padded_group), group=group,
                               block_k=block_k, split=split, heads=heads)
    operands = [query_lens, seq_lens, block_tables, *arrays]
  else:
    meta, tables = tile_meta(query_starts, query_lens, seq_lens, block_tables, tokens,
                             tile_tokens)
    programs = meta.shape[1]
    split, num_splits = split_layout(programs, kv_heads, positions, config, block_k)
    kernel = functools.partial(_kernel, sm_scale=float(sm_scale), tile_tokens=tile_tokens,
                               padded_group=padded_group, group=group, block_k=block_k,
                               split=split, heads=heads)
    operands = [meta, tables, *arrays]

  def whole(shape):  # the whole array as every program's block (indexed in the kernel)
    return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))

  if num_splits == 1:
    out_shape = [jax.ShapeDtypeStruct((tokens, heads, head_dim), qkv.dtype)]
  else:
    # The partials with the splits beside the rows, as split_combine takes them.
    out_shape = [jax.ShapeDtypeStruct((tokens, num_splits, heads, head_dim), jnp.float32),
                 jax.ShapeDtypeStruct((tokens, num_splits, heads), jnp.float32),
                 jax.ShapeDtypeStruct((tokens, num_splits, heads), jnp.float32)]
  out_shape += [jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype),
                jax.ShapeDtypeStruct(v_pages.shape, v_pages.dtype)]
  *result, k_pages, v_pages = pl.pallas_call(
      kernel,
      grid=(programs, kv_heads, num_splits),
      in_specs=[whole(x.shape) for x in operands],
      out_specs=[whole(s.shape) for s in out_shape],
      out_shape=out_shape,
      input_output_aliases={len(operands) - 2: len(out_shape) - 2,
                            len(operands) - 1: len(out_shape) - 1},
      compiler_params=pltriton.CompilerParams(num_warps=config.num_warps,
                                              num_stages=config.num_stages),
      interpret=interpret,
      name="ragged_paged_attention",
  )(*operands)
  if num_splits == 1:
    return result[0], k_pages, v_pages
  return split_combine(*result, dtype=qkv.dtype, interpret=interpret), k_pages, v_pages


@functools.partial(jax.jit, static_argnames=("sm_scale",), donate_argnames=("k_pages", "v_pages"))
def ragged_paged_attention_reference(qkv, k_pages, v_pages, layer, block_tables, seq_lens,
                                     query_starts, query_lens=None, *,
                                     sm_scale: float | None = None):
  """`ragged_paged_attention` in plain jnp: the tokens' keys and values scattered into their
  pages, then masked float32 softmax attention over each token's gathered block table (memory
  A x W C x K x H: for tests and small models). Same arguments and results, any float dtype
  and head_dim."""
  query_starts = query_starts.astype(jnp.int32)
  query_lens = _query_lens(query_starts, query_lens)
  _check(qkv, k_pages, v_pages, block_tables, seq_lens, query_starts, query_lens)
  _, num_pages, page_size, kv_heads, _ = k_pages.shape
  q, k_new, v_new = split_qkv(qkv, kv_heads)
  tokens, heads, head_dim = q.shape
  sequences, width = block_tables.shape
  if sm_scale is None:
    sm_scale = 1.0 / math.sqrt(head_dim)
  # [A] each token's sequence, whether it is a query token (else padding) and its position
  seq, real, position = token_positions(query_starts, query_lens, seq_lens, tokens)
  page = jnp.where(real, block_tables[seq, jnp.clip(position // page_size, 0, width - 1)],
                   num_pages)
  slot = position % page_size
  k_pages = k_pages.at[layer, page, slot].set(k_new.astype(k_pages.dtype), mode="drop")
  v_pages = v_pages.at[layer, page, slot].set(v_new.astype(v_pages.dtype), mode="drop")
  # [A, W C, K, H] each token's sequence's keys and values, position order
  keys = k_pages[layer][block_tables[seq]].reshape(tokens, width * page_size, kv_heads, head_dim)
  values = v_pages[layer][block_tables[seq]].reshape(keys.shape)
  group = heads // kv_heads
  # [A, K, G, H]
  grouped = q.reshape(tokens, kv_heads, group, head_dim).astype(jnp.float32)
  # [A, K, G, W C]
  scores = jnp.einsum("akgh,atkh->akgt", grouped, keys.astype(jnp.float32),
                      precision=lax.Precision.HIGHEST) * sm_scale
  # [A, 1, 1, W C]
  visible = ((jnp.arange(width * page_size)[None, :] <= position[:, None])
             & real[:, None])[:, None, None]
  scores = jnp.where(visible, scores, -jnp.inf)
  row_max = jnp.max(scores, axis=-1, keepdims=True)
  row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
  weights = jnp.where(visible, jnp.exp(scores - row_max), 0.0)
  denom = jnp.sum(weights, axis=-1, keepdims=True)
  probs = weights / jnp.where(denom > 0, denom, 1.0)
  # [A, K, G, H]
  out = jnp.einsum("akgt,atkh->akgh", probs, values.astype(jnp.float32),
                   precision=lax.Precision.HIGHEST)
  return out.reshape(tokens, heads, head_dim).astype(q.dtype), k_pages, v_pages
