"""The split merge (interpret mode) and its jnp reference against float64 NumPy on random
partials: splits not a power of two, heads not a multiple of the head block, splits and whole
rows with no valid key; validation; lowering for an H200."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cg_jax.kernels.split_combine import (SplitCombineConfig, split_combine,
                                          split_combine_reference)
from tests.kernels.kernel_test_base import assert_kernel_close, lower_for_h200


def _partials(rng, tokens, splits, heads, head_dim):
  """Partials as a split-K attention leaves them: some splits empty (max -inf, zero sums), and
  token 0's head 0 empty in every split."""
  split_max = rng.standard_normal((tokens, splits, heads)).astype(np.float32) * 3
  split_denom = rng.uniform(0.5, 4.0, (tokens, splits, heads)).astype(np.float32)
  split_acc = rng.standard_normal((tokens, splits, heads, head_dim)).astype(np.float32)
  empty = rng.uniform(size=(tokens, splits, heads)) < 0.3
  empty[0, :, 0] = True
  split_max[empty] = -np.inf
  split_denom[empty] = 0.0
  split_acc[empty] = 0.0
  return split_acc, split_max, split_denom


def _float64(split_acc, split_max, split_denom):
  acc, top, denom = (np.asarray(x, np.float64) for x in (split_acc, split_max, split_denom))
  best = top.max(axis=1)
  best = np.where(np.isfinite(best), best, 0.0)
  weight = np.exp(top - best[:, None])
  total = (denom * weight).sum(1)
  out = (acc * weight[..., None]).sum(1)
  return out / np.where(total > 0, total, 1.0)[..., None]


@pytest.mark.parametrize("tokens, splits, heads, head_dim, dtype, block_heads", [
    (3, 16, 32, 64, "float32", 8),  # llama-3.2-1b's heads, 16 splits
    (2, 5, 12, 16, "bfloat16", 8),  # splits and heads off the powers of two
    (4, 1, 6, 32, "float32", 2),
    (1, 3, 3, 16, "bfloat16", 4),  # fewer heads than a block
])
def test_against_float64(tokens, splits, heads, head_dim, dtype, block_heads):
  rng = np.random.default_rng(tokens * 100 + splits)
  partials = [jnp.asarray(x) for x in _partials(rng, tokens, splits, heads, head_dim)]
  reference = _float64(*partials)
  out = split_combine(*partials, dtype=jnp.dtype(dtype),
                      config=SplitCombineConfig(block_heads=block_heads), interpret=True)
  assert out.dtype == jnp.dtype(dtype)
  assert_kernel_close(out, reference, dtype, "split_combine")
  assert not np.any(np.asarray(out, np.float32)[0, 0])  # no valid key anywhere: zeros
  assert_kernel_close(split_combine_reference(*partials, dtype=jnp.dtype(dtype)), reference,
                      dtype, "split_combine_reference")


def test_validation():
  acc = jnp.zeros((2, 4, 8, 16))
  with pytest.raises(ValueError, match="split_max and split_denom must be"):
    split_combine(acc, jnp.zeros((2, 4, 7)), jnp.zeros((2, 4, 7)), dtype=jnp.float32,
                  interpret=True)
  with pytest.raises(ValueError, match="head dim must be a power of two"):
    split_combine(jnp.zeros((2, 4, 8, 24)), jnp.zeros((2, 4, 8)), jnp.zeros((2, 4, 8)),
                  dtype=jnp.float32, interpret=True)
  with pytest.raises(ValueError, match="block_heads must be a positive power of two"):
    SplitCombineConfig(block_heads=6)


def test_lowers_for_h200():
  f32 = jnp.float32
  text = lower_for_h200(lambda a, m, d: split_combine(a, m, d, dtype=jnp.bfloat16),
                        jax.ShapeDtypeStruct((8, 16, 32, 64), f32),
                        jax.ShapeDtypeStruct((8, 16, 32), f32),
                        jax.ShapeDtypeStruct((8, 16, 32), f32))
  assert "triton" in text and "split_combine" in text
