"""The scheduler's policy as plans: what one engine iteration runs, decided on the host only.

The engine thread (`cg_jax.core.scheduler`) asks a `Planner` for each phase of an iteration, right
before it runs it, and executes the plan: a phase's plan depends on the tokens read back before
it (a token may be EOS, a readback may finish a request), so an iteration is a sequence of
plans, not one:

  admit    (`Admission`)   waiting requests, first come first served, take a place among the
                           running ones (at most `max_num_seqs`) while the block pool has blocks
                           for the whole request (prompt and max_new_tokens); with the prefix
                           cache on, the cached blocks that start a prompt are shared
                           (`BlockPool.match`) and its cached tokens count as prefilled;
  step     (`StepPlan`)    one step over a flat batch of tokens, up to the token budget
                           (`max_num_batched_tokens`): every decoding request's next token
                           first (a row of one token), then the next chunks of prompts already
                           started (a cached prefix, or longer than a step's budget), then the
                           first chunks of new prompts, first come first served, each chunk at
                           its cache offset, none padded; the step takes the smallest token
                           bucket that holds them. A completed prompt's full blocks are indexed
                           for later prompts (`commit`). Finished requests give their blocks
                           back (`release`).

Plans are frozen dataclasses of ints and tuples naming requests, blocks and executable keys; the
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

# A step of more than EXACT_LOGIT_ROWS rows pads its logits (and the "draw" and
# "token_logprobs" executables that read them have as many rows) to at least MIN_WIDE_LOGIT_ROWS
# rows, or max_num_seqs: the 64-row step shares the 128-row one's draw executable. Below, each
# row of a draw costs its sampled tokens (XLA sorts few long rows one by one: 8 -> 16 rows was
# +200 us a sampled token, llama-3.2-1b on an H100, benchmarks/results/max_num_seqs_h100.md);
# many rows it sorts by radix, where padding rows cost little.
EXACT_LOGIT_ROWS = 32
MIN_WIDE_LOGIT_ROWS = 128


def logit_rows(rows: int, step_rows: int) -> int:
  """The rows of the logits of a step of `rows` rows (of `step_rows` at most)."""
  return rows if rows <= EXACT_LOGIT_ROWS else min(max(rows, MIN_WIDE_LOGIT_ROWS), step_rows)


class Scheduled(Protocol):
  """The request state the planner reads (the scheduler's `_Live`)."""

  prompt: Sequence[int]
  max_new_tokens: int
  settings: Any  # its `greedy` says whether the request samples
  logprobs: int | None
  blocks: list[int]  # its block table (empty until admitted)
  prefilled: int  # prompt tokens in the cache, or in a step launched
  launched: int  # tokens the launched steps emit for it (the first one included)
  decoding: bool  # its prompt is complete: each step feeds it its last token
  finished: bool


@dataclasses.dataclass(frozen=True)
class PlanConfig:
  """What the policy depends on.

  Args:
    max_num_seqs: the most requests running at once (the rows of a step).
    token_buckets: the token counts of the step executables (ascending); the last is a step's
      token budget.
    max_seq_len: tokens a request's block table covers at most (prompt and new tokens).
    block_size: tokens per KV-cache block.
    prefix_cache: prompts share the cached blocks that start them.
    batch_invariant: a step takes one request's prompt chunk of `chunk_tokens` tokens at
      multiples of it (the one prompt bucket) beside the decode rows, in the one token bucket
      (chunk_tokens + max_num_seqs), and prefix hits are used in whole chunks.
    chunk_tokens: the most prompt tokens one step takes (None: the token budget).
  """

  max_num_seqs: int
  token_buckets: tuple[int, ...]
  max_seq_len: int
  block_size: int = 16
  prefix_cache: bool = False
  batch_invariant: bool = False
  chunk_tokens: int | None = None

  @classmethod
  def of(cls, config) -> "PlanConfig":
    """From an `EngineConfig` (or a fake with the same fields)."""
    return cls(max_num_seqs=config.step_rows, token_buckets=config.token_buckets,
               max_seq_len=config.max_seq_len, block_size=config.prefix_block,
               prefix_cache=config.prefix_blocks > 0, batch_invariant=config.batch_invariant,
               chunk_tokens=config.max_num_batched_tokens)

  @property
  def max_tokens(self) -> int:
    """The token budget of one step (decode rows and prompt chunks)."""
    return self.token_buckets[-1]

  @property
  def max_chunk(self) -> int:
    """The most prompt tokens one step takes."""
    return self.max_tokens if self.chunk_tokens is None else min(self.chunk_tokens,
                                                                 self.max_tokens)

  def token_bucket(self, tokens: int) -> int:
    """The smallest token bucket >= tokens (1 <= tokens <= max_tokens)."""
    return self.token_buckets[bisect.bisect_left(self.token_buckets, tokens)]

  def rows(self, tokens: int) -> int:
    """R: the rows of a step of `tokens` tokens (a bucket): min(tokens, max_num_seqs)."""
    return min(tokens, self.max_num_seqs)

  def logit_rows(self, tokens: int) -> int:
    """Y: the rows of the logits of a step of `tokens` tokens (`logit_rows`)."""
    return logit_rows(self.rows(tokens), self.max_num_seqs)

  def blocks_needed(self, request: "Scheduled") -> int:
    """Blocks of a request's whole life: its prompt and max_new_tokens, within max_seq_len."""
    tokens = min(len(request.prompt) + request.max_new_tokens, self.max_seq_len)
    return -(-tokens // self.block_size)


@dataclasses.dataclass(frozen=True)
class Admission:
  """A waiting request let in: its block table and the prompt tokens its shared (cached)
  blocks already hold."""

  blocks: tuple[int, ...]
  cached: int


@dataclasses.dataclass(frozen=True)
class StepPlan:
  """One engine step: row i is the request `running[i]` (`requests[i]` indexes the running
  list), taking counts[i] tokens from its position starts[i]; the rows' tokens lie end to end
  in row order, padded to `tokens` (a token bucket); the step's block tables have `rows` rows
  (`PlanConfig.rows`), its logits `logit_rows`. The first `decodes` rows are decode rows (one
  token: the request's last, fed back); the others take prompt chunks. `done` are the rows
  whose chunk completes their prompt; decode rows and `done` rows emit a token. `sample`: an
  emitting row samples (its token is drawn by ("draw", logit_rows) from the step's logits);
  `scored`: an emitting row asks for log-probabilities (("token_logprobs", logit_rows)).
  """

  tokens: int
  rows: int
  logit_rows: int
  requests: tuple[int, ...]
  starts: tuple[int, ...]
  counts: tuple[int, ...]
  decodes: int
  done: tuple[int, ...]
  sample: bool = False
  scored: bool = False

  @property
  def emitting(self) -> tuple[int, ...]:
    """The rows that emit a token, in row order."""
    return (*range(self.decodes), *self.done)

  @property
  def key(self) -> tuple:
    return ("step", self.tokens)

  @property
  def keys(self) -> tuple[tuple, ...]:
    """Every executable the step runs, in order."""
    return (self.key, *([("draw", self.logit_rows)] if self.sample else []),
            *([("token_logprobs", self.logit_rows)] if self.scored else []))


class Planner:
  """Decides each phase's plan from host state (see the module docstring).

  Args:
    config: the buckets and limits.
    pool: the KV cache's block pool (`BlockPool`, its blocks of config.block_size tokens).
  """

  def __init__(self, config: PlanConfig, pool: BlockPool):
    self.config, self.pool = config, pool

  def fits(self, request: Scheduled) -> bool:
    """Whether the request's blocks could ever be had (the whole pool free)."""
    return self.config.blocks_needed(request) <= self.pool.num_blocks

  def admissible(self, waiting: Sequence[Scheduled], running: int) -> bool:
    """Whether `admit` would let the head of the queue in now (a free place and its blocks),
    without taking anything."""
    return bool(waiting) and running < self.config.max_num_seqs and self._has_blocks(waiting[0])

  def _has_blocks(self, request: Scheduled) -> bool:
    # Enough: the shared blocks a match takes from the cached ones are among those needed.
    return self.config.blocks_needed(request) <= self.pool.available

  def admit(self, waiting: Sequence[Scheduled], running: int) -> tuple[Admission, ...]:
    """The next waiting requests that the free places beside `running` requests and the pool's
    blocks take, in order; the first that does not get its blocks waits, and so do those
    behind it. Each takes its blocks here (`release` gives them back)."""
    c = self.config
    admitted = []
    for request in itertools.islice(waiting, max(c.max_num_seqs - running, 0)):
      if not self._has_blocks(request):
        break
      needed = c.blocks_needed(request)
      shared: list[int] = []
      if c.prefix_cache:
        # Batch-invariant engines take whole chunks only: the chunk boundaries of a miss.
        multiple = c.max_chunk // c.block_size if c.batch_invariant else 1
        shared = self.pool.match(request.prompt, multiple)
      fresh = self.pool.allocate(needed - len(shared))
      assert fresh is not None  # (guaranteed by the check above)
      admitted.append(Admission(tuple(shared + fresh), len(shared) * c.block_size))
    return tuple(admitted)

  def commit(self, request: Scheduled) -> None:
    """A completed prompt's full blocks become shareable (prefix cache on)."""
    if self.config.prefix_cache:
      self.pool.commit(request.prompt, request.blocks)

  def release(self, request: Scheduled) -> None:
    """A finished request's blocks go back to the pool (cached if indexed, else free)."""
    if request.blocks:
      self.pool.release(request.blocks)

  @staticmethod
  def prefilling(running: Sequence[Scheduled], waiting: Sequence[Scheduled]) -> bool:
    """Whether another prompt chunk may follow the steps launched: a request waits, or a
    running prompt has tokens no launched step takes (`step` plans them next)."""
    return bool(waiting) or any(not x.finished and _unprefilled(x) for x in running)

  def step(self, running: Sequence[Scheduled]) -> StepPlan | None:
    """The next step over the `running` requests (admission order): each decoding request that
    needs a token more than the launched steps give it takes a row of one token, then started
    prompts (a cached prefix, or longer than one step) take their next chunks, then new prompts
    their first ones, first come first served, while the token budget lasts; a
    batch-invariant step takes one prompt's chunk. None: nothing to run."""
    c = self.config
    live = [i for i, x in enumerate(running) if not x.finished]
    decodes = [i for i in live if running[i].decoding
               and running[i].launched < running[i].max_new_tokens][:c.max_tokens]
    pending = [i for i in live if _unprefilled(running[i])]
    # Started prompts first (stable: each kind in admission order).
    pending.sort(key=lambda i: running[i].prefilled == 0)
    requests = list(decodes)
    starts = [len(running[i].prompt) + running[i].launched - 1 for i in decodes]
    counts = [1] * len(decodes)
    budget = min(c.max_chunk, c.max_tokens - len(decodes))
    for i in pending[:1] if c.batch_invariant else pending:
      if budget == 0 or len(requests) == c.max_num_seqs:
        break
      request = running[i]
      take = min(len(request.prompt) - request.prefilled, budget)
      requests.append(i)
      starts.append(request.prefilled)
      counts.append(take)
      budget -= take
    if not requests:
      return None
    done = tuple(row for row in range(len(decodes), len(requests))
                 if starts[row] + counts[row] == len(running[requests[row]].prompt))
    emitting = [running[requests[row]] for row in (*range(len(decodes)), *done)]
    tokens = c.token_bucket(sum(counts))
    return StepPlan(tokens, c.rows(tokens), c.logit_rows(tokens), tuple(requests), tuple(starts),
                    tuple(counts), len(decodes), done,
                    sample=not all(x.settings.greedy for x in emitting),
                    scored=any(x.logprobs is not None for x in emitting))


def _unprefilled(request: Scheduled) -> bool:
  """Whether the request's prompt has tokens no launched step takes."""
  return request.prefilled < len(request.prompt)
