"""Flash attention (prefill) in interpret mode against a float64 NumPy reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cg_jax.kernels.flash_attention import (FlashAttentionConfig, flash_attention,
                                            flash_attention_reference)
from tests.kernels.kernel_test_base import (assert_kernel_close, attention_reference,
                                            lower_for_h200, random_array)

SMALL_BLOCKS = FlashAttentionConfig(block_q=16, block_k=16)


def _case(seed, batch, seq, heads, kv_heads, head_dim, dtype, lengths):
  rng = np.random.default_rng(seed)
  q = random_array(rng, (batch, seq, heads, head_dim), dtype)
  k = random_array(rng, (batch, seq, kv_heads, head_dim), dtype)
  v = random_array(rng, (batch, seq, kv_heads, head_dim), dtype)
  return q, k, v, jnp.asarray(lengths, jnp.int32)


def _reference(q, k, v, lengths, causal):
  """float64 reference, compared on the real rows only (rows past a length are unspecified)."""
  seq = q.shape[1]
  positions = np.arange(seq)
  lengths = np.asarray(lengths)
  mask = positions[None, None, :] < lengths[:, None, None]
  if causal:
    mask = mask & (positions[None, :, None] >= positions[None, None, :])
  mask = np.broadcast_to(mask, (q.shape[0], seq, seq))
  valid = (positions[None, :] < lengths[:, None])[:, :, None, None]
  return attention_reference(q, k, v, mask, 1 / np.sqrt(q.shape[-1])), valid


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (8, 2), (8, 1)])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_matches_float64_reference(dtype, heads, kv_heads, head_dim):
  # Length 1, the full length, and one that is not a multiple of the block size.
  q, k, v, lengths = _case(heads * head_dim, 3, 40, heads, kv_heads, head_dim, dtype, [1, 40, 23])
  out = flash_attention(q, k, v, lengths, config=SMALL_BLOCKS, interpret=True)
  reference, valid = _reference(q, k, v, lengths, causal=True)
  assert_kernel_close(np.where(valid, np.asarray(out, np.float64), 0.0),
                      np.where(valid, reference, 0.0), dtype, "flash_attention")


@pytest.mark.parametrize("block_q, block_k", [(32, 16), (16, 32)])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_unmasked_and_masked_key_blocks(block_q, block_k, causal):
  """Query blocks wider and narrower than key blocks: the key blocks run without a mask up to the
  diagonal or the padding, with it after (lengths at, inside and before a block boundary)."""
  q, k, v, lengths = _case(block_q + block_k, 3, 80, 4, 2, 64, "float32", [80, 47, 1])
  config = FlashAttentionConfig(block_q=block_q, block_k=block_k)
  out = flash_attention(q, k, v, lengths, causal=causal, config=config, interpret=True)
  reference, valid = _reference(q, k, v, lengths, causal=causal)
  assert_kernel_close(np.where(valid, np.asarray(out, np.float64), 0.0),
                      np.where(valid, reference, 0.0), "float32", "flash_attention blocks")


def test_group_of_four_and_non_causal():
  q, k, v, lengths = _case(1, 2, 33, 8, 2, 64, "float32", [33, 9])
  out = flash_attention(q, k, v, lengths, causal=False, config=SMALL_BLOCKS, interpret=True)
  reference, valid = _reference(q, k, v, lengths, causal=False)
  assert_kernel_close(np.where(valid, np.asarray(out, np.float64), 0.0),
                      np.where(valid, reference, 0.0), "float32", "non-causal")


def test_padded_rows_finite_and_empty_row_zero():
  q, k, v, lengths = _case(2, 2, 20, 4, 2, 64, "float32", [0, 5])
  out = np.asarray(flash_attention(q, k, v, lengths, config=SMALL_BLOCKS, interpret=True))
  assert np.all(np.isfinite(out))
  np.testing.assert_array_equal(out[0], 0.0)


def test_jnp_reference_matches_float64():
  for dtype in ("float32", "bfloat16"):
    q, k, v, lengths = _case(3, 2, 30, 8, 2, 64, dtype, [30, 17])
    out = flash_attention_reference(q, k, v, lengths)
    reference, valid = _reference(q, k, v, lengths, causal=True)
    assert_kernel_close(np.where(valid, np.asarray(out, np.float64), 0.0),
                        np.where(valid, reference, 0.0), dtype, "jnp reference")


def test_deterministic():
  q, k, v, lengths = _case(4, 1, 24, 4, 1, 64, "bfloat16", [24])
  first = flash_attention(q, k, v, lengths, config=SMALL_BLOCKS, interpret=True)
  second = flash_attention(q, k, v, lengths, config=SMALL_BLOCKS, interpret=True)
  np.testing.assert_array_equal(np.asarray(first), np.asarray(second))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_lowers_for_h200(dtype):
  spec = lambda *shape: jax.ShapeDtypeStruct(shape, dtype)  # noqa: E731
  text = lower_for_h200(lambda q, k, v, n: flash_attention(q, k, v, n), spec(2, 256, 32, 64),
                        spec(2, 256, 8, 64), spec(2, 256, 8, 64),
                        jax.ShapeDtypeStruct((2,), jnp.int32))
  assert "triton" in text.lower()


@pytest.mark.parametrize("bad, match", [
    (dict(q=(2, 8, 3, 64)), "multiple of kv heads"),
    (dict(k=(2, 9, 2, 64)), "do not match"),
    (dict(lengths=(3,)), "lengths must have shape"),
])
def test_bad_shapes(bad, match):
  shapes = dict(q=(2, 8, 4, 64), k=(2, 8, 2, 64), v=(2, 8, 2, 64), lengths=(2,))
  shapes.update(bad)
  if "k" in bad:
    shapes["v"] = bad["k"]
  args = [jnp.zeros(shapes[n], jnp.int32 if n == "lengths" else jnp.float32)
          for n in ("q", "k", "v", "lengths")]
  with pytest.raises(ValueError, match=match):
    flash_attention(*args, interpret=True)


def test_config_validation():
  with pytest.raises(ValueError, match="block_q must be a power of two"):
    FlashAttentionConfig(block_q=24)
