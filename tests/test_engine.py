"""Engine: buckets, ahead-of-time warmup, sampling, streaming, validation."""

import collections
import dataclasses
import math
import os
import pathlib
import re
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cg_jax.profile import identity_tables
from cg_jax import Buckets, Engine, EngineConfig
from cg_jax.core import compile_stats, executables
from cg_jax.core.config import blocks_for_memory, default_token_buckets, on_gpu
from cg_jax.core.executables import SERVING_PHASES, STAND_IN, ExecutableTable
from cg_jax.core.sampling import SamplingArrays, filter_logits, select_tokens
from models import preset
from models.decoder import KVCache

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENGINE_OPTIONS = dict(max_seq_len=64, batch_buckets=(1, 2, 4), prompt_buckets=(8, 16, 32),
                      max_num_batched_tokens=32)


@pytest.fixture(scope="module")
def engine():
  engine = Engine.from_pretrained("tiny-llama", **ENGINE_OPTIONS)
  engine.warmup(phases=SERVING_PHASES, progress=False)
  return engine


def _prompts(seed, sizes, vocab=263):
  rng = np.random.default_rng(seed)
  return [rng.integers(2, vocab, (n,)).tolist() for n in sizes]


# --------------------------------------------------------------------------------------------------
# Buckets


@given(st.integers(1, 64))
@settings(max_examples=50, deadline=None)
def test_bucket_is_smallest_fitting(n):
  buckets = Buckets((1, 2, 4, 8, 16, 32, 64), (16, 32, 64))
  bucket = buckets.batch_bucket(n)
  assert bucket >= n
  assert all(b < n for b in buckets.batch_sizes if b < bucket)


def test_bucket_raises_when_nothing_fits():
  buckets = Buckets.default(128, batch_sizes=(1, 4))
  assert buckets.prompt_lengths == (16, 32, 64, 128)
  assert buckets.length_bucket(17) == 32
  with pytest.raises(ValueError, match="prompt length 129 fits no bucket.*1..128"):
    buckets.length_bucket(129)
  with pytest.raises(ValueError, match="batch size 5"):
    buckets.batch_bucket(5)
  assert buckets.split(9) == [(0, 4), (4, 8), (8, 9)]
  with pytest.raises(ValueError, match="ascending"):
    Buckets((4, 2), (16,))


def test_token_buckets_start_where_padding_tokens_stop_being_free():
  """The Pallas kernel's steps start at 8 tokens (a step's products run on 8 rows anyway); XLA's
  attention attends for every token of a bucket, padding too: its steps start at one."""
  model = preset("tiny-llama")
  xla, pallas = (EngineConfig.create(model, max_seq_len=64, attention=attention,
                                     max_num_batched_tokens=32) for attention in ("xla", "pallas"))
  assert xla.token_buckets == (1, 2, 4, 8, 16, 32)
  assert pallas.token_buckets == (8, 16, 32)
  assert default_token_buckets(100, "pallas") == (8, 16, 32, 64, 100)  # (the budget ends them)
  assert default_token_buckets(4, "pallas") == (4,)


def test_executable_keys_narrow_to_the_steps_a_work_can_use():
  engine = Engine(preset("tiny-llama"), None, dtype="float32", max_seq_len=512,
                  max_num_batched_tokens=64)
  steps = lambda keys: [key[1] for key in keys if key[0] == "step"]  # noqa: E731
  draws = lambda keys: [key[1] for key in keys if key[0] == "draw"]  # noqa: E731
  every = engine.executable_keys()
  assert steps(every) == list(engine.config.token_buckets) == [1, 2, 4, 8, 16, 32, 64]
  narrow = engine.executable_keys(max_step_tokens=7)
  assert steps(narrow) == [1, 2, 4, 8]
  assert draws(narrow) == sorted({engine.config.logit_rows(t) for t in (1, 2, 4, 8)})
  assert steps(engine.executable_keys(max_step_tokens=10_000)) == steps(every)
  greedy = engine.executable_keys(max_step_tokens=8, draws=False)
  assert draws(greedy) == [] and steps(greedy) == [1, 2, 4, 8] and ("load",) in greedy
  with pytest.raises(ValueError, match="max_step_tokens must be an int >= 1 or None, got 0"):
    engine.executable_keys(max_step_tokens=0)


def test_default_gpu_engine_compiles_at_most_16_executables(monkeypatch):
  # The serving executables of the GPU defaults (no compile): up to 256 requests at once.
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  engine = Engine(preset("tiny-llama"), None, dtype="float32", max_seq_len=512)
  assert engine.config.max_num_seqs == 256
  assert engine.config.token_buckets == (8, 16, 32, 64, 128, 256, 512, 1024, 2048)
  keys = engine.executable_keys()
  assert len(keys) <= 16, keys
  # The 64- and 128-token steps share their logits' draw; steps of 64 decode rows and more,
  # and every step with prompt tokens, run their GEMMs on the prefill backend (cuBLAS).
  assert sorted(key[1] for key in keys if key[0] == "draw") == [8, 16, 32, 128, 256]
  assert [key[1] for key in keys if engine.executables.prefills(key)] == [
      64, 128, 256, 512, 1024, 2048]
  # A CPU engine runs 32 at most unless told.
  monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
  assert EngineConfig.create(preset("tiny-llama"), max_seq_len=512).max_num_seqs == 32
  assert EngineConfig.create(preset("tiny-llama"), batch_buckets=(1, 4)).max_num_seqs == 4


def test_default_gpu_cache_is_cut_to_the_memory_share(monkeypatch):
  """A GPU engine's default cache holds a full block table per running request unless that
  (with the weights) passes DEFAULT_MEMORY_SHARE of the device: then it is what the share
  leaves, and requests wait for blocks; given kv_blocks stay."""
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  model = preset("tiny-llama")
  roomy = Engine(model, None, dtype="float32", max_seq_len=512, memory_limit_bytes=1 << 40)
  assert roomy.config.kv_blocks is None
  full = roomy.config.num_blocks
  memory = int(1.15 * 2**30)  # (the activation reserve, 1 GiB, leaves about half the cache)
  cut = Engine(model, None, dtype="float32", max_seq_len=512, memory_limit_bytes=memory)
  share = dataclasses.replace(cut.config, kv_blocks=None, gpu_memory_utilization=0.9)
  assert cut.config.kv_blocks == blocks_for_memory(model, share, jnp.float32, memory) < full
  given = Engine(model, None, dtype="float32", max_seq_len=512, memory_limit_bytes=memory,
                 kv_blocks=100)
  assert given.config.kv_blocks == 100


