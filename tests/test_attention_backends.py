"""The model with attention="pallas" (kernels interpreted on CPU) equals attention="xla", and the
forward configuration's combinations."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from cg_jax import Engine, FlashAttentionConfig
from cg_jax.core.attention import PagedAttention, RealRows
from cg_jax.kernels.ragged_paged_attention import RaggedPagedAttentionConfig
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
  # ... and with unrolled layers.
  unrolled = xla.with_options(attention="pallas", layer_loop="unroll")
  assert unrolled.generate(prompts, max_new_tokens=12, eos_token_id=[]) == expected
  tokens = np.random.default_rng(0).integers(0, 263, (2, 21)).tolist()
  assert_close_relative(pallas.logits(tokens), xla.logits(tokens), RELATIVE_TOLERANCE["float32"],
                        "pallas logits")


def test_cpu_defaults():
  """Off the GPU: XLA attention, scanned layers; the flash kernel's config at its default, all
  as stats() reports them."""
  stats = Engine.from_pretrained("tiny-gpt2").stats()
  assert (stats["attention"], stats["layer_loop"]) == ("xla", "scan")
  assert stats["prefill_attention"] == dataclasses.asdict(FlashAttentionConfig())


def test_options_that_would_not_take_effect_are_errors():
  with pytest.raises(ValueError, match=r"prefill_attention=.* has no effect with attention='xla'"):
    Engine.from_pretrained("tiny-gpt2", attention="xla",
                           prefill_attention=FlashAttentionConfig(block_q=32))


def test_kernel_configs_are_typed():
  with pytest.raises(TypeError, match="prefill_attention must be a FlashAttentionConfig, got"):
    Engine.from_pretrained("tiny-gpt2", attention="pallas", prefill_attention={"block_q": 32})


def test_padded_decode_keeps_padding_rows_out():
  """Decode over 2 real rows of 5 (`RealRows`, as the engine's padded steps) over a paged cache:
  the ragged paged kernel's outputs and cache writes for the real rows equal the XLA ones'
  (float32, two splits of 16 positions), the padding rows give zeros and write nothing."""
  rng = np.random.default_rng(0)
  layers, pages, page, heads, kv_heads, head_dim, padded = 2, 5, 16, 4, 2, 16, 5
  q, k_new, v_new = (jnp.asarray(rng.standard_normal((padded, h, head_dim)), jnp.float32)
                     for h in (heads, kv_heads, kv_heads))
  cache = [rng.standard_normal((layers, pages, page, kv_heads, head_dim)).astype(np.float32)
           for _ in range(2)]
  tables = jnp.asarray([[3, 0], [1, 2]], jnp.int32)  # page 4 no row owns
  positions = jnp.asarray([7, 30, 0, 0, 0], jnp.int32)
  config = RaggedPagedAttentionConfig(block_k=16, split_size=16, min_programs=0)
  implementations = {
      "xla": PagedAttention(XlaAttention(), tables),
      "kernel": PagedAttention(XlaAttention(), tables, kernel=True, config=config,
                               interpret=True)}
  results = {
      name: RealRows(impl, 2).decode(q, k_new, v_new, positions, jnp.asarray(cache[0]),
                                     jnp.asarray(cache[1]), 1)  # (fresh arrays: donated)
      for name, impl in implementations.items()}
  (out_xla, k_xla, v_xla), (out, k_out, v_out) = results["xla"], results["kernel"]
  assert out.shape == (padded, heads, head_dim)
  assert_close_relative(out[:2], out_xla[:2], RELATIVE_TOLERANCE["float32"], "real rows")
  np.testing.assert_array_equal(out[2:], 0.0)
  np.testing.assert_array_equal(out_xla[2:], 0.0)
  np.testing.assert_array_equal(k_out, k_xla)
  np.testing.assert_array_equal(v_out, v_xla)
  # Nothing but the two new entries changed: (layer 1, page, slot) of positions 7 and 30.
  changed = np.argwhere(np.any(np.asarray(k_out) != cache[0], axis=(-1, -2)))
  assert changed.tolist() == [[1, 2, 14], [1, 3, 7]]


def test_padded_step_over_a_full_width_cache_gives_the_same_tokens():
  """A 2-row request padded to 8 rows on an engine whose cache holds 8 rows: the tokens of the
  Pallas kernels equal the XLA backend's."""
  xla = Engine.from_pretrained("tiny-llama", attention="xla", batch_buckets=(2, 8),
                               prompt_buckets=(16,), max_seq_len=40)
  prompts = [[3, 14, 15, 92, 65, 35, 89, 79, 32], [38, 46]]
  expected = xla.generate(prompts, max_new_tokens=10, eos_token_id=[])
  fused = xla.with_options(attention="pallas", layer_loop="unroll")
  assert fused.stats()["min_matmul_rows"] == 8
  assert fused.generate(prompts, max_new_tokens=10, eos_token_id=[]) == expected
