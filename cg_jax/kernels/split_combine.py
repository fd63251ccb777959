"""The merge of split-K attention partials into normalised outputs, as one kernel (Pallas,
Triton).

A split-K attention call (`ragged_paged_attention` with several splits) leaves, for every token
and query head, each split's unnormalised output sum, running maximum and denominator. The merge
is a max over the splits, a rescale of each split by exp(m_split - m_max), two sums and a
division. As jnp ops XLA runs it as three small kernels per layer (the max and the weights, the
denominators, the outputs), each a launch on a decode step's critical path; here it is one:

  One program per (token, block of `block_heads` query heads) loads the splits' partials of its
  heads whole ([splits, heads x H] tiles, the splits padded to a power of two by masked loads),
  reduces them over the splits and writes the block's outputs in the result's dtype. Rows with
  no valid key in any split (maximum -inf everywhere) get zeros.

`split_combine_reference` is the same computation in plain jnp (tests; it is what ran before).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from cg_jax.kernels.blocks import is_power_of_two


@dataclasses.dataclass(frozen=True)
class SplitCombineConfig:
  """Launch settings of the split merge.

  Attributes:
    block_heads: query heads per program (a power of two; clamped to the heads, rounded up to
      a power of two). Two, not eight: more programs with smaller tiles merged small decode
      steps' partials faster (benchmarks/results/split_combine_h100.md).
    num_warps: Triton launch setting.
  """

  block_heads: int = 2
  num_warps: int = 4

  def __post_init__(self):
    for name in ("block_heads", "num_warps"):
      value = getattr(self, name)
      if not is_power_of_two(value):
        raise ValueError(f"{type(self).__name__}.{name} must be a positive power of two, got "
                         f"{value!r}")


def _kernel(acc_ref, max_ref, denom_ref, out_ref, *, block_heads: int, padded_splits: int):
  """One (token, head block) program: one token's partials [splits, N(, H)] -> out [block, H]."""
  token, head_block = pl.program_id(0), pl.program_id(1)
  splits, heads, head_dim = acc_ref.shape[1:]
  # [splits (padded), block x H]: split s; column c is head (first + c // H), dim c % H
  split = jnp.arange(padded_splits)[:, None]
  column = jnp.arange(block_heads * head_dim)[None, :]
  head = head_block * block_heads + column // head_dim
  dim = column % head_dim
  valid = (split < splits) & (head < heads)
  split_max = pltriton.load(max_ref.at[token, split, head], mask=valid, other=-jnp.inf)
  split_denom = pltriton.load(denom_ref.at[token, split, head], mask=valid, other=0.0)
  split_acc = pltriton.load(acc_ref.at[token, split, head, dim], mask=valid, other=0.0)
  # [block x H]; a row with no valid key anywhere has max -inf: 0 keeps exp(-inf - 0) = 0
  top = jnp.max(split_max, axis=0)
  top = jnp.where(top > -jnp.inf, top, 0.0)
  weight = jnp.exp(split_max - top[None, :])
  denom = jnp.sum(split_denom * weight, axis=0)
  out = jnp.sum(split_acc * weight, axis=0) / jnp.where(denom > 0, denom, 1.0)
  pltriton.store(out_ref.at[token, head[0], dim[0]], out.astype(out_ref.dtype),
                 mask=head[0] < heads)


@functools.partial(jax.jit, static_argnames=("dtype", "config", "interpret"))
def split_combine(split_acc, split_max, split_denom, *, dtype,
                  config: SplitCombineConfig = SplitCombineConfig(), interpret: bool = False):
  """Merges per-split online-softmax partials into normalised outputs.

  Args:
    split_acc: float32 [A, splits, N, H] unnormalised sums of exp(score - split_max) * v.
    split_max: float32 [A, splits, N] running maxima (-inf for a split with no valid key).
    split_denom: float32 [A, splits, N] sums of exp(score - split_max) (0 for an empty split).
    dtype: the result's dtype.
    config: launch settings; interpret: run in the Pallas interpreter (CPU tests).
  Returns:
    [A, N, H] in `dtype`; zeros where no split saw a valid key.
  """
  tokens, splits, heads, head_dim = split_acc.shape
  if split_max.shape != (tokens, splits, heads) or split_denom.shape != split_max.shape:
    raise ValueError(f"split_max and split_denom must be [A, splits, N] of split_acc "
                     f"[A, splits, N, H]; "
                     f"got {tuple(split_acc.shape)}, {tuple(split_max.shape)}, "
                     f"{tuple(split_denom.shape)}")
  if not is_power_of_two(head_dim):
    raise ValueError(f"the head dim must be a power of two; got split_acc "
                     f"{tuple(split_acc.shape)}")
  block_heads = min(config.block_heads, pl.next_power_of_2(heads))
  kernel = functools.partial(_kernel, block_heads=block_heads,
                             padded_splits=pl.next_power_of_2(splits))

  def whole(shape):  # the whole array as every program's block (indexed in the kernel)
    return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))

  out_shape = jax.ShapeDtypeStruct((tokens, heads, head_dim), dtype)
  return pl.pallas_call(
      kernel,
      grid=(tokens, pl.cdiv(heads, block_heads)),
      in_specs=[whole(a.shape) for a in (split_acc, split_max, split_denom)],
      out_specs=whole(out_shape.shape),
      out_shape=out_shape,
      compiler_params=pltriton.CompilerParams(num_warps=config.num_warps, num_stages=1),
      interpret=interpret,
      name="split_combine",
  )(split_acc, split_max, split_denom)


def split_combine_reference(split_acc, split_max, split_denom, *, dtype):
  """`split_combine` in plain jnp (any leading dims: [..., splits, N, H] partials)."""
  # [..., N]
  top = jnp.max(split_max, axis=-2)
  top = jnp.where(jnp.isfinite(top), top, 0.0)
  # [..., splits, N]
  weight = jnp.exp(split_max - top[..., None, :])
  # [..., N]
  denom = jnp.sum(split_denom * weight, axis=-2)
  # [..., N, H]
  acc = jnp.sum(split_acc * weight[..., None], axis=-3)
  return (acc / jnp.where(denom > 0, denom, 1.0)[..., None]).astype(dtype)
