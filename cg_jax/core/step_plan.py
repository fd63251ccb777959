"""The scheduler's policy as plans: what one engine iteration runs, decided on the host only.

The engine thread (`cg_jax.core.scheduler`) asks a `Planner` for each phase of an iteration, right
before it runs it, and executes the plan: a phase's plan depends on the tokens the phase before
it read back (a first token may be EOS, a readback may finish a request), so an iteration is a
sequence of plans, not one:

  moves    (`MovePlan`)    the occupied slots stay [0, n): the last running request moves into
                           each slot freed by a finished one, from the last slot down;
  admit    (slots)         waiting requests take the free slots, first come first served;
  prefill  (`PrefillPlan`) new prompts that start with prefix-cache blocks load them
                           (`CopyPlan` "load") and skip their tokens; then one prompt call
                           (`ChunkPlan`): the next chunks of prompts already started ("chunk",
                           each at its cache offset), or else the first chunks of new prompts
                           ("prompts", consecutive slots), grouped up to a prompt-batch bucket
                           and `prefill_tokens` largest buckets of padded tokens;
  decode   (`DecodePlan`)  one step over slots [0, bucket), the smallest batch bucket holding
                           the occupied slots; slots not decoding are idle rows;
  save     (`CopyPlan`)    prompts completed this iteration copy their new full blocks into
                           the prefix cache's pool.

Plans are frozen dataclasses of ints and tuples naming slots and executable keys; the planner
reads request state (`Scheduled`) and the prefix index (host bookkeeping: a lookup refreshes
its LRU order and counts a hit or miss) and never touches the device. This module imports
nothing from jax (nor from `cg_jax`, whose package imports jax), so policy is tested without
compiling anything.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Protocol

# Padded prompt tokens one prompt call may take (its batch x chunk size), in units of the
# largest prompt bucket.
PREFILL_TOKENS = 16


class Scheduled(Protocol):
  """The request state the planner reads (the scheduler's `_Live`)."""

  prompt: Sequence[int]
  max_new_tokens: int
  settings: Any  # its `greedy` says whether the request samples
  logprobs: int | None
  slot: int | None
  prefilled: int
  looked_up: bool
  position: int
  emitted: int
  decoding: bool
  finished: bool


@dataclasses.dataclass(frozen=True)
class PlanConfig:
  """What the policy depends on.

  Args:
    batch_sizes: the batch buckets (ascending); the cache holds batch_sizes[-1] slots.
    prompt_lengths: the prompt buckets (ascending): chunk sizes.
    prompt_batches: the batch buckets of the prompt executables (`ExecutableTable.prompt_batches`).
    lookahead: new prompts, next in line, that ask the prefix cache per iteration.
    prefix_block: tokens per prefix-cache block.
    block_pairs: (slot, block, pool block) pairs one "load" or "save" call copies.
    batch_invariant: prefix hits are used in whole chunks (multiples of prompt_lengths[0]).
    prefill_tokens: see PREFILL_TOKENS.
  """

  batch_sizes: tuple[int, ...]
  prompt_lengths: tuple[int, ...]
  prompt_batches: tuple[int, ...]
  lookahead: int
  prefix_block: int = 16
  block_pairs: int = 1
  batch_invariant: bool = False
  prefill_tokens: int = PREFILL_TOKENS

  @classmethod
  def of(cls, config, table, lookahead: int) -> "PlanConfig":
    """From an `EngineConfig` and its `ExecutableTable` (or fakes with the same fields)."""
    b = config.buckets
    return cls(batch_sizes=b.batch_sizes, prompt_lengths=b.prompt_lengths,
               prompt_batches=table.prompt_batches(), lookahead=lookahead,
               prefix_block=config.prefix_block, block_pairs=table.block_pairs(),
               batch_invariant=config.batch_invariant)

  @property
  def max_batch(self) -> int:
    return self.batch_sizes[-1]

  def batch_bucket(self, batch: int) -> int:
    """The smallest batch bucket >= batch (1 <= batch <= max_batch)."""
    return self.batch_sizes[bisect.bisect_left(self.batch_sizes, batch)]


@dataclasses.dataclass(frozen=True)
class MovePlan:
  """Slot compaction: `freed` are the (old) slots of finished requests; "move" calls copy
  cache row `source` into row `target`, (source, target) in order; `order[i]` is the old slot
  of the request that holds slot i afterwards."""

  freed: tuple[int, ...]
  moves: tuple[tuple[int, int], ...]
  order: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class CopyPlan:
  """Prefix-cache block copies: "load" (pool -> cache) or "save" (cache -> pool); each call
  copies up to `block_pairs` (slot, block, pool block) pairs (padded with -1: no copy)."""

  phase: str
  calls: tuple[tuple[tuple[int, int, int], ...], ...] = ()

  @property
  def key(self) -> tuple:
    return (self.phase,)


@dataclasses.dataclass(frozen=True)
class ChunkPlan:
  """One prompt call.

  kind "prompts": the first chunk of new prompts in consecutive slots, written as cache rows
  [first_slot, first_slot + rows); padding rows take one token. kind "chunk": the next chunk
  of started prompts, row b into slot slots[b] at offset starts[b]; padding rows take nothing
  (slot 0, offset 0, no token). Row b of the group takes counts[b] prompt tokens from starts[b];
  `done` are the slots whose prompt this call completes (they join the decode batch with the
  token it picks); `sample`: a row samples (its first token is drawn by ("first", rows, False)
  from the call's logits); `scored`: a completing row asks for log-probabilities
  (("token_logprobs", rows)).
  """

  kind: str
  rows: int
  size: int
  first_slot: int
  slots: tuple[int, ...]
  starts: tuple[int, ...]
  counts: tuple[int, ...]
  done: tuple[int, ...]
  sample: bool = False
  scored: bool = False

  @property
  def key(self) -> tuple:
    return (self.kind, self.rows, self.size)

  @property
  def keys(self) -> tuple[tuple, ...]:
    """Every executable the call runs, in order."""
    return (self.key, *([("first", self.rows, False)] if self.sample else []),
            *([("token_logprobs", self.rows)] if self.scored else []))


@dataclasses.dataclass(frozen=True)
class PrefillPlan:
  """One iteration's prefill: prefix-cache lookups ((slot, cached tokens) per new prompt that
  asked), their block loads, then one prompt call (or None: nothing to prefill)."""

  lookups: tuple[tuple[int, int], ...] = ()
  loads: CopyPlan = CopyPlan("load")
  chunk: ChunkPlan | None = None


@dataclasses.dataclass(frozen=True)
class DecodePlan:
  """One decode step over slots [0, batch): `slots` decode, the other rows are idle. `launch`
  False: the steps in flight already cover every row's budget (read them back, launch
  nothing). `scored`: a row asks for log-probabilities (the "logprobs" step); `greedy`: no row
  samples."""

  batch: int
  slots: tuple[int, ...]
  greedy: bool
  scored: bool
  launch: bool = True

  @property
  def key(self) -> tuple:
    return ("logprobs", self.batch) if self.scored else ("decode", self.batch, self.greedy)


class Planner:
  """Decides each phase's plan from host state (see the module docstring).

  Args:
    config: the buckets and limits.
    prefix: the prefix cache's index (`cg_jax.core.prefix_cache.PrefixIndex`), or None when off.
  """

  def __init__(self, config: PlanConfig, prefix=None):
    self.config, self.prefix = config, prefix

  def moves(self, finished: Sequence[bool]) -> MovePlan:
    """Free the slots whose request finished: from the last slot down, the last occupied slot
    moves into each freed one (a batch that finished together moves nothing)."""
    # A request not visited yet has not moved: the one at `old` still holds slot `old`.
    order = list(range(len(finished)))  # order[slot]: the old slot of its request
    freed, moves = [], []
    for old in reversed(range(len(finished))):
      if not finished[old]:
        continue
      freed.append(old)
      if order[-1] != old:
        moves.append((len(order) - 1, old))
        order[old] = order[-1]
      order.pop()
    return MovePlan(tuple(freed), tuple(moves), tuple(order))

  def admit(self, waiting: int, occupied: int) -> tuple[int, ...]:
    """The slots the next `waiting` requests take: the free ones after [0, occupied)."""
    return tuple(range(occupied, occupied + max(min(waiting, self.config.max_batch - occupied), 0)))

  def prefill(self, slots: Sequence[Scheduled]) -> PrefillPlan:
    """`slots[i]` holds slot i. Up to `lookahead` new prompts next in line ask the prefix
    cache once (those behind them may find the blocks these are about to write); a hit loads
    its blocks and counts its tokens as prefilled. Then started prompts (a cached prefix, or
    longer than the largest chunk) take their next chunks first come first served; only when
    none is started do new prompts take their first chunks."""
    c = self.config
    prefilled = [x.prefilled for x in slots]
    fresh = [s for s, x in enumerate(slots) if x.prefilled == 0 and not x.finished]
    lookups, pairs = [], []
    if self.prefix is not None:
      # Batch-invariant engines take whole chunks only: the chunk boundaries of a miss.
      multiple = c.prompt_lengths[0] // c.prefix_block if c.batch_invariant else 1
      for s in fresh[:c.lookahead]:
        if slots[s].looked_up:
          continue
        ids = self.prefix.lookup(slots[s].prompt, multiple)
        prefilled[s] = len(ids) * c.prefix_block
        lookups.append((s, prefilled[s]))
        pairs += [(s, block, source) for block, source in enumerate(ids)]
      fresh = [s for s in fresh if prefilled[s] == 0]
    started = [s for s, x in enumerate(slots)
               if 0 < prefilled[s] < len(x.prompt) and not x.finished]
    if started:
      chunk = self._later_chunks(slots, prefilled, started)
    elif fresh:
      chunk = self._first_chunks(slots, prefilled, fresh)
    else:
      chunk = None
    return PrefillPlan(tuple(lookups), self._copies("load", pairs), chunk)

  def _later_chunks(self, slots, prefilled: list[int], started: list[int]) -> ChunkPlan:
    """The next chunk of a run of started prompts in one "chunk" call, each at its offset."""
    batches = self.config.prompt_batches
    size_of = self._size_of(slots, prefilled)
    group = self._group(started, batches, size_of)
    size, rows = size_of(group), next(b for b in batches if b >= len(group))
    counts = tuple(min(size, len(slots[s].prompt) - prefilled[s]) for s in group)
    return self._chunk("chunk", rows, size, group[0], slots, group,
                       tuple(prefilled[s] for s in group), counts)

  def _first_chunks(self, slots, prefilled: list[int], fresh: list[int]) -> ChunkPlan:
    """The first chunk of a run of new prompts in one "prompts" call: they hold consecutive
    slots (admitted in order), written as rows [first, first + rows), so `rows` (a batch
    bucket) must end within the cache and hold only free slots and prompts not started (the
    padding rows write there)."""
    first = fresh[0]
    fits = 0
    for slot in range(first, self.config.max_batch):
      if slot < len(slots) and prefilled[slot] > 0:
        break
      fits += 1
    batches = tuple(b for b in self.config.prompt_batches if b <= fits) or (1,)
    consecutive = [first]
    for s in fresh[1:]:
      if s != consecutive[-1] + 1:
        break
      consecutive.append(s)
    size_of = self._size_of(slots, prefilled)
    group = self._group(consecutive, batches, size_of)
    size, rows = size_of(group), next(b for b in batches if b >= len(group))
    counts = tuple(min(size, len(slots[s].prompt)) for s in group)
    return self._chunk("prompts", rows, size, first, slots, group, (0,) * len(group), counts)

  @staticmethod
  def _chunk(kind: str, rows: int, size: int, first: int, slots, group: list[int],
             starts: tuple[int, ...], counts: tuple[int, ...]) -> ChunkPlan:
    done = tuple(s for s, start, count in zip(group, starts, counts)
                 if start + count == len(slots[s].prompt))
    return ChunkPlan(kind, rows, size, first, tuple(group), starts, counts, done,
                     sample=not all(slots[s].settings.greedy for s in group),
                     scored=any(slots[s].logprobs is not None for s in done))

  def _size_of(self, slots, prefilled: list[int]) -> Callable[[list[int]], int]:
    """The chunk size of a group: the prompt bucket that takes its longest rest of a prompt
    (up to the largest)."""
    lengths = self.config.prompt_lengths

    def size_of(group: list[int]) -> int:
      longest = min(max(len(slots[s].prompt) - prefilled[s] for s in group), lengths[-1])
      return next(n for n in lengths if n >= longest)
    return size_of

  def _group(self, items: list[int], batches: tuple[int, ...],
             size_of: Callable[[list[int]], int]) -> list[int]:
    """The longest run of `items` (from the first) that one call of a batch bucket up to
    batches[-1] rows and `prefill_tokens` largest prompt buckets of padded tokens takes."""
    budget = self.config.prefill_tokens * self.config.prompt_lengths[-1]
    group = items[:1]
    for item in items[1:]:
      if len(group) == batches[-1]:
        break
      candidate = group + [item]
      if next(b for b in batches if b >= len(candidate)) * size_of(candidate) > budget:
        break
      group = candidate
    return group

  def decode(self, slots: Sequence[Scheduled], in_flight: int) -> DecodePlan | None:
    """The next decode step over the occupied `slots`, or None when no request decodes;
    `in_flight` steps launched and not read back cover that many tokens of each row: launch
    only if a row needs more."""
    rows = tuple(s for s, x in enumerate(slots) if x.decoding and not x.finished)
    if not rows:
      return None
    # Rows that ask for log-probabilities need the scoring step (with sampling arrays).
    scored = any(slots[s].logprobs is not None for s in rows)
    greedy = not scored and all(slots[s].settings.greedy for s in rows)
    launch = any(slots[s].emitted + in_flight < slots[s].max_new_tokens for s in rows)
    return DecodePlan(self.config.batch_bucket(len(slots)), rows, greedy, scored, launch)

  def saves(self, lives: Sequence[Scheduled]) -> CopyPlan:
    """Completed prompts' full blocks not in the prefix cache yet: copied into its pool."""
    pairs = [(live.slot, block, target) for live in lives
             for block, target in enumerate(self.prefix.insert(live.prompt))
             if target is not None]
    return self._copies("save", pairs)

  def _copies(self, phase: str, pairs: list[tuple[int, int, int]]) -> CopyPlan:
    size = self.config.block_pairs
    return CopyPlan(phase, tuple(tuple(pairs[start:start + size])
                                 for start in range(0, len(pairs), size)))