def test_decode_steps_start_on_stand_ins_then_run_their_own(monkeypatch):
  """With stand-ins on (a GPU's default), the warm-up returns before the decode steps' own
  executables are built; they replace the stand-ins once built, without a compile on the
  request path, and the tokens stay the same (here both compile alike: a CPU)."""
  engine = Engine(preset("tiny-llama"), None, dtype="float32", max_seq_len=64,
                  token_buckets=(2, 8, 64), compilation_cache=False)
  table = engine.executables
  table.stand_ins = True
  release, compile_ = threading.Event(), table._compile

  def gated(key):  # the decode steps' own builds wait for `release`
    if key[0] == "step" and key[-1] != STAND_IN and not table.prefills(key):
      assert release.wait(120)
    return compile_(key)

  monkeypatch.setattr(table, "_compile", gated)
  assert table.stand_in_keys(engine.executable_keys()) == [("step", 2), ("step", 8)]
  engine.warmup(phases=SERVING_PHASES, progress=False)
  assert {("step", 2, STAND_IN), ("step", 8, STAND_IN)} <= set(table.compiled)
  assert ("step", 2) not in table.compiled and not engine.wait_for_final_steps(0.05)
  assert engine.stats()["steps_on_stand_ins"] == 2
  prompts = _prompts(11, [3, 7])
  early = engine.generate(prompts, max_new_tokens=6, eos_token_id=[])
  release.set()
  assert engine.wait_for_final_steps(120)
  assert {("step", 2), ("step", 8)} <= set(table.compiled)
  assert not [key for key in table.compiled if key[-1] == STAND_IN]
  assert engine.generate(prompts, max_new_tokens=6, eos_token_id=[]) == early
  stats = engine.stats()
  assert stats["compiles_since_warmup"] == 0 and stats["final_steps_s"] > 0
  assert stats["steps_on_stand_ins"] == 0
  # On a GPU by default; batch-invariant engines never (a stand-in's GEMMs round otherwise).
  starts = ExecutableTable.starts_on_stand_ins
  model = preset("tiny-llama")
  assert starts(EngineConfig.create(model), "gpu") and not starts(EngineConfig.create(model), "cpu")
  assert not starts(EngineConfig.create(model, batch_invariant=True), "gpu")
  assert not starts(EngineConfig.create(model, prefill_gemm="xla"), "gpu")


def test_token_buckets_option():
  model = preset("tiny-llama")
  given = EngineConfig.create(model, max_seq_len=64, token_buckets=[4, 16, 64])
  assert given.token_buckets == (4, 16, 64) and given.max_num_batched_tokens == 64
  # Rebuilt from its options: the same tree; a default tree's options leave them out.
  assert EngineConfig.create(model, **given.options()) == given
  default = EngineConfig.create(model, max_seq_len=64)
  assert default.options()["token_buckets"] is None
  assert EngineConfig.create(model, **default.options()) == default
  for options, error, match in [
      (dict(token_buckets=[4, 16], max_num_batched_tokens=32), ValueError,
       r"token_buckets must end at max_num_batched_tokens \(32\).*\(4, 16\)"),
      (dict(token_buckets=[16, 4]), ValueError, r"ascending distinct ints >= 1, got \(16, 4\)"),
      (dict(token_buckets=[0, 4]), ValueError, r"ascending distinct ints >= 1, got \(0, 4\)"),
      (dict(token_buckets=[4, 4.0]), ValueError, r"ascending distinct ints >= 1"),
      (dict(token_buckets=[]), ValueError, r"ascending distinct ints >= 1, got \(\)"),
      (dict(token_buckets="16"), TypeError, r"token_buckets must be a sequence of ints, got '16'"),
      (dict(token_buckets=[8], batch_invariant=True), ValueError,
       r"token_buckets=\[8\] has no effect with batch_invariant=True")]:
    with pytest.raises(error, match=match):
      EngineConfig.create(model, max_seq_len=64, **options)


def test_given_token_buckets_are_the_steps(engine):
  # The steps run in the buckets given, and a request's tokens do not depend on them.
  other = engine.with_options(token_buckets=(2, 6, engine.config.max_num_batched_tokens))
  other.warmup(progress=False)  # (no compile on the request path: other tests count them)
  assert [k[1] for k in other.executable_keys() if k[0] == "step"] == list(
      other.config.token_buckets) == list(other.stats()["token_buckets"])
  prompts = _prompts(3, [5, 9, 2])
  assert list(other.generate(prompts, max_new_tokens=6, eos_token_id=[])) == list(
      engine.generate(prompts, max_new_tokens=6, eos_token_id=[]))


def test_large_batch_is_split_into_runs(engine):
  prompts = _prompts(0, [3, 9, 5, 12, 7, 2, 30])  # 7 rows > largest bucket (4)
  together = engine.generate(prompts, max_new_tokens=5, eos_token_id=[])
  alone = [engine.generate([p], max_new_tokens=5, eos_token_id=[])[0] for p in prompts]
  assert list(together) == alone


# --------------------------------------------------------------------------------------------------
# Warmup and compile counting


@pytest.mark.filterwarnings("ignore::cg_jax.validation.IgnoredSamplingWarning")  # greedy rows
def test_no_compiles_after_warmup(engine):
  before = compile_stats.compile_count()
  rng = np.random.default_rng(1)
  for _ in range(50):
    batch = int(rng.integers(1, 7))
    sizes = rng.integers(1, 33, batch)
    max_new = int(rng.integers(1, 64 - sizes.max() + 1))
    sample = bool(rng.integers(0, 2))
    engine.generate(
        _prompts(int(rng.integers(1 << 30)), sizes), max_new_tokens=min(max_new, 6),
        do_sample=sample, temperature=float(rng.uniform(0, 2)), top_k=int(rng.integers(0, 5)),
        top_p=float(rng.uniform(0.1, 1.0)), seed=int(rng.integers(1 << 31)),
        eos_token_id=[int(rng.integers(0, 263))])
  assert compile_stats.compile_count() == before
  assert engine.stats()["compiles_since_warmup"] == 0
  assert engine.stats()["executables"] == len(engine.executable_keys(phases=SERVING_PHASES))


def test_with_options_reuses_the_executables_an_option_does_not_change(engine):
  """Another queue size and readback lag: the new engine compiles nothing and gives the same
  tokens; another prefix-cache size changes the paged cache's block count, so it compiles its
  own executables."""
  before = compile_stats.compile_count()
  other = engine.with_options(max_waiting=7, readback_lag=1)
  other.warmup(phases=SERVING_PHASES, progress=False)
  prompts = _prompts(3, [5, 12])
  assert other.generate(prompts, max_new_tokens=4, eos_token_id=[]) == engine.generate(
      prompts, max_new_tokens=4, eos_token_id=[])
  assert compile_stats.compile_count() == before
  smaller = engine.with_options(prefix_cache_tokens=engine.config.prefix_block * 2)
  assert smaller.config.num_blocks == engine.config.num_blocks - engine.config.prefix_blocks + 2
  other.close()
  smaller.close()


