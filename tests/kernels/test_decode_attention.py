"""Decode-attention kernel (interpret mode) and its jnp reference vs the float64 NumPy reference,
plus determinism, shape validation and lowering for an H200."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import jax
import jax.numpy as jnp

from cg_jax.kernels.decode_attention import (DecodeAttentionConfig, decode_attention,
                                             decode_attention_with_write,
                                             decode_attention_reference, split_layout)
from tests.kernels.kernel_test_base import (assert_kernel_close, attention_reference,
                                            lower_for_h200, random_array)

# Small blocks keep interpret mode fast and give several splits per row (min_programs=0: the
# split sizes as given).
SMALL_BLOCKS = DecodeAttentionConfig(block_k=16, split_size=32, min_programs=0)


@dataclasses.dataclass(frozen=True)
class Case:
  dtype: str
  head_dim: int
  num_q_heads: int
  num_kv_heads: int
  cache_len: int
  lengths: tuple[int, ...]
  config: DecodeAttentionConfig = SMALL_BLOCKS
  sm_scale: float | None = None

  def __str__(self):
    return (f"{self.dtype}-D{self.head_dim}-Hq{self.num_q_heads}-Hkv{self.num_kv_heads}-"
            f"T{self.cache_len}-len{'_'.join(map(str, self.lengths))}-"
            f"bk{self.config.block_k}-split{self.config.split_size}-"
            f"min{self.config.min_programs}")


CASES = [
    # GQA 4, T not a multiple of block_k; lengths 1, T and 0.
    Case("float32", 64, 8, 2, 100, (1, 100, 0)),
    # MHA (ratio 1), D 128, ten splits of 32; lengths off block and split boundaries.
    Case("float32", 128, 2, 2, 300, (300, 77, 143), sm_scale=0.3),
    # GQA 8: lengths on and around block/split boundaries, T = 129 (one key past a split).
    Case("float32", 64, 16, 2, 129, (129, 64, 65)),
    # MQA (one KV head, 4 query heads), short T = 37.
    Case("bfloat16", 64, 4, 1, 37, (37, 17, 0)),
    # bfloat16, D 128, GQA 8 on a single KV head, splits of 64.
    Case("bfloat16", 128, 8, 1, 200, (1, 200, 131),
         config=DecodeAttentionConfig(block_k=16, split_size=64, min_programs=0)),
    # The default config: few (batch, head) programs, so the split shrinks to block_k (64).
    Case("bfloat16", 64, 8, 2, 100, (100, 33)),
    # Split clamped to the short cache: one split, block_k 64.
    Case("bfloat16", 64, 8, 2, 100, (100, 33), config=DecodeAttentionConfig(min_programs=0)),
    # A group of 3 (not a power of two) in one split (normalised in the kernel), with a
    # length-0 row; and the same group over several splits.
    Case("float32", 64, 6, 2, 50, (50, 0, 7),
         config=DecodeAttentionConfig(block_k=16, split_size=64, min_programs=0)),
    Case("bfloat16", 64, 6, 2, 130, (130, 0, 65)),
]


def make_inputs(case: Case, seed: int = 0):
  rng = np.random.default_rng(seed)
  batch = len(case.lengths)
  q = random_array(rng, (batch, case.num_q_heads, case.head_dim), case.dtype)
  cache_shape = (batch, case.cache_len, case.num_kv_heads, case.head_dim)
  k_cache = random_array(rng, cache_shape, case.dtype)
  v_cache = random_array(rng, cache_shape, case.dtype)
  lengths = jnp.asarray(case.lengths, jnp.int32)
  return q, k_cache, v_cache, lengths


def float64_reference(q, k_cache, v_cache, lengths, sm_scale=None):
  """The shared [B, T, Hq, D] reference with T = 1 and a [B, 1, S] length mask."""
  if sm_scale is None:
    sm_scale = 1.0 / np.sqrt(q.shape[-1])
  cache_len = k_cache.shape[1]
  # [B, 1, S]
  mask = np.arange(cache_len)[None, None, :] < np.asarray(lengths)[:, None, None]
  return attention_reference(q[:, None], k_cache, v_cache, mask, sm_scale)[:, 0]


def run_kernel(case: Case, q, k_cache, v_cache, lengths):
  return decode_attention(q, k_cache, v_cache, lengths, sm_scale=case.sm_scale,
                          config=case.config, interpret=True)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_kernel_matches_float64_reference(case):
  inputs = make_inputs(case)
  out = run_kernel(case, *inputs)
  assert out.dtype == jnp.dtype(case.dtype)
  reference = float64_reference(*inputs, sm_scale=case.sm_scale)
  assert_kernel_close(out, reference, case.dtype, what=f"decode_attention[{case}]")
  # A row with no valid key is exactly zero.
  for row, length in enumerate(case.lengths):
    if length == 0:
      assert np.all(np.asarray(out[row], np.float32) == 0.0)


@pytest.mark.parametrize("case", [CASES[0], CASES[3], CASES[4]], ids=str)
def test_jnp_reference_matches_float64_reference(case):
  inputs = make_inputs(case, seed=1)
  out = decode_attention_reference(*inputs, sm_scale=case.sm_scale)
  assert out.dtype == jnp.dtype(case.dtype)
  reference = float64_reference(*inputs, sm_scale=case.sm_scale)
  assert_kernel_close(out, reference, case.dtype, what="decode_attention_reference")


def test_all_rows_empty_give_zeros():
  case = Case("float32", 64, 4, 2, 40, (0, 0))
  out = run_kernel(case, *make_inputs(case))
  assert np.all(np.asarray(out) == 0.0)


def test_lengths_past_cache_are_clamped():
  case = Case("float32", 64, 4, 2, 40, (40, 7))
  q, k_cache, v_cache, lengths = make_inputs(case)
  out = run_kernel(case, q, k_cache, v_cache, jnp.asarray([1000, 7], jnp.int32))
  np.testing.assert_array_equal(np.asarray(out), np.asarray(run_kernel(case, q, k_cache, v_cache,
                                                                       lengths)))


def test_kernel_is_deterministic():
  case = CASES[1]
  inputs = make_inputs(case, seed=2)
  first = np.asarray(run_kernel(case, *inputs))
  second = np.asarray(run_kernel(case, *inputs))
  assert first.tobytes() == second.tobytes()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
def test_lowers_to_triton_for_h200(dtype):
  batch, cache_len, num_kv_heads, group, head_dim = 2, 1000, 4, 8, 128
  specs = (jax.ShapeDtypeStruct((batch, num_kv_heads * group, head_dim), dtype),
           jax.ShapeDtypeStruct((batch, cache_len, num_kv_heads, head_dim), dtype),
           jax.ShapeDtypeStruct((batch, cache_len, num_kv_heads, head_dim), dtype),
           jax.ShapeDtypeStruct((batch,), jnp.int32))
  text = lower_for_h200(decode_attention, *specs)
  assert "triton" in text.lower()


def _shapes(batch=2, num_q_heads=4, num_kv_heads=2, head_dim=64, cache_len=32,
            cache_head_dim=None, v_cache_len=None, lengths_shape=None, dtype=jnp.float32):
  cache_head_dim = head_dim if cache_head_dim is None else cache_head_dim
  v_cache_len = cache_len if v_cache_len is None else v_cache_len
  lengths_shape = (batch,) if lengths_shape is None else lengths_shape
  return (jnp.zeros((batch, num_q_heads, head_dim), dtype),
          jnp.zeros((batch, cache_len, num_kv_heads, cache_head_dim), dtype),
          jnp.zeros((batch, v_cache_len, num_kv_heads, cache_head_dim), dtype),
          jnp.zeros(lengths_shape, jnp.int32))


@pytest.mark.parametrize("fn", [decode_attention, decode_attention_reference],
                         ids=["kernel", "reference"])
@pytest.mark.parametrize("arguments, message", [
    (_shapes(num_q_heads=6, num_kv_heads=4), "multiple of k_cache heads"),
    (_shapes(cache_head_dim=128), "head_dim"),
    (_shapes(lengths_shape=(3,)), "lengths"),
    (_shapes(lengths_shape=(2, 1)), "lengths"),
    (_shapes(v_cache_len=16), "v_cache"),
    ((jnp.zeros((2, 64)),) + _shapes()[1:], "q must be"),
], ids=["heads", "head_dim", "lengths_batch", "lengths_rank", "v_cache", "q_rank"])
def test_bad_shapes_raise(fn, arguments, message):
  with pytest.raises(ValueError, match=message):
    fn(*arguments)


def test_kernel_rejects_unsupported_head_dim_and_dtype():
  with pytest.raises(ValueError, match="head_dim"):
    decode_attention(*_shapes(head_dim=80), interpret=True)
  with pytest.raises(ValueError, match="dtype"):
    decode_attention(*_shapes(dtype=jnp.float16), interpret=True)


@pytest.mark.parametrize("batch, kv_heads, cache_len, expected", [
    (1, 12, 1024, (64, 16)),    # gpt2 shape at batch 1: 12 programs -> 192 (never below block_k)
    (1, 8, 1024, (64, 16)),     # llama-3.2-1b shape at batch 1: 8 -> 128
    (8, 12, 1024, (128, 8)),    # gpt2 at batch 8: 192 -> 768
    (8, 8, 1024, (128, 8)),     # llama at batch 8: 128 -> 512
    (32, 8, 1024, (256, 4)),    # llama at batch 32: 512 at the full split -> 1024
    (32, 12, 1024, (256, 4)),   # gpt2 at batch 32: 768 -> 1536
    (32, 20, 1024, (512, 2)),   # gpt2-large at batch 32: 1280 programs at the full split
    (32, 8, 4096, (512, 8)),    # 2048
    (8, 20, 1024, (256, 4)),    # gpt2-large at batch 8: 320 -> 640
    (1, 8, 100, (64, 2)),       # short cache
    (1, 1, 40, (64, 1)),        # never below block_k
])
def test_split_layout_spreads_small_launches(batch, kv_heads, cache_len, expected):
  assert split_layout(batch, kv_heads, cache_len, DecodeAttentionConfig()) == expected
  assert split_layout(batch, kv_heads, cache_len, DecodeAttentionConfig(min_programs=0))[0] == \
      min(512, max(64, 1 << (cache_len - 1).bit_length()))


@pytest.mark.parametrize("fields, name", [
    (dict(block_k=24), "block_k"),
    (dict(block_k=8, split_size=64), "block_k"),
    (dict(split_size=96), "split_size"),
    (dict(block_k=128, split_size=64), "split_size"),
    (dict(num_warps=3), "num_warps"),
    (dict(num_stages=0), "num_stages"),
    (dict(min_programs=-1), "min_programs"),
])
def test_config_validation(fields, name):
  with pytest.raises(ValueError, match=name):
    DecodeAttentionConfig(**fields)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_stacked_cache_with_layer_reads_that_layer_in_place(dtype):
  """A [L, B', T, Hkv, D] cache with a static layer equals the kernel on the sliced layer."""
  rng = np.random.default_rng(11)
  layers, rows, batch, cache_len, heads, kv_heads, head_dim = 3, 4, 2, 70, 8, 2, 64
  q = random_array(rng, (batch, heads, head_dim), dtype)
  k = random_array(rng, (layers, rows, cache_len, kv_heads, head_dim), dtype)
  v = random_array(rng, (layers, rows, cache_len, kv_heads, head_dim), dtype)
  lengths = jnp.asarray([70, 33], jnp.int32)
  config = DecodeAttentionConfig(block_k=16, split_size=32, min_programs=0)
  stacked = decode_attention(q, k, v, lengths, layer=1, config=config, interpret=True)
  sliced = decode_attention(q, k[1, :batch], v[1, :batch], lengths, config=config, interpret=True)
  np.testing.assert_array_equal(np.asarray(stacked), np.asarray(sliced))
  mask = np.arange(cache_len)[None, None, :] < np.asarray(lengths)[:, None, None]
  reference = attention_reference(q[:, None], k[1, :batch], v[1, :batch], mask,
                                  1 / np.sqrt(head_dim))[:, 0]
  assert_kernel_close(stacked, reference, dtype, "stacked-cache decode_attention")
  with pytest.raises(ValueError, match="layer must be in"):
    decode_attention(q, k, v, lengths, layer=3, interpret=True)
  text = lower_for_h200(lambda *a: decode_attention(*a, layer=2), jax.ShapeDtypeStruct(q.shape, q.dtype),
                        jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype),
                        jax.ShapeDtypeStruct((batch,), jnp.int32))
  assert "triton" in text.lower()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("config", [SMALL_BLOCKS, DecodeAttentionConfig(min_programs=0),
                                    DecodeAttentionConfig(block_k=16, split_size=16)],
                         ids=["splits32", "one-split", "splits16"])
