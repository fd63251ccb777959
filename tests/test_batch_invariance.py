"""Batch-invariant engines: a request's tokens and log-probabilities, bit for bit, do not depend
on the requests around it, its place in a step, the load, or the prefix cache."""

import re

import numpy as np
import pytest

from cg_jax.core.attention import paged_for_forward
from cg_jax import Engine, EngineConfig
from cg_jax.kernels.ragged_paged_attention import RaggedPagedAttentionConfig, split_layout
from models import preset

OPTIONS = dict(max_seq_len=64, batch_buckets=(1, 4, 16), prompt_buckets=(16,), prefix_block=8,
               batch_invariant=True)
TARGET = list(np.random.default_rng(0).integers(2, 263, (37,)))  # three chunks of 16


def _result(engine, prompt, **kwargs):
  return engine.submit(prompt, 12, eos_token_id=[], **kwargs).result()


def _same(got, want):
  assert got.tokens == want.tokens
  assert got.logprobs == want.logprobs  # exact floats
  assert got.top_logprobs == want.top_logprobs


@pytest.fixture(scope="module")
def engine():
  return Engine.from_pretrained("tiny-llama", **OPTIONS)


@pytest.fixture(scope="module")
def alone():
  """The target request on an engine that serves nothing else, without a prefix cache."""
  solo = Engine.from_pretrained("tiny-llama", prefix_cache_tokens=0, **OPTIONS)
  return _result(solo, TARGET, logprobs=3), _result(solo, TARGET)


def test_the_configuration_fixes_every_shape():
  config = EngineConfig.create(preset("tiny-llama"), **OPTIONS)
  assert config.forward.batch_invariant and config.token_buckets == (16 + 16,)
  gpu_like = EngineConfig.create(preset("tiny-llama"), attention="pallas",
                                 **{**OPTIONS, "prefix_block": 16})
  # The paged kernel's splits: fixed by the block table's width, not the number of tiles (the
  # default config's follow the batch).
  paged = paged_for_forward(gpu_like.forward)
  assert paged.config.min_programs == paged.prefill_config.min_programs == 0
  fixed, default = paged.config, RaggedPagedAttentionConfig()
  assert len({split_layout(tiles, 8, 4096, fixed, 64) for tiles in (1, 8, 32)}) == 1
  assert len({split_layout(tiles, 8, 4096, default, 64) for tiles in (1, 8, 32)}) > 1
  assert EngineConfig.create(preset("tiny-llama"), batch_invariant=True,
                             max_seq_len=512).buckets.prompt_lengths == (256,)


def _projection_shapes(engine, tokens: int) -> set[str]:
  """The operand types of a step's two-dimensional products (projections, unembed)."""
  text = engine.executables.lower(("step", tokens)).as_text()
  matrix = r"(tensor<\d+x\d+x(?:f|bf)\d+>)"
  return set(re.findall(rf"stablehlo\.dot_general[^\n]*: \({matrix}, {matrix}\)", text))


def test_every_step_runs_the_same_products(engine):
  # One token bucket: a chunk of the prompt bucket beside a decode row per running request.
  assert engine.config.token_buckets == (16 + 16,)
  assert [key for key in engine.executable_keys() if key[0] == "step"] == [("step", 32)]
  assert _projection_shapes(engine, 32)
  default = Engine.from_pretrained("tiny-llama", max_seq_len=64, batch_buckets=(1, 4, 16),
                                   prompt_buckets=(16,))
  assert len(default.config.token_buckets) > 1
  assert _projection_shapes(default, 8) != _projection_shapes(default, 16)


@pytest.mark.parametrize("others", [3, 15])
def test_logprobs_equal_the_request_alone_among_others(engine, alone, others):
  rng = np.random.default_rng(others)
  # The others go first, so the target lands in slot `others` and moves as they finish.
  handles = [engine.submit(list(rng.integers(2, 263, (int(rng.integers(3, 40)),))),
                           int(rng.integers(4, 20)), eos_token_id=[],
                           **(dict(do_sample=True, temperature=0.8, seed=i) if i % 2 else {}))
             for i in range(others)]  # every other one samples
  scored = engine.submit(TARGET, 12, eos_token_id=[], logprobs=3)
  plain = engine.submit(TARGET, 12, eos_token_id=[])
  _same(scored.result(), alone[0])
  assert plain.result().tokens == alone[1].tokens
  for handle in handles:
    handle.result()


@pytest.mark.parametrize("shared, used", [(24, 16), (12, 0)])
def test_a_prefix_cache_hit_gives_the_same_logprobs(engine, alone, shared, used):
  """A request sharing `shared` tokens with the target leaves blocks of 8 in the cache; the
  target uses them in whole chunks of 16 (`used` tokens), the rest it prefills as a miss would."""
  engine.reset_prefix_cache()
  engine.submit(TARGET[:shared] + [5, 6, 7, 8, 9, 10, 11, 12], 2, eos_token_id=[]).result()
  before = engine.stats()["prefix_cache_hit_tokens"]
  _same(_result(engine, TARGET, logprobs=3), alone[0])
  assert engine.stats()["prefix_cache_hit_tokens"] - before == used


@pytest.mark.parametrize("options, match", [
    (dict(prompt_buckets=(16, 32)), r"chunks of one prompt bucket, got prompt_buckets=\(16, 32\)"),
    (dict(prompt_buckets=(20,)), r"prefix_block \(8\) to divide the prompt bucket \(20\)"),
    (dict(max_num_batched_tokens=32), r"max_num_batched_tokens must equal the prompt bucket"),
])
def test_settings_that_would_break_it_are_refused(options, match):
  with pytest.raises(ValueError, match=match):
    EngineConfig.create(preset("tiny-llama"), **{**OPTIONS, **options})