def test_compile_counter_counts(engine):
  before = compile_stats.compile_count()
  jnp.arange(7919).sum().block_until_ready()  # a shape nothing else uses
  assert compile_stats.compile_count() > before


def _slow_builds(table, monkeypatch, seconds=0.3):
  """Count the table's builds per key, each taking at least `seconds`."""
  built = collections.Counter()
  build = table._build

  def slow(key):
    built[key] += 1
    time.sleep(seconds)
    return build(key)

  monkeypatch.setattr(table, "_build", slow)
  return built


def test_a_key_being_warmed_up_is_waited_for_not_built_twice(monkeypatch):
  """`get` of a key a warm-up is building (in its pool) waits for that build; the warm-up
  running beside requests keeps `compiles_since_warmup` at 0 (its compiles are planned), a
  compile on the request path counts."""
  engine = Engine.from_pretrained("tiny-llama", **ENGINE_OPTIONS)
  engine.warmup(phases=SERVING_PHASES, progress=False)
  table = engine.executables
  built = _slow_builds(table, monkeypatch)
  keys = engine.executable_keys(phases=("logprobs",))
  warm = threading.Thread(target=engine.warmup, kwargs=dict(phases=("logprobs",), progress=False,
                                                            workers=len(keys)))
  warm.start()
  deadline = time.monotonic() + 30
  while not built and time.monotonic() < deadline:
    time.sleep(0.01)
  key = keys[-1]
  exe = table.get(key)  # (requested while the warm-up builds it)
  warm.join(60)
  assert table.compiled[key] is exe and all(key in table.compiled for key in keys)
  assert dict(built) == {key: 1 for key in keys if key != ("cache",)}  # (built before)
  scores = engine.score([3, 4, 5, 6])
  assert len(scores) == 3 and engine.stats()["compiles_since_warmup"] == 0
  table.get(("first", 1, True))  # (a key no warm-up built: compiled here, on the caller's path)
  assert engine.stats()["compiles_since_warmup"] == 1
  wall = engine.stats()["warmup_wall_s"]
  engine.warmup_behind(("prefill",), stopping=lambda: False)  # (keeps the warm-up's stats)
  assert ("prefill", 1, 8) in table.compiled
  assert engine.stats()["compiles_since_warmup"] == 1
  assert engine.stats()["warmup_wall_s"] == wall
  engine.close()


def test_a_build_published_between_a_look_and_a_claim_is_not_built_again(monkeypatch):
  """A key that another thread's build publishes after a caller looked at `compiled` and before
  it claimed the key is taken as built, by `compile` and by `get` (the race that built
  ("cache",) twice when a warm-up met the compiles started beside the checkpoint read)."""
  engine = Engine.from_pretrained("tiny-llama", **ENGINE_OPTIONS)
  table = engine.executables
  built = _slow_builds(table, monkeypatch, seconds=0)
  keys = engine.executable_keys(phases=("logprobs",))
  claim, caller = table._claim, threading.get_ident()

  def late(key):  # (the caller's claims come only once another thread has built the key)
    if threading.get_ident() == caller:
      other = threading.Thread(target=table.get, args=(key,))
      other.start()
      other.join(60)
    return claim(key)

  monkeypatch.setattr(table, "_claim", late)
  table.compile(keys[:2], progress=False, workers=1)
  assert table.get(keys[2]) is table.compiled[keys[2]]
  assert dict(built) == {key: 1 for key in keys[:3]} and not table._building
  engine.close()


def test_executables_build_while_the_weights_load(engine, monkeypatch):
  """compile_while_loading: the executables are building before the weights are asked for; the
  warm-up then builds none again, and the tokens are the engine's without it."""
  rng = np.random.default_rng()
  prompts = [rng.integers(0, engine.model_config.vocab_size, n).tolist() for n in (5, 19)]
  expected = engine.generate(prompts, 6, eos_token_id=[])
  built = collections.Counter()
  build = ExecutableTable._build

  def counted(table, key):
    built[key] += 1
    return build(table, key)

  monkeypatch.setattr(ExecutableTable, "_build", counted)
  weights = engine.weights()

  def load(device):
    assert device == jax.devices()[0]  # (not tensor-parallel: read onto the device)
    deadline = time.monotonic() + 60
    while not built and time.monotonic() < deadline:
      time.sleep(0.01)
    assert built, "no executable was building while the weights loaded"
    return weights

  later = Engine(engine.model_config, load, compilation_cache=False,
                 compile_while_loading=SERVING_PHASES, **ENGINE_OPTIONS)
  later.warmup(phases=SERVING_PHASES, progress=False)
  assert built == {key: 1 for key in later.executable_keys(phases=SERVING_PHASES)}
  assert later.stats()["checkpoint_read_s"] > 0
  assert later.generate(prompts, 6, eos_token_id=[]) == expected
  later.close()


def test_compile_behind_leaves_stored_executables_to_the_warmup(engine, monkeypatch, tmp_path):
  fresh = Engine(engine.model_config, engine.weights(), compilation_cache=False, **ENGINE_OPTIONS)
  table = fresh.executables
  keys = fresh.executable_keys(phases=SERVING_PHASES)
  stored, marker = set(keys[::2]), tmp_path / "stored.exe"
  marker.write_bytes(b"")
  monkeypatch.setattr(table, "_stored", lambda key: marker if key in stored else None)
  built = _slow_builds(table, monkeypatch, seconds=0)
  table.compile_behind(keys)
  deadline = time.monotonic() + 60
  while not set(keys) - stored <= set(table.compiled) and time.monotonic() < deadline:
    time.sleep(0.01)
  assert set(built) == set(table.compiled) == set(keys) - stored
  fresh.close()


def test_a_stopped_warmup_leaves_its_unstarted_keys_to_get(monkeypatch):
  engine = Engine.from_pretrained("tiny-llama", **ENGINE_OPTIONS)
  table = engine.executables
  built = _slow_builds(table, monkeypatch, seconds=0.05)
  keys = engine.executable_keys(phases=("logprobs",))

  def stop(done, total):
    if done:
      raise InterruptedError

  with pytest.raises(InterruptedError):
    table.compile(keys, progress=False, workers=1, on_progress=stop)
  missing = [key for key in keys if key not in table.compiled]
  assert not table._building and sum(built.values()) == len(keys) - len(missing) < len(keys)
  assert all(table.get(key) is table.compiled[key] for key in missing)
  assert set(built) == set(keys) and set(built.values()) == {1}
  engine.close()


# --------------------------------------------------------------------------------------------------
# Generation semantics