def test_write_and_attend_matches_scatter_then_float64_attention(dtype, config):
  """decode_attention_with_write stores each row's new key/value at (layer, b, length - 1) and
  attends to it: the caches equal the scatter's exactly (rows past the batch, other layers and
  a length-0 row untouched), the output matches float64 attention over the written cache."""
  rng = np.random.default_rng(12)
  layers, rows, batch, cache_len, kv_heads, group, head_dim = 3, 4, 4, 100, 2, 3, 64
  q = random_array(rng, (batch - 1, kv_heads * group, head_dim), dtype)
  k_cache = random_array(rng, (layers, rows, cache_len, kv_heads, head_dim), dtype)
  v_cache = random_array(rng, (layers, rows, cache_len, kv_heads, head_dim), dtype)
  k_new = random_array(rng, (batch - 1, kv_heads, head_dim), dtype)
  v_new = random_array(rng, (batch - 1, kv_heads, head_dim), dtype)
  # Lengths 1 (the new key alone), T (written at the last position), 33 and 0 (nothing).
  lengths = jnp.asarray([1, cache_len, 33], jnp.int32)
  written = (np.asarray(lengths) > 0)
  positions = np.maximum(np.asarray(lengths) - 1, 0)
  expected_k, expected_v = np.array(k_cache), np.array(v_cache)
  for b in np.flatnonzero(written):
    expected_k[1, b, positions[b]] = np.asarray(k_new[b])
    expected_v[1, b, positions[b]] = np.asarray(v_new[b])
  out, k_out, v_out = decode_attention_with_write(
      q, k_new, v_new, jnp.array(k_cache), jnp.array(v_cache), lengths, layer=1, config=config,
      interpret=True)
  np.testing.assert_array_equal(np.asarray(k_out), expected_k)
  np.testing.assert_array_equal(np.asarray(v_out), expected_v)
  reference = float64_reference(q, expected_k[1, :batch - 1], expected_v[1, :batch - 1], lengths)
  assert_kernel_close(out, reference, dtype, "decode_attention_with_write")
  # A zero-length row is neither written nor attended.
  zero = decode_attention_with_write(q[:1], k_new[:1], v_new[:1], jnp.array(k_cache),
                                     jnp.array(v_cache), jnp.asarray([0], jnp.int32), layer=0,
                                     config=config, interpret=True)
  assert np.all(np.asarray(zero[0], np.float32) == 0.0)
  np.testing.assert_array_equal(np.asarray(zero[1]), np.asarray(k_cache))
  text = lower_for_h200(
      lambda *a: decode_attention_with_write(*a, layer=2, config=config),
      *(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k_new, v_new, k_cache, v_cache,
                                                          lengths)))
  assert "triton" in text.lower()
