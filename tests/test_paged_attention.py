"""The model over a paged KV cache (`cg_jax.core.attention.PagedAttention`, XLA and the ragged
paged kernel interpreted) equals the model over the slot cache: a prefill with an empty row, a
chunk at each row's offset (on the paged cache: an engine step's flat batch, `RaggedAttention`),
decode steps with an idle row; the pages hold each row's keys at the slots its block table names
and nothing else is written."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from cg_jax.core.attention import PagedAttention, RaggedAttention
from cg_jax.kernels.ragged_paged_attention import RaggedPagedAttentionConfig
from models import Decoder, init_cache
from models.attention import XlaAttention
from models.config import PRESETS
from models.decoder import KVCache
from tests.helpers import RELATIVE_TOLERANCE, assert_close_relative

PAGE = 16  # tokens per block (C)
WIDTH = 4  # blocks per row (W): 64 positions
KERNEL = RaggedPagedAttentionConfig(block_k=16, split_size=32, min_programs=0)


def _calls(model, attention, cache):
  """Hidden states of each call at its real tokens, and the final cache: prefill (row 2 empty),
  a chunk (rows 0 and 1 at their offsets, row 2 padding), three decode steps (row 2 idle)."""
  rng = np.random.default_rng(1)
  vocab = model.config.vocab_size
  outs = []
  tokens = jnp.asarray(rng.integers(0, vocab, (3, 16)), jnp.int32)
  lengths = jnp.asarray([16, 9, 0], jnp.int32)
  hidden, cache = jax.jit(functools.partial(model.prefill_hidden, attention=attention))(
      tokens, lengths, cache)
  outs.append(np.asarray(hidden[:2]))
  # [3, 8]: row 0 at 16..23, row 1's 5 tokens at 9..13, row 2 none
  chunk = rng.integers(0, vocab, (3, 8))
  offsets = np.arange(8)
  positions = np.stack([16 + offsets, np.where(offsets < 5, 9 + offsets, -1), -np.ones(8, int)])
  if isinstance(attention, PagedAttention):
    # One step: the 13 tokens end to end in a flat batch of 16, row 2 without a token.
    flat = np.zeros((1, 16), np.int32)
    flat[0, :13] = chunk[positions >= 0]
    ragged = RaggedAttention(attention, *(jnp.asarray(x, jnp.int32) for x in
                                          ([0, 8, 13, 13], [8, 5, 0], [24, 14, 0])))
    step_positions = np.full((1, 16), -1)
    step_positions[0, :13] = positions[positions >= 0]
    hidden, cache = jax.jit(functools.partial(model.extend_hidden, attention=ragged))(
        jnp.asarray(flat), jnp.asarray(step_positions, jnp.int32), None, cache)
    outs.append(np.asarray(hidden)[0, :13])
  else:
    hidden, cache = jax.jit(functools.partial(model.extend_hidden, attention=attention))(
        jnp.asarray(chunk, jnp.int32), jnp.asarray(positions, jnp.int32),
        jnp.arange(3, dtype=jnp.int32), cache)
    outs.append(np.asarray(hidden)[positions >= 0])
  step = jax.jit(functools.partial(model.decode_hidden, attention=attention))
  for i in range(3):
    token = jnp.asarray(rng.integers(0, vocab, (3,)), jnp.int32)
    hidden, cache = step(token, jnp.asarray([24 + i, 14 + i, -1], jnp.int32), cache)
    outs.append(np.asarray(hidden[:2]))
  return outs, cache


@pytest.mark.parametrize("kernel", [False, True], ids=["xla", "kernel"])
@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-llama"])
def test_paged_cache_gives_the_slot_cache_results(name, kernel):
  config = PRESETS[name]
  model = Decoder(config, rngs=nnx.Rngs(0))
  want, slots = _calls(model, XlaAttention(), init_cache(config, 3, WIDTH * PAGE, jnp.float32))
  pages = 3 * WIDTH + 2  # two blocks no row owns
  tables = np.random.default_rng(0).permutation(pages)[:3 * WIDTH].reshape(3, WIDTH)
  shape = (config.num_layers, pages, PAGE, config.num_kv_heads, config.head_dim)
  empty = KVCache(k=jnp.zeros(shape, jnp.float32), v=jnp.zeros(shape, jnp.float32))
  attention = PagedAttention(XlaAttention(), jnp.asarray(tables, jnp.int32), kernel=kernel,
                             config=KERNEL, interpret=True)
  got, paged = _calls(model, attention, empty)
  for i, (g, w) in enumerate(zip(got, want)):
    assert_close_relative(g, w, RELATIVE_TOLERANCE["float32"], f"call {i} hidden states")
  # Row b's positions [0, length) sit in its blocks; the slot cache holds the same keys there.
  lengths = (27, 17)
  for name_, slot_array, page_array in (("k", slots.k, paged.k), ("v", slots.v, paged.v)):
    page_array = np.asarray(page_array)
    for row, length in enumerate(lengths):
      at = np.arange(length)
      stored = page_array[:, tables[row, at // PAGE], at % PAGE]
      assert_close_relative(stored, np.asarray(slot_array)[:, row, :length],
                            RELATIVE_TOLERANCE["float32"], f"{name_} of row {row}")
      unwritten = np.arange(length, WIDTH * PAGE)
      assert not np.any(page_array[:, tables[row, unwritten // PAGE], unwritten % PAGE])
    # The idle row's blocks and the blocks no row owns are untouched.
    assert not np.any(page_array[:, tables[2]])
    assert not np.any(np.delete(page_array, tables.ravel(), axis=1))
