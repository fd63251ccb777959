"""Continuous batching: requests from many threads over fewer KV-cache slots get the tokens they
get alone; chunked prefill; cancellation, timeouts, a full queue and close(); no compilation
after warm-up and no thread left behind."""

import asyncio
import gc
import threading
import time

import numpy as np
import pytest

from cg_jax import Engine
from cg_jax.core import compile_stats
from cg_jax.core.executables import SERVING_PHASES
from cg_jax.handles import EngineClosed, QueueFull, RequestTimeout
from tests.helpers import wait_blocks_released

OPTIONS = dict(max_seq_len=64, batch_buckets=(1, 2, 4), prompt_buckets=(8, 16))


def _prompts(seed, count, vocab=263):
  rng = np.random.default_rng(seed)
  return [rng.integers(2, vocab, (int(rng.integers(1, 40)),)).tolist() for _ in range(count)]


def _shared_prefixes(seed, count, vocab=263):
  """Prompts of which about half start with one of three common prefixes (16-34 tokens)."""
  rng = np.random.default_rng(seed)
  bases = [rng.integers(2, vocab, (int(rng.integers(16, 35)),)).tolist() for _ in range(3)]
  prompts = []
  for i, prompt in enumerate(_prompts(seed + 1, count, vocab)):
    if i % 2:
      base = bases[i % 3]
      prompt = (base[:int(rng.integers(8, len(base) + 1))] + prompt)[:int(rng.integers(17, 45))]
    prompts.append(prompt)
  return prompts


@pytest.fixture(scope="module")
def engine():
  engine = Engine.from_pretrained("tiny-llama", **OPTIONS)
  engine.warmup(phases=(*SERVING_PHASES, "logprobs"), progress=False)
  yield engine
  engine.close()


@pytest.fixture(scope="module")
def engine_off(engine):
  """The same weights without the prefix cache."""
  other = engine.with_options(prefix_cache_tokens=0)
  other.warmup(progress=False)
  yield other
  other.close()


