"""The scheduler's policy as plans: what one engine iteration runs, decided on the host only.

The engine thread (`cg_jax.core.scheduler`) asks a `Planner` for each phase of an iteration, right
before it runs it, and executes the plan: a phase's plan depends on the tokens the phase before
it read back (a first token may be EOS, a readback may finish a request), so an iteration is a
sequence of plans, not one:

  retire   (`MovePlan`)    finished requests give their blocks back (`release`); the occupied
                           rows stay [0, n): the last running request takes each row freed by a
                           finished one, from the last row down (its block table moves with it:
                           no cache bytes move);
  admit    (`Admission`)   waiting requests, first come first served, take the free rows while
                           the block pool has blocks for the whole request (prompt and
                           max_new_tokens); with the prefix cache on, the cached blocks that
                           start a prompt are shared (`BlockPool.match`) and its cached tokens
                           count as prefilled;
  prefill  (`ChunkPlan`)   one prompt call: the next chunks of prompts already started ("chunk",
                           each at its cache offset: a cached prefix, or longer than the largest
                           chunk), or else the first chunks of new prompts ("prompts"), grouped
                           up to a prompt-batch bucket and `prefill_tokens` largest buckets of
                           padded tokens; a completed prompt's full blocks are indexed for later
                           prompts (`commit`);
  decode   (`DecodePlan`)  one step over rows [0, bucket), the smallest batch bucket holding
                           the occupied rows; rows not decoding are idle.

Plans are frozen dataclasses of ints and tuples naming rows, blocks and executable keys; the
planner reads request state (`Scheduled`) and keeps the block pool (`cg_jax.core.block_pool`,
host bookkeeping) and never touches the device. This module imports nothing from jax (nor from
`cg_jax`, whose package imports jax), so policy is tested without compiling anything.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # (an annotation only: this module imports nothing of cg_jax when it runs)
  from cg_jax.core.block_pool import BlockPool

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
  blocks: list[int]  # its block table (empty until admitted)
  prefilled: int
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
    max_seq_len: tokens a request's block table covers at most (prompt and new tokens).
    block_size: tokens per KV-cache block.
    prefix_cache: prompts share the cached blocks that start them.
    batch_invariant: prefix hits are used in whole chunks (multiples of prompt_lengths[0]).
    prefill_tokens: see PREFILL_TOKENS.
  """

  batch_sizes: tuple[int, ...]
  prompt_lengths: tuple[int, ...]
  prompt_batches: tuple[int, ...]
  max_seq_len: int
  block_size: int = 16
  prefix_cache: bool = False
  batch_invariant: bool = False
  prefill_tokens: int = PREFILL_TOKENS

  @classmethod
  def of(cls, config, table) -> "PlanConfig":
    """From an `EngineConfig` and its `ExecutableTable` (or fakes with the same fields)."""
    b = config.buckets
    return cls(batch_sizes=b.batch_sizes, prompt_lengths=b.prompt_lengths,
               prompt_batches=table.prompt_batches(), max_seq_len=config.max_seq_len,
               block_size=config.prefix_block, prefix_cache=config.prefix_blocks > 0,
               batch_invariant=config.batch_invariant)

  @property
  def max_batch(self) -> int:
    return self.batch_sizes[-1]

  def batch_bucket(self, batch: int) -> int:
    """The smallest batch bucket >= batch (1 <= batch <= max_batch)."""
    return self.batch_sizes[bisect.bisect_left(self.batch_sizes, batch)]

  def blocks_needed(self, request: "Scheduled") -> int:
    """Blocks of a request's whole life: its prompt and max_new_tokens, within max_seq_len."""
    tokens = min(len(request.prompt) + request.max_new_tokens, self.max_seq_len)
    return -(-tokens // self.block_size)


@dataclasses.dataclass(frozen=True)
class MovePlan:
  """Row compaction: `freed` are the (old) rows of finished requests; `order[i]` is the old row
  of the request that holds row i afterwards (its block table moves with it)."""

  freed: tuple[int, ...]
  order: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Admission:
  """A waiting request let in: its row, its block table and the prompt tokens its shared
  (cached) blocks already hold."""

  slot: int
  blocks: tuple[int, ...]
  cached: int


@dataclasses.dataclass(frozen=True)
class ChunkPlan:
  """One prompt call.

  kind "prompts": the first chunk of new prompts, from position 0; kind "chunk": the next chunk
  of started prompts, row b at offset starts[b]. Row b of the group (the rows `slots`) takes
  counts[b] prompt tokens from starts[b]; padding rows past the group take nothing. `done` are
  the rows whose prompt this call completes (they join the decode batch with the token it
  picks); `sample`: a row samples (its first token is drawn by ("first", rows, False) from the
  call's logits); `scored`: a completing row asks for log-probabilities
  (("token_logprobs", rows)).
  """

  kind: str
  rows: int
  size: int
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
class DecodePlan:
  """One decode step over rows [0, batch): `slots` decode, the other rows are idle. `launch`
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
    pool: the KV cache's block pool (`BlockPool`, its blocks of config.block_size tokens).
  """

  def __init__(self, config: PlanConfig, pool: BlockPool):
    self.config, self.pool = config, pool

  def moves(self, finished: Sequence[bool]) -> MovePlan:
    """Free the rows whose request finished: from the last row down, the last occupied row
    moves into each freed one."""
    # A request not visited yet has not moved: the one at `old` still holds row `old`.
    order = list(range(len(finished)))  # order[row]: the old row of its request
    freed = []
    for old in reversed(range(len(finished))):
      if not finished[old]:
        continue
      freed.append(old)
      if order[-1] != old:
        order[old] = order[-1]
      order.pop()
    return MovePlan(tuple(freed), tuple(order))

  def fits(self, request: Scheduled) -> bool:
    """Whether the request's blocks could ever be had (the whole pool free)."""
    return self.config.blocks_needed(request) <= self.pool.num_blocks

  def admissible(self, waiting: Sequence[Scheduled], occupied: int) -> bool:
    """Whether `admit` would let the head of the queue in now (a free row and its blocks),
    without taking anything."""
    return bool(waiting) and occupied < self.config.max_batch and self._has_blocks(waiting[0])

  def _has_blocks(self, request: Scheduled) -> bool:
    # Enough: the shared blocks a match takes from the cached ones are among those needed.
    return self.config.blocks_needed(request) <= self.pool.available

  def admit(self, waiting: Sequence[Scheduled], occupied: int) -> tuple[Admission, ...]:
    """The next waiting requests that the free rows after [0, occupied) and the pool's blocks
    take, in order; the first that does not get its blocks waits, and so do those behind it.
    Each takes its blocks here (`release` gives them back)."""
    c = self.config
    admitted = []
    for request in itertools.islice(waiting, max(c.max_batch - occupied, 0)):
      if not self._has_blocks(request):
        break
      needed = c.blocks_needed(request)
      shared: list[int] = []
      if c.prefix_cache:
        # Batch-invariant engines take whole chunks only: the chunk boundaries of a miss.
        multiple = c.prompt_lengths[0] // c.block_size if c.batch_invariant else 1
        shared = self.pool.match(request.prompt, multiple)
      fresh = self.pool.allocate(needed - len(shared))
      assert fresh is not None  # (guaranteed by the check above)
      admitted.append(Admission(occupied + len(admitted), tuple(shared + fresh),
                                len(shared) * c.block_size))
    return tuple(admitted)

  def commit(self, request: Scheduled) -> None:
    """A completed prompt's full blocks become shareable (prefix cache on)."""
    if self.config.prefix_cache:
      self.pool.commit(request.prompt, request.blocks)

  def release(self, request: Scheduled) -> None:
    """A finished request's blocks go back to the pool (cached if indexed, else free)."""
    if request.blocks:
      self.pool.release(request.blocks)

  def prefill(self, slots: Sequence[Scheduled]) -> ChunkPlan | None:
    """`slots[i]` holds row i. Started prompts (a cached prefix, or longer than the largest
    chunk) take their next chunks first come first served; only when none is started do new
    prompts take their first chunks. None: nothing to prefill."""
    started = [s for s, x in enumerate(slots)
               if 0 < x.prefilled < len(x.prompt) and not x.finished]
    if started:
      return self._later_chunks(slots, started)
    fresh = [s for s, x in enumerate(slots) if x.prefilled == 0 and not x.finished]
    if fresh:
      return self._first_chunks(slots, fresh)
    return None

  def _later_chunks(self, slots, started: list[int]) -> ChunkPlan:
    """The next chunk of a run of started prompts in one "chunk" call, each at its offset."""
    batches = self.config.prompt_batches
    size_of = self._size_of(slots)
    group = self._group(started, batches, size_of)
    size, rows = size_of(group), next(b for b in batches if b >= len(group))
    counts = tuple(min(size, len(slots[s].prompt) - slots[s].prefilled) for s in group)
    return self._chunk("chunk", rows, size, slots, group,
                       tuple(slots[s].prefilled for s in group), counts)

  def _first_chunks(self, slots, fresh: list[int]) -> ChunkPlan:
    """The first chunk of a run of new prompts in one "prompts" call."""
    batches = self.config.prompt_batches
    size_of = self._size_of(slots)
    group = self._group(fresh, batches, size_of)
    size, rows = size_of(group), next(b for b in batches if b >= len(group))
    counts = tuple(min(size, len(slots[s].prompt)) for s in group)
    return self._chunk("prompts", rows, size, slots, group, (0,) * len(group), counts)

  @staticmethod
  def _chunk(kind: str, rows: int, size: int, slots, group: list[int],
             starts: tuple[int, ...], counts: tuple[int, ...]) -> ChunkPlan:
    done = tuple(s for s, start, count in zip(group, starts, counts)
                 if start + count == len(slots[s].prompt))
    return ChunkPlan(kind, rows, size, tuple(group), starts, counts, done,
                     sample=not all(slots[s].settings.greedy for s in group),
                     scored=any(slots[s].logprobs is not None for s in done))

  def _size_of(self, slots) -> Callable[[list[int]], int]:
    """The chunk size of a group: the prompt bucket that takes its longest rest of a prompt
    (up to the largest)."""
    lengths = self.config.prompt_lengths

    def size_of(group: list[int]) -> int:
      longest = min(max(len(slots[s].prompt) - slots[s].prefilled for s in group), lengths[-1])
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
