"""Continuous batching over a paged KV cache: one engine thread owns the device.

Requests wait in a bounded FIFO. The engine thread loops:
  1. retire: finished, cancelled and timed-out requests leave and give their blocks back;
  2. admit: waiting requests join the running ones (at most `max_num_seqs`) while the block pool
     has blocks for their whole life (prompt and max_new_tokens); a prompt that starts with
     cached blocks shares them (a prefix-cache hit copies nothing) and prefills only the rest;
  3. step: one executable over a flat batch of tokens up to the token budget
     (`max_num_batched_tokens`; the smallest token bucket that holds them): every decoding
     request's next token (fed from the previous step's output on the device), then the next
     chunks of prompts already started (a cached prefix, or longer than a step's budget), then
     the first chunks of newly admitted prompts, each at its cache offset, first come first
     served. A long prompt delays the running streams by its chunk's share of one step. A
     request whose prompt the step completes emits its first token and decodes from the next
     step on; its full blocks become shareable.
Up to `readback_lag` steps are in flight: the host reads a step's tokens while later steps run
(a step that emits first tokens is read at once, or, when prompt chunks follow it, as soon as
the next step is launched behind it: the device does not wait for the host between chunks).
Tokens go to each caller's own buffer, so a slow or absent consumer never blocks the loop.

The policy lives in `cg_jax.core.step_plan`: its `Planner` returns each phase's plan (which
requests, blocks, token counts and executable key) from host state and keeps the block pool; the
engine thread here runs the plans: it calls the executables, reads tokens back and delivers
them.
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from cg_jax import validation
from cg_jax.core import host_io
from cg_jax.core.block_pool import BlockPool
from cg_jax.core.config import EngineConfig
from cg_jax.core.executables import ExecutableTable
from cg_jax.core.kv_cache import CacheHolder
from cg_jax.core.sampling import SamplingArrays
from cg_jax.core.step_plan import PlanConfig, Planner, StepPlan
from cg_jax.generation import RowText
from cg_jax.handles import EngineClosed, Group, QueueFull, RequestTimeout


@dataclasses.dataclass
class _Live:
  """One request inside the scheduler (touched by the engine thread only, except `cancelled`)."""

  group: "Group"
  row: int  # index in its caller's batch: keys its seeded randomness
  prompt: np.ndarray
  max_new_tokens: int
  settings: validation.SamplingSettings
  text: RowText | None  # followed only to find stop strings
  deadline: float | None
  logprobs: int | None = None  # alternatives per token with their log-probabilities, or None
  blocks: list[int] = dataclasses.field(default_factory=list)  # its block table
  prefilled: int = 0  # prompt tokens in the cache (or in a step launched)
  launched: int = 0  # tokens the launched steps emit for it
  carry: tuple[int, int] = (-1, 0)  # (step, row): where its last launched token is on the device
  token: int = 0  # the last token read back
  emitted: int = 0  # tokens read back
  decoding: bool = False
  finished: bool = False

  @property
  def cancelled(self) -> bool:
    return self.group.cancelled

  def expired(self, now: float) -> bool:
    return self.deadline is not None and now > self.deadline


class Scheduler:
  """The engine thread and its queues (see the module docstring).

  Args:
    config: the engine's config; table: its executables; cache: its paged KV cache.
    weights: the flat weight list; inputs_at: where request arrays go; tokenizer: or None.
    lock: the engine's lock, held for each loop iteration (swap-out and the static path wait).
  """

  def __init__(self, config: EngineConfig, table: ExecutableTable, cache: CacheHolder,
               weights: list, inputs_at, tokenizer, lock: threading.RLock):
    self.config, self.table, self.cache, self.weights = config, table, cache, weights
    self.inputs_at, self.tokenizer, self.lock = inputs_at, tokenizer, lock
    # The cache's blocks (host bookkeeping; the scratch block past them is not the pool's).
    self.blocks = BlockPool(config.num_blocks, config.prefix_block)
    # The policy (`cg_jax.core.step_plan`): what each phase of an iteration runs.
    self.planner = Planner(PlanConfig.of(config), self.blocks)
    self._wakeup = threading.Condition()
    self._waiting: collections.deque[_Live] = collections.deque()
    self._running: list[_Live] = []  # admitted, in admission order
    self._reader = host_io.AsyncReader()  # (tokens, [live per row]) of steps in flight
    # The last step's tokens on the device [U] (decode rows of the next step read theirs) and
    # the number of steps launched.
    self._carry = None
    self._steps = 0
    # The last step launched behind which more prompt chunks went: its first tokens are read
    # once the step after it is launched.
    self._first_tokens_step = 0
    # The staged buffer: the index arrays of the last step loaded and the lengths the last step
    # left (`cg_jax.core.step_inputs`), donated to every step; None until the first step.
    self._staged = None
    # A decode step kept on the device while the same requests decode in the same rows: (its
    # key, its requests, sampling arrays or None); the staged buffer holds its next inputs.
    self._decoding: tuple | None = None
    self._thread: threading.Thread | None = None
    self._closed = False
    self._resume = True  # False while a swapped-out cache should stay out
    self.counters = collections.Counter()
    # Called on the engine thread after each batch of tokens and ends went to their groups (once
    # per step), or None: how the engine-core process sends a step's outputs in one message.
    self.on_delivered: Callable[[], None] | None = None
    self._started = time.perf_counter()

  # ------------------------------------------------------------------------------------------------
  # Callers

  def submit(self, request: validation.Request, timeout: float | None = None,
             group: Callable[[list[int], Callable[[], None]], Group] = Group) -> Group:
    """Queue a validated request's prompts; returns their group, made by `group(prompt lengths,
    on_cancel)` (the engine-core process passes a group that sends its tokens on)."""
    group = group([len(prompt) for prompt in request.rows], self.wake)
    lives = []
    deadline = None if timeout is None else time.perf_counter() + timeout
    for row, prompt in enumerate(request.rows):
      follow = RowText(self.tokenizer, request.stop) if request.stop else None
      lives.append(_Live(group, row, prompt, request.max_new_tokens, request.settings,
                         follow, deadline, request.logprobs))
    for live in lives:
      if not self.planner.fits(live):
        raise ValueError(
            f"a prompt of {len(live.prompt)} tokens with max_new_tokens={live.max_new_tokens} "
            f"needs {self.planner.config.blocks_needed(live)} KV-cache blocks of "
            f"{self.config.prefix_block} tokens; the cache has {self.blocks.num_blocks}")
    with self._wakeup:
      if self._closed:
        raise EngineClosed("the engine is closed")
      if len(self._waiting) + len(lives) > self.config.max_waiting:
        raise QueueFull(f"the waiting queue is full ({len(self._waiting)} requests waiting, "
                        f"max_waiting={self.config.max_waiting}); retry later")
      self._waiting.extend(lives)
      self._resume = True  # a new request brings a swapped-out cache back
      self.counters["submitted"] += len(lives)
      if self._thread is None:
        self._thread = threading.Thread(target=self._run, name="cg_jax-engine", daemon=True)
        self._thread.start()
        _RUNNING.add(self)
      self._wakeup.notify()
    return group

  def wake(self) -> None:
    with self._wakeup:
      self._wakeup.notify()

  def pause(self) -> None:
    """After a swap-out: running requests wait until `swap_in` or a new request."""
    with self._wakeup:
      self._resume = False

  def resume(self) -> None:
    with self._wakeup:
      self._resume = True
      self._wakeup.notify()

  @property
  def closed(self) -> bool:
    return self._closed

  def idle(self) -> bool:
    return not self._waiting and not self._running

  def exclusive(self) -> "Exclusive":
    """A context holding the engine's lock while no request is queued or running (the static
    path writes cache rows from 0)."""
    return Exclusive(self)

  def close(self, wait: bool = True) -> None:
    """Fail every pending request with EngineClosed and stop the engine thread (joined unless
    `wait` is False)."""
    with self._wakeup:
      self._closed = True
      self._wakeup.notify()
    thread = self._thread
    if wait and thread is not None and thread is not threading.current_thread():
      thread.join()

  def stats(self) -> dict[str, Any]:
    elapsed = time.perf_counter() - self._started
    running = sum(not live.finished for live in self._running)
    blocks = self.blocks.stats()
    if not self.planner.config.prefix_cache:
      blocks = {k: v for k, v in blocks.items() if not k.startswith("prefix_cache")}
    return {"running": running, "waiting": len(self._waiting),
            "max_running": self.config.step_rows,
            "steps": self.counters["steps"],
            "decode_steps": self.counters["decode_steps"],
            "prefill_chunks": self.counters["chunks"],
            "generated_tokens": self.counters["tokens"],
            "tokens_per_s": self.counters["tokens"] / elapsed if elapsed > 0 else 0.0,
            "requests_submitted": self.counters["submitted"],
            "requests_finished": self.counters["finished"],
            "prefix_cache": self.planner.config.prefix_cache,
            "kv_block_size": self.config.prefix_block, **blocks}

  # ------------------------------------------------------------------------------------------------
  # The engine thread

  def _run(self) -> None:
    while True:
      with self._wakeup:
        while not self._closed and (self.idle() or self._paused()):
          self._wakeup.wait(timeout=0.05)
        if self._closed:
          break
      try:
        with self.lock:
          if not self._paused():
            self._iteration()  # (its first cache access swaps a swapped-out cache back in)
      except Exception as error:  # noqa: BLE001 - a device failure ends every live request
        self._fail_all(error)
    self._fail_all(EngineClosed("the engine was closed before the request finished"))

  def _paused(self) -> bool:
    return self.cache.swapped_out and not self._resume

  def _fail_all(self, error: BaseException) -> None:
    with self._wakeup:
      lives = list(self._running) + list(self._waiting)
      self._running, self._carry, self._decoding, self._staged = [], None, None, None
      self._waiting.clear()
    for live in lives:
      self._release(live)
    self._reader = host_io.AsyncReader()
    for live in lives:
      live.finished = True
      live.group._fail(error)
    self._delivered()

  def _delivered(self) -> None:
    if self.on_delivered is not None:
      self.on_delivered()

  def _iteration(self) -> None:
    now = time.perf_counter()
    stale = [live for live in self._running if live.cancelled or live.finished
             or live.expired(now)]
    with self._wakeup:
      startable = self.planner.admissible(self._waiting, len(self._running))
      stale = stale or any(w.cancelled or w.expired(now) for w in self._waiting)
    if stale or startable:
      self._drain()
      self._retire(now)
      self._admit()
    plan = self.planner.step(self._running)
    if plan is None:
      self._drain()  # the steps in flight cover every running request's budget
    else:
      firsts = self._first_tokens_step
      self._run_step(plan)
      if plan.done and not self.planner.prefilling(self._running, self._waiting):
        self._drain()  # first tokens go out now
      else:
        # More prompt chunks follow: the first tokens of a step go out once the next step is
        # launched behind it, so the device never waits for the host between chunks.
        self._read_through(firsts)
        if plan.done:
          self._first_tokens_step = self._steps
        if len(self._reader) > self.config.readback_lag:
          self._read_one()
    self._delivered()  # (the ends of cancelled and timed-out requests)

  def _read_through(self, step: int) -> None:
    """Read the steps in flight up to step number `step` (the oldest in flight is step
    `self._steps - len(self._reader) + 1`)."""
    while len(self._reader) and self._steps - len(self._reader) + 1 <= step:
      self._read_one()

  def _drain(self) -> None:
    while len(self._reader):
      self._read_one()

  def _retire(self, now: float) -> None:
    """End cancelled and timed-out requests, then release every finished one's blocks."""
    for live in self._running:
      if not live.finished:
        if live.cancelled:
          self._end(live, "cancelled")
        elif live.expired(now):
          live.finished = True
          live.group._fail(RequestTimeout("the request ran past its timeout"))
    for live in self._running:
      if live.finished:
        self._release(live)
    self._running = [live for live in self._running if not live.finished]
    with self._wakeup:
      for live in [w for w in self._waiting if w.cancelled or w.expired(now)]:
        self._waiting.remove(live)
        if live.cancelled:
          self._end(live, "cancelled")
        else:
          live.finished = True
          live.group._fail(RequestTimeout("the request ran past its timeout while waiting"))

  def _admit(self) -> None:
    with self._wakeup:
      for admission in self.planner.admit(self._waiting, len(self._running)):
        live = self._waiting.popleft()
        live.blocks, live.prefilled = list(admission.blocks), admission.cached
        live.group.admitted_at[live.row] = time.perf_counter()
        self._running.append(live)

  def _release(self, live: _Live) -> None:
    """A request that left: its blocks go back to the pool (once)."""
    self.planner.release(live)
    live.blocks = []

  def _tables(self, rows: list[_Live], count: int) -> np.ndarray:
    """int32 [count, W]: each row's block table; rows past `rows` name the scratch block
    (they write nothing)."""
    tables = np.full((count, self.config.table_width), self.config.scratch_block, np.int32)
    for b, live in enumerate(rows):
      tables[b, :len(live.blocks)] = live.blocks
    return tables

  def _run_step(self, plan: StepPlan) -> None:
    """One engine step (see `StepPlan`): its emitting rows' tokens are read back later
    (`_read_one`); the requests whose prompt it completes decode from the next step on."""
    group = [self._running[i] for i in plan.requests]
    fed = all(live.carry[0] == self._steps for live in group[:plan.decodes])
    if not fed:
      self._drain()  # a decode row not in the last step: its token comes from the host
    emitting = set(plan.emitting)
    rows = [live if b in emitting else None for b, live in enumerate(group)]
    carry = self._carry
    if carry is None:
      carry = np.zeros((self.config.step_rows,), np.int32)
    # A step of decode rows only, each fed from the carry: its inputs serve the steps after it
    # while the same requests decode in the same rows (their block tables never change).
    reusable = plan.decodes == len(group) and fed
    last = self._decoding
    reused = reusable and last is not None and last[0] == plan.key and _same(last[1], group)
    if reused:
      # The same rows decode again: the staged inputs as the last step left them.
      sampling = last[2]
    else:
      inputs = self._inputs(plan, group)
      self._load(inputs)
      sampling = self._sampling(rows, plan.logit_rows) if plan.sample else None
    carry, emitted, logits, cache, self._staged = self.table.get(plan.key)(
        self.weights, self.cache.get(), carry, self._staged)
    self.cache.set(cache)
    if reusable and not reused:
      # Staged once for the steps after it, each row fed from its own row of the carry this
      # step leaves (one token per row: token b is row b's), at the lengths this step leaves.
      tokens, feed, tables, starts, counts, seq_lens = inputs
      own = np.where(np.arange(len(feed)) < len(group), np.arange(len(feed)), -1)
      if not np.array_equal(own, feed):
        self._load((tokens, own.astype(np.int32), tables, starts, counts,
                    seq_lens + (counts > 0)))
      if sampling is not None:
        sampling = host_io.stage(sampling, self.inputs_at)
    self._decoding = (plan.key, group, sampling) if reusable else None
    if plan.sample:
      # [U]: the emitting rows' tokens drawn at their sequences' lengths.
      carry, emitted = self.table.get(("draw", plan.logit_rows))(logits, self._staged,
                                                                 sampling, carry)
    scores = None
    if plan.scored:
      scores = self.table.get(("token_logprobs", plan.logit_rows))(logits, carry)
    self._carry = carry
    self._steps += 1
    self.counters["steps"] += 1
    self.counters["decode_steps"] += plan.decodes > 0
    self.counters["chunks"] += plan.decodes < len(group)
    for b in plan.emitting:
      live = group[b]
      live.launched += 1
      live.carry = (self._steps, b)
    for b in range(plan.decodes, len(group)):
      group[b].prefilled += plan.counts[b]
    for b in plan.done:
      group[b].decoding = True
    self._reader.push((emitted, scores), (rows, [group[b] for b in plan.done]))

  def prime(self, keys) -> None:
    """Run the steps among `keys` twice on empty rows on this scheduler's staged buffer
    (`ExecutableTable.prime`), which the next step then loads afresh. The caller holds the
    engine's lock (no step runs meanwhile)."""
    cache, self._staged = self.table.prime(keys, self.weights, self.cache.get(),
                                           self._staged_buffer())
    self.cache.set(cache)
    self._decoding = None  # (the staged buffer no longer holds a decode step's inputs)

  def _load(self, inputs: tuple[np.ndarray, ...]) -> None:
    """A step's index arrays into the staged buffer (one transfer; the buffer keeps its
    address)."""
    packed = self.config.step_layout.pack(*inputs)
    self._staged = self.table.get(("load",))(self._staged_buffer(), packed)

  def _staged_buffer(self):
    """The staged buffer [I], or a new one before the first step (and after a failure)."""
    if self._staged is None:
      return np.zeros((self.config.step_layout.size,), np.int32)
    return self._staged

  def _inputs(self, plan: StepPlan, group: list[_Live]) -> tuple[np.ndarray, ...]:
    """A step's host arrays: (tokens [A], feed [A], tables [R, W], query_starts [R + 1],
    query_lens [R], seq_lens [R]); decode rows feed their token from the carry."""
    tokens = np.zeros((plan.tokens,), np.int32)
    feed = np.full((plan.tokens,), -1, np.int32)  # where a token comes from the carry
    counts = np.zeros((plan.rows,), np.int32)  # rows past the group take no token
    counts[:len(group)] = plan.counts
    starts = np.zeros((plan.rows + 1,), np.int32)  # where each request's tokens start
    np.cumsum(counts, out=starts[1:])
    seq_lens = np.zeros((plan.rows,), np.int32)
    for b, live in enumerate(group):
      begin, at = plan.starts[b], starts[b]
      if b < plan.decodes:
        step, row = live.carry
        if step == self._steps:
          feed[at] = row
        else:
          tokens[at] = live.token
      else:
        tokens[at:at + counts[b]] = live.prompt[begin:begin + counts[b]]
      seq_lens[b] = begin + counts[b]
    return tokens, feed, self._tables(group, plan.rows), starts, counts, seq_lens

  def _deliver(self, new: list[tuple[_Live, int, np.ndarray | None]]) -> None:
    """One step's new tokens (with their scores, or None): emitted to their groups (one event
    per group), then each request ends on EOS, its budget or a stop string."""
    by_group: dict[Group, tuple[dict[int, int], dict[int, np.ndarray]]] = {}
    ends = []
    for live, token, score in new:
      live.token, live.emitted = token, live.emitted + 1
      tokens, scores = by_group.setdefault(live.group, ({}, {}))
      tokens[live.row] = token
      if live.logprobs is not None:
        scores[live.row] = score
      self.counters["tokens"] += 1
      if token in live.settings.eos_ids:
        ends.append((live, "stop"))
      elif live.emitted >= live.max_new_tokens:
        ends.append((live, "length"))
      elif live.text is not None:
        try:
          live.text.push(token)
        except Exception as error:  # noqa: BLE001 - a tokenizer failure ends this request only
          ends.append((live, error))
          continue
        if live.text.stopped:
          ends.append((live, "stop"))
    for group, (tokens, scores) in by_group.items():
      group._emit(tokens, scores)
    for live, reason in ends:
      if isinstance(reason, BaseException):
        live.finished = True
        live.group._fail(reason)
      else:
        self._end(live, reason)
    self._delivered()

  def _end(self, live: _Live, reason: str) -> None:
    if not live.finished:
      live.finished = True
      self.counters["finished"] += 1
      live.group._finish(live.row, reason)

  @staticmethod
  def _sampling(rows: list[_Live | None], batch: int) -> SamplingArrays:
    """Per-row sampling arrays of `batch` rows (None and padding rows: greedy)."""
    temperature = np.zeros((batch,), np.float32)
    top_k = np.zeros((batch,), np.int32)
    top_p = np.ones((batch,), np.float32)
    seed = np.zeros((batch,), np.uint32)
    row = np.zeros((batch,), np.int32)
    for b, live in enumerate(rows):
      if live is not None:
        s = live.settings
        temperature[b] = 0.0 if s.greedy else s.temperature
        top_k[b], top_p[b], seed[b], row[b] = s.top_k, s.top_p, s.seed, live.row
    return SamplingArrays(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, row=row)

  def _read_one(self) -> None:
    """The oldest step in flight: its tokens go to their requests (a request whose prompt it
    completed: its full blocks become shareable once its first token is out)."""
    (tokens, scores), (rows, completed) = self._reader.pop()
    new = [(live, int(tokens[b]), None if scores is None else scores[b])
           for b, live in enumerate(rows) if live is not None and not live.finished]
    self._deliver(new)
    for live in completed:
      if live.blocks:  # (not released: a request cancelled meanwhile gave them back)
        self.planner.commit(live)


def _same(a: list, b: list) -> bool:
  """Whether two lists hold the same objects in the same order."""
  return len(a) == len(b) and all(x is y for x, y in zip(a, b))


class Exclusive:
  """See `Scheduler.exclusive`."""

  def __init__(self, scheduler: Scheduler):
    self._scheduler = scheduler

  def __enter__(self):
    lock = self._scheduler.lock
    while True:
      lock.acquire()
      if self._scheduler.idle():
        return self
      lock.release()
      time.sleep(0.001)

  def __exit__(self, *exc):
    self._scheduler.lock.release()


# Schedulers whose engine thread runs: stopped before the interpreter exits (a daemon thread
# still inside XLA at exit aborts the process).
_RUNNING: "weakref.WeakSet[Scheduler]" = weakref.WeakSet()


@atexit.register
def _close_running() -> None:
  for scheduler in list(_RUNNING):
    scheduler.close()
