"""Prompt-chunk attention over a paged KV cache on the Mosaic GPU backend (Hopper: TMA and wgmma).

The same contract as `ragged_paged_attention` (a flat batch of query tokens from many sequences,
regions by query_starts, the cache [L, M, C, K, H], the new tokens' keys and values written into
their pages), built for calls with many query tokens per sequence, where the Triton kernel runs
at about half of PyTorch SDPA's speed (benchmarks/results/ragged_paged_attention_v3_h200.md;
jax's Mosaic GPU FlashAttention-3 example at 1.2x SDPA on the same shapes, attention_h200.md).

  1. Tiles. Each sequence's query tokens are cut into tiles of `consumers` x 64 tokens
     (`aligned_tiles`). A program (CTA) runs per (tile, query head) with consumers + 1
     warpgroups: the consumers, one per 64 tokens (the wgmma M of 64 rows), and a producer that
     streams key and value blocks of block_kv positions into SMEM with TMA,
     `max_concurrent_steps` blocks ahead. Programs run the heaviest tiles first (a sequence's
     tiles in reverse).
  2. Keys. The producer streams the sequence's cached positions [0, first query position) from
     its pages (a block of block_kv positions: one TMA copy within a page, or one per page when
     pages are smaller), then the tokens' own keys from qkv [A, N + 2K, H] in place, in blocks
     of block_kv tokens from the sequence's first query token rounded down to ALIGN, up to the
     tile's last token. Each consumer attends to the blocks up to its own last token (it only
     releases the tile's later ones) and masks only the blocks that need it (the cached keys'
     last partial block, own blocks holding earlier tokens or positions past its first row),
     with the online softmax in base 2 (the scale folded into one multiply-add) and the
     rescaled sum accumulated in place by the values' wgmma.
  3. Out. Each consumer stores its rows of the region (padding tokens of the region: zeros)
     from SMEM with TMA copies of 64, 32, ..., 1 rows (a box per power of two: the row count
     is only known at run time); rows past the region are not written, so tiles never touch a
     row of another sequence.
  4. The write. The programs of each KV group's first query head store their tile's new keys
     and values into the pages (the caches are aliased to the outputs), in runs that end at
     page ends; nothing reads a slot the call writes.

The launch settings are `MosaicPrefillConfig`'s. The kernel runs under the Mosaic GPU
interpreter on the CPU (`interpret=True`: tests; its wgmma takes both operands from SMEM, so
there the probabilities go through an SMEM buffer instead of registers).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from cg_jax.kernels.ragged_paged_attention import checked_layout, new_heads

# wgmma's rows per warpgroup: 64 query tokens per consumer.
WG_ROWS = 64
ALIGN = 8  # tokens: a tile's and a key block's first token is a multiple of it
_LOG2E = math.log2(math.e)
_DTYPES = (jnp.bfloat16, jnp.float16)
# Whether this jax runs the kernel (refs passed to a Mosaic GPU kernel; the interpreter).
SUPPORTED = tuple(int(part) for part in jax.__version__.split(".")[:2]) >= (0, 11)


@dataclasses.dataclass(frozen=True)
class MosaicPrefillConfig:
  """Launch settings: `consumers` attending warpgroups per program (a tile holds 64 tokens
  each; 1 or 2), `max_concurrent_steps` key/value blocks in flight per program (SMEM buffers
  of 2 x block_kv x H each); `pingpong` (two consumers): they take turns at the tensor cores,
  one's softmax running while the other's products do (FlashAttention-3's schedule);
  `block_kv`: key positions per block (64 or 128; the default measured faster at 2,048 and
  4,096 tokens, benchmarks/results/mosaic_prefill_h100.md)."""

  consumers: int = 2
  max_concurrent_steps: int = 2
  pingpong: bool = True
  block_kv: int = 128

  def __post_init__(self):
    if self.consumers not in (1, 2):
      raise ValueError(f"consumers must be 1 or 2; got {self.consumers!r}")
    if self.block_kv not in (64, 128):
      raise ValueError(f"block_kv must be 64 or 128; got {self.block_kv!r}")
    if not isinstance(self.max_concurrent_steps, int) or self.max_concurrent_steps < 1:
      raise ValueError(f"max_concurrent_steps must be an int >= 1; got "
                       f"{self.max_concurrent_steps!r}")


# The fields of `aligned_tiles`' first result, one row each.
TILE_FIELDS = 6


def aligned_tiles(query_starts, query_lens, seq_lens, block_tables, tokens: int,
                  consumers: int):
  """Tiles of `consumers` x 64 tokens whose first token is a multiple of ALIGN (Mosaic GPU's
  TMA copy into a tiled SMEM buffer starts at a multiple of its 8-row tiles): sequence r's
  tiles cover its region [query_starts[r], query_starts[r + 1]) from its start rounded down to
  ALIGN (rows before the region are not stored), and the tokens past query_starts[R] get tiles
  of their own (zeros).

  Returns (meta [TILE_FIELDS, X] int32: each tile's first token, its region's first token (the
  sequence's first query token), query tokens (0 when inactive), sequence length, region end,
  1 if it holds query tokens; tables [X, W]: its sequence's block table), X = an upper bound
  of the tiles (those past them all have an empty region)."""
  sequences = query_starts.shape[0] - 1
  tile = consumers * WG_ROWS
  count = pl.cdiv(tokens + ALIGN * (sequences + 1), tile) + sequences + 1
  # [R + 1]: the sequences' regions, then the padding past them
  begins = query_starts.astype(jnp.int32)
  ends = jnp.append(begins[1:], tokens)
  aligned = begins - begins % ALIGN
  last = jnp.cumsum(pl.cdiv(ends - aligned, tile) * (ends > begins))
  # [X]
  index = jnp.arange(count, dtype=jnp.int32)
  owner = jnp.searchsorted(last, index, side="right", method="compare_all").astype(jnp.int32)
  first = jnp.where(owner > 0, last[jnp.maximum(owner - 1, 0)], 0)
  held = owner <= sequences
  region = jnp.minimum(owner, sequences)
  seq = jnp.minimum(owner, sequences - 1)
  active = owner < sequences
  q_lens = jnp.where(active, query_lens[seq], 0)
  meta = jnp.stack([aligned[region] + (index - first) * tile, begins[region], q_lens,
                    seq_lens[seq], jnp.where(held, ends[region], 0),
                    (active & (q_lens > 0)).astype(jnp.int32)]).astype(jnp.int32)
  return meta, block_tables[seq]


def _store_rows(o_smem, out_gmem, first_token, lo, hi, head, most: int = WG_ROWS) -> None:
  """Rows [lo, hi) of o_smem [64, H] (0 <= lo <= hi, hi - lo <= most, known at run time) to
  out_gmem[first_token + i, head]: `most` rows (a power of two <= 64) in one TMA copy, else one
  copy per set bit of the count, most / 2 rows down to 1."""
  count = hi - lo

  @pl.when(count == most)
  def _whole():
    plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(lo, most)],
                            out_gmem.at[pl.ds(first_token + lo, most), head])

  start = lo
  size = most // 2
  while size >= 1:
    @pl.when((count & size) != 0)
    def _copy(start=start, size=size):
      plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(start, size)],
                              out_gmem.at[pl.ds(first_token + start, size), head])
    start = start + (count & size)
    size //= 2


def _kernel(meta_ref, tables_ref, layer_ref, qkv_ref, k_pages_ref, v_pages_ref, out_ref,
            q_smem, o_smem, k_smem, v_smem, q_barriers, k_barriers, v_barriers, k_consumed,
            v_consumed, schedule, w_smem, w_barrier, p_smem=None, *, sm_scale: float,
            heads: int, steps: int, consumers: int, pingpong: bool, block: int):
  """One (tile, query head) program: warpgroups 0 .. consumers - 1 attend, the last one loads
  the keys and values (and writes the new ones into the pages). Refs as `aligned_tiles` and
  `mosaic_prefill_attention` give them (whole arrays in GMEM), then the SMEM buffers and
  barriers of the kernel's scratch list."""
  # (tiles in reverse, the heaviest first: a sequence's later tiles attend to more keys)
  tile = meta_ref.shape[1] - 1 - lax.axis_index("tile")
  head = lax.axis_index("head")
  wg = lax.axis_index("wg")
  kv_heads, page_size = k_pages_ref.shape[3], k_pages_ref.shape[2]
  kv_head = head // (heads // kv_heads)
  layer = layer_ref[0]
  tile_first, q_begin, q_len, seq_len, region_end, active = (
      meta_ref[field, tile] for field in range(TILE_FIELDS))
  tile_first = pl.multiple_of(tile_first, ALIGN)
  first_position = seq_len - q_len
  active = active > 0
  # The tile's keys: cached blocks over positions [0, first_position) from the pages, then own
  # blocks of tokens from `base` (q_begin rounded down; keys before q_begin are masked) up to
  # the tile's last query token.
  base = pl.multiple_of(q_begin - q_begin % ALIGN, ALIGN)
  tile_end = jnp.minimum(tile_first + consumers * WG_ROWS, q_begin + q_len)
  cached_steps = jnp.where(active, pl.cdiv(first_position, block), 0)
  own_steps = jnp.where(active, pl.cdiv(jnp.maximum(tile_end - base, 0), block), 0)
  kv_steps = cached_steps + own_steps

  @pl.when(wg < consumers)
  def _consumer():
    plgpu.set_max_registers(232, action="increase")
    first_token = pl.multiple_of(tile_first + wg * WG_ROWS, ALIGN)
    qo = q_smem.at[wg]
    # This consumer's blocks: up to its last query token (the tile's later blocks are only
    # released); none when it holds no query token.
    rows_end = jnp.minimum(first_token + WG_ROWS, tile_end)
    own_steps_wg = pl.cdiv(jnp.maximum(rows_end - base, 0), block)
    steps_wg = jnp.where(active & (first_token < tile_end),
                         jnp.minimum(cached_steps + own_steps_wg, kv_steps), 0)

    @pl.when(active)  # (a tile of padding tokens stores zeros: no queries to load)
    def _load_queries():
      plgpu.copy_gmem_to_smem(qkv_ref.at[pl.ds(first_token, WG_ROWS), head], qo,
                              q_barriers.at[wg])
      plgpu.barrier_wait(q_barriers.at[wg])
    # Row i: token first_token + i, at position first_row_position + i (rows before q_begin
    # attend as its first token: they are not stored, and stay finite).
    first_row_position = first_position + first_token - q_begin
    scale = sm_scale * _LOG2E

    def take_turn():  # (pingpong: both consumers meet; the turns alternate from there)
      if pingpong:
        plgpu.barrier_arrive(schedule)
        plgpu.barrier_wait(schedule)

    def step(index, carry, mask: str | None, key_start=None):
      """One key block; `mask`: None (every row sees every key), "cached" (keys at
      key_start + j below first_position) or "own" (keys at key_start + j from
      first_position up to each row's position)."""
      acc, row_max, denom = carry
      slot = index % steps
      plgpu.barrier_wait(k_barriers.at[slot])

      def qk_scope(acc_ref):
        plgpu.wgmma(acc_ref, qo, k_smem.at[slot].transpose((1, 0)))
        take_turn()
        return acc_ref[...]
      # [64, block] raw scores
      scores = pl.run_scoped(qk_scope, plgpu.ACC((WG_ROWS, block), jnp.float32))
      plgpu.barrier_arrive(k_consumed.at[slot])
      if mask is not None:
        rows = plgpu.broadcasted_iota(jnp.int32, (WG_ROWS, block), 0, layout=plgpu.Layout.WGMMA)
        cols = plgpu.broadcasted_iota(jnp.int32, (WG_ROWS, block), 1, layout=plgpu.Layout.WGMMA)
        key_position = key_start + cols
        if mask == "cached":
          visible = key_position < first_position
        else:
          row_position = jnp.maximum(first_row_position + rows, first_position)
          visible = (key_position >= first_position) & (key_position <= row_position)
        scores = jnp.where(visible, scores, -jnp.inf)
      # Base-2 online softmax: the max kept scaled (one multiply-add per score).
      new_max = jnp.maximum(row_max, scores.max(axis=1) * scale)
      rescale = jnp.exp2(row_max - new_max)
      probs = jnp.exp2(scores * scale - lax.broadcast_in_dim(new_max, scores.shape, [0]))
      denom = denom * rescale + probs.sum(axis=1)
      acc = acc * lax.broadcast_in_dim(rescale, acc.shape, [0])
      probs = probs.astype(qo.dtype)
      if pingpong:  # softmax done; wait for the values, then for the tensor cores
        acc, new_max, denom, probs = lax.optimization_barrier((acc, new_max, denom, probs))
        plgpu.barrier_arrive(schedule)
      plgpu.barrier_wait(v_barriers.at[slot])
      if pingpong:
        plgpu.barrier_wait(schedule)

      def pv(acc_ref):
        plgpu.wgmma(acc_ref, probs, v_smem.at[slot])
      if p_smem is None:  # [64, H] this block's values added to the rescaled sum in the wgmma
        acc = pl.run_state(pv)(plgpu.ACC.init(acc))
      else:  # (the interpreter: its wgmma takes SMEM operands and starts from zeros)
        p_smem.at[wg][...] = probs
        plgpu.commit_smem()
        probs = p_smem.at[wg]

        def pv_from_zeros(acc_ref):
          pv(acc_ref)
          return acc_ref[...]
        acc = acc + pl.run_scoped(pv_from_zeros, plgpu.ACC(acc.shape, jnp.float32))
      plgpu.barrier_arrive(v_consumed.at[slot])
      return acc, new_max, denom

    def skip(index, _):
      """A block past this consumer's rows: observed, released and its turns kept, nothing
      computed."""
      slot = index % steps
      for arrived, consumed in ((k_barriers, k_consumed), (v_barriers, v_consumed)):
        plgpu.barrier_wait(arrived.at[slot])
        plgpu.barrier_arrive(consumed.at[slot])
      take_turn()
      take_turn()

    head_dim = qo.shape[-1]
    carry = (plgpu.layout_cast(jnp.zeros((WG_ROWS, head_dim), jnp.float32), plgpu.Layout.WGMMA),
             plgpu.layout_cast(jnp.full((WG_ROWS,), -jnp.inf, jnp.float32),
                               plgpu.Layout.WGMMA.reduce(1)),
             plgpu.layout_cast(jnp.zeros((WG_ROWS,), jnp.float32), plgpu.Layout.WGMMA.reduce(1)))
    # Every consumer meets the schedule barrier 2 kv_steps + 1 times: the second starts a turn
    # behind the first.
    pl.when(wg == 1)(take_turn)
    # Cached keys: every row sees them all; only a last partial block is masked.
    # (every loop bound capped at this consumer's blocks)
    whole_cached = jnp.minimum(first_position // block, jnp.minimum(cached_steps, steps_wg))
    cached_end = jnp.minimum(cached_steps, steps_wg)
    carry = lax.fori_loop(0, whole_cached, lambda i, c: step(i, c, None), carry)
    carry = lax.fori_loop(whole_cached, cached_end,
                          lambda i, c: step(i, c, "cached", i * block), carry)

    # Own keys: masked where a block holds tokens before q_begin (the first, if q_begin is not
    # aligned) or positions past this warpgroup's first row; the blocks between are whole.
    def own(i, c, mask):
      return step(i, c, mask, first_position + base + (i - cached_steps) * block - q_begin)
    lead = jnp.minimum(cached_steps + jnp.minimum((q_begin != base).astype(jnp.int32), own_steps),
                       steps_wg)
    whole_end = jnp.clip(cached_steps + (first_token - base) // block, lead, steps_wg)
    carry = lax.fori_loop(cached_end, lead, lambda i, c: own(i, c, "own"), carry)
    carry = lax.fori_loop(lead, whole_end, lambda i, c: own(i, c, None), carry)
    acc, _, denom = lax.fori_loop(whole_end, steps_wg, lambda i, c: own(i, c, "own"), carry)
    lax.fori_loop(steps_wg, kv_steps, skip, None)
    pl.when(wg == 0)(take_turn)

    # [64, H]: rows of query tokens normalised, the region's padding rows zeros
    rows = plgpu.broadcasted_iota(jnp.int32, (WG_ROWS, head_dim), 0, layout=plgpu.Layout.WGMMA)
    keep = active & (first_token + rows >= q_begin) & (first_token + rows < q_begin + q_len)
    out = jnp.where(keep, acc / lax.broadcast_in_dim(jnp.where(denom > 0, denom, 1.0),
                                                      acc.shape, [0]), 0.0)
    o_smem.at[wg][...] = out.astype(o_smem.dtype)
    plgpu.commit_smem()
    # Stored: the rows inside the tile's region.
    lo = jnp.clip(q_begin - first_token, 0, WG_ROWS)
    hi = jnp.clip(region_end - first_token, lo, WG_ROWS)
    _store_rows(o_smem.at[wg], out_ref, first_token, lo, hi, head)
    plgpu.wait_smem_to_gmem(0)

  @pl.when(wg == consumers)
  def _producer():
    plgpu.set_max_registers(40, action="decrease")
    width = tables_ref.shape[1]
    chunk = min(page_size, block)
    copies = block // chunk
    key_head, value_head = new_heads(heads, kv_heads, kv_head)

    @pl.loop(0, kv_steps)
    def _load(index):
      slot = index % steps

      @pl.when(index >= steps)
      def _wait():  # every consumer is done with the block this slot held
        plgpu.barrier_wait(k_consumed.at[slot])
        plgpu.barrier_wait(v_consumed.at[slot])

      # A block is `copies` TMA copies of `chunk` rows (one page each when pages are smaller
      # than a block); each arrives on the slot's barrier.
      @pl.when(index < cached_steps)
      def _cached():
        for c in range(copies):
          position = index * block + c * chunk
          page = tables_ref[tile, jnp.minimum(position // page_size, width - 1)]
          window = (layer, page, pl.ds(pl.multiple_of(position % page_size, chunk), chunk),
                    kv_head)
          rows = pl.ds(c * chunk, chunk)
          plgpu.copy_gmem_to_smem(k_pages_ref.at[window], k_smem.at[slot, rows],
                                  k_barriers.at[slot])
          plgpu.copy_gmem_to_smem(v_pages_ref.at[window], v_smem.at[slot, rows],
                                  v_barriers.at[slot])

      @pl.when(index >= cached_steps)
      def _own():
        for c in range(copies):
          token = pl.multiple_of(base + (index - cached_steps) * block + c * chunk, ALIGN)
          rows = pl.ds(c * chunk, chunk)
          plgpu.copy_gmem_to_smem(qkv_ref.at[pl.ds(token, chunk), key_head],
                                  k_smem.at[slot, rows], k_barriers.at[slot])
          plgpu.copy_gmem_to_smem(qkv_ref.at[pl.ds(token, chunk), value_head],
                                  v_smem.at[slot, rows], v_barriers.at[slot])

    @pl.loop(jnp.maximum(kv_steps - steps, 0), kv_steps)
    def _drain(index):  # the last blocks' releases, so that no barrier phase goes unobserved
      plgpu.barrier_wait(k_consumed.at[index % steps])
      plgpu.barrier_wait(v_consumed.at[index % steps])

    # The write: the first query head of each KV group's program stores its tile's new keys
    # and values into their pages, 64 tokens at a time through w_smem [2, 64, H] (untiled, so a
    # run can start at any row), in runs that end at page ends, each run's rows by
    # `_store_rows`. No program reads a slot this call writes.
    @pl.when(active & (head % (heads // kv_heads) == 0))
    def _write():
      for part in range(consumers):
        first_token = pl.multiple_of(tile_first + part * WG_ROWS, ALIGN)
        lo = jnp.clip(q_begin - first_token, 0, WG_ROWS)  # rows of query tokens
        hi = jnp.clip(q_begin + q_len - first_token, lo, WG_ROWS)

        @pl.when(hi > lo)
        def _part():
          for at, buffer in ((key_head, 0), (value_head, 1)):
            plgpu.copy_gmem_to_smem(qkv_ref.at[pl.ds(first_token, WG_ROWS), at],
                                    w_smem.at[buffer], w_barrier)
          plgpu.barrier_wait(w_barrier)
          start = lo
          for _ in range(WG_ROWS // min(page_size, WG_ROWS) + 1):  # (runs: one a page)
            position = first_position + first_token + start - q_begin
            page = tables_ref[tile, jnp.clip(position // page_size, 0, width - 1)]
            slot = position % page_size
            run = jnp.maximum(jnp.minimum(hi - start, page_size - slot), 0)
            for pages_ref, buffer in ((k_pages_ref, 0), (v_pages_ref, 1)):
              _store_rows(w_smem.at[buffer], pages_ref.at[layer, page], slot - start, start,
                          start + run, kv_head, min(page_size, WG_ROWS))
            start = start + run
          plgpu.wait_smem_to_gmem(0)


@functools.partial(jax.jit, static_argnames=("sm_scale", "config", "interpret"),
                   donate_argnames=("k_pages", "v_pages"))
def mosaic_prefill_attention(qkv, k_pages, v_pages, layer, block_tables, seq_lens, query_starts,
                             query_lens=None, *, sm_scale: float | None = None,
                             config: MosaicPrefillConfig = MosaicPrefillConfig(),
                             interpret: bool = False):
  """`ragged_paged_attention`'s computation (same arguments and results) on the Mosaic GPU
  backend: qkv bfloat16 or float16 with H a multiple of 64, the page size C 16, 32 or a
  multiple of 64.
  `interpret`: run in the Mosaic GPU interpreter (CPU tests)."""
  query_starts, query_lens, tokens, head_dim, page_size, kv_heads, heads = checked_layout(
      qkv, k_pages, v_pages, block_tables, seq_lens, query_starts, query_lens)
  if qkv.dtype not in _DTYPES:
    raise ValueError(f"qkv dtype must be bfloat16 or float16 for the Mosaic GPU kernel; got "
                     f"{qkv.dtype}")
  if head_dim % 64:
    raise ValueError(f"qkv head_dim must be a multiple of 64 for the Mosaic GPU kernel; got qkv "
                     f"{tuple(qkv.shape)}")
  block = config.block_kv
  if page_size % WG_ROWS and (page_size < 16 or WG_ROWS % page_size):
    raise ValueError(f"the page size C must be 16, 32 or a multiple of {WG_ROWS} for the Mosaic "
                     f"GPU kernel; got k_pages {tuple(k_pages.shape)}")
  if page_size % min(page_size, block):
    raise ValueError(f"the page size C must be a multiple of block_kv={block} when larger; got "
                     f"k_pages {tuple(k_pages.shape)}")
  copies = block // min(page_size, block)  # TMA copies a key block takes
  if not SUPPORTED:
    raise NotImplementedError(f"the Mosaic GPU prompt kernel needs jax >= 0.11 (its pages are "
                              f"refs written in place; its interpreter); this is jax "
                              f"{jax.__version__}")
  if sm_scale is None:
    sm_scale = 1.0 / math.sqrt(head_dim)
  seq_lens, block_tables = seq_lens.astype(jnp.int32), block_tables.astype(jnp.int32)
  layer = jnp.asarray(layer, jnp.int32).reshape(1)
  consumers = config.consumers
  meta, tables = aligned_tiles(query_starts, query_lens, seq_lens, block_tables, tokens,
                               consumers)
  steps = config.max_concurrent_steps
  swizzled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
  kernel = functools.partial(_kernel, sm_scale=float(sm_scale), heads=heads, steps=steps,
                             consumers=consumers, pingpong=config.pingpong and consumers == 2,
                             block=block)
  call = plgpu.kernel(
      kernel,
      out_type=jax.ShapeDtypeStruct((tokens, heads, head_dim), qkv.dtype),
      scratch_types=[
          plgpu.SMEM((consumers, WG_ROWS, head_dim), qkv.dtype, transforms=swizzled),
          plgpu.SMEM((consumers, WG_ROWS, head_dim), qkv.dtype),
          plgpu.SMEM((steps, block, head_dim), qkv.dtype, transforms=swizzled),
          plgpu.SMEM((steps, block, head_dim), qkv.dtype, transforms=swizzled),
          plgpu.Barrier(num_barriers=consumers),
          plgpu.Barrier(num_arrivals=copies, num_barriers=steps),
          plgpu.Barrier(num_arrivals=copies, num_barriers=steps),
          plgpu.Barrier(num_arrivals=consumers, num_barriers=steps),
          plgpu.Barrier(num_arrivals=consumers, num_barriers=steps),
          plgpu.Barrier(num_arrivals=consumers),
          plgpu.SMEM((2, WG_ROWS, head_dim), qkv.dtype),
          plgpu.Barrier(num_arrivals=2),
      ] + ([plgpu.SMEM((consumers, WG_ROWS, block), qkv.dtype, transforms=swizzled)]
           if interpret else []),
      grid=(meta.shape[1], heads),
      grid_names=("tile", "head"),
      num_threads=consumers + 1,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True),
      interpret=plgpu.InterpretGPUParams() if interpret else None,
  )

  # The pages as refs: the kernel's writes update them in place (donated: no copy).
  k_ref, v_ref = jax.new_ref(k_pages), jax.new_ref(v_pages)
  out = call(meta, tables, layer, qkv, k_ref, v_ref)
  return out, jax.freeze(k_ref), jax.freeze(v_ref)
