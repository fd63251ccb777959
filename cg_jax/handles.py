"""A request from the caller's side: `Group` (the tokens of one caller's requests, filled by
whoever runs them: the engine thread in-process, or the client of the engine-core process), the
`Handle` a caller holds, its `Delta`s and `Completion`, and the request errors. No device work
happens here."""

from __future__ import annotations

import asyncio
import dataclasses
import queue
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import numpy as np

from cg_jax.core.sampling import unpack_scores
from cg_jax.generation import RowText, final_text


class QueueFull(RuntimeError):
  """The waiting queue holds `max_waiting` requests already."""


class EngineClosed(RuntimeError):
  """The engine was closed before the request finished."""


class RequestTimeout(TimeoutError):
  """The request ran past its `timeout`."""


class _Waker:
  """Sets one event loop's `asyncio.Event`s from other threads with one loop callback per batch:
  events woken before the loop has run the previous callback ride on it, so a step that gives
  tokens to many requests wakes their loop once, not once per request (each
  `call_soon_threadsafe` writes to the loop's self-pipe)."""

  def __init__(self, loop: asyncio.AbstractEventLoop):
    self._loop = weakref.ref(loop)
    self._lock = threading.Lock()
    self._pending: list[asyncio.Event] = []

  def wake(self, ready: asyncio.Event) -> None:
    with self._lock:
      first = not self._pending
      self._pending.append(ready)
    loop = self._loop()
    if first and loop is not None:
      try:
        loop.call_soon_threadsafe(self._run)
      except RuntimeError:  # the loop is closed: nobody listens
        with self._lock:
          self._pending.clear()

  def _run(self) -> None:
    with self._lock:
      pending, self._pending = self._pending, []
    for ready in pending:
      ready.set()


_WAKERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_WAKERS_LOCK = threading.Lock()


def _waker(loop: asyncio.AbstractEventLoop) -> _Waker:
  with _WAKERS_LOCK:
    waker = _WAKERS.get(loop)
    if waker is None:
      waker = _WAKERS[loop] = _Waker(loop)
    return waker


