"""Where a `generate` call's time to first token goes beyond the prefill (issue #18): for B
prompts of 512 tokens, the static path's prefill + greedy first token, the scheduler's
"prompts" executable (sampling arrays, logits output) on pre-staged inputs, the same function
greedy-only (no sampling arrays: the sampling path sorts the vocabulary), and `generate`'s
`ttft_s` with its host timeline (submit -> prompt call -> dispatched -> outputs ready -> first
token emitted), each with the profile's top kernel families.

  PYTHONPATH=$PWD python3 benchmarks/ttft_probe.py --checkpoint /tmp/ck/gpt2 --out OUT
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import jax
import numpy as np

from bench_util import median_s
from cg_jax import Engine, profile
from cg_jax import scheduler as scheduler_module
from cg_jax.sampling import SamplingArrays


def timed(fn, repeats=10):
  return median_s(fn, repeats) * 1e3


def kernels(fn, calls=3):
  report = profile.profile_calls(fn, calls)
  return {"kernels_per_call": report.kernels_per_step, "gpu_busy_us": report.gpu_busy_us,
          "graph_launches_per_call": report.graph_launches_per_step,
          "top": [list(k) for k in report.top_kernels[:10]]}


def timeline(engine, call, runs=7) -> dict[str, float]:
  """Median times (ms, from the submit) at which a `generate` call's prompt executable is called,
  returns from its dispatch and has its outputs ready, and the first token is emitted."""
  marks: dict[str, float] = {}
  table, scheduler = engine._scheduler.table, engine._scheduler
  get, submit, emit = table.get, scheduler.submit, scheduler_module.Group._emit

  def timed_get(key):
    executable = get(key)
    if key[0] != "prompts":
      return executable

    def run(*args):
      marks["call"] = time.perf_counter()
      outputs = executable(*args)
      marks["dispatched"] = time.perf_counter()
      jax.block_until_ready(outputs)
      marks["ready"] = time.perf_counter()
      return outputs
    return run

  def timed_submit(*args, **kwargs):
    marks["submit"] = time.perf_counter()
    return submit(*args, **kwargs)

  def timed_emit(group, *args):
    marks.setdefault("emit", time.perf_counter())
    return emit(group, *args)

  table.get, scheduler.submit, scheduler_module.Group._emit = timed_get, timed_submit, timed_emit
  rows = []
  try:
    for _ in range(runs):
      marks.clear()
      call()
      rows.append({k: (v - marks["submit"]) * 1e3 for k, v in marks.items() if k != "submit"})
  finally:
    del table.get, scheduler.submit
    scheduler_module.Group._emit = emit
  return {k: statistics.median(r[k] for r in rows[1:]) for k in rows[-1]}


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--checkpoint", required=True)
  ap.add_argument("--out", required=True)
  ap.add_argument("--prompt-len", type=int, default=512, help="CPU smoke run: 64")
  args = ap.parse_args()
  length = args.prompt_len
  engine = Engine.from_pretrained(args.checkpoint, dtype="bfloat16", max_seq_len=2 * length,
                                  batch_buckets=(1, 8), prompt_buckets=(length,))
  weights = engine.executables.steps.split.weights
  vocab = engine.model_config.vocab_size
  rng = np.random.default_rng(0)
  result = {"model": os.path.basename(args.checkpoint.rstrip("/")), "jax": jax.__version__,
            "commit": os.environ.get("CG_JAX_COMMIT")}
  for batch in (1, 8):
    tokens = jax.device_put(rng.integers(0, vocab, (batch, length)).astype(np.int32))
    lengths = jax.device_put(np.full((batch,), length, np.int32))
    sampling = jax.device_put(SamplingArrays.host(batch, temperature=0.0, top_k=0, top_p=1.0,
                                                  seed=0, rows=np.arange(batch)))
    prompts = engine.executables.get(("prompts", batch, length))
    # The same executable's function without sampling arrays (greedy only): the token choice's
    # share of the prompt call.
    greedy_prompts = jax.jit(lambda w, c, t, n, f: engine.executables.steps.prompts(
        w, c, t, n, f, None), donate_argnums=1)
    prefill = engine.executables.get(("prefill", batch, length))
    first = engine.executables.get(("first", batch, True))

    # Each direct call holds the engine idle: a `generate` call returns before the engine thread
    # has stored the cache of its last step.
    def held(fn):
      def call():
        with engine._scheduler.exclusive():
          return fn()
      return call

    @held
    def scheduler_path():
      new, _, cache = prompts(weights, engine.kv_cache.get(), tokens, lengths, np.int32(0),
                              sampling)
      engine.kv_cache.set(cache)
      return np.asarray(new)

    @held
    def greedy_path():
      new, _, cache = greedy_prompts(weights, engine.kv_cache.get(), tokens, lengths,
                                     np.int32(0))
      engine.kv_cache.set(cache)
      return np.asarray(new)

    @held
    def static_path():
      logits, cache = prefill(weights, engine.kv_cache.get(), tokens, lengths)
      engine.kv_cache.set(cache)
      return np.asarray(first(logits, lengths, None))

    def generate():
      return engine.generate(rng.integers(0, vocab, (batch, length)).tolist(), max_new_tokens=1,
                             eos_token_id=[]).stats["ttft_s"] * 1e3

    row = {"prompts_ms": timed(scheduler_path), "prompts_greedy_ms": timed(greedy_path),
           "static_ms": timed(static_path)}
    generate()
    row["generate_ttft_ms"] = statistics.median(generate() for _ in range(7))
    row["generate_timeline_ms"] = timeline(engine, generate)
    row["prompts_kernels"] = kernels(scheduler_path)
    row["prompts_greedy_kernels"] = kernels(greedy_path)
    row["static_kernels"] = kernels(static_path)
    result[f"b{batch}"] = row
    print(batch, {k: v for k, v in row.items() if k.endswith("ms")}, row["generate_timeline_ms"],
          row["prompts_kernels"]["gpu_busy_us"], row["static_kernels"]["gpu_busy_us"], flush=True)
  with open(os.path.join(args.out, f"ttft_{result['model']}.json"), "w") as f:
    json.dump(result, f, indent=1)


if __name__ == "__main__":
  main()
