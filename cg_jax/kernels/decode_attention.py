"""Flash-decoding attention for one new token per sequence over a right-padded KV cache (Pallas).

Decode attention has a single query token per sequence, so a kernel that parallelised only over
(batch, head) would leave most of the GPU idle for long caches. Flash-decoding also splits the
cache along the key axis:

  1. The cache is cut into splits of `split_size` keys. One Triton program runs per
     (batch row, KV head, split). It holds every query head of its KV group (GQA) as the rows of
     one [group, H] tile, so each key/value block it loads serves the whole group, and it walks its
     split in blocks of `block_k` keys with an online softmax: a running max m, a running
     denominator l and an unnormalised float32 accumulator. The trip count is dynamic: a program
     reads only the blocks that hold keys below `lengths[b]`, and a split that lies entirely past
     the length reads nothing and reports m = -inf, l = 0, acc = 0.
  2. The per-split partials are combined in plain jnp (`combine_splits`, which XLA fuses): the
     max over splits, each split rescaled by exp(m_split - m_max), summed, and divided by the
     summed denominator. A row with no valid key (length 0) gets zeros, never NaN. When the cache fits one split, the kernel
     normalises and writes the result itself: one kernel, no combine.

Triton dots need every dimension >= 16 and power-of-two shapes, so the kernel handles the query
group as G_pad = max(16, next_pow2(N // K)) rows: the query and output blocks are G_pad rows of
arrays that hold G, and the Triton lowering masks the rows past G (they read as zeros and are
never written; nothing is padded outside the kernel, and no ref is sliced past its end). Cache rows past the length
(and past T, where T is not a multiple of the split) are never loaded: every key/value load is
masked, so the cache is not copied or padded.

`decode_attention_with_write` also takes the new token's key and value and writes them into the
(donated, aliased) stacked cache: the program whose split holds a row's new position stores
them there, and attends to the new key from its input (the cache supplies the keys before it).
A decode step then has one kernel per layer for the cache write and attention, instead of two
scatters and the attention.

`decode_attention_reference` is the same computation in plain jnp, the XLA fallback.
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

_KERNEL_DTYPES = (jnp.float32, jnp.bfloat16)


@dataclasses.dataclass(frozen=True)
class DecodeAttentionConfig:
  """Block sizes and launch settings of the decode-attention kernel.

  Attributes:
    block_k: keys per inner-loop step (a power of two, >= 16 for Triton dots).
    split_size: keys per split-K program (a power of two, a multiple of block_k). It is clamped to
      the cache length rounded up to a power of two, so short caches run as one split.
    min_programs: when batch x KV heads x splits would give fewer programs than this, the split
      is halved (down to block_k) until it does not: a few long programs leave most SMs idle
      and each walks its keys at load latency. Programs past a row's length exit at once, and
      an SM holds many programs, so the count is sized for the whole cache T (of which often
      only part is valid). A launch at the full `split_size` needs twice this many: a row whose
      valid keys end mid-cache then leaves half its programs idle. The defaults are the fastest
      measured decode steps (benchmarks/results/attention_step_h200.md,
      benchmarks/results/graphs_split_h200.md).
      0 keeps `split_size`.
    num_warps: Triton warps per program.
    num_stages: Triton software-pipelining stages.
  """

  block_k: int = 64
  split_size: int = 512
  min_programs: int = 512
  num_warps: int = 4
  num_stages: int = 2

  def __post_init__(self):
    check_split_config(self, ("block_k", "split_size", "num_warps"), ("block_k",))


def _check_shapes(q, k_cache, v_cache, lengths) -> None:
  """Raises ValueError, naming the argument and the shapes, for inconsistent inputs."""
  shapes = (f"q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, "
            f"v_cache {tuple(v_cache.shape)}, lengths {tuple(lengths.shape)}")
  if q.ndim != 3:
    raise ValueError(f"q must be [B, N, H]; got {shapes}")
  if k_cache.ndim != 4:
    raise ValueError(f"k_cache must be [B, T, K, H]; got {shapes}")
  if v_cache.shape != k_cache.shape:
    raise ValueError(f"v_cache must have the shape of k_cache; got {shapes}")
  batch, num_q_heads, head_dim = q.shape
  cache_batch, cache_len, num_kv_heads, cache_head_dim = k_cache.shape
  if cache_batch != batch:
    raise ValueError(f"k_cache batch must equal q batch; got {shapes}")
  if cache_head_dim != head_dim:
    raise ValueError(f"k_cache head_dim must equal q head_dim; got {shapes}")
  if cache_len < 1:
    raise ValueError(f"k_cache must hold at least one position; got {shapes}")
  if num_kv_heads < 1 or num_q_heads % num_kv_heads:
    raise ValueError(f"q heads must be a multiple of k_cache heads (GQA); got {shapes}")
  if lengths.shape != (batch,):
    raise ValueError(f"lengths must be [B]; got {shapes}")
  if not jnp.issubdtype(lengths.dtype, jnp.integer):
    raise ValueError(f"lengths must be an integer array; got dtype {lengths.dtype}")
  if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
    raise ValueError(f"q, k_cache and v_cache must share a dtype; got q {q.dtype}, "
                     f"k_cache {k_cache.dtype}, v_cache {v_cache.dtype}")


def _decode_attention_kernel(lengths_ref, q_ref, k_ref, v_ref, *refs, sm_scale: float,
                             block_k: int, split_size: int, group: int, writes_new: bool):
  """One (batch row, KV head, split) program.

  With `writes_new`, refs start with k_new_ref, v_new_ref [H] (the new token's key and value,
  at position length - 1) and end with the aliased cache outputs k_out_ref, v_out_ref
  [split_size, H]: the cache supplies keys below length - 1, the new key is attended from its
  input, and the program whose split holds position length - 1 stores it there.

  Refs: lengths_ref [] int32; q_ref [G_pad, H]; k_ref, v_ref [split_size, H] (this split's
  window of the cache, possibly reaching past T: rows at or past the length are never loaded).
  Outputs: with one split, out_ref [G_pad, H] (the normalised result in q's dtype); with several,
  the partials acc_ref [G_pad, H] f32 and max_ref, denom_ref [G_pad] f32 for `combine_splits`.
  Rows past the `group` real ones lie past the arrays' ends: loads mask them to zeros and
  stores skip them.
  """
  if writes_new:
    k_new_ref, v_new_ref, *refs = refs
    *out_refs, k_out_ref, v_out_ref = refs
  else:
    out_refs = refs
  padded_group, head_dim = q_ref.shape
  real_rows = jnp.arange(padded_group) < group
  length = lengths_ref[()]
  # This split's first key: its window of the cache starts there.
  split_start = window_start = pl.program_id(2) * split_size
  if writes_new:
    # The new token's position, and whether this program's split holds it.
    new_position = length - 1
    owns_new = (length > 0) & (split_start <= new_position) & (
        new_position < split_start + split_size)
    length = jnp.maximum(new_position, 0)  # the keys read from the cache
  # Blocks of this split that hold at least one key below `length` (0 when the split is past it).
  keys_left = jnp.maximum(length - split_start, 0)
  num_blocks = jnp.minimum((keys_left + block_k - 1) // block_k, split_size // block_k)

  # [G_pad, H]; rows past G read as zeros and are never stored.
  query = pltriton.load(q_ref, mask=real_rows[:, None], other=0.0)

  def attend_block(block_index, carry):
    acc, row_max, denom = carry
    # The block's first key: its cache position, and its row in the window.
    block_start = split_start + block_index * block_k
    window_row = block_start - window_start
    # [block_k]
    key_valid = block_start + jnp.arange(block_k) < length
    # [block_k, H]; rows past the length are not read (they may lie past the end of the cache).
    keys = pltriton.load(k_ref.at[pl.ds(window_row, block_k), :], mask=key_valid[:, None],
                         other=0.0)
    values = pltriton.load(v_ref.at[pl.ds(window_row, block_k), :], mask=key_valid[:, None],
                           other=0.0)
    # [G, block_k] = query [G, H] . keys [block_k, H]^T; HIGHEST keeps float32 off TF32.
    scores = lax.dot_general(query, keys, (((1,), (1,)), ((), ())),
                             precision=lax.Precision.HIGHEST,
                             preferred_element_type=jnp.float32) * sm_scale
    scores = jnp.where(key_valid[None, :], scores, -jnp.inf)
    # [G]; every block in the loop has a valid key, so new_max is finite after the first block
    # and exp(-inf - new_max) = 0 discards the initial state.
    new_max = jnp.maximum(row_max, jnp.max(scores, axis=1))
    rescale = jnp.exp(row_max - new_max)
    # [G, block_k]
    probs = jnp.exp(scores - new_max[:, None])
    denom = denom * rescale + jnp.sum(probs, axis=1)
    # [G, H] = probs [G, block_k] . values [block_k, H]
    block_out = lax.dot_general(probs.astype(values.dtype), values, (((1,), (0,)), ((), ())),
                                precision=lax.Precision.HIGHEST,
                                preferred_element_type=jnp.float32)
    acc = acc * rescale[:, None] + block_out
    return acc, new_max, denom

  initial = (jnp.zeros((padded_group, head_dim), jnp.float32),
             jnp.full((padded_group,), -jnp.inf, jnp.float32),
             jnp.zeros((padded_group,), jnp.float32))
  acc, row_max, denom = lax.fori_loop(0, num_blocks, attend_block, initial)
  if writes_new:
    # The new key and value: attended from the inputs, stored into the cache by their owner.
    # [H]
    key, value = k_new_ref[...], v_new_ref[...]
    # [G]
    score = jnp.sum(query.astype(jnp.float32) * key.astype(jnp.float32)[None, :], axis=1) * sm_scale
    score = jnp.where(owns_new, score, -jnp.inf)
    new_max = jnp.maximum(row_max, score)
    safe_max = jnp.where(jnp.isfinite(new_max), new_max, 0.0)
    rescale, weight = jnp.exp(row_max - safe_max), jnp.exp(score - safe_max)
    denom = denom * rescale + weight
    acc = acc * rescale[:, None] + weight[:, None] * value.astype(jnp.float32)[None, :]
    row_max = new_max
    row = jnp.clip(new_position - window_start, 0, k_out_ref.shape[0] - 1)
    stored = jnp.full((1, head_dim), owns_new)
    pltriton.store(k_out_ref.at[pl.ds(row, 1), :], key[None, :].astype(k_out_ref.dtype),
                   mask=stored)
    pltriton.store(v_out_ref.at[pl.ds(row, 1), :], value[None, :].astype(v_out_ref.dtype),
                   mask=stored)
  if len(out_refs) == 1:  # one split: normalise here (a row with no valid key gives zeros)
    (out_ref,) = out_refs
    out = acc / jnp.where(denom > 0, denom, 1.0)[:, None]
    pltriton.store(out_ref, out.astype(out_ref.dtype), mask=real_rows[:, None])
    return
  acc_ref, max_ref, denom_ref = out_refs
  pltriton.store(acc_ref, acc, mask=real_rows[:, None])
  pltriton.store(max_ref, row_max, mask=real_rows)
  pltriton.store(denom_ref, denom, mask=real_rows)


def combine_splits(split_acc, split_max, split_denom):
  """Merges per-split online-softmax partials into normalised outputs (plain jnp).

  Args:
    split_acc: float32 [..., splits, G, H] unnormalised sums of exp(score - split_max) * v.
    split_max: float32 [..., splits, G] running maxima (-inf for a split with no valid key).
    split_denom: float32 [..., splits, G] sums of exp(score - split_max) (0 for an empty split).
  Returns:
    float32 [..., G, H]; zeros where no split saw a valid key.
  """
  # [..., G]: a row with no valid key anywhere has max -inf; use 0 so exp(-inf - 0) = 0, not NaN.
  global_max = jnp.max(split_max, axis=-2)
  global_max = jnp.where(jnp.isfinite(global_max), global_max, 0.0)
  # [..., splits, G]
  split_weight = jnp.exp(split_max - global_max[..., None, :])
  # [..., G]
  denom = jnp.sum(split_denom * split_weight, axis=-2)
  # [..., G, H]
  acc = jnp.sum(split_acc * split_weight[..., None], axis=-3)
  return acc / jnp.where(denom > 0, denom, 1.0)[..., None]


def split_layout(batch: int, num_kv_heads: int, cache_len: int,
                 config: DecodeAttentionConfig) -> tuple[int, int]:
  """(keys per split, number of splits) for a launch of batch x num_kv_heads x splits programs.

  Short caches run as one split (the split is clamped to the cache length rounded up to a power
  of two; the last split may reach past T, its loads are masked). The split is halved, down to
  `config.block_k`, while the launch has fewer than `config.min_programs` programs, or fewer
  than twice that at the full `config.split_size`.
  """
  split_size = min(config.split_size, max(config.block_k, pl.next_power_of_2(cache_len)))

  def programs(split: int) -> int:
    return batch * num_kv_heads * pl.cdiv(cache_len, split)

  while split_size > config.block_k and (
      programs(split_size) < config.min_programs
      or (split_size == config.split_size and programs(split_size) < 2 * config.min_programs)):
    split_size //= 2
  return split_size, pl.cdiv(cache_len, split_size)


@functools.partial(jax.jit, static_argnames=("layer", "sm_scale", "config", "interpret"),
                   donate_argnames=("k_cache", "v_cache"))
def decode_attention_with_write(q, k_new, v_new, k_cache, v_cache, lengths, *, layer: int,
                                sm_scale: float | None = None,
                                config: DecodeAttentionConfig = DecodeAttentionConfig(),
                                interpret: bool = False):
  """The decode step's cache write and attention in one kernel.

  Writes k_new, v_new [B, K, H] (the new token's key and value) into the stacked caches
  [L, B', T, K, H] at (layer, b, lengths[b] - 1) in place (the caches are donated and aliased
  to the outputs) and attends q over keys 0..lengths[b] - 1, the last one being the new key.
  Replaces `cache.at[layer, rows, lengths - 1].set(...)` followed by `decode_attention`, which
  costs two scatter kernels per layer. lengths[b] >= 1 for real rows; a row with length 0 is
  neither written nor attended (zeros).

  Returns:
    (out [B, N, H] in q's dtype, k_cache, v_cache).
  """
  batch, num_kv_heads, head_dim = q.shape[0], k_cache.shape[-2], k_cache.shape[-1]
  if k_new.shape != (batch, num_kv_heads, head_dim) or v_new.shape != k_new.shape:
    raise ValueError(f"k_new and v_new must be [B, K, H] = {(batch, num_kv_heads, head_dim)}; "
                     f"got {tuple(k_new.shape)} and {tuple(v_new.shape)}")
  return _decode_attention(q, k_cache, v_cache, lengths, layer=layer, sm_scale=sm_scale,
                           config=config, interpret=interpret,
                           new=(k_new.astype(k_cache.dtype), v_new.astype(v_cache.dtype)))


@functools.partial(jax.jit, static_argnames=("layer", "sm_scale", "config", "interpret"))
def decode_attention(q, k_cache, v_cache, lengths, *, layer: int | None = None,
                     sm_scale: float | None = None,
                     config: DecodeAttentionConfig = DecodeAttentionConfig(),
                     interpret: bool = False):
  """Single-token attention over a right-padded KV cache with a split-K Pallas/Triton kernel.

  Args:
    q: [B, N, H] queries of the new token, float32 or bfloat16.
    k_cache, v_cache: [B, T, K, H] caches in q's dtype; N must be a multiple of K (GQA/MQA).
      H must be a power of two >= 16 (Triton). With `layer`, the whole stacked cache
      [L, B', T, K, H] (B' >= B): the kernel reads rows [0, B) of that layer in place, so no
      per-layer slice is materialised.
    layer: static layer index into a stacked cache, or None for a [B, T, K, H] cache.
    lengths: int [B] valid cache entries per row (keys 0..lengths[b]-1 attend); 0 is allowed and
      gives zeros. Values are clamped to [0, T].
    sm_scale: softmax scale, 1/sqrt(H) when None.
    config: block sizes and launch settings.
    interpret: run the kernel in the Pallas interpreter (CPU tests).
  Returns:
    [B, N, H] in q's dtype.
  Raises:
    ValueError: inconsistent shapes or dtypes, or a dtype/head_dim the kernel does not support.
  """
  return _decode_attention(q, k_cache, v_cache, lengths, layer=layer, sm_scale=sm_scale,
                           config=config, interpret=interpret, new=None)


def _decode_attention(q, k_cache, v_cache, lengths, *, layer, sm_scale, config, interpret, new):
  """decode_attention; with `new` = (k_new, v_new), decode_attention_with_write."""
  batch = q.shape[0] if q.ndim == 3 else None
  if layer is not None:
    if k_cache.ndim != 5 or v_cache.shape != k_cache.shape:
      raise ValueError(f"with layer, k_cache and v_cache must be [L, B', T, K, H]; got "
                       f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if not 0 <= layer < k_cache.shape[0]:
      raise ValueError(f"layer must be in [0, {k_cache.shape[0]}), got {layer}")
    if batch is None or k_cache.shape[1] < batch:
      raise ValueError(f"k_cache rows ({k_cache.shape[1]}) must cover q's batch; got q "
                       f"{tuple(q.shape)}")
    # Check the layer's [B, T, K, H] view without slicing it.
    view = jax.ShapeDtypeStruct((batch,) + k_cache.shape[2:], k_cache.dtype)
    _check_shapes(q, view, jax.ShapeDtypeStruct(view.shape, v_cache.dtype), lengths)
  else:
    _check_shapes(q, k_cache, v_cache, lengths)
  batch, num_q_heads, head_dim = q.shape
  cache_len, num_kv_heads = k_cache.shape[-3], k_cache.shape[-2]
  if q.dtype not in _KERNEL_DTYPES:
    raise ValueError(f"q dtype must be float32 or bfloat16 for the kernel; got {q.dtype}")
  if not is_power_of_two(head_dim) or head_dim < MIN_DOT_DIM:
    raise ValueError(f"q head_dim must be a power of two >= {MIN_DOT_DIM} for the kernel; "
                     f"got q {tuple(q.shape)} (use decode_attention_reference)")
  if sm_scale is None:
    sm_scale = 1.0 / math.sqrt(head_dim)

  group = num_q_heads // num_kv_heads
  padded_group = max(MIN_DOT_DIM, pl.next_power_of_2(group))
  block_k = config.block_k
  split_size, num_splits = split_layout(batch, num_kv_heads, cache_len, config)

  lengths = jnp.clip(lengths.astype(jnp.int32), 0, cache_len)

  kernel = functools.partial(_decode_attention_kernel, sm_scale=float(sm_scale), block_k=block_k,
                             split_size=split_size, group=group,
                             writes_new=new is not None)
  squeezed = pl.squeezed
  # Each program's window of the cache: its split.
  if layer is None:
    cache_spec = pl.BlockSpec((squeezed, split_size, squeezed, head_dim),
                              lambda b, h, s: (b, s, h, 0))
  else:
    cache_spec = pl.BlockSpec((squeezed, squeezed, split_size, squeezed, head_dim),
                              lambda b, h, s: (layer, b, s, h, 0))
  if num_splits == 1:
    # One kernel, no combine: [B, K, G, H] in q's dtype.
    out_specs = pl.BlockSpec((squeezed, squeezed, padded_group, head_dim),
                             lambda b, h, s: (b, h, 0, 0))
    out_shape = jax.ShapeDtypeStruct((batch, num_kv_heads, group, head_dim), q.dtype)
  else:
    # Per-split partials, merged by `combine_splits`.
    out_specs = [
        pl.BlockSpec((squeezed, squeezed, squeezed, padded_group, head_dim),
                     lambda b, h, s: (b, h, s, 0, 0)),
        pl.BlockSpec((squeezed, squeezed, squeezed, padded_group), lambda b, h, s: (b, h, s, 0)),
        pl.BlockSpec((squeezed, squeezed, squeezed, padded_group), lambda b, h, s: (b, h, s, 0)),
    ]
    out_shape = [
        jax.ShapeDtypeStruct((batch, num_kv_heads, num_splits, group, head_dim), jnp.float32),
        jax.ShapeDtypeStruct((batch, num_kv_heads, num_splits, group), jnp.float32),
        jax.ShapeDtypeStruct((batch, num_kv_heads, num_splits, group), jnp.float32),
    ]
  lengths_spec = pl.BlockSpec((squeezed,), lambda b, h, s: (b,))
  # [B, K, G, H] (a free reshape); each program's block is G_pad rows, those past G masked.
  q_operand = q.reshape(batch, num_kv_heads, group, head_dim)
  q_spec = pl.BlockSpec((squeezed, squeezed, padded_group, head_dim),
                        lambda b, h, s: (b, h, 0, 0))
  in_specs = [lengths_spec, q_spec, cache_spec, cache_spec]
  operands = [lengths, q_operand, k_cache, v_cache]
  aliases = {}
  if new is not None:
    # k_new, v_new [B, K, H]; the caches come back as outputs aliased to inputs 2 and 3.
    in_specs += [pl.BlockSpec((squeezed, squeezed, head_dim), lambda b, h, s: (b, h, 0))] * 2
    operands += list(new)
    out_specs = (out_specs if isinstance(out_specs, list) else [out_specs]) + [cache_spec] * 2
    out_shape = (out_shape if isinstance(out_shape, list) else [out_shape]) + [
        jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
        jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype)]
    aliases = {2: len(out_shape) - 2, 3: len(out_shape) - 1}
  result = pl.pallas_call(
      kernel,
      grid=(batch, num_kv_heads, num_splits),
      in_specs=in_specs,
      out_specs=out_specs,
      out_shape=out_shape,
      input_output_aliases=aliases,
      compiler_params=pltriton.CompilerParams(num_warps=config.num_warps,
                                              num_stages=config.num_stages),
      interpret=interpret,
      name="decode_attention",
  )(*operands)
  caches = None
  if new is not None:
    *result, k_cache, v_cache = result
    caches = (k_cache, v_cache)
    result = result[0] if num_splits == 1 else result

  # [B, K, G, H] -> [B, N, H]
  out = result if num_splits == 1 else combine_splits(*result)
  out = out.reshape(batch, num_q_heads, head_dim).astype(q.dtype)
  return out if caches is None else (out, *caches)


@functools.partial(jax.jit, static_argnames=("sm_scale",))
def decode_attention_reference(q, k_cache, v_cache, lengths, *, sm_scale: float | None = None):
  """`decode_attention` in plain jnp (the XLA fallback): masked float32 softmax, GQA by reshape.

  Same arguments and result as `decode_attention`, for any float dtype and head_dim.
  """
  _check_shapes(q, k_cache, v_cache, lengths)
  batch, num_q_heads, head_dim = q.shape
  _, cache_len, num_kv_heads, _ = k_cache.shape
  if sm_scale is None:
    sm_scale = 1.0 / math.sqrt(head_dim)
  group = num_q_heads // num_kv_heads
  # [B, K, G, H]
  grouped_q = q.reshape(batch, num_kv_heads, group, head_dim).astype(jnp.float32)
  # [B, K, G, T]
  scores = jnp.einsum("bhgd,bthd->bhgt", grouped_q, k_cache.astype(jnp.float32),
                      precision=lax.Precision.HIGHEST) * sm_scale
  # [B, 1, 1, T]
  key_valid = (jnp.arange(cache_len)[None, :] < lengths.astype(jnp.int32)[:, None])[:, None, None]
  scores = jnp.where(key_valid, scores, -jnp.inf)
  # [B, K, G, 1]; rows with no valid key get max 0 and all-zero weights.
  row_max = jnp.max(scores, axis=-1, keepdims=True)
  row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
  weights = jnp.exp(scores - row_max)
  denom = jnp.sum(weights, axis=-1, keepdims=True)
  probs = weights / jnp.where(denom > 0, denom, 1.0)
  # [B, K, G, H]
  out = jnp.einsum("bhgt,bthd->bhgd", probs, v_cache.astype(jnp.float32),
                   precision=lax.Precision.HIGHEST)
  return out.reshape(batch, num_q_heads, head_dim).astype(q.dtype)
