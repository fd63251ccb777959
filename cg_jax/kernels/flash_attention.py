"""Flash attention for prefill: causal self-attention over right-padded sequences in one kernel.

One program per (query head, block of `block_q` queries) of one sequence (the batch is a vmapped
grid axis). It streams the keys and values of its KV head in blocks of `block_k` (grouped-query
attention: query head h reads KV head h // group, nothing is repeated in memory), keeps a running
max, denominator and float32 accumulator (online softmax, in base 2), and applies the scale, the
causal mask and the padding mask (keys at or past the sequence's length) on the fly, in two
loops: the key blocks every query of the program sees whole run without a mask, then the blocks
on the diagonal or at the padding with it. The loop stops at the last block any query of the
program may see, so padding and the causal future are never read.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from cg_jax.kernels.blocks import MIN_DOT_DIM, is_power_of_two

LOG2_E = math.log2(math.e)


@dataclasses.dataclass(frozen=True)
class FlashAttentionConfig:
  """Block sizes and launch settings (powers of two; Triton dots need blocks >= 16)."""

  block_q: int = 64
  block_k: int = 64
  num_warps: int = 4
  num_stages: int = 2

  def __post_init__(self):
    for name in ("block_q", "block_k"):
      value = getattr(self, name)
      if not is_power_of_two(value) or value < MIN_DOT_DIM:
        raise ValueError(f"{name} must be a power of two >= {MIN_DOT_DIM}, got {value}")
    for name in ("num_warps", "num_stages"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


def _kernel(length_ref, q_ref, k_ref, v_ref, o_ref, *, sm_scale: float, causal: bool,
            block_q: int, block_k: int):
  """q_ref, o_ref: [block_q, H]; k_ref, v_ref: [S_padded, H]; length_ref: [] int32."""
  length = length_ref[()]
  q_block = pl.program_id(1)
  head_dim = q_ref.shape[-1]
  # float32 inputs get true float32 dots (Triton would otherwise use TF32).
  precision = jax.lax.Precision.HIGHEST if q_ref.dtype == jnp.float32 else None
  # Scores in log2 units: exp2(s log2(e) - m) = exp(s - m / log2(e)).
  scale = sm_scale * LOG2_E
  # [block_q, H]
  q = q_ref[...]
  q_positions = q_block * block_q + jnp.arange(block_q)
  visible = length
  # Key blocks every query of the program sees whole (before the diagonal and the padding):
  # no mask, and every row's max is finite.
  unmasked = length // block_k
  if causal:
    visible = jnp.minimum(visible, (q_block + 1) * block_q)
    unmasked = jnp.minimum(unmasked, (q_block * block_q + 1) // block_k)
  num_blocks = pl.cdiv(visible, block_k)

  def step(block, carry, masked: bool):
    running_max, denominator, accumulator = carry
    keys = pl.ds(block * block_k, block_k)
    # [block_k, H]
    k = k_ref[keys, :]
    v = v_ref[keys, :]
    # [block_q, block_k], float32
    scores = jnp.dot(q, k.T, precision=precision, preferred_element_type=jnp.float32) * scale
    if masked:
      k_positions = block * block_k + jnp.arange(block_k)
      mask = k_positions[None, :] < length
      if causal:
        mask = mask & (k_positions[None, :] <= q_positions[:, None])
      scores = jnp.where(mask, scores, -jnp.inf)
    new_max = jnp.maximum(running_max, jnp.max(scores, axis=1))
    shift = new_max
    if masked:
      # A row with no visible key yet keeps max -inf: shift by 0 instead (exp2(-inf) = 0).
      shift = jnp.where(new_max == -jnp.inf, 0.0, new_max)
    probs = jnp.exp2(scores - shift[:, None])
    rescale = jnp.exp2(running_max - shift)
    denominator = denominator * rescale + jnp.sum(probs, axis=1)
    accumulator = accumulator * rescale[:, None] + jnp.dot(
        probs.astype(v.dtype), v, precision=precision, preferred_element_type=jnp.float32)
    return new_max, denominator, accumulator

  init = (jnp.full((block_q,), -jnp.inf, jnp.float32), jnp.zeros((block_q,), jnp.float32),
          jnp.zeros((block_q, head_dim), jnp.float32))
  carry = jax.lax.fori_loop(0, unmasked, functools.partial(step, masked=False), init)
  _, denominator, accumulator = jax.lax.fori_loop(unmasked, num_blocks,
                                                  functools.partial(step, masked=True), carry)
  # Queries that saw no key (a length-0 row) produce zeros.
  denominator = jnp.where(denominator == 0.0, 1.0, denominator)
  o_ref[...] = (accumulator / denominator[:, None]).astype(o_ref.dtype)


def _check_shapes(q, k, v, lengths):
  if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
    raise ValueError(f"q, k, v must be [B, S, heads, H]; got {q.shape}, {k.shape}, {v.shape}")
  if k.shape != v.shape:
    raise ValueError(f"k and v shapes differ: {k.shape} vs {v.shape}")
  batch, seq, num_heads, head_dim = q.shape
  if k.shape[0] != batch or k.shape[1] != seq or k.shape[3] != head_dim:
    raise ValueError(f"k/v {k.shape} do not match q {q.shape} in batch, length or head_dim")
  if num_heads % k.shape[2]:
    raise ValueError(f"query heads ({num_heads}) must be a multiple of kv heads ({k.shape[2]})")
  if lengths.shape != (batch,):
    raise ValueError(f"lengths must have shape ({batch},), got {lengths.shape}")


@functools.partial(jax.jit, static_argnames=("causal", "sm_scale", "config", "interpret"))
def flash_attention(q, k, v, lengths, *, causal: bool = True, sm_scale: float | None = None,
                    config: FlashAttentionConfig = FlashAttentionConfig(),
                    interpret: bool = False):
  """Fused attention over right-padded sequences.

  Args:
    q: [B, S, N, H]; k, v: [B, S, K, H] with N a multiple of K; lengths: int32 [B],
      valid tokens per row (keys at or past it are ignored; 0 gives zeros).
    causal: mask future keys.
    sm_scale: score scale, default 1/sqrt(H).
    config: block sizes and launch settings.
    interpret: run the kernel in the Pallas interpreter (CPU tests).
  Returns:
    [B, S, N, H] in q.dtype.
  """
  _check_shapes(q, k, v, lengths)
  batch, seq, num_heads, head_dim = q.shape
  group = num_heads // k.shape[2]
  sm_scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
  block_q = min(config.block_q, max(MIN_DOT_DIM, pl.next_power_of_2(seq)))
  block_k = min(config.block_k, max(MIN_DOT_DIM, pl.next_power_of_2(seq)))
  padded = pl.cdiv(seq, max(block_q, block_k)) * max(block_q, block_k)
  pad = ((0, padded - seq), (0, 0), (0, 0))

  def one_sequence(q, k, v, length):
    # q [S, N, H], k/v [S, K, H] -> [S, N, H], padded along S to whole blocks.
    q, k, v = (jnp.pad(x, pad) for x in (q, k, v))
    kernel = functools.partial(_kernel, sm_scale=sm_scale, causal=causal, block_q=block_q,
                               block_k=block_k)
    out = pl.pallas_call(
        kernel,
        grid=(num_heads, padded // block_q),
        in_specs=[
            pl.BlockSpec((), lambda h, i: ()),
            pl.BlockSpec((block_q, None, head_dim), lambda h, i: (i, h, 0)),
            pl.BlockSpec((padded, None, head_dim), lambda h, i: (0, h // group, 0)),
            pl.BlockSpec((padded, None, head_dim), lambda h, i: (0, h // group, 0)),
        ],
        out_specs=pl.BlockSpec((block_q, None, head_dim), lambda h, i: (i, h, 0)),
        out_shape=jax.ShapeDtypeStruct((padded, num_heads, head_dim), q.dtype),
        compiler_params=pltriton.CompilerParams(num_warps=config.num_warps,
                                                num_stages=config.num_stages),
        interpret=interpret,
        name="flash_attention",
    )(length, q, k, v)
    return out[:seq]

  return jax.vmap(one_sequence)(q, k, v, lengths.astype(jnp.int32))


def flash_attention_reference(q, k, v, lengths, *, causal: bool = True,
                              sm_scale: float | None = None):
  """The same function in plain jnp (mask, float32 softmax, GQA by reshape); the XLA fallback."""
  _check_shapes(q, k, v, lengths)
  batch, seq, num_heads, head_dim = q.shape
  num_kv_heads = k.shape[2]
  sm_scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
  positions = jnp.arange(seq)
  # [B, S(query), S(key)]
  mask = jnp.broadcast_to(positions[None, None, :] < lengths[:, None, None], (batch, seq, seq))
  if causal:
    mask = mask & (positions[None, :, None] >= positions[None, None, :])
  # [B, S, K, G, H]
  grouped = q.reshape(batch, seq, num_kv_heads, num_heads // num_kv_heads, head_dim)
  precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
  # [B, K, G, S, S]
  scores = jnp.einsum("btkgh,bskh->bkgts", grouped, k, precision=precision,
                      preferred_element_type=jnp.float32) * sm_scale
  scores = jnp.where(mask[:, None, None], scores, -jnp.inf)
  row_max = jnp.max(scores, axis=-1, keepdims=True)
  weights = jnp.exp(scores - jnp.where(jnp.isfinite(row_max), row_max, 0.0))
  total = jnp.sum(weights, axis=-1, keepdims=True)
  probs = weights / jnp.where(total == 0.0, 1.0, total)
  out = jnp.einsum("bkgts,bskh->btkgh", probs.astype(v.dtype), v, precision=precision,
                   preferred_element_type=jnp.float32)
  return out.reshape(batch, seq, num_heads, head_dim).astype(q.dtype)
