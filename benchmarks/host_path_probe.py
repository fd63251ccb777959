"""A/B of the host path around a prompt call and a decode step (issue #18), in one process:
variants of the engine's own executables are compiled beside them and swapped into its table,
so `generate` runs each in turn on the same machine and weights.

Variants of the ("prompts", B, S) executable:
  base        the engine's
  host-out    its next tokens written to pinned host memory by the executable (the read-back
              needs no device-to-host transfer of its own)
  packed      host-out, with tokens, lengths and the first slot in one int32 array (one
              transfer instead of three)
Variants of the greedy ("decode", B, True) step: base, host-out (the emitted tokens in pinned
host memory), idle-rows (the rows padded up to `min_matmul_rows` are idle rows, position -1,
that the attention takes too, as batch-invariant steps do: no slice to the real rows and no pad
of the attention output; the vocabulary product and token choice on the padded rows).

Per variant: the direct call (NumPy inputs, new tokens read back; host time of the call's
dispatch and of the whole), and `generate`'s TTFT (max_new_tokens=1) or per-token time (128
new tokens), medians.

  PYTHONPATH=$PWD python3 benchmarks/host_path_probe.py --checkpoint /tmp/ck/gpt2 --out OUT
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time

import jax
import numpy as np
from jax.sharding import SingleDeviceSharding

from bench_util import git_commit
from cg_jax import Engine, profile


def _compile(engine, key, fn, args, donate, in_shardings, out_shardings):
  options = (engine.config.prefill_xla_options if key[0] == "prompts"
             else engine.config.xla_options)
  return jax.jit(fn, donate_argnums=donate, in_shardings=in_shardings,
                 out_shardings=out_shardings).lower(*args).compile(compiler_options=options)


def prompt_variants(engine, key):
  """{name: callable taking the scheduler's prompt-call arguments}."""
  table = engine.executables
  fn, args, donate, _, _ = table.signature(key)
  device = SingleDeviceSharding(jax.devices()[0])
  host = device.with_memory_kind("pinned_host")
  batch, length = key[1], key[2]
  variants = {"base": table.get(key)}
  variants["host-out"] = _compile(engine, key, fn, args, donate, None, (host, device, device))

  def unpack(w, c, packed):
    tokens = packed[:batch * length].reshape(batch, length)
    return fn(w, c, tokens, packed[batch * length:batch * length + batch], packed[-1])
  packed_args = (args[0], args[1], jax.ShapeDtypeStruct((batch * length + batch + 1,), np.int32))
  packed = _compile(engine, key, unpack, packed_args, donate, None, (host, device, device))

  def call_packed(w, c, tokens, lengths, first):
    return packed(w, c, np.concatenate([tokens.ravel(), lengths, np.int32(first)[None]]))
  variants["packed"] = call_packed
  return variants


def decode_variants(engine, key):
  table = engine.executables
  fn, args, donate, _, _ = table.signature(key)
  device = SingleDeviceSharding(jax.devices()[0])
  host = device.with_memory_kind("pinned_host")
  # The emitted copy goes last: donated inputs alias outputs of their shape in order, and a
  # device buffer must not alias the host output.
  def emitted_last(*inputs):
    emitted, *state = fn(*inputs)
    return (*state, emitted)
  exe = _compile(engine, key, emitted_last, args, donate, None, (device, device, device, host))

  def call(*inputs):
    *state, emitted = exe(*inputs)
    return (emitted, *state)
  forward = dataclasses.replace(table.steps.forward, batch_invariant=True)
  idle = dataclasses.replace(table.steps, forward=forward)
  options = engine.config.xla_options
  idle_exe = jax.jit(idle.decode, donate_argnums=donate).lower(*args).compile(
      compiler_options=options)
  return {"base": table.get(key), "host-out": call, "idle-rows": idle_exe}


def direct(engine, exe, batch, length, rng, repeats=15):
  """(dispatch ms, call + read-back ms) of the prompt call on fresh NumPy inputs, medians."""
  weights = engine.executables.steps.split.weights
  vocab = engine.model_config.vocab_size
  dispatch, total = [], []
  with engine._scheduler.exclusive():
    for _ in range(repeats + 1):
      tokens = rng.integers(0, vocab, (batch, length)).astype(np.int32)
      lengths = np.full((batch,), length, np.int32)
      cache = jax.block_until_ready(engine.kv_cache.get())
      start = time.perf_counter()
      new, _, cache = exe(weights, cache, tokens, lengths, np.int32(0))
      returned = time.perf_counter()
      np.asarray(new)
      end = time.perf_counter()
      engine.kv_cache.set(cache)
      dispatch.append(returned - start)
      total.append(end - start)
  return statistics.median(dispatch[1:]) * 1e3, statistics.median(total[1:]) * 1e3


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--checkpoint", required=True)
  ap.add_argument("--out", required=True)
  ap.add_argument("--prompt-len", type=int, default=512, help="CPU smoke run: 64")
  ap.add_argument("--batches", default="1,8")
  ap.add_argument("--new-tokens", type=int, default=128)
  ap.add_argument("--repeats", type=int, default=9)
  args = ap.parse_args()
  length, batches = args.prompt_len, tuple(int(b) for b in args.batches.split(","))
  name = os.path.basename(args.checkpoint.rstrip("/"))
  engine = Engine.from_pretrained(args.checkpoint, dtype="bfloat16", max_seq_len=2 * length,
                                  batch_buckets=batches, prompt_buckets=(length,))
  engine.warmup(phases=("prompts", "decode", "move", "prefix"), progress=False)
  table, vocab = engine.executables, engine.model_config.vocab_size
  rng = np.random.default_rng(0)
  rows = []
  for batch in batches:
    def ttft():
      prompts = rng.integers(0, vocab, (batch, length)).tolist()
      return engine.generate(prompts, max_new_tokens=1, eos_token_id=[]).stats["ttft_s"] * 1e3

    def per_token():
      prompts = rng.integers(0, vocab, (batch, length)).tolist()
      stats = engine.generate(prompts, max_new_tokens=args.new_tokens, eos_token_id=[]).stats
      return stats["per_token_s"] * 1e6, stats["ttft_s"] * 1e3

    key = ("prompts", batch, length)
    for variant, exe in prompt_variants(engine, key).items():
      base = table.compiled[key]
      table.compiled[key] = exe
      try:
        dispatch_ms, call_ms = direct(engine, exe, batch, length, rng)
        ttft()
        row = {"model": name, "batch": batch, "part": "prompts", "variant": variant,
               "dispatch_ms": dispatch_ms, "call_readback_ms": call_ms,
               "generate_ttft_ms": statistics.median(ttft() for _ in range(args.repeats))}
      except Exception as error:  # noqa: BLE001 - a failed variant is a row
        row = {"model": name, "batch": batch, "part": "prompts", "variant": variant,
               "error": f"{type(error).__name__}: {error}"[:300]}
      finally:
        table.compiled[key] = base
      rows.append(row)
      print(row, flush=True)
    key = ("decode", batch, True)
    fixed = np.random.default_rng(1).integers(0, vocab, (batch, length)).tolist()
    reference = None
    for variant, exe in decode_variants(engine, key).items():
      base = table.compiled[key]
      table.compiled[key] = exe
      try:
        per_token()
        runs = [per_token() for _ in range(max(3, args.repeats // 3))]
        row = {"model": name, "batch": batch, "part": "decode", "variant": variant,
               "generate_us_per_token": statistics.median(r[0] for r in runs),
               "generate_ttft_ms": statistics.median(r[1] for r in runs),
               "step_us": profile.time_decode(engine, batch, position=length)["step_us"]}
        tokens = engine.generate(fixed, max_new_tokens=32, eos_token_id=[])
        reference = tokens if reference is None else reference
        row["tokens_equal_base"] = list(tokens) == list(reference)
      except Exception as error:  # noqa: BLE001 - a failed variant is a row
        row = {"model": name, "batch": batch, "part": "decode", "variant": variant,
               "error": f"{type(error).__name__}: {error}"[:300]}
      finally:
        table.compiled[key] = base
      rows.append(row)
      print(row, flush=True)
  meta = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
          "commit": git_commit(), "date": time.strftime("%Y-%m-%d"), "prompt_len": length}
  with open(os.path.join(args.out, f"host_path_{name}.json"), "w") as f:
    json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
  main()