def test_outputs_the_host_reads_are_in_pinned_host_memory(engine):
  """The tokens a step hands to the host are written to pinned host memory by the executable
  itself (no transfer of their own on the read-back path: results/ttft_host_path_h200.md);
  the carry, the logits and the donated cache stay on the device, and the next step feeds the
  carry's token back."""
  config, table = engine.config, engine.executables
  size = config.token_buckets[0]
  rows = config.rows(size)
  weights = engine.step_weights
  # One request of `size` tokens in the step's first row, the others empty; then its decode row.
  counts = np.zeros((rows,), np.int32)
  counts[0] = size
  starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
  no_feed = np.full((size,), -1, np.int32)
  step, load, layout = table.get(("step", size)), table.get(("load",)), config.step_layout
  carry = np.zeros((config.step_rows,), np.int32)
  with engine._scheduler.exclusive():
    staged = load(np.zeros((layout.size,), np.int32),
                  layout.pack(np.ones((size,), np.int32), no_feed, identity_tables(engine, rows),
                              starts, counts, counts))
    carry, new, logits, cache, staged = step(weights, engine.kv_cache.get(), carry, staged)
    one = (np.arange(rows) == 0).astype(np.int32)
    feed = no_feed.copy()
    feed[0] = 0
    staged = load(staged, layout.pack(np.zeros((size,), np.int32), feed,
                                      identity_tables(engine, rows),
                                      np.concatenate([[0], np.cumsum(one)]).astype(np.int32), one,
                                      one * (size + 1)))
    carry, emitted, _, cache, staged = step(weights, cache, carry, staged)
    lens = layout.split(np.asarray(staged), size)[-1]
    engine.kv_cache.set(cache)
  assert new.sharding.memory_kind == emitted.sharding.memory_kind == "pinned_host"
  assert logits.sharding.memory_kind == carry.sharding.memory_kind == "device"
  assert np.asarray(lens).tolist() == (one * (size + 2)).tolist()  # the next decode step's
  assert cache.k.sharding.memory_kind == "device"
  assert np.asarray(emitted).tolist() == np.asarray(carry).tolist()
  # The same tokens as the host feeding the first step's token itself.
  expected = engine.generate([[1] * size], max_new_tokens=2, eos_token_id=[])[0]
  assert [int(np.asarray(new)[0]), int(np.asarray(emitted)[0])] == expected


def _aliased_inputs(engine, key) -> dict[int, int]:
  """{flat input index: flat output index} of the buffers a key's executable donates and reuses
  for an output (from its lowered module)."""
  text = engine.executables.lower(key).as_text()
  head = next(line for line in text.splitlines() if "func.func public @main" in line)
  inputs = head.split(") -> (")[0].split("%arg")[1:]
  return {int(arg.split(":")[0]): int(found.group(1)) for arg in inputs
          if (found := re.search(r"tf.aliasing_output = (\d+)", arg))}


def test_step_state_keeps_its_device_buffers(engine):
  """The state a step hands to the next (cache, carry, lengths) is donated and aliased to the
  outputs that carry it on, and "load" writes the staged index arrays in place, so no address
  a step's command buffer records moves from one step to the next (moved ones make XLA update
  the recorded commands first)."""
  table = engine.executables
  weights = len(jax.tree.leaves(table.signature(("step", 8))[1][0]))
  for size in engine.config.token_buckets:
    # inputs: weights, cache k and v, carry, staged; outputs: carry, tokens (host), logits,
    # cache k and v, staged (with the next lengths)
    assert _aliased_inputs(engine, ("step", size)) == {
        weights: 3, weights + 1: 4, weights + 2: 0, weights + 3: 5}, size
  assert _aliased_inputs(engine, ("load",)) == {0: 0}
  rows = engine.config.logit_rows(engine.config.token_buckets[0])
  sampling = len(jax.tree.leaves(SamplingArrays.spec(rows)))
  # draw(logits, staged, sampling, carry) -> (carry, tokens): the carry in place
  assert _aliased_inputs(engine, ("draw", rows)) == {2 + sampling: 0}


def test_decode_steps_read_buffers_that_stay_where_they_are(engine):
  """Through `generate`: every step reads the same device buffers (the cache, the staged index
  arrays and lengths, and the carry after the first), as the CUDA graph it runs records them;
  the staged buffer is the one `warmup` primed the steps on."""
  table = engine.executables
  get = table.get
  seen = []

  def recording(key):
    exe = get(key)
    if key[0] != "step":
      return exe

    def call(weights, cache, *state):
      seen.append((key, [x.unsafe_buffer_pointer() if isinstance(x, jax.Array) else None
                         for x in (cache.k, cache.v, *state)]))
      return exe(weights, cache, *state)
    return call

  engine.warmup(progress=False)  # (primes the steps on the scheduler's staged buffer)
  primed = engine._scheduler._staged.unsafe_buffer_pointer()
  table.get = recording
  try:
    engine.generate([list(range(3, 15))], max_new_tokens=12, eos_token_id=[])
  finally:
    del table.get
  # (cache k, cache v, carry, staged): the prompt's step and 11 decode steps
  assert len(seen) == 12 and None not in seen[1][1]
  assert all(where == seen[1][1] for _, where in seen[1:]), seen
  assert [where[:2] + where[3:] for _, where in seen[:1]] == [seen[1][1][:2] + seen[1][1][3:]]
  assert seen[0][1][3] == primed  # the buffer whose addresses warm-up's graphs recorded


def test_priming_between_decode_steps_leaves_the_requests_as_they_were(engine, monkeypatch):
  """`warmup` primes the steps on the staged buffer that running requests' steps read (between
  two engine iterations, as the engine's lock lets it): the next step loads its inputs afresh,
  and the requests go on unchanged."""
  prompts = _prompts(4, (5, 9))
  expected = engine.generate(prompts, max_new_tokens=24, eos_token_id=[])
  scheduler, iterations = engine._scheduler, []
  iterate = scheduler._iteration

  def iteration():
    iterate()
    iterations.append(scheduler._decoding is not None)
    if len(iterations) == 6:  # (the same rows have been decoding for a few steps)
      scheduler.prime(engine.executable_keys())

  monkeypatch.setattr(scheduler, "_iteration", iteration)
  assert engine.generate(prompts, max_new_tokens=24, eos_token_id=[]) == expected
  assert iterations[5]  # primed while a decode step's inputs were staged


