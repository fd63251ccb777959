"""The model with attention="pallas" (kernels interpreted on CPU) equals attention="xla", and the
forward configuration's combinations."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from cg_jax import DecodeAttentionConfig, Engine, FlashAttentionConfig
from cg_jax.core.attention import PallasAttention, RealRows
from models.attention import XlaAttention
from tests.helpers import RELATIVE_TOLERANCE, assert_close_relative


@pytest.mark.parametrize("model", ["tiny-gpt2", "tiny-llama"])
def test_pallas_and_xla_agree(model):
  xla = Engine.from_pretrained(model, attention="xla", batch_buckets=(2,), prompt_buckets=(16,),
                               max_seq_len=40)
  pallas = xla.with_options(attention="pallas")
  assert pallas.stats()["attention"] == "pallas"
  prompts = [[3, 14, 15, 92, 65, 35, 89, 79, 32], [38, 46]]
  expected = xla.generate(prompts, max_new_tokens=12, eos_token_id=[])
  assert pallas.generate(prompts, max_new_tokens=12, eos_token_id=[]) == expected
  # Unrolled layers pass the stacked cache and a static layer to the kernel (no slice copy).
  unrolled = xla.with_options(attention="pallas", layer_loop="unroll")
  assert unrolled.generate(prompts, max_new_tokens=12, eos_token_id=[]) == expected
  # ... whose new keys/values the kernel stores itself ("fused"), or XLA scatters first.
  assert unrolled.stats()["cache_write"] == "fused"
  scattered = unrolled.with_options(cache_write="scatter")
  assert scattered.generate(prompts, max_new_tokens=12, eos_token_id=[]) == expected
  tokens = np.random.default_rng(0).integers(0, 263, (2, 21)).tolist()
  assert_close_relative(pallas.logits(tokens), xla.logits(tokens), RELATIVE_TOLERANCE["float32"],
                        "pallas logits")


def test_decode_kernel_config_reaches_the_kernel():
  """A DecodeAttentionConfig with small splits (a 256-long cache cut into 16 splits of 16 keys,
  an 80-token prompt) gives the XLA backend's tokens, and stats() reports it."""
  xla = Engine.from_pretrained("tiny-llama", attention="xla", batch_buckets=(2,),
                               prompt_buckets=(96,), max_seq_len=256)
  prompts = [list(range(3, 83)), [38, 46]]
  expected = xla.generate(prompts, max_new_tokens=8, eos_token_id=[])
  config = DecodeAttentionConfig(block_k=16, split_size=16, min_programs=0)
  small = xla.with_options(attention="pallas", layer_loop="unroll", decode_attention=config)
  assert small.stats()["decode_attention"] == dataclasses.asdict(config)
  assert small.generate(prompts, max_new_tokens=8, eos_token_id=[]) == expected


def test_cpu_defaults():
  """Off the GPU: XLA attention, scanned layers, scatters; the kernel configs at their
  defaults, all as stats() reports them."""
  stats = Engine.from_pretrained("tiny-gpt2").stats()
  assert (stats["attention"], stats["layer_loop"], stats["cache_write"]) == ("xla", "scan",
                                                                             "scatter")
  assert stats["decode_attention"] == dataclasses.asdict(DecodeAttentionConfig())


@pytest.mark.parametrize("options, match", [
    (dict(attention="xla", cache_write="fused"),
     r"cache_write='fused' needs attention='pallas' .*got attention='xla'"),
    (dict(attention="pallas", layer_loop="scan", cache_write="fused"),
     r"cache_write='fused' needs layer_loop='unroll' .*got layer_loop='scan'"),
    (dict(attention="xla", decode_attention=DecodeAttentionConfig(split_size=256)),
     r"decode_attention=DecodeAttentionConfig\(.*split_size=256.*\) has no effect with "
     r"attention='xla'"),
    (dict(attention="xla", prefill_attention=FlashAttentionConfig(block_q=32)),
     r"prefill_attention=.* has no effect with attention='xla'"),
])
def test_options_that_would_not_take_effect_are_errors(options, match):
  with pytest.raises(ValueError, match=match):
    Engine.from_pretrained("tiny-gpt2", **options)


def test_kernel_configs_are_typed():
  with pytest.raises(TypeError, match="decode_attention must be a DecodeAttentionConfig, got"):
    Engine.from_pretrained("tiny-gpt2", attention="pallas", decode_attention={"block_k": 32})


@pytest.mark.parametrize("cache_rows", [3, 5])
def test_decode_write_keeps_padding_rows_out(cache_rows):
  """Decode over 2 real rows of 5 (`RealRows`) with the fused Pallas kernel: the real rows'
  outputs and cache writes equal the XLA implementation's (float32), the padding rows give zeros
  and write nothing, on a cache with fewer and with as many rows as the padded input."""
  rng = np.random.default_rng(cache_rows)
  layers, max_len, heads, kv_heads, head_dim, padded = 2, 32, 4, 2, 16, 5
  q, k_new, v_new = (jnp.asarray(rng.standard_normal((padded, h, head_dim)), jnp.float32)
                     for h in (heads, kv_heads, kv_heads))
  cache = [rng.standard_normal((layers, cache_rows, max_len, kv_heads, head_dim)).astype(np.float32)
           for _ in range(2)]
  positions = jnp.asarray([7, 30, 0, 0, 0], jnp.int32)
  implementations = {"xla": XlaAttention(), "pallas": PallasAttention(interpret=True)}
  results = {
      name: RealRows(impl, 2).decode(q, k_new, v_new, positions, jnp.asarray(cache[0]),
                                     jnp.asarray(cache[1]), 1)  # (fresh arrays: donated)
      for name, impl in implementations.items()}
  (out_xla, k_xla, v_xla), (out, k_out, v_out) = results["xla"], results["pallas"]
  assert out.shape == (padded, heads, head_dim)
  assert_close_relative(out[:2], out_xla[:2], RELATIVE_TOLERANCE["float32"], "real rows")
  np.testing.assert_array_equal(out[2:], 0.0)
  np.testing.assert_array_equal(out_xla[2:], 0.0)
  np.testing.assert_array_equal(k_out, k_xla)
  np.testing.assert_array_equal(v_out, v_xla)
  # Nothing but the two new entries changed.
  changed = np.argwhere(np.any(np.asarray(k_out) != cache[0], axis=(-1, -2)))
  assert changed.tolist() == [[1, 0, 7], [1, 1, 30]]


def test_padded_step_over_a_full_width_cache_gives_the_same_tokens():
  """A 2-row request padded to 8 rows on an engine whose cache holds 8 rows: the tokens of the
  fused kernel equal the XLA backend's."""
  xla = Engine.from_pretrained("tiny-llama", attention="xla", batch_buckets=(2, 8),
                               prompt_buckets=(16,), max_seq_len=40)
  prompts = [[3, 14, 15, 92, 65, 35, 89, 79, 32], [38, 46]]
  expected = xla.generate(prompts, max_new_tokens=10, eos_token_id=[])
  fused = xla.with_options(attention="pallas", layer_loop="unroll")
  assert fused.stats()["min_matmul_rows"] == 8
  assert fused.generate(prompts, max_new_tokens=10, eos_token_id=[]) == expected
