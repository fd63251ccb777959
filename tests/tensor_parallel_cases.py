"""The tensor-parallel engine against the single-device engine on N host CPU devices.

Run by tests/test_tensor_parallel.py in a subprocess (the device count is fixed when JAX starts):
  python tests/tensor_parallel_cases.py N
Exits non-zero with the failing check's message.
"""

from __future__ import annotations

import dataclasses
import os
import sys

DEVICES = int(sys.argv[1]) if len(sys.argv) > 1 else 2
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + f" --xla_force_host_platform_device_count={DEVICES}")
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["CG_JAX_COMPILATION_CACHE"] = "off"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from cg_jax import Engine, profile  # noqa: E402
from cg_jax.core.sharding import AXIS  # noqa: E402
from models.config import PRESETS  # noqa: E402
from models.decoder import init_cache  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

# GPT-2 (4 heads, LayerNorm, biases, plain MLP) and a GQA Llama with a gated MLP whose 4 KV
# heads split over 4 devices.
CONFIGS = {
    "tiny-gpt2": PRESETS["tiny-gpt2"],
    "gqa-llama": dataclasses.replace(PRESETS["tiny-llama"], num_heads=8, num_kv_heads=4,
                                     intermediate_size=96),
}
PROMPTS = [[3, 1, 4, 1, 5, 9, 2], [6, 5, 3], [5, 8, 9, 7, 9, 3, 2, 3, 8]]


def relative_error(out, reference) -> float:
  out, reference = np.asarray(out, np.float64), np.asarray(reference, np.float64)
  return float(np.max(np.abs(out - reference)) / np.max(np.abs(reference)))


def split_by_kv_head(array) -> bool:
  """Split over every device along the KV-head axis of [L, B, T, K, H]."""
  return (len(array.sharding.device_set) == DEVICES
          and array.sharding.is_equivalent_to(
              jax.sharding.NamedSharding(array.sharding.mesh,
                                         jax.sharding.PartitionSpec(None, None, None, AXIS)),
              array.ndim))


def check(condition: bool, message: str) -> None:
  if not condition:
    raise AssertionError(message)