def test_priming_runs_the_steps_and_writes_no_block(engine):
  """`warmup` runs steps (and their draws) on empty rows: on a GPU each twice (the second call
  records the CUDA graphs), on the CPU the smallest once (a first call there costs mostly the
  weights' first touch); the blocks of the pool keep their keys and values, and nothing
  compiles."""
  table = engine.executables
  keys = engine.executable_keys()
  ran = collections.Counter()
  get = table.get

  def counting(key):
    ran[key] += 1
    return get(key)

  rng = np.random.default_rng(5)
  with engine._scheduler.exclusive():
    cache = engine.kv_cache.get()
    noise = [rng.standard_normal(x.shape).astype(x.dtype) for x in (cache.k, cache.v)]
    cache = KVCache(*jax.device_put(noise, engine.input_placement))
    compiles = compile_stats.compile_count()
    table.get = counting
    try:
      cache, _ = table.prime(keys, engine.step_weights, cache,
                             np.zeros((engine.config.step_layout.size,), np.int32))
    finally:
      del table.get
    # every block but the scratch one (the last)
    for before, after in zip(noise, (cache.k, cache.v)):
      np.testing.assert_array_equal(np.asarray(after)[:, :-1], before[:, :-1])
    engine.kv_cache.set(cache)
  steps = sorted((key for key in keys if key[0] == "step"), key=lambda key: key[1])
  primed, runs = (steps, 2) if on_gpu() else (steps[:1], 1)
  assert table.priming(keys) == (primed, runs) and len(steps) > 1
  assert {key: ran[key] for key in steps} == {key: runs * (key in primed) for key in steps}
  assert ran[("load",)] == runs * len(primed)  # each step's empty rows, staged
  assert {key for key in ran if key[0] == "draw"} == {
      ("draw", engine.config.logit_rows(key[1])) for key in primed}
  assert compile_stats.compile_count() == compiles


def test_mixed_length_batch_equals_each_prompt_alone(engine):
  prompts = _prompts(2, [1, 17, 6, 32])
  together = engine.generate(prompts, max_new_tokens=12, eos_token_id=[])
  for prompt, row in zip(prompts, together):
    assert engine.generate([prompt], max_new_tokens=12, eos_token_id=[])[0] == row
  assert [len(r) for r in together] == [12] * 4


def test_same_seed_same_samples_and_batch_invariance(engine):
  prompts = _prompts(3, [4, 9])
  kwargs = dict(max_new_tokens=10, do_sample=True, temperature=1.5, seed=1234, eos_token_id=[])
  first = engine.generate(prompts, **kwargs)
  assert engine.generate(prompts, **kwargs) == first
  # Row 0 of a one-row request uses the same key as row 0 of the batch.
  assert engine.generate(prompts[:1], **kwargs)[0] == first[0]
  assert engine.generate(prompts, **{**kwargs, "seed": 99}) != first


def test_top_k_1_and_temperature_0_are_greedy(engine):
  prompts = _prompts(4, [5, 11])
  greedy = engine.generate(prompts, max_new_tokens=8, eos_token_id=[])
  assert engine.generate(prompts, max_new_tokens=8, do_sample=True, top_k=1, temperature=3.0,
                         seed=5, eos_token_id=[]) == greedy
  assert engine.generate(prompts, max_new_tokens=8, do_sample=True, temperature=0.0,
                         eos_token_id=[]) == greedy


def test_top_p_keeps_only_the_nucleus():
  probs = np.array([0.5, 0.3, 0.1, 0.05, 0.03, 0.02])
  draws = 4000
  logits = np.tile(np.log(probs), (draws, 1)).astype(np.float32)
  sampling = SamplingArrays(
      temperature=np.ones(draws, np.float32), top_k=np.zeros(draws, np.int32),
      top_p=np.full(draws, 0.75, np.float32), seed=np.full(draws, 7, np.uint32),
      row=np.arange(draws, dtype=np.int32))
  tokens = np.asarray(select_tokens(jnp.asarray(logits), jnp.zeros(draws, jnp.int32), sampling))
  assert set(np.unique(tokens)) == {0, 1}
  share = np.mean(tokens == 0)
  expected = 0.5 / 0.8
  assert abs(share - expected) < 4 * math.sqrt(expected * (1 - expected) / draws)


def test_filter_logits_top_k_and_top_p_combined():
  logits = jnp.log(jnp.array([[0.1, 0.4, 0.2, 0.3]]))
  kept = np.isfinite(np.asarray(filter_logits(logits, jnp.ones(1), jnp.array([3]), jnp.array([0.6]))))
  np.testing.assert_array_equal(kept, [[False, True, False, True]])
  kept = np.isfinite(np.asarray(filter_logits(logits, jnp.ones(1), jnp.array([0]), jnp.array([1.0]))))
  assert kept.all()


def test_eos_stops_each_row(engine):
  prompts = _prompts(5, [3, 8, 13])
  free = engine.generate(prompts, max_new_tokens=10, eos_token_id=[])
  eos = free[1][3]  # the 4th token of row 1 becomes the EOS id
  stopped = engine.generate(prompts, max_new_tokens=10, eos_token_id=[eos, 262])
  for row_free, row in zip(free, stopped):
    cut = row_free.index(eos) + 1 if eos in row_free else len(row_free)
    assert row == row_free[:cut]
  assert stopped[1][-1] == eos and len(stopped[1]) <= 4


def test_stream_yields_the_generated_tokens(engine):
  prompts = _prompts(6, [7, 2])
  expected = engine.generate(prompts, max_new_tokens=9, eos_token_id=[])
  collected = [[], []]
  steps = []
  for chunk in engine.stream(prompts, max_new_tokens=9, eos_token_id=[]):
    steps.append(chunk.step)
    for row, token in chunk.tokens.items():
      collected[row].append(token)
  assert collected == list(expected)
  # One chunk per engine step that gave the call tokens (rows start when their own prompts
  # are in).
  assert steps == list(range(len(steps)))
  assert len(steps) >= 9


def test_stats_are_reported(engine):
  result = engine.generate(_prompts(7, [5]), max_new_tokens=6, eos_token_id=[])
  for key in ("ttft_s", "per_token_s", "tokens_per_s"):
    assert result.stats[key] > 0
  assert result.stats["new_tokens"] == 6
  assert result.stats["ttft_s_rows"] == [result.stats["ttft_s"]] == [result.stats["ttft_s_last"]]


def test_every_row_has_its_time_to_first_token(engine):
  # Steps of 32 tokens: the 40-token prompt is prefilled in two (9 tokens beside the short
  # prompts, then 31): its first token comes a step after theirs.
  result = engine.generate(_prompts(8, [3, 20, 40]), max_new_tokens=5, eos_token_id=[])
  stats = result.stats
  rows = stats["ttft_s_rows"]
  assert len(rows) == 3
  assert min(rows) == stats["ttft_s"] and stats["ttft_s_last"] == max(rows)
  assert all(stats["ttft_s"] <= t <= stats["total_s"] for t in rows)
  assert rows[2] > stats["ttft_s"] == rows[0] == rows[1]
  # Per token from each row's own first token (the late row's wait is not in it), then the
  # median over rows.
  per_token = stats["per_token_s_rows"]
  assert len(per_token) == 3 and all(t > 0 for t in per_token)
  assert per_token[2] * 4 <= stats["total_s"] - rows[2] + 1e-9
  assert stats["per_token_s"] == sorted(per_token)[1]


