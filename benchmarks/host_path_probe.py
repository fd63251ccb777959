"""A/B of the host path around a prompt call and a decode step (issue #18), in one process:
variants of the engine's own executables are compiled beside them and swapped into its table,
so `generate` runs each in turn on the same machine and weights.

Variants of the ("prompts", B, S) executable:
  base        the engine's (its next tokens written to pinned host memory by the executable)
  device-out  its next tokens left in device memory and copied to the host after the call (the
              engine before 8cc9016)
  packed      base, with tokens, lengths and the first slot in one int32 array (one transfer
              instead of three)
Variants of the greedy ("decode", B, True) step: base, device-out (the emitted tokens in device
memory), idle-rows (the rows padded up to `min_matmul_rows` are idle rows, position -1, that the
attention takes too, as batch-invariant steps do: no slice to the real rows and no pad of the
attention output; the vocabulary product and token choice on the padded rows).
(Taking the request arrays from pinned host memory was tried: NumPy arguments of such an input
land in device memory on the GPU, and the executable refuses them.)

Per variant: the direct call (NumPy inputs, new tokens read back; host time of the call's
dispatch and of the whole), and `generate`'s TTFT (max_new_tokens=1) or per-token time (128
new tokens), medians.

  PYTHONPATH=$PWD python3 benchmarks/host_path_probe.py --checkpoint /tmp/ck/gpt2 --out OUT
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import statistics
import time

import jax
import numpy as np
from jax.sharding import SingleDeviceSharding

from bench_util import generate_ttft_ms, git_commit, prompt_call_ms, prompt_probe_parser
from cg_jax import Engine, profile


def _compile(engine, key, fn, args, donate, in_shardings, out_shardings):
  options = (engine.config.prefill_xla_options if key[0] == "prompts"
             else engine.config.xla_options)
  return jax.jit(fn, donate_argnums=donate, in_shardings=in_shardings,
                 out_shardings=out_shardings).lower(*args).compile(compiler_options=options)


def _placements():
  device = SingleDeviceSharding(jax.devices()[0])
  return device, device.with_memory_kind("pinned_host")


def prompt_variants(engine, key):
  """{name: callable taking the scheduler's prompt-call arguments}."""
  table = engine.executables
  fn, args, donate, _, _ = table.signature(key)
  device, host = _placements()
  batch, length = key[1], key[2]
  variants = {"base": table.get(key),
              "device-out": _compile(engine, key, fn, args, donate, None, (device,) * 3)}

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
  device, host = _placements()
  forward = dataclasses.replace(table.steps.forward, batch_invariant=True)
  idle = dataclasses.replace(table.steps, forward=forward)
  return {"base": table.get(key),
          "device-out": _compile(engine, key, fn, args, donate, None, (device,) * 4),
          "idle-rows": _compile(engine, key, idle.decode, args, donate, None,
                                (device, device, device, host))}


def swapped(table, key, exe, measure, row: dict) -> dict:
  """`row` with `measure()`'s numbers while `exe` stands in for the table's `key` (or with the
  error it raised: a failed variant is a row)."""
  base = table.compiled[key]
  table.compiled[key] = exe
  try:
    row.update(measure())
  except Exception as error:  # noqa: BLE001
    row["error"] = f"{type(error).__name__}: {error}"[:300]
  finally:
    table.compiled[key] = base
  print(row, flush=True)
  return row


def main():
  ap = prompt_probe_parser()
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
    def per_token():
      prompts = rng.integers(0, vocab, (batch, length)).tolist()
      stats = engine.generate(prompts, max_new_tokens=args.new_tokens, eos_token_id=[]).stats
      return stats["per_token_s"] * 1e6, stats["ttft_s"] * 1e3

    def prompt_row(exe):
      dispatch_ms, call_ms = prompt_call_ms(engine, exe, batch, length, rng)
      return {"dispatch_ms": dispatch_ms, "call_readback_ms": call_ms,
              "generate_ttft_ms": generate_ttft_ms(engine, batch, length, rng, args.repeats)}

    fixed = np.random.default_rng(1).integers(0, vocab, (batch, length)).tolist()
    reference = []

    def decode_row():
      per_token()
      runs = [per_token() for _ in range(max(3, args.repeats // 3))]
      tokens = [list(t) for t in engine.generate(fixed, max_new_tokens=32, eos_token_id=[])]
      reference[:] = reference or tokens
      return {"generate_us_per_token": statistics.median(r[0] for r in runs),
              "generate_ttft_ms": statistics.median(r[1] for r in runs),
              "step_us": profile.time_decode(engine, batch, position=length)["step_us"],
              "tokens_equal_base": tokens == reference}

    for part, variants, measure in (("prompts", prompt_variants, prompt_row),
                                    ("decode", decode_variants, lambda _: decode_row())):
      key = (part, batch, length) if part == "prompts" else (part, batch, True)
      for variant, exe in variants(engine, key).items():
        row = {"model": name, "batch": batch, "part": part, "variant": variant}
        rows.append(swapped(table, key, exe, functools.partial(measure, exe), row))
  meta = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
          "commit": git_commit(), "date": time.strftime("%Y-%m-%d"), "prompt_len": length}
  with open(os.path.join(args.out, f"host_path_{name}.json"), "w") as f:
    json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
  main()
