"""Host dispatch of one decode step: where the time of a single call into an idle GPU goes.

For one model and batch, the same weights are compiled under several sets of XLA options (the
graph modes plus command-buffer variants given as JSON). Per variant: the pipelined step, the host
time of one call issued into an idle queue, and the host time of a trivial executable with the
same arguments (the PJRT call cost without any GPU work), so graph-launch cost and argument
handling can be told apart. One process, rows to JSON, table last.

  PYTHONPATH=$PWD python3 benchmarks/dispatch_bench.py --out $OUT \\
      --variants '{"serialize": {"xla_gpu_command_buffer_scheduling_mode": "SERIALIZE"}}'
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp

from bench_util import git_commit, write_rows
from cg_jax import Engine, profile


def _idle_queue_call_us(engine: Engine, step, weights, batch: int, position: int,
                        repeats: int = 32) -> float:
  """Median host time of `step(weights, cache, tokens, positions)` -> (cache, tokens,
  positions), all three donated, each call issued into an idle queue."""
  cache = engine.kv_cache.get()  # allocates the KV cache
  tokens, positions = jnp.zeros((batch,), jnp.int32), jnp.full((batch,), position, jnp.int32)
  cache, tokens, positions = step(weights, cache, tokens, positions)
  times = []
  for _ in range(repeats):
    jax.block_until_ready((cache, tokens))
    start = time.perf_counter()
    cache, tokens, positions = step(weights, cache, tokens, positions)
    times.append(time.perf_counter() - start)
  engine.kv_cache.set(cache)
  return statistics.median(times) * 1e6


def trivial_dispatch_us(engine: Engine, batch: int, position: int) -> float:
  """Host time of calling an executable that takes the decode step's arguments and does ~nothing."""

  def touch(weights, cache, tokens, positions):
    return cache, tokens + 1, positions + 1

  step = jax.jit(touch, donate_argnums=(1, 2, 3))
  return _idle_queue_call_us(engine, step, engine.weights(), batch, position)


def no_emitted_dispatch_us(engine: Engine, batch: int, position: int) -> float:
  """Host time of one decode step into an idle queue when the step returns only its donated
  state (no separate `emitted` token output), to see whether that fresh output is one of the
  allocations XLA re-records the graph for on every call."""
  steps = engine.executables.steps

  def decode_state_only(weights, cache, tokens, positions):
    _, tokens, positions, cache = steps.decode(weights, cache, tokens, positions, None)
    return cache, tokens, positions

  weights = steps.split.weights
  specs = (steps.split.specs(), engine.executables.cache_spec(),
           jax.ShapeDtypeStruct((batch,), jnp.int32))
  step = jax.jit(decode_state_only, donate_argnums=(1, 2, 3)).lower(
      *specs, specs[-1]).compile(compiler_options=engine.config.xla_options)
  return _idle_queue_call_us(engine, step, weights, batch, position)


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
  parser.add_argument("--model", default="gpt2")
  parser.add_argument("--batch", type=int, default=1)
  parser.add_argument("--max-seq-len", type=int, default=1024)
  parser.add_argument("--modes", default="off,full", help="graph modes measured as they are")
  parser.add_argument("--variants", default="{}",
                      help='JSON {name: {xla option: value}}, each on top of graphs="full"')
  args = parser.parse_args()
  commit = git_commit()
  meta = dict(system="cg_jax", model=args.model, batch=args.batch, gpu=jax.devices()[0].device_kind,
              jax_version=jax.__version__, commit=commit, date=datetime.date.today().isoformat())
  base = Engine.from_pretrained(args.model, dtype="bfloat16", batch_buckets=(args.batch,),
                                prompt_buckets=(16,), max_seq_len=args.max_seq_len, graphs="full",
                                layer_loop="unroll", compilation_cache=False)
  variants = {mode: (mode, {}) for mode in args.modes.split(",")}
  variants.update({name: ("full", options) for name, options in json.loads(args.variants).items()})
  rows = []
  for name, (mode, options) in variants.items():
    row = dict(meta, variant=name, mode=mode, extra_options=options)
    try:
      engine = base.with_options(graphs=mode, compiler_options=options, compilation_cache=False)
      start = time.perf_counter()
      engine.warmup(phases=("decode",), progress=False)
      row["compile_s"] = time.perf_counter() - start
      row.update(profile.time_decode(engine, args.batch, position=args.max_seq_len // 2))
      row["trivial_dispatch_us"] = trivial_dispatch_us(engine, args.batch,
                                                       args.max_seq_len // 2)
      if mode != "off":
        row["no_emitted_dispatch_us"] = no_emitted_dispatch_us(engine, args.batch,
                                                               args.max_seq_len // 2)
    except Exception as err:  # an option this XLA rejects: record it and go on
      row["error"] = f"{type(err).__name__}: {str(err)[:300]}"
    rows.append(row)
    print(json.dumps({k: v for k, v in row.items() if k not in meta}), flush=True)
  write_rows(args.out, "dispatch_rows.json", rows)
  print(f"\n{'variant':28s} {'step_us':>9s} {'dispatch_us':>12s} {'trivial_us':>11s} "
        f"{'no_emitted':>10s} {'loop/token':>10s}")
  for r in rows:
    if "error" in r:
      print(f"{r['variant']:28s} error: {r['error'][:80]}")
    else:
      print(f"{r['variant']:28s} {r['step_us']:9.1f} {r['host_dispatch_wall_us']:12.1f} "
            f"{r['trivial_dispatch_us']:11.1f} {r.get('no_emitted_dispatch_us', float('nan')):10.1f} "
            f"{r.get('loop_dispatch_per_token_us', float('nan')):10.1f}")


if __name__ == "__main__":
  main()
