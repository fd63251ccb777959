"""The paged KV cache's block manager: which device blocks each sequence holds, and prompt
prefixes shared between sequences by reference.

The cache is N blocks of G tokens ([L, N, G, K, H] per key and value on the device). A sequence's
block table lists its blocks in position order: token t lives in slot t % G of block
table[t // G]. This module is host-only bookkeeping; the rules:

- A block is *used* (reference count > 0), *cached* (no reference, but its tokens are indexed by
  the digest chained over the prompt blocks up to it, so a later prompt that starts the same way
  can take it) or *free*.
- `allocate` takes free blocks first, then evicts cached ones, least recently released first
  (an evicted block loses its digest). It gives all the blocks asked for or none.
- `match` takes references on the cached or used blocks that start a prompt: a hit moves no KV
  bytes. It covers whole blocks and at most len(prompt) - 1 tokens (the request still needs its
  last token's logits), so a sequence never writes into a block it shares.
- `commit` indexes a sequence's full prompt blocks once their KV is written.
- `release` drops a sequence's references. Its indexed blocks become cached, the table's last
  block first in line for eviction (a prefix's later blocks go before its earlier ones); the
  others become free.
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Iterator, Sequence

import numpy as np


def block_digests(prompt: Sequence[int], block: int) -> Iterator[bytes]:
  """The chained digest of each full block of `prompt`, in order (lazily: a lookup that misses
  its first block hashes one block, not the whole prompt)."""
  data = np.asarray(prompt, np.int32).tobytes()
  width, previous = block * 4, b""
  for start in range(0, len(data) - width + 1, width):
    previous = hashlib.blake2b(previous + data[start:start + width], digest_size=16).digest()
    yield previous


def blocks_for(tokens: int, block: int) -> int:
  """Blocks that hold `tokens` tokens."""
  return -(-tokens // block)


class BlockPool:
  """`num_blocks` blocks of `block_size` tokens (see the module docstring).

  Counters: hits / misses (prompts matched with / without a cached prefix), hit_tokens (prompt
  tokens served from the cache), evictions (cached blocks reused for other tokens).
  """

  def __init__(self, num_blocks: int, block_size: int):
    for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r}: the block pool needs an integer >= 1")
    self.num_blocks, self.block_size = num_blocks, block_size
    self._refs = [0] * num_blocks
    self._free = list(range(num_blocks - 1, -1, -1))  # popped from the end: block 0 first
    self._cached: collections.OrderedDict[int, None] = collections.OrderedDict()  # LRU first
    self._digest: dict[int, bytes] = {}  # block -> its digest, for indexed blocks
    self._block: dict[bytes, int] = {}  # digest -> block
    self.counters = collections.Counter()

  @property
  def available(self) -> int:
    """Blocks `allocate` can give now (free or cached)."""
    return len(self._free) + len(self._cached)

  def allocate(self, count: int) -> list[int] | None:
    """`count` blocks, each with one reference; None (and nothing changed) if fewer are
    available."""
    if count > self.available:
      return None
    taken = []
    for _ in range(count):
      if self._free:
        block = self._free.pop()
      else:
        block, _ = self._cached.popitem(last=False)
        del self._block[self._digest.pop(block)]
        self.counters["evictions"] += 1
      self._refs[block] = 1
      taken.append(block)
    return taken

  def match(self, prompt: Sequence[int], multiple: int = 1) -> list[int]:
    """The blocks holding `prompt`'s longest indexed prefix (whole blocks, at most
    len(prompt) - 1 tokens, a multiple of `multiple` blocks), each with one more reference;
    counts a hit or a miss."""
    found = []
    for digest in block_digests(prompt[:len(prompt) - 1], self.block_size):
      block = self._block.get(digest)
      if block is None:
        break
      found.append(block)
    found = found[:len(found) // multiple * multiple]
    for block in found:
      if self._refs[block] == 0:
        del self._cached[block]
      self._refs[block] += 1
    self.counters["hits" if found else "misses"] += 1
    self.counters["hit_tokens"] += len(found) * self.block_size
    return found

  def commit(self, prompt: Sequence[int], table: Sequence[int]) -> None:
    """Index the full blocks of `prompt` held by `table` (its block table, KV written). A block
    whose tokens another block already holds stays unindexed (it is freed on release)."""
    for digest, block in zip(block_digests(prompt, self.block_size), table):
      self._check_used(block)
      if digest in self._block or block in self._digest:
        continue
      self._block[digest], self._digest[block] = block, digest

  def release(self, table: Sequence[int]) -> None:
    """Drop one reference on each block of `table`."""
    for block in table:
      self._check_used(block)
    for block in reversed(table):
      self._refs[block] -= 1
      if self._refs[block]:
        continue
      if block in self._digest:
        self._cached[block] = None
      else:
        self._free.append(block)

  def reset(self) -> None:
    """Forget every cached block's tokens (they become free); used blocks keep theirs."""
    for block in self._cached:
      del self._block[self._digest.pop(block)]
      self._free.append(block)
    self._cached.clear()

  def refs(self, block: int) -> int:
    return self._refs[block]

  def _check_used(self, block: int) -> None:
    if not (0 <= block < self.num_blocks and self._refs[block]):
      raise ValueError(f"block {block} is not in use (blocks 0 to {self.num_blocks - 1}, "
                       "allocated or matched)")

  def stats(self) -> dict[str, float]:
    c, cached = self.counters, len(self._cached)
    asked = c["hits"] + c["misses"]
    used = self.num_blocks - len(self._free) - cached
    return {"kv_blocks": self.num_blocks, "kv_blocks_used": used, "kv_blocks_cached": cached,
            "kv_blocks_free": len(self._free), "prefix_cache_hits": c["hits"],
            "prefix_cache_misses": c["misses"],
            "prefix_cache_hit_rate": c["hits"] / asked if asked else 0.0,
            "prefix_cache_hit_tokens": c["hit_tokens"],
            "prefix_cache_evictions": c["evictions"]}
