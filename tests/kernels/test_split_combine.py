"""The split-K combine kernel (interpret mode) and its jnp reference against a float64 merge,
with empty splits and empty rows, and its lowering for an H200."""

from __future__ import annotations

import numpy as np
import pytest
import jax
import jax.numpy as jnp

from cg_jax.kernels.split_combine import (SplitCombineConfig, split_combine,
                                          split_combine_reference)
from tests.kernels.kernel_test_base import assert_kernel_close, lower_for_h200


def make_partials(rng, batch, kv_heads, splits, group, head_dim):
  """Partials as the attention kernel leaves them: some splits empty (-inf, 0, 0), row 0 of
  head 0 empty everywhere."""
  split_max = rng.normal(size=(batch, kv_heads, splits, group)) * 3
  split_denom = rng.uniform(0.5, 4.0, size=split_max.shape)
  split_acc = rng.normal(size=split_max.shape + (head_dim,)) * split_denom[..., None]
  empty = rng.uniform(size=split_max.shape) < 0.3
  empty[0, 0] = True
  split_max[empty], split_denom[empty], split_acc[empty] = -np.inf, 0.0, 0.0
  return split_acc, split_max, split_denom


def float64_merge(split_acc, split_max, split_denom):
  """sum_s exp(m_s - M) acc_s / sum_s exp(m_s - M) l_s in float64; zeros for empty rows."""
  top = np.max(split_max, axis=-2, keepdims=True)
  top = np.where(np.isfinite(top), top, 0.0)
  weight = np.exp(split_max - top)
  denom = np.sum(weight * split_denom, axis=-2)
  acc = np.sum(weight[..., None] * split_acc, axis=-3)
  return acc / np.where(denom > 0, denom, 1.0)[..., None]


@pytest.mark.parametrize("out_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("batch, kv_heads, splits, group, head_dim", [
    (2, 3, 5, 4, 64),    # splits not a power of two
    (1, 2, 16, 3, 32),   # a group of 3 (padded to 16 rows in the kernel)
    (3, 1, 1, 1, 64),    # one split, MHA
])
def test_kernel_and_reference_match_float64(out_dtype, batch, kv_heads, splits, group, head_dim):
  rng = np.random.default_rng(batch * 100 + splits)
  partials = make_partials(rng, batch, kv_heads, splits, group, head_dim)
  expected = float64_merge(*partials)
  arrays = [jnp.asarray(p, jnp.float32) for p in partials]
  out = split_combine(*arrays, out_dtype=jnp.dtype(out_dtype), interpret=True)
  assert out.dtype == jnp.dtype(out_dtype)
  assert_kernel_close(out, expected, out_dtype, "split_combine")
  assert_kernel_close(split_combine_reference(*arrays), expected, "float32",
                      "split_combine_reference")
  # Rows with no valid key anywhere are exactly zero.
  empty_rows = ~np.isfinite(np.max(partials[1], axis=-2))
  assert np.all(np.asarray(out, np.float32)[empty_rows] == 0.0)


def test_bad_shapes_and_config_are_named():
  with pytest.raises(ValueError, match=r"split_acc must be \[B, Hkv, S, G, D\]"):
    split_combine(jnp.zeros((1, 2, 3, 4, 8)), jnp.zeros((1, 2, 3, 5)), jnp.zeros((1, 2, 3, 5)),
                  interpret=True)
  with pytest.raises(ValueError, match="num_warps must be a positive power of two, got 3"):
    SplitCombineConfig(num_warps=3)


def test_lowers_for_h200():
  specs = [jax.ShapeDtypeStruct((4, 8, 12, 4, 64), jnp.float32),
           jax.ShapeDtypeStruct((4, 8, 12, 4), jnp.float32),
           jax.ShapeDtypeStruct((4, 8, 12, 4), jnp.float32)]
  text = lower_for_h200(lambda *a: split_combine(*a, out_dtype=jnp.bfloat16), *specs)
  assert "triton" in text.lower()
