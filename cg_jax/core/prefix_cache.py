"""The prefix cache's index: which prompt blocks have their keys and values in the block pool.

A prompt is cut into blocks of G tokens; block i is named by a digest chained over blocks 0..i,
so equal digests mean equal tokens from the prompt's start. The pool on the device holds N
blocks ([L, N, G, K, H] per key and value; `cg_jax.core.steps` copies blocks between it and cache
slots). This module is host-only bookkeeping:

  lookup(prompt) -> pool ids of its longest cached prefix (never its last token: the request
                    still needs that token's logits)
  insert(prompt) -> per block, the pool id to write it to, or None (cached already / no room)

Blocks are evicted least recently used first; a lookup refreshes a prefix's blocks from its end
back to its start, so a prefix's later blocks go before its earlier ones.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

from cg_jax.core.block_pool import block_digests


class PrefixIndex:
  """Host-side index of a pool of `blocks` blocks of `block` tokens (see the module docstring).

  Counters: hits / misses (requests with / without a cached prefix), hit_tokens (prompt tokens
  not prefilled), evictions, inserted (blocks written).
  """

  def __init__(self, blocks: int, block: int):
    self.blocks, self.block = blocks, block
    self._ids: collections.OrderedDict[bytes, int] = collections.OrderedDict()  # LRU first
    self._free = list(range(blocks - 1, -1, -1))
    self.counters = collections.Counter()

  def __len__(self) -> int:
    return len(self._ids)

  def lookup(self, prompt: Sequence[int], multiple: int = 1) -> list[int]:
    """Pool ids of the cached blocks that start `prompt`, covering at most len(prompt) - 1
    tokens, in a multiple of `multiple` blocks; counts a hit or a miss."""
    found = []
    for digest in block_digests(prompt[:len(prompt) - 1], self.block):
      if digest not in self._ids:
        break
      found.append(digest)
    found = found[:len(found) // multiple * multiple]
    for digest in reversed(found):
      self._ids.move_to_end(digest)
    self.counters["hits" if found else "misses"] += 1
    self.counters["hit_tokens"] += len(found) * self.block
    return [self._ids[d] for d in found]

  def insert(self, prompt: Sequence[int]) -> list[int | None]:
    """Pool ids to write `prompt`'s full blocks to (None: already cached, or no block left to
    evict). A new block takes a free one or evicts the least recently used block outside this
    prompt."""
    digests = list(block_digests(prompt, self.block))
    own = set(digests)
    targets: list[int | None] = []
    for digest in digests:
      if digest in self._ids:
        targets.append(None)
        continue
      block = self._take(own)
      if block is None:
        targets.append(None)
        break
      self._ids[digest] = block
      targets.append(block)
      self.counters["inserted"] += 1
    for digest in reversed(digests[:len(targets)]):
      if digest in self._ids:
        self._ids.move_to_end(digest)
    return targets

  def _take(self, keep: set[bytes]) -> int | None:
    if self._free:
      return self._free.pop()
    victim = next((d for d in self._ids if d not in keep), None)
    if victim is None:
      return None
    self.counters["evictions"] += 1
    return self._ids.pop(victim)

  def clear(self) -> None:
    self._ids.clear()
    self._free = list(range(self.blocks - 1, -1, -1))

  def stats(self) -> dict[str, float]:
    c = self.counters
    asked = c["hits"] + c["misses"]
    return {"prefix_cache_blocks": self.blocks, "prefix_cache_blocks_used": len(self._ids),
            "prefix_cache_hits": c["hits"], "prefix_cache_misses": c["misses"],
            "prefix_cache_hit_rate": c["hits"] / asked if asked else 0.0,
            "prefix_cache_hit_tokens": c["hit_tokens"],
            "prefix_cache_evictions": c["evictions"]}