def _engine_threads():
  return [t for t in threading.enumerate() if t.name == "cg_jax-engine"]


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_concurrent_requests_equal_their_solo_runs(engine, engine_off, prefix_cache):
  """50 requests of different lengths and budgets (half sharing prefixes), submitted from 8
  threads in random order into 4 slots, with the prefix cache on and off: each one's greedy
  tokens equal the same request alone without the prefix cache, and seeded sampling the same
  seed alone; nothing compiles."""
  prompts = _shared_prefixes(0, 50)
  rng = np.random.default_rng(1)
  budgets = [int(rng.integers(1, 64 - len(p) + 1)) for p in prompts]
  budgets = [min(b, 20) for b in budgets]
  sampled = [bool(i % 3 == 0) for i in range(50)]

  def options(i):
    if sampled[i]:
      return dict(do_sample=True, temperature=0.9, top_k=20, seed=100 + i)
    return {}

  solo = [engine_off.generate([p], max_new_tokens=b, eos_token_id=[], **options(i))[0]
          for i, (p, b) in enumerate(zip(prompts, budgets))]
  served = engine if prefix_cache else engine_off
  hits = served.stats().get("prefix_cache_hits", 0)
  before = compile_stats.compile_count()
  order = rng.permutation(50)
  results = [None] * 50

  def worker(indices):
    handles = [(i, served.submit(prompts[i], budgets[i], eos_token_id=[], **options(i)))
               for i in indices]
    for i, handle in handles:
      results[i] = handle.result(timeout=120).tokens

  threads = [threading.Thread(target=worker, args=(order[k::8],)) for k in range(8)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(timeout=300)
  assert results == solo
  assert compile_stats.compile_count() == before
  stats = served.stats()
  assert stats["running"] == 0 and stats["waiting"] == 0
  assert stats["max_running"] == served.config.step_rows
  assert stats["prefix_cache"] is prefix_cache
  if prefix_cache:
    assert stats["prefix_cache_hits"] - hits >= 3 and stats["prefix_cache_hit_tokens"] > 0


def test_prefix_cache_eviction_keeps_tokens(engine_off):
  """A paged cache of 11 blocks of 8 tokens (one row's table of 8 and 3 for prefixes), cycled
  through by prompts (each twice in a row) of several prefixes: cached blocks are evicted and
  reused, and every request's tokens equal the engine without the cache."""
  small = engine_off.with_options(prefix_cache_tokens=24, prefix_block=8, batch_buckets=(1,))
  prompts = [p + [7] for p in _prompts(11, 12) if len(p) >= 9 for _ in range(2)]
  expected = [engine_off.generate([p], max_new_tokens=5, eos_token_id=[])[0] for p in prompts]
  assert [small.generate([p], max_new_tokens=5, eos_token_id=[])[0] for p in prompts] == expected
  stats = wait_blocks_released(small)
  assert stats["prefix_cache_evictions"] > 0 and stats["prefix_cache_hits"] > 0
  assert stats["kv_blocks"] == 11 and stats["kv_blocks_used"] == 0
  assert stats["kv_blocks_cached"] + stats["kv_blocks_free"] == 11
  small.reset_prefix_cache()
  assert small.stats()["kv_blocks_cached"] == 0
  small.generate([prompts[0]], max_new_tokens=5, eos_token_id=[])
  assert small.stats()["prefix_cache_misses"] == stats["prefix_cache_misses"] + 1
  small.close()


def test_a_generate_list_is_several_requests(engine):
  """A list of prompts in one call is several requests: each row equals itself alone, with
  more rows than slots."""
  prompts = _prompts(2, 7)
  together = engine.generate(prompts, max_new_tokens=6, eos_token_id=[])
  assert list(together) == [engine.generate([p], max_new_tokens=6, eos_token_id=[])[0]
                            for p in prompts]


def test_long_prompts_are_chunked_and_equal_one_chunk():
  """Prompts longer than a step's token budget (8), up to the cache, give the tokens of an
  engine whose step holds the whole prompt."""
  small = Engine.from_pretrained("tiny-llama", max_seq_len=64, batch_buckets=(1, 2),
                                 prompt_buckets=(8,), max_num_batched_tokens=8)
  whole = small.with_options(max_num_batched_tokens=128)
  prompts = [list(range(3, 60)), list(range(100, 121))]
  expected = whole.generate(prompts, max_new_tokens=6, eos_token_id=[])
  assert small.generate(prompts, max_new_tokens=6, eos_token_id=[]) == expected
  assert small.generate([list(range(2, 64))], max_new_tokens=1, eos_token_id=[])[0] == \
      whole.generate([list(range(2, 64))], max_new_tokens=1, eos_token_id=[])[0]
  # 78 prompt tokens in steps of 8, then 62.
  assert small.stats()["prefill_chunks"] == 10 + 8
  small.close()
  whole.close()


def test_first_tokens_are_read_behind_the_next_prompt_chunk():
  """A step that completes a prompt while other prompts' chunks follow is read once the next
  step is launched behind it (the device never waits for the host between chunks); the step
  that ends the prefill is read before anything else is launched. Tokens equal the one-step
  engine's."""
  small = Engine.from_pretrained("tiny-llama", max_seq_len=64, batch_buckets=(1, 2, 4),
                                 prompt_buckets=(8,), max_num_batched_tokens=16)
  whole = small.with_options(max_num_batched_tokens=128)
  scheduler, log = small._scheduler, []
  run_step, read_one = scheduler._run_step, scheduler._read_one

  def launch(plan):
    run_step(plan)
    log.append(("launch", scheduler._steps, bool(plan.done)))

  def read():
    log.append(("read", scheduler._steps - len(scheduler._reader) + 1))
    read_one()

  scheduler._run_step, scheduler._read_one = launch, read
  # 20 + 20 + 20 prompt tokens in steps of at most 16: A completes in step 2, B in 3, C in 4.
  prompts = [list(range(3, 23)), list(range(30, 50)), list(range(60, 80))]
  assert small.generate(prompts, max_new_tokens=4, eos_token_id=[]) == \
      whole.generate(prompts, max_new_tokens=4, eos_token_id=[])
  completing = [step for kind, step, *done in log if kind == "launch" and done[0]]
  assert completing == [2, 3, 4]
  for step in completing:
    read_at = log.index(("read", step))
    next_launch = next(i for i, e in enumerate(log) if e[0] == "launch" and e[1] == step + 1)
    if step < completing[-1]:
      assert next_launch < read_at, log  # read behind the next chunk's step
    else:
      assert read_at < next_launch, log  # the last prefill step: its tokens out at once
  small.close()
  whole.close()


def test_generate_inside_a_suspended_stream(engine):
  """A generate() while the same thread holds a suspended stream, and callers behind a stream
  nobody consumes, get their own tokens at once; the stream's tokens are unchanged."""
  prompt, other = _prompts(3, 2)
  alone = engine.generate([prompt], max_new_tokens=12, eos_token_id=[])[0]
  other_alone = engine.generate([other], max_new_tokens=12, eos_token_id=[])[0]
  stream = engine.stream([prompt], max_new_tokens=12, eos_token_id=[])
  first = [next(stream) for _ in range(3)]
  start = time.perf_counter()
  assert engine.generate([other], max_new_tokens=12, eos_token_id=[])[0] == other_alone
  kept = engine.stream([other], max_new_tokens=12, eos_token_id=[])
  next(kept)  # held, never consumed again
  assert engine.submit(other, 12, eos_token_id=[]).result(timeout=30).tokens == other_alone
  assert time.perf_counter() - start < 30
  rest = list(stream)
  assert [c.tokens[0] for c in first + rest] == alone
  kept.close()


def test_cancel_frees_the_slot(engine):
  prompts = _prompts(4, 6)
  handles = [engine.submit(p, 40 - len(p) // 2, eos_token_id=[]) for p in prompts]
  handles[1].cancel()
  handles[4].cancel()
  expected = engine.generate([prompts[0]], max_new_tokens=40 - len(prompts[0]) // 2,
                             eos_token_id=[])[0]
  assert handles[0].result(timeout=60).tokens == expected
  for i in (1, 4):
    result = handles[i].result(timeout=60)
    assert result.finish_reason == "cancelled"
  # A dropped handle cancels its request.
  engine.submit(prompts[2], 30, eos_token_id=[])
  gc.collect()
  deadline = time.perf_counter() + 30
  while engine.stats()["running"] + engine.stats()["waiting"] and time.perf_counter() < deadline:
    time.sleep(0.01)
  for handle in handles:
    handle.result(timeout=60)
  assert engine.stats()["running"] == 0


def test_timeout_fails_only_that_request(engine):
  slow = engine.submit(list(range(3, 13)), 40, eos_token_id=[], timeout=1e-4)
  ok = engine.submit([5, 6, 7], 5, eos_token_id=[])
  with pytest.raises(RequestTimeout):
    slow.result(timeout=60)
  assert len(ok.result(timeout=60).tokens) == 5


def test_bad_submissions_never_reach_the_queue(engine):
  with pytest.raises(ValueError, match="token ids must be in"):
    engine.submit([1, 999], 4)
  with pytest.raises(ValueError, match="timeout must be None or a number of seconds > 0"):
    engine.submit([1, 2], 4, timeout=0)
  with pytest.raises(TypeError, match="prompt must be a string or a list of token ids"):
    engine.submit(7, 4)
  assert engine.stats()["waiting"] == 0


def test_queue_overflow_is_an_error():
  engine = Engine.from_pretrained("tiny-llama", max_seq_len=64, batch_buckets=(1,),
                                  prompt_buckets=(16,), max_waiting=2)
  with engine:
    handles = []
    with pytest.raises(QueueFull, match="max_waiting=2"):
      for _ in range(50):
        handles.append(engine.submit([3, 4, 5], 40, eos_token_id=[]))
    for handle in handles:
      handle.result(timeout=60)


def test_async_iteration(engine):
  """12 requests streamed concurrently in one event loop get their solo tokens, and no thread
  waits for them (the engine thread wakes the loop)."""
  prompts = _prompts(6, 12)
  expected = [engine.generate([p], max_new_tokens=8, eos_token_id=[])[0] for p in prompts]

  async def collect(prompt):
    return [delta.token async for delta in engine.submit(prompt, 8, eos_token_id=[])]

  async def main():
    threads = threading.active_count()
    results = await asyncio.gather(*(collect(p) for p in prompts))
    return results, threading.active_count() - threads

  results, new_threads = asyncio.run(main())
  assert results == expected
  assert new_threads == 0


def test_close_fails_pending_requests_and_leaves_no_thread():
  before = set(_engine_threads())
  engine = Engine.from_pretrained("tiny-llama", max_seq_len=64, batch_buckets=(1,),
                                  prompt_buckets=(16,))
  handles = [engine.submit([3, 4, 5], 55, eos_token_id=[]) for _ in range(4)]
  assert len(set(_engine_threads()) - before) == 1
  engine.close()
  for handle in handles:
    with pytest.raises(EngineClosed):
      handle.result(timeout=30)
  with pytest.raises(EngineClosed):
    engine.submit([3], 2)
  assert set(_engine_threads()) <= before


def test_prompts_prefilled_together_leave_running_rows_alone():
  """Prompts admitted while others decode, into slots freed and compacted in between (the
  batched first chunk pads to a batch bucket), change no other request's tokens."""
  engine = Engine.from_pretrained("tiny-llama", max_seq_len=64, batch_buckets=(1, 2, 4, 8),
                                  prompt_buckets=(8, 16))
  prompts = _prompts(7, 24)
  budgets = [3 + (i * 7) % 17 for i in range(24)]
  budgets = [min(b, 64 - len(p)) for b, p in zip(budgets, prompts)]
  solo = [engine.generate([p], max_new_tokens=b, eos_token_id=[])[0]
          for p, b in zip(prompts, budgets)]
  handles = []
  for i, (p, b) in enumerate(zip(prompts, budgets)):
    handles.append(engine.submit(p, b, eos_token_id=[]))
    if i % 5 == 4:
      time.sleep(0.02)  # arrivals while others decode
  assert [h.result(timeout=120).tokens for h in handles] == solo
  engine.close()


def _reference_logprobs(engine, prompt, tokens):
  """float64 log-softmax of the engine's cache-free float32 logits at each new token."""
  logits = engine.logits(np.array([list(prompt) + list(tokens)], np.int32))[0].astype(np.float64)
  logits = logits[len(prompt) - 1:len(prompt) - 1 + len(tokens)]
  return logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
      - logits.max(-1, keepdims=True)


@pytest.mark.parametrize("options", [{}, {"do_sample": True, "temperature": 0.8, "seed": 3}])
def test_logprobs_match_the_reference(engine, options):
  """Each new token's log-probability and its top alternatives equal a float64 log-softmax of
  the cache-free logits (greedy and sampled), in a batch with other requests, whose tokens do
  not change; the stream's deltas carry the same values."""
  prompt, other = _prompts(21, 2)
  alone = engine.generate([other], max_new_tokens=9, eos_token_id=[])[0]
  before = compile_stats.compile_count()
  neighbour = engine.submit(other, 9, eos_token_id=[])
  handle = engine.submit(prompt, 9, eos_token_id=[], logprobs=3, **options)
  result = handle.result(timeout=60)
  assert neighbour.result(timeout=60).tokens == alone
  deltas = list(engine.submit(prompt, 9, eos_token_id=[], logprobs=3, **options))
  assert compile_stats.compile_count() == before  # warmed up with the "logprobs" phase
  reference = _reference_logprobs(engine, prompt, result.tokens)
  chosen = reference[np.arange(len(result.tokens)), result.tokens]
  np.testing.assert_allclose(result.logprobs, chosen, atol=2e-4)
  for row, top in zip(reference, result.top_logprobs):
    assert [t for t, _ in top] == list(np.argsort(-row)[:3])
    np.testing.assert_allclose([lp for _, lp in top], np.sort(row)[::-1][:3], atol=2e-4)
  assert [d.token for d in deltas] == result.tokens
  np.testing.assert_allclose([d.logprob for d in deltas], result.logprobs, atol=1e-6)
  assert [d.top_logprobs for d in deltas][0] == result.top_logprobs[0]


@pytest.mark.parametrize("length", [13, 64])  # a prompt bucket's; past the largest: the context
def test_prompt_scores_match_the_reference(engine, length):
  prompt = list(np.random.default_rng(22).integers(2, 263, (length,)))
  scores = engine.score(prompt, top=2)
  reference = _reference_logprobs(engine, prompt[:1], prompt[1:])
  assert len(scores) == len(prompt) - 1
  np.testing.assert_allclose([s[0] for s in scores],
                             reference[np.arange(len(prompt) - 1), prompt[1:]], atol=2e-4)
  assert [[t for t, _ in s[1]] for s in scores] == [list(np.argsort(-r)[:2]) for r in reference]


def test_bad_logprobs_are_refused(engine):
  with pytest.raises(ValueError, match=r"logprobs must be None or an int in \[0, 20\], got 21"):
    engine.submit([3, 4], 2, logprobs=21)
  with pytest.raises(ValueError, match=r"at most 64 tokens \(max_seq_len\), got 65"):
    engine.score(list(range(2, 67)))
