"""The prefix cache by reference: a hit shares the cached blocks of the paged cache (no
executable copies KV bytes), the tokens equal the cache-off run's; the config's checks and the
paged cache's size."""

import numpy as np
import pytest

from cg_jax import Engine
from cg_jax.core.config import EngineConfig
from cg_jax.core.executables import SERVING_PHASES
from models.config import PRESETS
from tests.helpers import wait_blocks_released

OPTIONS = dict(max_seq_len=64, batch_buckets=(1, 2), prompt_buckets=(8, 16))


def test_config_checks_the_prefix_cache_and_sizes_the_paged_cache():
  model = PRESETS["tiny-llama"]
  config = EngineConfig.create(model, max_seq_len=64, prompt_buckets=(16,), attention="xla")
  assert (config.prefix_cache_tokens, config.prefix_block, config.prefix_blocks) == (256, 16, 16)
  # A full block table per row of the largest batch bucket (W = 64 / 16), and the prefix's.
  assert (config.table_width, config.num_blocks, config.scratch_block) == (4, 4 * 32 + 16, 144)
  assert EngineConfig.create(model, max_seq_len=64, prompt_buckets=(16,), attention="xla",
                             prefix_cache_tokens=0).prefix_blocks == 0
  with pytest.raises(ValueError, match=r"prefix_cache_tokens must be 0 \(off\) or an int >= "
                                       r"prefix_block \(16\), got 8"):
    EngineConfig.create(model, max_seq_len=64, prompt_buckets=(16,), prefix_cache_tokens=8)
  with pytest.raises(ValueError, match=r"prefix_block must be an int in \[1, 63\]"):
    EngineConfig.create(model, max_seq_len=64, prompt_buckets=(16,), prefix_block=64)
  # The Pallas kernel's pages: 64 tokens by default, a power of two >= 16 if given.
  assert EngineConfig.create(model, max_seq_len=256, attention="pallas").prefix_block == 64
  with pytest.raises(ValueError, match=r"prefix_block \(the KV-cache page size\) must be a "
                                       r"power of two >= 16 for the Pallas attention kernel, "
                                       r"got 24"):
    EngineConfig.create(model, max_seq_len=256, attention="pallas", prefix_block=24)


def test_a_hit_shares_blocks_and_copies_no_kv_bytes():
  """A prompt that starts with a finished prompt's 32 tokens: a hit of two shared blocks, the
  tokens of the cache-off engine, and only the load, step and draw executables run (no
  executable copies cache blocks: the cache is one donated buffer that each call replaces)."""
  engine = Engine.from_pretrained("tiny-llama", **OPTIONS)
  engine.warmup(phases=SERVING_PHASES, progress=False)
  off = engine.with_options(prefix_cache_tokens=0)
  rng = np.random.default_rng(3)
  base = rng.integers(2, 263, (32,)).tolist()
  prompts = [base + rng.integers(2, 263, (5,)).tolist(), base + rng.integers(2, 263, (9,)).tolist()]
  ran = []
  get = engine.executables.get

  def recording(key):
    ran.append(key)
    return get(key)

  engine.executables.get = recording
  served = [engine.generate([p], max_new_tokens=6, eos_token_id=[])[0] for p in prompts]
  stats = engine.stats()
  assert served == [off.generate([p], max_new_tokens=6, eos_token_id=[])[0] for p in prompts]
  assert (stats["prefix_cache_hits"], stats["prefix_cache_hit_tokens"]) == (1, 32)
  assert {key[0] for key in ran} <= {"load", "step", "draw", "cache"}
  # The hit's prompt ran as one step of its 9 own tokens (from position 32); the first prompt's
  # 37 tokens in the 64-token bucket; the other steps decode (one token: the smallest bucket).
  decode = ("step", engine.config.token_buckets[0])
  assert [key for key in ran if key not in (decode, ("load",))] == [("step", 64), ("step", 16)]
  # Nothing runs: once the engine thread retires the last request (its next iteration, after
  # the steps in flight that still write its blocks), the two full prompt blocks they share
  # stay cached and the rest is free.
  stats = wait_blocks_released(engine)
  assert stats["kv_blocks_used"] == 0 and stats["kv_blocks_cached"] == 2
  engine.reset_prefix_cache()
  assert engine.stats()["kv_blocks_cached"] == 0
  engine.close()
  off.close()