class Group:
  """The tokens of one caller's requests (one `submit`, or the prompts of one `generate` or
  `stream` call): each engine step that produced tokens for them is one event."""

  def __init__(self, prompt_tokens: list[int], on_cancel: Callable[[], None]):
    rows = len(prompt_tokens)
    self.prompt_tokens = prompt_tokens  # each row's prompt length
    self._on_cancel = on_cancel  # wakes whoever runs the requests
    self._events: queue.SimpleQueue = queue.SimpleQueue()
    self._done = threading.Event()
    self.cancelled = False  # set by `cancel` and `_fail`: the runner ends the requests
    self.tokens: list[list[int]] = [[] for _ in range(rows)]
    # Per row, with logprobs: each new token's `token_scores` row (float32 [E]).
    self.scores: list[list[np.ndarray]] = [[] for _ in range(rows)]
    self.finish_reasons: list[str | None] = [None] * rows
    self.error: BaseException | None = None
    self.submitted_at = time.perf_counter()
    self.admitted_at: list[float | None] = [None] * rows  # each row's admission (it starts running)
    self.first_token_at: float | None = None  # the group's first token, any row
    self.row_first_token_at: list[float | None] = [None] * rows  # each row's first token
    self.row_finished_at: list[float | None] = [None] * rows  # each row's end
    self.finished_at: float | None = None
    self._open = rows
    self._watchers: list[tuple[_Waker, asyncio.Event]] = []

  def row_end(self, row: int) -> float | None:
    """When a row ended: its own finish, else the group's (a failed or cancelled group)."""
    return self.row_finished_at[row] or self.finished_at

  # The engine thread's side.

  def _emit(self, tokens: dict[int, int], scores: dict[int, np.ndarray]) -> None:
    now = time.perf_counter()
    if self.first_token_at is None:
      self.first_token_at = now
    for row, score in scores.items():
      self.scores[row].append(score)
    for row, token in tokens.items():
      if not self.tokens[row]:
        self.row_first_token_at[row] = now
      self.tokens[row].append(token)
    self._events.put(tokens)
    self._notify()

  def _finish(self, row: int, reason: str) -> None:
    if self._done.is_set():
      return
    self.row_finished_at[row] = time.perf_counter()
    self.finish_reasons[row] = reason
    self._open -= 1
    if self._open == 0:
      self._close()

  def _fail(self, error: BaseException) -> None:
    """End the group with `error`; its other requests are cancelled."""
    if not self._done.is_set():
      self.error = error
      self.cancelled = True
      self._close()

  def _close(self) -> None:
    self.finished_at = time.perf_counter()
    self._events.put(None)
    self._done.set()
    self._notify()

  def _notify(self) -> None:
    for waker, ready in self._watchers:
      waker.wake(ready)

  # The caller's side.

  @property
  def done(self) -> bool:
    return self._done.is_set()

  def cancel(self) -> None:
    """Stop the requests at the next step boundary; their KV blocks are freed."""
    if not self._done.is_set():
      self.cancelled = True
      self._on_cancel()

  def wait(self, timeout: float | None = None) -> None:
    """Wait until every request finished; raises its error (or TimeoutError)."""
    if not self._done.wait(timeout):
      raise TimeoutError(f"the request did not finish within {timeout} s")
    if self.error is not None:
      raise self.error

  def watch(self, ready: asyncio.Event) -> None:
    """Set `ready` (an event of the running loop) whenever an event is queued; the caller clears
    it before taking what is queued (`take`), so no wake-up is lost."""
    self._watchers.append((_waker(asyncio.get_running_loop()), ready))

  def take(self) -> list[dict[int, int] | None]:
    """The events queued now, without waiting (None: every request finished)."""
    events = []
    while True:
      try:
        events.append(self._events.get_nowait())
      except queue.Empty:
        return events

  def events(self, timeout: float | None = None) -> Iterator[dict[int, int]]:
    """{row: token} per engine step, until every request finished (then raises its error)."""
    while True:
      try:
        event = self._events.get(timeout=timeout)
      except queue.Empty:
        raise TimeoutError(f"no token within {timeout} s") from None
      if event is None:
        if self.error is not None:
          raise self.error
        return
      yield event


@dataclasses.dataclass(frozen=True)
class Delta:
  """One new token of a request, and its text delta (with a tokenizer); with `logprobs`, its
  log-probability and its most likely alternatives ((token, log-probability) pairs). A last
  delta with token -1 may carry text held back until the end."""

  token: int
  text: str | None = None
  logprob: float | None = None
  top_logprobs: tuple[tuple[int, float], ...] | None = None


@dataclasses.dataclass(frozen=True)
class Completion:
  """A finished request: its new tokens, text (with a tokenizer), why it ended ("stop": EOS or
  a stop string, "length": its budget) and its timings; with `logprobs`, per token its
  log-probability and most likely alternatives."""

  tokens: list[int]
  text: str | None
  finish_reason: str
  stats: dict[str, Any]
  logprobs: list[float] | None = None
  top_logprobs: list[tuple[tuple[int, float], ...]] | None = None


