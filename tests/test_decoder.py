"""The three forward paths agree: decode with cache equals the full forward at every position,
and padding never changes a real row."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from cg_jax.core.attention import RealRows
from models import Decoder, init_cache
from models.attention import XlaAttention
from models.hf import config_from_hf
from tests.helpers import RELATIVE_TOLERANCE, assert_close_relative, hf_gpt2_config, hf_llama_config

CONFIGS = {
    "gpt2": hf_gpt2_config(),
    "llama-mha": hf_llama_config(num_key_value_heads=4),
    "llama-gqa": hf_llama_config(num_attention_heads=8, num_key_value_heads=2, head_dim=8),
    "llama-mqa-bias": hf_llama_config(num_key_value_heads=1, attention_bias=True, mlp_bias=True),
}


def _model(name, seed=0):
  model = Decoder(config_from_hf(CONFIGS[name]), rngs=nnx.Rngs(seed))
  # Non-trivial norms and biases (zeros/ones would hide bugs).
  state = nnx.state(model)
  keys = iter(jax.random.split(jax.random.key(seed + 1), 64))
  for path, leaf in nnx.to_flat_state(state):
    name_ = path[-1] if isinstance(path[-1], str) else str(path[-1])
    if "norm" in name_ or "bias" in name_:
      leaf[...] = leaf[...] + 0.1 * jax.random.normal(next(keys), leaf[...].shape)
  return model


def _padded_decode(model, rows: int, layer_loop: str):
  """A decode step whose layers run on the rows padded to `rows` (token 0 at position 0), the
  attention over the real rows only (`cg_jax.core.attention.RealRows`), as the engine's steps do."""

  def decode(tokens, positions, cache):
    batch = tokens.shape[0]
    attention = XlaAttention()
    if rows > batch:
      tokens, positions = (jnp.pad(x, (0, rows - batch)) for x in (tokens, positions))
      attention = RealRows(attention, batch)
    hidden, cache = model.decode_hidden(tokens, positions, cache, attention=attention,
                                        layer_loop=layer_loop)
    return model.unembed(hidden[:batch]), cache

  return jax.jit(decode)


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("rows, layer_loop", [(1, "scan"), (8, "unroll")],
                         ids=["scan", "unroll-padded-rows8"])
def test_decode_with_cache_matches_full_forward(name, rows, layer_loop):
  """Also with unrolled layers and the decode step's rows padded to 8 (3 real rows): neither
  changes the result."""
  model = _model(name)
  rng = np.random.default_rng(0)
  vocab = model.config.vocab_size
  prompt_lengths = np.array([5, 17, 1], np.int32)
  batch, padded, new_tokens, cache_len = 3, 17, 20, 48
  tokens = rng.integers(0, vocab, (batch, padded)).astype(np.int32)
  # The cache has more rows than the batch: rows past the batch must be ignored.
  cache = init_cache(model.config, batch + 1, cache_len, jnp.float32)
  prefill = jax.jit(lambda t, n, c: model.prefill(t, n, c))
  decode = _padded_decode(model, rows, layer_loop)
  logits, cache = prefill(tokens, prompt_lengths, cache)
  sequences = [list(tokens[b, :prompt_lengths[b]]) for b in range(batch)]
  step_logits = [[np.asarray(logits[b])] for b in range(batch)]
  positions = prompt_lengths.copy()
  for _ in range(new_tokens):
    next_tokens = rng.integers(0, vocab, (batch,)).astype(np.int32)  # any continuation works
    for b in range(batch):
      sequences[b].append(int(next_tokens[b]))
    logits, cache = decode(next_tokens, positions, cache)
    for b in range(batch):
      step_logits[b].append(np.asarray(logits[b]))
    positions = positions + 1
  for b in range(batch):
    full = np.asarray(model.logits(jnp.asarray([sequences[b]], jnp.int32)))[0]
    # Position of each generated-step logit: the prompt's last token, then each new token.
    expected = full[prompt_lengths[b] - 1:]
    assert_close_relative(np.stack(step_logits[b]), expected, RELATIVE_TOLERANCE["float32"],
                          f"{name} row {b}")


@pytest.mark.parametrize("name", ["gpt2", "llama-gqa"])
def test_padding_changes_no_row(name):
  model = _model(name, seed=3)
  rng = np.random.default_rng(1)
  row = rng.integers(0, model.config.vocab_size, (9,)).astype(np.int32)
  alone, _ = model.prefill(row[None], np.array([9], np.int32),
                           init_cache(model.config, 1, 32, jnp.float32))
  padded = np.zeros((4, 16), np.int32)
  padded[2, :9] = row
  padded[0, :16] = rng.integers(0, model.config.vocab_size, (16,))
  lengths = np.array([16, 0, 9, 3], np.int32)
  together, _ = model.prefill(padded, lengths, init_cache(model.config, 4, 32, jnp.float32))
  assert np.all(np.isfinite(np.asarray(together)))
  assert_close_relative(together[2], alone[0], RELATIVE_TOLERANCE["float32"], "padded row")


def test_full_forward_is_causal():
  model = _model("llama-mha")
  rng = np.random.default_rng(2)
  tokens = rng.integers(0, model.config.vocab_size, (1, 12)).astype(np.int32)
  changed = tokens.copy()
  changed[0, 8:] = (changed[0, 8:] + 1) % model.config.vocab_size
  a, b = np.asarray(model.logits(tokens)), np.asarray(model.logits(changed))
  assert_close_relative(b[0, :8], a[0, :8], RELATIVE_TOLERANCE["float32"], "prefix")
  assert np.abs(a[0, 8:] - b[0, 8:]).max() > 1e-3