# --------------------------------------------------------------------------------------------------
# Validation: host-side errors, and the engine is unchanged afterwards


BAD_REQUESTS = [
    (dict(inputs=[]), ValueError, "input_ids is empty"),
    (dict(inputs=[[1, 2], []]), ValueError, r"input_ids\[1\] is empty"),
    (dict(inputs=[[1, -1]]), ValueError, r"input_ids\[0\]\[1\] = -1 is out of range.*\[0, 262\]"),
    (dict(inputs=[[1, 263]]), ValueError, r"= 263 is out of range"),
    (dict(inputs=[[1, 2.0]]), TypeError, r"input_ids\[0\]\[1\] must be an int"),
    (dict(inputs=[[True, 2]]), TypeError, "must be an int"),
    (dict(inputs=[[1, 2, np.bool_(True)]]), TypeError, r"input_ids\[0\]\[2\] must be an int"),
    (dict(inputs=[[1, 2**70]]), ValueError, r"input_ids\[0\]\[1\] = 1180591620717411303424 is out"),
    (dict(inputs=np.zeros((2, 3), np.float32)), TypeError, "must hold integers"),
    (dict(inputs=[1, 2, 3]), ValueError, "rank 2"),
    (dict(inputs=np.zeros((1, 2, 3), np.int32)), ValueError, "rank 2"),
    (dict(inputs=[[1] * 30], max_new_tokens=35), ValueError, "exceeds the context of 64.*1..34"),
    (dict(max_new_tokens=0), ValueError, "max_new_tokens must be >= 1, got 0"),
    (dict(max_new_tokens=2.5), TypeError, "max_new_tokens must be an int"),
    (dict(do_sample=True, temperature=-0.1), ValueError, "temperature must be a finite number >= 0"),
    (dict(do_sample=True, temperature=float("nan")), ValueError, "temperature"),
    (dict(do_sample=True, temperature=float("inf")), ValueError, "temperature"),
    (dict(do_sample=True, top_p=0.0), ValueError, r"top_p must be in \(0, 1\]"),
    (dict(do_sample=True, top_p=1.5), ValueError, "top_p"),
    (dict(do_sample=True, top_k=-1), ValueError, "top_k must be >= 0"),
    (dict(do_sample=True, top_k=2.0), TypeError, "top_k must be an int"),
    (dict(seed=-3), ValueError, "seed must be None or an int"),
    (dict(eos_token_id=400), ValueError, "eos_token_id 400 is out of range"),
    (dict(inputs="hello"), TypeError, "text prompts need a tokenizer"),
]


@pytest.mark.parametrize("overrides, error, match", BAD_REQUESTS)
def test_bad_requests_are_rejected_and_engine_unchanged(engine, overrides, error, match):
  good = _prompts(8, [6, 3])
  expected = engine.generate(good, max_new_tokens=7, eos_token_id=[])
  request = dict(inputs=good, max_new_tokens=7)
  request.update(overrides)
  before = compile_stats.compile_count()
  with pytest.raises(error, match=match):
    engine.generate(**request)
  with pytest.raises(error, match=match):
    engine.stream(**request)  # raised at call time, not on first iteration
  assert compile_stats.compile_count() == before
  assert engine.generate(good, max_new_tokens=7, eos_token_id=[]) == expected


def test_unknown_keyword_is_named(engine):
  with pytest.raises(TypeError, match="temprature"):
    engine.generate([[1, 2]], max_new_tokens=2, temprature=0.5)


def test_abandoned_stream_leaves_engine_usable(engine):
  prompts = _prompts(9, [5])
  expected = engine.generate(prompts, max_new_tokens=6, eos_token_id=[])
  stream = engine.stream(prompts, max_new_tokens=20, eos_token_id=[])
  next(stream)
  next(stream)
  stream.close()
  assert engine.generate(prompts, max_new_tokens=6, eos_token_id=[]) == expected


def test_kv_cache_too_large_fails_at_construction():
  with pytest.raises(ValueError, match=r"KV cache for max_num_seqs 32 x max_seq_len 131072 \(and "
                                       r"a prefix cache of 524288 tokens\) needs \d+ bytes.*"
                                       r"lower max_seq_len, max_num_seqs or prefix_cache_tokens"):
    Engine(preset("llama-3.1-8b"), max_num_seqs=32, max_seq_len=131072, dtype="bfloat16",
           prompt_buckets=(16,))
  with pytest.raises(ValueError, match="needs"):
    Engine(preset("tiny-llama"), memory_limit_bytes=1000)


GIB = 2**30


def _block_bytes(config, block: int, itemsize: int = 4) -> int:
  """One KV block's keys and values over every layer."""
  return 2 * config.num_layers * block * config.num_kv_heads * config.head_dim * itemsize


def test_kv_blocks_fill_the_memory_share_left_by_weights_and_activations():
  """Blocks sized from a 2 GiB device: gpu_memory_utilization of it, less the weights and the
  1 GiB activation floor, in whole blocks (one of them the scratch block)."""
  config = preset("tiny-llama")
  weights = config.num_parameters() * 4
  for utilization in (0.9, 0.6):
    engine = Engine(config, memory_limit_bytes=2 * GIB, gpu_memory_utilization=utilization,
                    max_seq_len=128, batch_buckets=(1, 2), prompt_buckets=(16,))
    free = int(utilization * 2 * GIB) - weights - GIB
    want = free // _block_bytes(config, engine.config.prefix_block) - 1
    assert engine.stats()["kv_blocks"] == engine.config.num_blocks == want
    assert want > 2 * engine.config.table_width + engine.config.prefix_blocks  # above the default
    # Another engine over the same weights sizes its blocks from the same memory (here given,
    # nothing in use), so it shares the executables compiled for that cache.
    other = engine.with_options(readback_lag=0)
    assert other.config.num_blocks == want and other.executables.compiled is \
        engine.executables.compiled
    other.close()
    engine.close()
  # Without gpu_memory_utilization the memory size only checks: the blocks are the rows' tables
  # and the prefix cache's.
  default = Engine(config, memory_limit_bytes=2 * GIB, max_seq_len=128, batch_buckets=(1, 2),
                   prompt_buckets=(16,)).config
  assert default.num_blocks == 2 * default.table_width + default.prefix_blocks
  # What another engine holds is not free: asking for more than the rest is an error.
  engine_config = EngineConfig.create(config, max_seq_len=128, batch_buckets=(1, 2),
                                      prompt_buckets=(16,), gpu_memory_utilization=0.5)
  assert blocks_for_memory(config, engine_config, "float32", 4 * GIB, 2 * GIB) == \
      (2 * GIB - weights - GIB) // _block_bytes(config, engine_config.prefix_block) - 1
  with pytest.raises(ValueError, match=r"gpu_memory_utilization=0.5 asks for 2.00 GiB of the "
                                       r"device's 4.00 GiB, but only 1.50 GiB are free"):
    blocks_for_memory(config, engine_config, "float32", 4 * GIB, 2.5 * GIB)


