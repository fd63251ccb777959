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
  step     (`StepPlan`)    one step over a flat batch of prompt tokens, up to the token budget
                           (`max_num_batched_tokens`): the next chunks of prompts already started
                           (a cached prefix, or longer than one step's budget) first, then the
                           first chunks of new prompts, first come first served, each chunk at
                           its cache offset, none padded; the step takes the smallest token
                           bucket that holds them. A completed prompt's full blocks are indexed
                           for later prompts (`commit`);
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
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # (an annotation only: this module imports nothing of cg_jax when it runs)
  from cg_jax.core.block_pool import BlockPool


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
    token_buckets: the token counts of the step executables (ascending); the last is the
      token budget of a step.
    max_seq_len: tokens a request's block table covers at most (prompt and new tokens).
    block_size: tokens per KV-cache block.
    prefix_cache: prompts share the cached blocks that start them.
    batch_invariant: a step takes one request's chunk of token_buckets[-1] tokens (the one
      prompt bucket) at multiples of it, and prefix hits are used in whole chunks.
  """

  batch_sizes: tuple[int, ...]
  token_buckets: tuple[int, ...]
  max_seq_len: int
  block_size: int = 16
  prefix_cache: bool = False
  batch_invariant: bool = False

  @classmethod
  def of(cls, config) -> "PlanConfig":
    """From an `EngineConfig` (or a fake with the same fields)."""
    return cls(batch_sizes=config.buckets.batch_sizes, token_buckets=config.token_buckets,
               max_seq_len=config.max_seq_len, block_size=config.prefix_block,
               prefix_cache=config.prefix_blocks > 0, batch_invariant=config.batch_invariant)

  @property
  def max_batch(self) -> int:
    return self.batch_sizes[-1]

  @property
  def max_tokens(self) -> int:
    """The token budget of one step."""
    return self.token_buckets[-1]

  def batch_bucket(self, batch: int) -> int:
    """The smallest batch bucket >= batch (1 <= batch <= max_batch)."""
    return self.batch_sizes[bisect.bisect_left(self.batch_sizes, batch)]

  def token_bucket(self, tokens: int) -> int:
    """The smallest token bucket >= tokens (1 <= tokens <= max_tokens)."""
    return self.token_buckets[bisect.bisect_left(self.token_buckets, tokens)]

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
class StepPlan:
  """One engine step: the request of row slots[i] takes counts[i] prompt tokens from its
  position starts[i], the chunks laid end to end in that order and padded to `tokens` (a token
  bucket); the step's block tables, logits and tokens have `rows` rows (`step_rows`), the
  requests' first. `done` are the rows whose prompt this step completes (they join the decode
  batch with the token it picks); `sample`: one of them samples (its first token is drawn by
  ("first", rows, False) from the step's logits); `scored`: one of them asks for
  log-probabilities (("token_logprobs", rows)).
  """

  tokens: int
  rows: int
  slots: tuple[int, ...]
  starts: tuple[int, ...]
  counts: tuple[int, ...]
  done: tuple[int, ...]
  sample: bool = False
  scored: bool = False

  @property
  def key(self) -> tuple:
    return ("step", self.tokens)

  @property
  def keys(self) -> tuple[tuple, ...]:
    """Every executable the step runs, in order."""
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
        multiple = c.max_tokens // c.block_size if c.batch_invariant else 1
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

  def step(self, slots: Sequence[Scheduled]) -> StepPlan | None:
    """`slots[i]` holds row i. Started prompts (a cached prefix, or longer than one step) take
    their next chunks first, then new prompts their first ones, each first come first served
    (row order), while the token budget lasts; a batch-invariant step takes one request. None:
    nothing to prefill."""
    c = self.config
    pending = [s for s, x in enumerate(slots) if x.prefilled < len(x.prompt) and not x.finished]
    if not pending:
      return None
    # Started prompts first (stable: each kind in row order).
    pending.sort(key=lambda s: slots[s].prefilled == 0)
    group, starts, counts, budget = [], [], [], c.max_tokens
    for s in pending[:1] if c.batch_invariant else pending:
      if budget == 0:
        break
      live = slots[s]
      take = min(len(live.prompt) - live.prefilled, budget)
      group.append(s)
      starts.append(live.prefilled)
      counts.append(take)
      budget -= take
    done = tuple(s for s, start, count in zip(group, starts, counts)
                 if start + count == len(slots[s].prompt))
    return StepPlan(c.token_bucket(sum(counts)), c.max_batch, tuple(group), tuple(starts),
                    tuple(counts), done, sample=not all(slots[s].settings.greedy for s in group),
                    scored=any(slots[s].logprobs is not None for s in done))

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