class Handle:
  """A submitted request. `result()` waits for it; iterating it (or `async for`) streams its
  tokens as `Delta`s; `cancel()` (or dropping the handle) frees its KV blocks at the next step."""

  def __init__(self, group: Group, tokenizer, stop: tuple[str, ...], logprobs: int | None = None):
    self._group, self._tokenizer, self._stop, self._top = group, tokenizer, stop, logprobs
    # `poll`'s stream: its text (with a tokenizer), the tokens given, whether it has ended.
    self._row: RowText | None = None
    self._given, self._ended = 0, False

  @property
  def done(self) -> bool:
    return self._group.done

  def cancel(self) -> None:
    self._group.cancel()

  close = cancel

  def __del__(self):
    group = getattr(self, "_group", None)
    if group is not None and not group.done:
      group.cancel()

  def __enter__(self) -> "Handle":
    return self

  def __exit__(self, *exc) -> None:
    self.cancel()

  def result(self, timeout: float | None = None) -> Completion:
    """The finished request (waits up to `timeout` seconds; TimeoutError past it)."""
    group = self._group
    group.wait(timeout)
    tokens = group.tokens[0]
    shown = None if self._tokenizer is None else final_text(self._tokenizer, tokens, self._stop)
    logprobs = top_logprobs = None
    if self._top is not None:
      unpacked = [unpack_scores(score, self._top) for score in group.scores[0]]
      logprobs, top_logprobs = [u[0] for u in unpacked], [u[1] for u in unpacked]
    return Completion(tokens=list(tokens), text=shown, finish_reason=group.finish_reasons[0],
                      stats=request_stats(group, 0), logprobs=logprobs,
                      top_logprobs=top_logprobs)

  @property
  def prompt_tokens(self) -> int:
    """The prompt's length in tokens."""
    return self._group.prompt_tokens[0]

  def __iter__(self) -> Iterator[Delta]:
    row = None if self._tokenizer is None else RowText(self._tokenizer, self._stop)
    for index, event in enumerate(self._group.events()):
      yield self._delta(row, event[0], index)
    if row is not None and (rest := row.finish()):
      yield Delta(-1, rest)

  async def __aiter__(self) -> AsyncIterator[Delta]:
    ready = asyncio.Event()
    self.watch(ready)
    while True:
      ready.clear()
      deltas, ended = self.poll()
      for delta in deltas:
        yield delta
      if ended:
        return
      if not deltas:
        await ready.wait()

  def watch(self, ready: asyncio.Event) -> None:
    """Set `ready` (an event of the running loop) when the request has news for `poll`; one
    event may watch many handles (a response's choices wait on one)."""
    self._group.watch(ready)

  def poll(self) -> tuple[list[Delta], bool]:
    """The stream's deltas since the last call, without waiting, and whether it has ended (its
    last delta given; a failed request raises its error instead). `async for` is built on it;
    don't mix it with iterating the handle."""
    if self._ended:
      return [], True
    if self._row is None and self._tokenizer is not None:
      self._row = RowText(self._tokenizer, self._stop)
    deltas = []
    for event in self._group.take():
      if event is None:
        self._ended = True
        if self._group.error is not None:
          raise self._group.error
        if self._row is not None and (rest := self._row.finish()):
          deltas.append(Delta(-1, rest))
        break
      deltas.append(self._delta(self._row, event[0], self._given))
      self._given += 1
    return deltas, self._ended

  def _delta(self, row: RowText | None, token: int, index: int) -> Delta:
    shown = None if row is None else row.push(token)
    if self._top is None:
      return Delta(token, shown)
    logprob, top = unpack_scores(self._group.scores[0][index], self._top)
    return Delta(token, shown, logprob, top)


def row_per_token(group: Group, row: int) -> float | None:
  """A row's time per output token after its own first token (vLLM's TPOT: from that row's
  first token to its end, over its tokens after the first), in seconds; None before it ends.
  Other rows' prompts that run meanwhile count (they share its steps); the time before its
  first token does not."""
  first, end = group.row_first_token_at[row], group.row_end(row)
  if first is None or end is None:
    return None
  return (end - first) / max(len(group.tokens[row]) - 1, 1)


def request_stats(group: Group, row: int) -> dict[str, Any]:
  """Per-request timings in seconds: queue (submit to admission), ttft, per output token
  (`row_per_token`), total."""
  first, end = group.row_first_token_at[row], group.row_end(row)
  admitted = group.admitted_at[row]
  return {
      "queue_s": None if admitted is None else admitted - group.submitted_at,
      "ttft_s": None if first is None else first - group.submitted_at,
      "per_token_s": row_per_token(group, row),
      "total_s": None if end is None else end - group.submitted_at,
      "new_tokens": len(group.tokens[row]),
  }


