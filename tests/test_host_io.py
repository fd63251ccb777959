"""Asynchronous read-back, pinned-host staging and KV-cache swap give exactly the same tokens."""

import types

import jax
import numpy as np
import pytest

from cg_jax import Engine
from cg_jax.core import host_io

OPTIONS = dict(max_seq_len=64, batch_buckets=(1, 2), prompt_buckets=(16,))


@pytest.fixture(scope="module")
def engine():
  return Engine.from_pretrained("tiny-llama", **OPTIONS)


def _prompts(seed=0, sizes=(3, 11, 7)):
  rng = np.random.default_rng(seed)
  return [rng.integers(2, 263, (n,)).tolist() for n in sizes]


@pytest.mark.parametrize("sample", [False, True])
def test_async_readback_equals_synchronous(engine, sample):
  prompts = _prompts()
  kwargs = dict(max_new_tokens=12, do_sample=sample, temperature=0.9, seed=3)
  sync = engine.with_options(readback_lag=0)
  reference = sync.generate(prompts, eos_token_id=[], **kwargs)
  for lag in (1, 3):
    lagged = engine.with_options(readback_lag=lag)
    assert lagged.generate(prompts, eos_token_id=[], **kwargs) == reference
  # EOS seen late by the host still cuts every row at the same token.
  eos = reference[1][4]
  cut = sync.generate(prompts, eos_token_id=eos, **kwargs)
  assert engine.with_options(readback_lag=3).generate(prompts, eos_token_id=eos, **kwargs) == cut


def test_request_inputs_skip_the_pinned_host(engine, monkeypatch):
  """Request inputs reach the executables as host arrays (each call copies its own: a step's
  index arrays packed into one, for the "load" executable), and what is staged ahead (a decode
  batch's sampling arrays) goes straight to device memory."""
  placed = []
  device_put = jax.device_put

  def recording_device_put(tree, sharding, *args, **kwargs):
    out = device_put(tree, sharding, *args, **kwargs)
    placed.append(tuple(leaf.sharding.memory_kind for leaf in jax.tree.leaves(out)))
    return out

  monkeypatch.setattr(host_io.jax, "device_put", recording_device_put)
  sampled = engine.generate(_prompts(1, (4, 5, 6)), max_new_tokens=3, eos_token_id=[],
                            do_sample=True, seed=1)
  # the sampling arrays of a decode batch (temperature, top_k, top_p, seed, row), once
  assert placed and all(kinds == ("device",) * 5 for kinds in placed), placed
  placed.clear()
  greedy = engine.generate(_prompts(1, (4, 5, 6)), max_new_tokens=3, eos_token_id=[])
  assert placed == []  # greedy steps stage nothing ahead
  assert [len(row) for row in sampled] == [len(row) for row in greedy] == [3] * 3


def test_swap_out_and_in_mid_stream_continues_identically(engine):
  prompts = _prompts(2, (5, 9))
  expected = engine.generate(prompts, max_new_tokens=14, eos_token_id=[])
  collected = [[], []]
  stream = engine.stream(prompts, max_new_tokens=14, eos_token_id=[])
  for index, chunk in enumerate(stream):
    for row, token in chunk.tokens.items():
      collected[row].append(token)
    if index == 5:
      engine.swap_out()
      assert engine.kv_cache_memory_kind == "pinned_host"
      assert not engine.kv_cache.on_device  # device copy released
      engine.swap_in()
      assert engine.kv_cache_memory_kind == "device"
  assert collected == list(expected)


def test_swapped_out_engine_serves_next_request(engine):
  prompts = _prompts(3, (6,))
  expected = engine.generate(prompts, max_new_tokens=5, eos_token_id=[])
  engine.swap_out()
  assert engine.kv_cache_memory_kind == "pinned_host"
  assert engine.generate(prompts, max_new_tokens=5, eos_token_id=[]) == expected
  assert engine.kv_cache_memory_kind == "device"


def test_async_reader_order():
  reader = host_io.AsyncReader()
  for value in range(3):
    reader.push(jax.numpy.full((2,), value), tag=value)
  assert [reader.pop()[1] for _ in range(3)] == [0, 1, 2]
  assert len(reader) == 0


def test_bad_readback_lag():
  with pytest.raises(ValueError, match="readback_lag"):
    Engine.from_pretrained("tiny-gpt2", readback_lag=-1)


def test_host_resident_arrays_get_no_async_copy():
  """Outputs already in host memory (or on the CPU) are read in place: no copy_to_host_async,
  whose callback could otherwise fire during interpreter finalization and abort the process."""
  array = jax.numpy.ones((2,))
  pinned = jax.device_put(array, host_io.pinned_host(jax.devices()[0]))
  assert not host_io.needs_copy(pinned)
  assert host_io.needs_copy(array) == (jax.devices()[0].platform != "cpu")
  # The memory-kind rule on a GPU, which the CPU cannot place: only device memory is copied.
  gpu = types.SimpleNamespace(platform="gpu")

  def on_gpu(kind):
    return types.SimpleNamespace(sharding=types.SimpleNamespace(memory_kind=kind,
                                                                device_set=(gpu,)))
  assert host_io.needs_copy(on_gpu("device"))
  assert not host_io.needs_copy(on_gpu("pinned_host"))
  assert not host_io.needs_copy(on_gpu("unpinned_host"))