def test_kv_blocks_given_and_their_errors():
  config = preset("tiny-llama")
  engine = Engine(config, kv_blocks=9, max_seq_len=128, batch_buckets=(1, 2),
                  prompt_buckets=(16,))
  assert engine.stats()["kv_blocks"] == 9 and engine.config.table_width == 8
  [tokens] = engine.generate([[1, 2, 3]], 4, eos_token_id=[])
  assert len(tokens) == 4
  engine.close()
  cases = [
      (dict(kv_blocks=7), r"kv_blocks must be None or an int >= 8 \(one sequence of max_seq_len "
                          r"128 in blocks of 16\), got 7"),
      (dict(kv_blocks=9, gpu_memory_utilization=0.5),
       r"gpu_memory_utilization=0.5 has no effect with kv_blocks=9"),
      (dict(gpu_memory_utilization=0.5), r"gpu_memory_utilization=0.5 has no effect on a cpu "
                                         r"device that reports no memory size"),
      (dict(gpu_memory_utilization=1.5, memory_limit_bytes=GIB),
       r"gpu_memory_utilization must be None or a number in \(0, 1\], got 1.5"),
      (dict(memory_limit_bytes=GIB, gpu_memory_utilization=0.9),
       r"needs at least 8 blocks .*gpu_memory_utilization=0.9 of 1.00 GiB .*raise "
       r"gpu_memory_utilization"),
  ]
  for options, match in cases:
    with pytest.raises(ValueError, match=match):
      Engine(config, max_seq_len=128, batch_buckets=(1, 2), prompt_buckets=(16,), **options)


@pytest.mark.parametrize("options, match", [
    (dict(max_seq_len=10_000), "max_seq_len must be an int in"),
    (dict(attention="flash"), "attention must be one of"),
    (dict(prompt_buckets=(16, 64), max_seq_len=64), "must be < max_seq_len"),
    (dict(batch_buckets=()), "batch_sizes must be a non-empty"),
    (dict(prefill_gemm="triton"), r"prefill_gemm must be one of \('xla', 'cublas'\), got 'triton'"),
    (dict(dtype="int8"), "dtype must be one of"),
    (dict(min_matmul_rows=0), r"min_matmul_rows must be an int in \[1, 64\], got 0"),
    (dict(min_matmul_rows=2.0), "min_matmul_rows must be an int"),
    (dict(readback_lag=9), r"readback_lag must be an int in \[0, 8\], got 9"),
    (dict(graphs="all"), r"graphs must be one of \('off', 'xla-default', 'full'\), got 'all'"),
    (dict(max_num_batched_tokens=0),
     r"max_num_batched_tokens must be an int in \[1, 65536\], got 0"),
    (dict(max_num_batched_tokens=512, batch_invariant=True),
     r"max_num_batched_tokens must equal the prompt bucket \(256\), got 512"),
    (dict(max_num_seqs=0), r"max_num_seqs must be an int in \[1, 4096\], got 0"),
    (dict(max_num_seqs=8.0), r"max_num_seqs must be an int in \[1, 4096\], got 8.0"),
    (dict(max_num_seqs=4, batch_buckets=(1, 8)),
     r"the largest batch bucket \(8\) must be <= max_num_seqs \(4\)"),
])
def test_bad_engine_options(options, match):
  with pytest.raises(ValueError, match=match):
    Engine(preset("tiny-gpt2"), **options)


def test_padded_matmul_rows_give_the_same_tokens(engine):
  """min_matmul_rows pads the decode step's rows without changing a token: unpadded (1)
  against the default (8) and 16."""
  prompts = [[3, 1, 4, 1, 5], [9, 2, 6]]
  assert engine.stats()["min_matmul_rows"] == 8
  expected = engine.with_options(min_matmul_rows=1).generate(prompts, max_new_tokens=12,
                                                             eos_token_id=[])
  assert engine.generate(prompts, max_new_tokens=12, eos_token_id=[]) == expected
  padded = engine.with_options(min_matmul_rows=16)
  assert padded.stats()["min_matmul_rows"] == 16
  assert padded.generate(prompts, max_new_tokens=12, eos_token_id=[]) == expected


def test_max_num_seqs_sizes_the_running_requests_and_their_cache():
  model = preset("tiny-gpt2")
  default = EngineConfig.create(model, max_seq_len=64)
  assert default.max_num_seqs == default.step_rows == 32 == default.buckets.max_batch
  wide = EngineConfig.create(model, max_seq_len=64, max_num_seqs=256)
  assert wide.step_rows == 256 and wide.buckets.batch_sizes == (1, 2, 4, 8, 16, 32)
  assert wide.num_blocks == 256 * wide.table_width + wide.prefix_blocks
  assert wide.options()["max_num_seqs"] == 256
  narrow = EngineConfig.create(model, max_seq_len=64, max_num_seqs=3)
  assert narrow.step_rows == 3 and narrow.buckets.batch_sizes == (1, 2)
  assert EngineConfig.create(model, max_seq_len=64, max_num_seqs=1).buckets.batch_sizes == (1,)
  # The largest batch bucket when max_num_seqs is not given (as before the option existed).
  assert EngineConfig.create(model, max_seq_len=64, batch_buckets=(1, 64)).step_rows == 64


def test_max_num_seqs_bounds_the_requests_that_run_together():
  # Four requests of 6 tokens: in one wave of steps with room for four, in two waves with room
  # for two (the last two start when the first two have finished); the same tokens either way.
  prompts = [[3, 1, 4, 1, 5], [9, 2, 6], [5, 3, 5], [8, 9, 7, 9]]
  steps, made = {}, {}
  for seqs in (4, 2):
    engine = Engine(preset("tiny-gpt2"), max_seq_len=64, max_num_seqs=seqs, prompt_buckets=(16,))
    before = engine.stats()["steps"]
    made[seqs] = engine.generate(prompts, max_new_tokens=6, eos_token_id=[])
    steps[seqs] = engine.stats()["steps"] - before
    assert engine.stats()["max_running"] == seqs
    engine.close()
  assert made[2] == made[4]
  assert steps[4] == 6 and steps[2] == 12


@pytest.mark.parametrize("options, match", [
    (dict(linear="pallas"), r"Engine\(\) got unexpected keyword argument\(s\): 'linear'"),
    (dict(max_model_len=64), r"'max_model_len' \(use max_seq_len\)"),
    (dict(torch_dtype="bfloat16"), r"'torch_dtype' \(use dtype\)"),
    (dict(decode_loop_steps=4), r"'decode_loop_steps' \(removed with the device loop"),
    (dict(cache_write="fused"), r"'cache_write' \(removed with the slot-cache decode kernel"),
    (dict(decode_attention=None), r"'decode_attention' \(removed with the slot-cache decode"),
])
def test_unknown_engine_options_are_named(options, match):
  with pytest.raises(TypeError, match=match):
    Engine(preset("tiny-gpt2"), **options)