def check_engine(name, config):
  options = dict(dtype="float32", batch_buckets=(1, 2, 4), prompt_buckets=(16,), max_seq_len=48,
                 seed=7)
  single = Engine(config, None, **options)
  parallel = single.with_options(tensor_parallel=DEVICES)
  check(parallel.stats()["tensor_parallel"] == DEVICES, "stats report tensor_parallel")

  # Placements: split weights and a cache split by KV head, over all devices.
  qkv = next(w for w in parallel.step_weights if w.ndim == 3
             and w.shape[-1] == config.qkv_width)
  check(len(qkv.sharding.device_set) == DEVICES, f"{name}: qkv on {qkv.sharding.device_set}")
  check(qkv.sharding.spec == jax.sharding.PartitionSpec(None, None, AXIS), f"{name}: qkv spec")
  # Round trip: the engine's canonical weights are the single engine's.
  for kind, value in single.weights().items():
    np.testing.assert_array_equal(np.asarray(parallel.weights()[kind]), np.asarray(value),
                                  err_msg=f"{name}: weights() round trip of {kind}")

  # Back to one device from the split engine.
  again = parallel.with_options(tensor_parallel=1)
  check(all(len(w.sharding.device_set) == 1 for w in again.step_weights),
        f"{name}: with_options(tensor_parallel=1) left weights split")

  # Full-forward logits.
  ids = np.asarray([p[:3] for p in PROMPTS])
  error = relative_error(parallel.logits(ids), single.logits(ids))
  check(error <= 1e-5, f"{name}: full-forward logits differ by {error:.2e} relative")

  # Prefill + decode logits through the model with the split engine's attention and weights.
  tokens = jnp.asarray([[3, 1, 4, 0], [2, 7, 1, 8]], jnp.int32)
  lengths = jnp.asarray([3, 4], jnp.int32)

  def run(engine):
    steps = engine.executables.steps
    cache = init_cache(config, 2, 16, jnp.float32)
    if engine is parallel:
      cache = jax.device_put(cache, parallel.kv_cache.get().k.sharding)
    model = steps.split.merge(engine.step_weights)
    options = dict(attention=steps.attention, shards=steps.shards)
    prefill = jax.jit(lambda t, n, c: model.prefill(t, n, c, **options))
    decode = jax.jit(lambda t, p, c: model.decode(t, p, c, **options))
    logits, cache = prefill(tokens, lengths, cache)
    outs = [logits]
    step_tokens, positions = jnp.asarray([5, 6], jnp.int32), lengths
    for _ in range(4):
      logits, cache = decode(step_tokens, positions, cache)
      outs.append(logits)
      step_tokens, positions = jnp.argmax(logits, -1).astype(jnp.int32), positions + 1
    return outs, cache

  reference, reference_cache = run(single)
  sharded, sharded_cache = run(parallel)
  for step, (got, want) in enumerate(zip(sharded, reference)):
    error = relative_error(got, want)
    check(error <= 1e-5, f"{name}: step {step} logits differ by {error:.2e} relative")
  check(split_by_kv_head(sharded_cache.k),
        f"{name}: decode returned the cache as {sharded_cache.k.sharding}")
  error = relative_error(sharded_cache.k, reference_cache.k)
  check(error <= 1e-5, f"{name}: cache keys differ by {error:.2e}")

  # Greedy tokens: generate, streaming, unrolled layers.
  expected = single.generate(PROMPTS, max_new_tokens=10, eos_token_id=[])
  check(parallel.generate(PROMPTS, max_new_tokens=10, eos_token_id=[]) == expected,
        f"{name}: greedy tokens differ")
  streamed = [[] for _ in PROMPTS]
  for chunk in parallel.stream(PROMPTS, max_new_tokens=10, eos_token_id=[]):
    for row, token in chunk.tokens.items():
      streamed[row].append(token)
  check(streamed == [list(row) for row in expected], f"{name}: streamed tokens differ")
  unrolled = parallel.with_options(layer_loop="unroll")
  check(unrolled.generate(PROMPTS, max_new_tokens=10, eos_token_id=[]) == expected,
        f"{name}: greedy tokens differ (unrolled layers)")
  check(split_by_kv_head(parallel.kv_cache.get().k), f"{name}: engine cache placement")

  # Swap out mid-stream and back in: the same continuation; the cache returns split.
  stream = parallel.stream(PROMPTS[:1], max_new_tokens=10, eos_token_id=[])
  first = [next(stream) for _ in range(3)]
  parallel.swap_out()
  check(parallel.kv_cache_memory_kind == "pinned_host", f"{name}: swapped-out memory kind")
  parallel.swap_in()
  check(split_by_kv_head(parallel.kv_cache.get().k), f"{name}: cache placement after swap-in")
  tokens_after = [chunk.tokens[0] for chunk in first + list(stream) if 0 in chunk.tokens]
  check(tokens_after == list(expected[0]), f"{name}: tokens after a swap differ")

  # The timing helpers the benchmarks use take the engine's placements.
  timing = profile.time_decode(parallel, 2, position=8, steps=2, repeats=1)
  check(timing["step_us"] > 0, f"{name}: time_decode on the split engine")
  check(profile.time_prefill(parallel, 2, 12, repeats=1) > 0, f"{name}: time_prefill")

  # The Pallas attention kernels (interpreted on CPU) run per device inside shard_map.
  if DEVICES == 2:
    pallas_single = single.with_options(attention="pallas", layer_loop="unroll")
    pallas = parallel.with_options(attention="pallas", layer_loop="unroll")
    want = pallas_single.generate(PROMPTS[:2], max_new_tokens=4, eos_token_id=[])
    check(pallas.generate(PROMPTS[:2], max_new_tokens=4, eos_token_id=[]) == want,
          f"{name}: greedy tokens differ with Pallas attention")
  print(f"{name}: ok on {DEVICES} devices")


def main():
  if len(jax.devices()) != DEVICES:
    raise SystemExit(f"expected {DEVICES} devices, got {jax.devices()}")
  for name, config in CONFIGS.items():
    check_engine(name, config)


if __name__ == "__main__":
  main()
