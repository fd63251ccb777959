"""The merge of flash-decoding's split-K partials as one Pallas kernel.

The decode-attention kernel (`cg_jax.kernels.decode_attention`) leaves, per (batch row, KV head,
split), an unnormalised float32 accumulator [G, D], a running maximum [G] and a denominator
[G]. In plain jnp (`split_combine_reference`) XLA merges them in two kernels: a reduction for
the global maxima and denominators, then the weighted sum. Here one program per (row, KV head)
walks the splits with the attention kernel's online rescaling and stores the normalised result
in the output dtype: one kernel per layer instead of two.

Rows with no valid key anywhere (every split's maximum -inf) get zeros, never NaN.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from cg_jax.kernels.blocks import MIN_DOT_DIM, is_power_of_two


@dataclasses.dataclass(frozen=True)
class SplitCombineConfig:
  """Launch settings of the split combine.

  Attributes:
    num_warps: Triton warps per program (a power of two).
  """

  num_warps: int = 4

  def __post_init__(self):
    if not is_power_of_two(self.num_warps):
      raise ValueError(f"SplitCombineConfig.num_warps must be a positive power of two, "
                       f"got {self.num_warps!r}")


def split_combine_reference(split_acc, split_max, split_denom):
  """Merges per-split online-softmax partials into normalised outputs (plain jnp).

  Args:
    split_acc: float32 [..., S, G, D] unnormalised sums of exp(score - split_max) * v.
    split_max: float32 [..., S, G] running maxima (-inf for a split with no valid key).
    split_denom: float32 [..., S, G] sums of exp(score - split_max) (0 for an empty split).
  Returns:
    float32 [..., G, D]; zeros where no split saw a valid key.
  """
  # [..., G]: a row with no valid key anywhere has max -inf; use 0 so exp(-inf - 0) = 0, not NaN.
  global_max = jnp.max(split_max, axis=-2)
  global_max = jnp.where(jnp.isfinite(global_max), global_max, 0.0)
  # [..., S, G]
  split_weight = jnp.exp(split_max - global_max[..., None, :])
  # [..., G]
  denom = jnp.sum(split_denom * split_weight, axis=-2)
  # [..., G, D]
  acc = jnp.sum(split_acc * split_weight[..., None], axis=-3)
  return acc / jnp.where(denom > 0, denom, 1.0)[..., None]


def _split_combine_kernel(acc_ref, max_ref, denom_ref, out_ref, *, num_splits: int,
                          padded_group: int):
  """One (batch row, KV head) program. acc_ref [S, G, D], max_ref and denom_ref [S, G] float32;
  out_ref [G, D]. The G rows are handled as `padded_group` through masked loads and stores."""
  group, head_dim = out_ref.shape
  real_rows = jnp.arange(padded_group) < group
  rows = pl.ds(0, padded_group)

  def merge(split, carry):
    acc, row_max, denom = carry
    # [G_pad]
    split_max = pltriton.load(max_ref.at[split, rows], mask=real_rows, other=-jnp.inf)
    split_denom = pltriton.load(denom_ref.at[split, rows], mask=real_rows, other=0.0)
    # [G_pad, D]
    split_acc = pltriton.load(acc_ref.at[split, rows, :], mask=real_rows[:, None], other=0.0)
    new_max = jnp.maximum(row_max, split_max)
    # exp(-inf - 0) = 0 while every split so far is empty, never NaN
    safe_max = jnp.where(jnp.isfinite(new_max), new_max, 0.0)
    kept, added = jnp.exp(row_max - safe_max), jnp.exp(split_max - safe_max)
    return (acc * kept[:, None] + split_acc * added[:, None], new_max,
            denom * kept + split_denom * added)

  initial = (jnp.zeros((padded_group, head_dim), jnp.float32),
             jnp.full((padded_group,), -jnp.inf, jnp.float32),
             jnp.zeros((padded_group,), jnp.float32))
  acc, _, denom = lax.fori_loop(0, num_splits, merge, initial)
  out = acc / jnp.where(denom > 0, denom, 1.0)[:, None]
  pltriton.store(out_ref.at[rows, :], out.astype(out_ref.dtype), mask=real_rows[:, None])


@functools.partial(jax.jit, static_argnames=("out_dtype", "config", "interpret"))
def split_combine(split_acc, split_max, split_denom, *, out_dtype=jnp.float32,
                  config: SplitCombineConfig = SplitCombineConfig(), interpret: bool = False):
  """`split_combine_reference` for [B, Hkv, S, G, D] partials as one kernel.

  Args:
    split_acc: float32 [B, Hkv, S, G, D]; split_max, split_denom: float32 [B, Hkv, S, G].
    out_dtype: the output's dtype.
    config: launch settings.
    interpret: run in the Pallas interpreter (CPU tests).
  Returns:
    [B, Hkv, G, D] in `out_dtype`.
  """
  if split_acc.ndim != 5 or split_max.shape != split_acc.shape[:4] \
      or split_denom.shape != split_max.shape:
    raise ValueError(f"split_acc must be [B, Hkv, S, G, D] and split_max, split_denom "
                     f"[B, Hkv, S, G]; got {tuple(split_acc.shape)}, {tuple(split_max.shape)}, "
                     f"{tuple(split_denom.shape)}")
  batch, num_kv_heads, num_splits, group, head_dim = split_acc.shape
  squeezed = pl.squeezed
  kernel = functools.partial(_split_combine_kernel, num_splits=num_splits,
                             padded_group=max(MIN_DOT_DIM, pl.next_power_of_2(group)))
  return pl.pallas_call(
      kernel,
      grid=(batch, num_kv_heads),
      in_specs=[
          pl.BlockSpec((squeezed, squeezed, num_splits, group, head_dim),
                       lambda b, h: (b, h, 0, 0, 0)),
          pl.BlockSpec((squeezed, squeezed, num_splits, group), lambda b, h: (b, h, 0, 0)),
          pl.BlockSpec((squeezed, squeezed, num_splits, group), lambda b, h: (b, h, 0, 0)),
      ],
      out_specs=pl.BlockSpec((squeezed, squeezed, group, head_dim), lambda b, h: (b, h, 0, 0)),
      out_shape=jax.ShapeDtypeStruct((batch, num_kv_heads, group, head_dim), out_dtype),
      compiler_params=pltriton.CompilerParams(num_warps=config.num_warps, num_stages=1),
      interpret=interpret,
      name="split_combine",
  )(split_acc.astype(jnp.float32), split_max.astype(jnp.float32),
    split_denom.astype(jnp.float32))
