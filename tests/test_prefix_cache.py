"""The prefix cache's index: the longest cached prefix (never the last token), least-recently-used
eviction (a prefix's later blocks first), counters."""

import pytest

from cg_jax.core.config import EngineConfig
from cg_jax.core.prefix_cache import PrefixIndex
from models.config import PRESETS


def test_lookup_finds_the_longest_prefix_but_not_the_last_token():
  index = PrefixIndex(blocks=8, block=4)
  prompt = list(range(10, 22))  # 3 blocks
  assert index.insert(prompt) == [0, 1, 2]
  assert index.insert(prompt) == [None, None, None]  # cached already
  assert index.lookup(prompt) == [0, 1]  # block 2 holds the last token
  assert index.lookup(prompt + [5]) == [0, 1, 2]
  assert index.lookup(prompt[:4] + [99] * 8) == [0]
  assert index.lookup([99] + prompt) == []
  stats = index.stats()
  assert (stats["prefix_cache_hits"], stats["prefix_cache_misses"]) == (3, 1)
  assert stats["prefix_cache_hit_tokens"] == 4 * (2 + 3 + 1)
  assert stats["prefix_cache_hit_rate"] == pytest.approx(0.75)
  # Whole groups of blocks only (batch-invariant chunks), counted as used.
  assert index.lookup(prompt + [5], multiple=2) == [0, 1]
  assert index.lookup(prompt, multiple=4) == []
  assert index.stats()["prefix_cache_hit_tokens"] == 4 * (2 + 3 + 1 + 2)


def test_least_recently_used_blocks_go_first_later_blocks_before_earlier():
  index = PrefixIndex(blocks=4, block=2)
  first, second = [1, 2, 3, 4], [5, 6, 7, 8]
  assert index.insert(first) == [0, 1]
  assert index.insert(second) == [2, 3]
  index.lookup(first + [0])  # refresh the first prompt's blocks
  # New blocks evict the second prompt's last block, then its first, then the first's last.
  assert index.insert([9, 9]) == [3]
  assert index.insert([8, 8, 7, 7]) == [2, 1]
  assert index.lookup(second + [0]) == []
  assert index.lookup(first + [0]) == [0]
  assert index.stats()["prefix_cache_evictions"] == 3


def test_insert_never_evicts_its_own_blocks():
  index = PrefixIndex(blocks=2, block=2)
  # 3 blocks into a pool of 2: the third finds no block outside the prompt.
  assert index.insert([1, 2, 3, 4, 5, 6]) == [0, 1, None]
  assert len(index) == 2
  index.clear()
  assert len(index) == 0 and index.insert([1, 2]) == [0]


def test_config_checks_the_prefix_cache():
  model = PRESETS["tiny-llama"]
  config = EngineConfig.create(model, max_seq_len=64, prompt_buckets=(16,))
  assert (config.prefix_cache_tokens, config.prefix_block, config.prefix_blocks) == (256, 16, 16)
  assert EngineConfig.create(model, max_seq_len=64, prompt_buckets=(16,),
                             prefix_cache_tokens=0).prefix_blocks == 0
  with pytest.raises(ValueError, match=r"prefix_cache_tokens must be 0 \(off\) or an int >= "
                                       r"prefix_block \(16\), got 8"):
    EngineConfig.create(model, max_seq_len=64, prompt_buckets=(16,), prefix_cache_tokens=8)
  with pytest.raises(ValueError, match=r"prefix_block must be an int in \[1, 63\]"):
    EngineConfig.create(model, max_seq_len=64, prompt_buckets=(16,), prefix_block=64)
