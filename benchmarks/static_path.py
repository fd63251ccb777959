"""The static path, the scheduler's baseline in serving_bench.py: a validated request run alone,
batch by batch, through an engine's executable table and KV cache (`Engine.generate` goes
through `cg_jax.core.scheduler` instead).

A request's prompts are cut into runs of at most the largest batch bucket; each run is padded
to its (batch, prompt-length) bucket, prefilled ("prefill", then "first"), and decoded one host
call per token. Steps are launched up to `readback_lag` ahead of the one whose tokens are read
back (asynchronous device-to-host copies), and the next run's inputs are staged while the
current one computes. It writes cache rows from 0, so it runs while the scheduler is idle
(`StaticPath.of(engine)` holds the scheduler's exclusive lock for each request).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from cg_jax import Engine, text, validation
from cg_jax.core import host_io
from cg_jax.core.config import EngineConfig
from cg_jax.core.executables import ExecutableTable
from cg_jax.core.kv_cache import CacheHolder
from cg_jax.core.sampling import SamplingArrays
from cg_jax.generation import GenerationResult, RowText, StreamChunk


@dataclasses.dataclass(frozen=True)
class _Batch:
  """One run of a request, padded to its bucket, inputs already staged on the device."""

  row_start: int
  real: int
  batch: int
  length: int
  tokens: Any
  lengths: Any
  sampling: SamplingArrays | None


class StaticPath:
  """Runs requests on one engine's executables and KV cache, one request at a time (`lock`)."""

  def __init__(self, config: EngineConfig, table: ExecutableTable, cache: CacheHolder,
               weights: list, inputs_at, tokenizer, lock):
    self.config, self.table, self.cache, self.weights = config, table, cache, weights
    self.inputs_at, self.tokenizer, self.lock = inputs_at, tokenizer, lock

  @classmethod
  def of(cls, engine: Engine) -> "StaticPath":
    return cls(engine.config, engine.executables, engine.kv_cache, engine.executables.steps.split.weights,
               engine.input_placement, engine.tokenizer, engine._scheduler.exclusive())

  def generate(self, request: validation.Request) -> GenerationResult:
    tokens: list[list[int]] = [[] for _ in request.rows]
    # Texts are followed token by token only to find stop strings; otherwise decoded once.
    rows = self._row_texts(request) if request.stop else None
    for chunk in self._run(request, rows):
      for row, token in chunk.tokens.items():
        tokens[row].append(token)
    texts = None
    if rows is not None:
      texts = [row.text for row in rows]
    elif self.tokenizer is not None:
      texts = [text.decode(self.tokenizer, t) for t in tokens]
    return GenerationResult(tokens, texts, request.stats)

  def _row_texts(self, request) -> list[RowText] | None:
    if self.tokenizer is None:
      return None
    return [RowText(self.tokenizer, request.stop) for _ in request.rows]

  def _run(self, request: validation.Request, rows: list[RowText] | None
           ) -> Iterator[StreamChunk]:
    """Run a request run by run; one chunk per step. With `rows`, each token is pushed to its
    row's text first and a stopped row emits no more."""
    with self.lock:
      start = time.perf_counter()
      first_token_at = None
      total_tokens = steps = 0
      runs = self.config.buckets.split(len(request.rows))
      batch = self._prepare(request, *runs[0])
      for index in range(len(runs)):
        following = runs[index + 1] if index + 1 < len(runs) else None
        prepare_next = (lambda r=following: self._prepare(request, *r)) if following else None
        chunks = self._run_batch(request, batch, prepare_next, rows)
        while True:
          try:
            chunk = next(chunks)
          except StopIteration as stop:
            batch = stop.value
            break
          if first_token_at is None:
            first_token_at = time.perf_counter()
          total_tokens += len(chunk.tokens)
          steps += 1
          yield chunk
      end = time.perf_counter()
      decode_steps = max(steps - 1, 1)
      request.stats.update(
          ttft_s=first_token_at - start, total_s=end - start, new_tokens=total_tokens,
          per_token_s=(end - first_token_at) / decode_steps,
          tokens_per_s=total_tokens / (end - start),
          greedy=request.settings.greedy, readback_lag=self.config.readback_lag)

  def _prepare(self, request: validation.Request, row_start: int, row_stop: int) -> _Batch:
    """Pad one run of rows to its bucket and stage its inputs on the device (asynchronously)."""
    rows = request.rows[row_start:row_stop]
    settings, real = request.settings, len(rows)
    buckets = self.config.buckets
    batch = buckets.batch_bucket(real)
    length = buckets.length_bucket(max(len(r) for r in rows))
    # Right-padded prompts; padding rows are one token long and finish at once.
    tokens = np.zeros((batch, length), np.int32)
    lengths = np.ones((batch,), np.int32)
    for i, row in enumerate(rows):
      tokens[i, :len(row)] = row
      lengths[i] = len(row)
    sampling = None
    if not settings.greedy:
      sampling = SamplingArrays.host(
          batch, temperature=settings.temperature, top_k=settings.top_k, top_p=settings.top_p,
          seed=settings.seed, rows=np.arange(row_start, row_stop))
    staged = host_io.stage((tokens, lengths, sampling), self.inputs_at)
    return _Batch(row_start, real, batch, length, *staged)

  def _emit(self, step: int, tokens: dict[int, int], rows: list[RowText] | None,
            done: np.ndarray, row_start: int) -> StreamChunk | None:
    """The chunk of a step's tokens {request row: token}, pushing them to the rows' texts and
    marking rows that hit a stop string done (batch rows index `done`)."""
    if rows is not None:
      for row, token in tokens.items():
        rows[row].push(token)
        if rows[row].stopped:
          done[row - row_start] = True
    return StreamChunk(step, tokens) if tokens else None

  def _run_batch(self, request: validation.Request, batch: _Batch, prepare_next,
                 rows: list[RowText] | None) -> Iterator[StreamChunk]:
    """Prefill and decode one staged run; returns the next staged run (or None)."""
    settings, real, row_start = request.settings, batch.real, batch.row_start
    greedy, sampling = settings.greedy, batch.sampling
    weights, table = self.weights, self.table
    eos = np.asarray(settings.eos_ids, np.int32)
    lag = self.config.readback_lag

    logits, cache = table.get(("prefill", batch.batch, batch.length))(
        weights, self.cache.get(), batch.tokens, batch.lengths)
    self.cache.set(cache)
    first = table.get(("first", batch.batch, greedy))(logits, batch.lengths, sampling)
    if host_io.needs_copy(first):
      first.copy_to_host_async()
    following = prepare_next() if prepare_next else None  # overlaps this run's compute
    host_tokens = np.asarray(first)
    budget = np.full((batch.batch,), request.max_new_tokens - 1, np.int32)
    done = np.arange(batch.batch) >= real
    done |= np.isin(host_tokens, eos) | (budget <= 0)
    chunk = self._emit(0, {row_start + i: int(host_tokens[i]) for i in range(real)}, rows, done,
                       row_start)
    yield chunk
    step, calls, reader = 1, 0, host_io.AsyncReader()

    decode = table.get(("decode", batch.batch, greedy))
    tokens, positions = host_tokens, batch.lengths
    while True:
      # Launch step N+1 (up to `lag` steps ahead) before reading step N's tokens.
      while not np.all(done) and calls < request.max_new_tokens - 1 and len(reader) <= lag:
        emitted_tokens, tokens, positions, cache = decode(weights, self.cache.get(), tokens,
                                                          positions, sampling)
        self.cache.set(cache)
        reader.push(emitted_tokens)
        calls += 1
      if not len(reader):
        return following
      host_tokens, _ = reader.pop()
      emitted = {row_start + i: int(host_tokens[i]) for i in range(real) if not done[i]}
      budget = np.where(done, budget, budget - 1)
      done = done | np.isin(host_tokens, eos) | (budget <= 0)
      chunk = self._emit(step, emitted, rows, done, row_start)
      if chunk is not None:
        yield chunk
        step += 1