def test_stored_executables_load_and_a_bad_file_is_compiled_again(engine, tmp_path):
  """An executable stored by one table loads in another of the same build (and runs the same);
  an unreadable file is compiled again with a warning; another configuration stores apart."""
  def table(config=engine.config):
    return ExecutableTable(engine.model_config, config, engine.executables.steps, engine.dtype,
                           None, store=tmp_path)

  first, second = table(), table()
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(1, engine.model_config.vocab_size)).astype(np.float32)
  token = np.zeros((engine.config.step_rows,), np.int32)  # a step's carry: row 0 is scored
  token[0] = 3
  key = ("token_logprobs", 1)
  scored = first.get(key)(logits, token)
  assert first.loaded == 0 and len(list((tmp_path / "executables").iterdir())) == 1
  again = second.get(key)(logits, token)
  assert second.loaded == 1
  np.testing.assert_array_equal(np.asarray(again), np.asarray(scored))
  for path in (tmp_path / "executables").iterdir():
    path.write_bytes(b"not an executable")
  with pytest.warns(UserWarning, match="could not load the stored executable"):
    third = table()
    third.get(key)
  assert third.loaded == 0
  other = table(dataclasses.replace(engine.config, readback_lag=1))
  other.get(key)
  assert other.loaded == 0 and len(list((tmp_path / "executables").iterdir())) == 2


def test_a_kernel_change_is_a_new_build(monkeypatch):
  """The stored executables' digest reads the kernels' source too: an upgrade that changes
  only a Pallas kernel must not load the executables compiled with the old one."""
  before = executables._build_digest(None, None, jnp.bfloat16)
  read = pathlib.Path.read_bytes
  monkeypatch.setattr(pathlib.Path, "read_bytes", lambda path: read(path) + (
      b"# changed" if path.name == "ragged_paged_attention.py" else b""))
  assert executables._build_digest(None, None, jnp.bfloat16) != before


_NEW_BUILD = """
import sys
from cg_jax import Engine
from cg_jax.core import compile_stats, executables
if sys.argv[1] == "new":  # another build of cg_jax (an upgrade): another digest
  digest = executables._build_digest
  executables._build_digest = lambda *args: digest(*args)[::-1]
engine = Engine.from_pretrained("tiny-llama", max_seq_len=64, batch_buckets=(1, 2),
                                prompt_buckets=(8, 16), max_num_batched_tokens=16)
hits = compile_stats.cache_hit_count()
engine.executables.get(("token_logprobs", 1))
print(engine.executables.loaded, compile_stats.cache_hit_count() - hits, flush=True)
"""


def test_a_new_build_compiles_and_stores_its_executables_once(tmp_path):
  """With the persistent compilation cache on: a second start of one build loads its stored
  executable; a new build's first start neither loads it nor takes the old build's from XLA's
  cache (it would not be stored, and every later start would fetch it again): it compiles and
  stores it, and its second start loads it."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", CG_JAX_COMPILATION_CACHE=str(tmp_path))

  def start(build):
    out = subprocess.run([sys.executable, "-c", _NEW_BUILD, build], capture_output=True,
                         text=True, env=env, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    return tuple(map(int, out.stdout.split()))

  # (executables loaded from the store, persistent-cache hits)
  assert [start("old"), start("old"), start("new"), start("new")] == [
      (0, 0), (1, 0), (0, 0), (1, 0)]
  assert len(list((tmp_path / "executables").iterdir())) == 2


def test_prefill_gemm_default_is_cublas_unautotuned():
  for name in ("llama-3.2-1b", "gpt2"):
    config = EngineConfig.create(preset(name))
    assert config.prefill_gemm == "cublas"
    assert config.prefill_xla_options["xla_gpu_autotune_level"] == 0
    assert "xla_gpu_autotune_level" not in config.xla_options  # (the decode steps autotune)
  assert EngineConfig.create(preset("gpt2"), prefill_gemm="xla").prefill_gemm == "xla"


def test_prompt_executables_compile_with_the_prefill_gemm_options(monkeypatch):
  """Steps of more tokens than rows carry prompt chunks: the prefill GEMM options; steps of at
  most a token per row are decode steps: the engine's own."""
  engine = Engine(preset("tiny-llama"), max_seq_len=64, batch_buckets=(1, 8), prompt_buckets=(16,),
                  prefill_gemm="cublas", compilation_cache=False)
  seen = {}
  lower = engine.executables.lower

  class Recording:
    def __init__(self, key):
      self.key, self.lowered = key, lower(key)

    def compile(self, compiler_options):
      seen[self.key] = compiler_options
      return self.lowered.compile(compiler_options=compiler_options)

  monkeypatch.setattr(engine.executables, "lower", Recording)
  prompt = list(range(3, 15))  # 12 tokens: the 16-token step, then decode steps of one token
  tokens = engine.generate([prompt], max_new_tokens=3, eos_token_id=[])
  decode = ("step", engine.config.token_buckets[0])
  assert seen[("step", 16)]["xla_gpu_enable_triton_gemm"] is False
  assert "xla_gpu_enable_triton_gemm" not in seen[decode]
  assert seen[decode] == engine.config.xla_options
  reference = Engine(preset("tiny-llama"), max_seq_len=64, batch_buckets=(1, 8),
                     prompt_buckets=(16,), prefill_gemm="xla", compilation_cache=False)
  assert reference.generate([prompt], max_new_tokens=3, eos_token_id=[]) == tokens


def test_static_prefill_gives_generates_first_tokens(engine):
  """The static path's executables ("prefill", "first": benchmarks' baseline) give the first
  tokens that `generate` gives. (Last in the file: it compiles after the warm-up.)"""
  prompts = _prompts(5, [3, 11])
  tokens = np.zeros((2, 16), np.int32)
  for row, prompt in enumerate(prompts):
    tokens[row, :len(prompt)] = prompt
  lengths = np.array([len(p) for p in prompts], np.int32)
  cache = engine.kv_cache
  with engine._scheduler.exclusive():
    logits, new_cache = engine.executables.get(("prefill", 2, 16))(
        engine.step_weights, cache.get(), tokens, lengths,
        identity_tables(engine, 2))
    cache.set(new_cache)
    first = np.asarray(engine.executables.get(("first", 2, True))(logits, lengths, None))
  expected = engine.generate(prompts, max_new_tokens=1, eos_token_id=[])
  assert first.tolist() == [row[0] for row in expected]
