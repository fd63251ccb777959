"""The paged cache's block manager (cg_jax.core.block_pool): chained block digests, allocation, sharing by reference,
eviction order, exhaustion, and its invariants under random traffic against a plain model."""

import random

import pytest

from cg_jax.core import block_pool
from cg_jax.core.block_pool import BlockPool, block_digests, blocks_for


def test_digests_chain_over_the_prefix():
  a = list(block_digests([1, 2, 3, 4, 5, 6, 7], 3))
  assert len(a) == 2  # full blocks only
  assert list(block_digests([1, 2, 3, 4, 5, 6], 3)) == a
  # The same second block after another first block has another digest.
  assert list(block_digests([9, 2, 3, 4, 5, 6], 3))[1] != a[1]
  assert next(block_digests([1, 2, 3, 4, 5, 0], 3)) == a[0]


def test_a_match_hashes_only_up_to_its_first_miss(monkeypatch):
  pool = BlockPool(8, 4)
  prompt = list(range(10, 42))  # 8 blocks
  table = pool.allocate(2)
  pool.commit(prompt[:8], table)
  calls = []
  real = block_pool.hashlib.blake2b
  monkeypatch.setattr(block_pool.hashlib, "blake2b",
                      lambda *a, **k: calls.append(1) or real(*a, **k))
  assert pool.match(prompt) == table
  assert len(calls) == 3  # two hits, then the miss
  calls.clear()
  assert pool.match([99] + prompt) == []
  assert len(calls) == 1


def _counts(pool):
  s = pool.stats()
  return s["kv_blocks_used"], s["kv_blocks_cached"], s["kv_blocks_free"]


def test_allocate_is_all_or_nothing():
  pool = BlockPool(4, 2)
  a = pool.allocate(3)
  assert sorted(a) == [0, 1, 2] and _counts(pool) == (3, 0, 1)
  assert pool.allocate(2) is None and _counts(pool) == (3, 0, 1)  # nothing taken
  assert pool.allocate(1) == [3] and pool.available == 0
  pool.release(a)
  assert _counts(pool) == (1, 0, 3) and pool.allocate(3) is not None


def test_a_prefix_hit_shares_blocks_by_reference():
  pool = BlockPool(8, 2)
  prompt = [5, 6, 7, 8, 9]  # blocks [5 6] [7 8], then 9 in a third block
  first = pool.allocate(blocks_for(len(prompt), 2))
  pool.commit(prompt, first)
  assert pool.match([5, 6, 7, 8, 9, 1]) == first[:2]  # shared while the first still runs
  assert [pool.refs(b) for b in first] == [2, 2, 1]
  pool.release(first)
  assert _counts(pool) == (2, 0, 6)  # the shared blocks stay used; the tail block is free
  # a prompt that is exactly the cached blocks takes all but its last block's worth
  assert pool.match([5, 6, 7, 8]) == first[:1]
  assert pool.match([5, 6, 0, 0, 0]) == first[:1]
  assert pool.match([6, 6, 7, 8, 9]) == []
  s = pool.stats()
  assert (s["prefix_cache_hits"], s["prefix_cache_misses"], s["prefix_cache_hit_tokens"]) == (
      3, 1, 8)


def test_released_blocks_are_cached_and_evicted_least_recent_first_tail_first():
  pool = BlockPool(6, 1)
  a, b = [1, 2, 3], [7, 8, 9]
  ta, tb = pool.allocate(3), pool.allocate(3)
  pool.commit(a + [0], ta)
  pool.commit(b + [0], tb)
  pool.release(ta)
  pool.release(tb)
  assert _counts(pool) == (0, 6, 0)
  # a's blocks were released first, its last block first in line
  got = pool.allocate(1)
  assert got == [ta[2]] and pool.stats()["prefix_cache_evictions"] == 1
  assert pool.match(a + [0]) == ta[:2]  # a's first two blocks are still cached
  assert pool.match(b + [0]) == tb
  pool.release(got)
  assert pool.allocate(1) == got  # an unindexed block goes to the free list, taken first


def test_commit_keeps_the_first_block_of_equal_tokens_and_checks_blocks():
  pool = BlockPool(4, 2)
  one, two = pool.allocate(1), pool.allocate(1)
  pool.commit([1, 2], one)
  pool.commit([1, 2], two)  # same tokens written twice (both prefilled before either committed)
  pool.release(one + two)
  assert _counts(pool) == (0, 1, 3)  # the duplicate is free, not cached
  with pytest.raises(ValueError, match="block 3 is not in use"):
    pool.release([3])
  with pytest.raises(ValueError, match="block 9 is not in use"):
    pool.commit([1, 2], [9])
  with pytest.raises(ValueError, match="num_blocks=0"):
    BlockPool(0, 16)


def test_reset_forgets_cached_tokens_only():
  pool = BlockPool(4, 1)
  held, done = pool.allocate(2), pool.allocate(2)
  pool.commit([1, 2, 0], held)
  pool.commit([3, 4, 0], done)
  pool.release(done)
  pool.reset()
  assert _counts(pool) == (2, 0, 2)
  assert pool.match([3, 4, 0]) == [] and pool.match([1, 2, 0]) == held


@pytest.mark.parametrize("seed", range(4))
def test_random_traffic_keeps_the_invariants(seed):
  """Sequences come and go with prompts drawn from a few shared prefixes; after every
  operation the counts add up, each block's references equal the tables holding it, and a
  matched block holds the prompt's tokens (checked against what was written to it)."""
  rng = random.Random(seed)
  block, pool = 3, BlockPool(24, 3)
  stems = [[rng.randrange(50) for _ in range(12)] for _ in range(3)]
  written: dict[int, tuple] = {}  # block -> the tokens its KV holds (the model of the device)
  running: list[list[int]] = []
  for _ in range(400):
    if running and (rng.random() < 0.4 or pool.available < 6):
      pool.release(running.pop(rng.randrange(len(running))))
    else:
      prompt = rng.choice(stems)[:rng.randrange(1, 13)] + [rng.randrange(50)
                                                           for _ in range(rng.randrange(4))]
      if not prompt:
        continue
      shared = pool.match(prompt)
      for i, b in enumerate(shared):  # a hit's blocks hold exactly the prompt's tokens
        assert written[b] == tuple(prompt[i * block:(i + 1) * block])
      new = pool.allocate(blocks_for(len(prompt), block) - len(shared))
      if new is None:
        pool.release(shared)
        continue
      table = shared + new
      for i, b in enumerate(new, len(shared)):  # "prefill" the new blocks
        written[b] = tuple(prompt[i * block:(i + 1) * block])
      pool.commit(prompt, table)
      running.append(table)
    used, cached, free = _counts(pool)
    assert used + cached + free == pool.num_blocks
    holders = [b for table in running for b in table]
    assert all(pool.refs(b) == holders.count(b) for b in range(pool.num_blocks))
    assert used == len(set(holders))
  s = pool.stats()
  assert s["prefix_cache_hits"] > 50 and s["prefix_cache_evictions"] > 10  # all paths taken
