"""Host I/O on the GPU: streamed tokens against the pipelined step, pinned against pageable
transfers both ways, KV-cache swap of a ~1 GB cache, and copy/kernel overlap from a profile.

One process; rows to JSON (graphs-issue schema plus `stream_token_us`), table last.

  PYTHONPATH=$PWD python3 benchmarks/io_bench.py --out $OUT
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import tempfile
import threading
import time

import jax
import numpy as np
from bench_util import median_s, write_rows

from cg_jax import Engine, profile
from cg_jax.bench.rows import git_commit
from cg_jax.core import host_io


def transfer_rows(device, size_bytes: int) -> list[dict]:
  """Host<->device bandwidth, pageable (NumPy) against pinned (pinned_host memory kind)."""
  host = np.random.default_rng(0).integers(0, 255, size_bytes, dtype=np.uint8)
  pinned = jax.device_put(host, host_io.pinned_host(device))
  on_device = jax.device_put(host, host_io.on_device(device))
  jax.block_until_ready((pinned, on_device))
  cases = {
      ("h2d", "pageable"): lambda: jax.block_until_ready(jax.device_put(host, device)),
      ("h2d", "pinned"): lambda: jax.block_until_ready(
          jax.device_put(pinned, host_io.on_device(device))),
      ("d2h", "pageable"): lambda: np.asarray(on_device + 0),
      ("d2h", "pinned"): lambda: jax.block_until_ready(
          jax.device_put(on_device, host_io.pinned_host(device))),
  }
  rows = []
  for (direction, memory), fn in cases.items():
    seconds = median_s(fn)
    rows.append(dict(kind="transfer", direction=direction, host_memory=memory,
                     bytes=size_bytes, seconds=seconds, gb_per_s=size_bytes / seconds / 1e9))
  return rows


def stream_rows(model: str, batch: int, new_tokens: int, graphs: str,
                max_seq_len: int) -> list[dict]:
  """Per-token time of a streamed generation against the pipelined step without host reads."""
  engine = Engine.from_pretrained(model, dtype="bfloat16", batch_buckets=(batch,),
                                  prompt_buckets=(16,), max_seq_len=max_seq_len, graphs=graphs,
                                  layer_loop="unroll", compilation_cache=False)
  engine.warmup(progress=False)
  prompts = [[11 + i, 22, 33, 44, 55] for i in range(batch)]

  def streamed_token_s():
    chunks = engine.stream(prompts, max_new_tokens=new_tokens, eos_token_id=[])
    next(chunks)
    start = time.perf_counter()
    count = sum(1 for _ in chunks)
    return (time.perf_counter() - start) / count

  rows = []
  for lag in (0, 1, 2):
    engine = engine.with_options(readback_lag=lag, compilation_cache=False)  # shares executables
    stream_us = statistics.median(streamed_token_s() for _ in range(5)) * 1e6
    rows.append(dict(kind="stream", model=model, batch=batch, mode=graphs, readback_lag=lag,
                     stream_token_us=stream_us))
  step = profile.time_decode(engine, batch, position=max_seq_len // 2)
  for row in rows:
    row["step_us"] = step["step_us"]
    row["stream_over_step"] = row["stream_token_us"] / step["step_us"]
  # Overlap of the token copies with kernels during a streamed generation.
  logdir = tempfile.mkdtemp()
  with jax.profiler.trace(logdir):
    for _ in engine.stream(prompts, max_new_tokens=32, eos_token_id=[]):
      pass
  rows[-1].update(profile.copy_overlap(profile.find_trace(logdir)))
  return rows


def swap_rows(model: str, batch: int, max_seq_len: int) -> list[dict]:
  """Swap-out/in time of a KV cache (default: llama-3.2-1b shape, 8 x 4096 = 1.07 GB)."""
  engine = Engine.from_pretrained(model, dtype="bfloat16", batch_buckets=(batch,),
                                  prompt_buckets=(16,), max_seq_len=max_seq_len,
                                  prefix_block=64, kv_blocks=batch * -(-max_seq_len // 64),
                                  compilation_cache=False)
  engine.warmup(phases=(), progress=False)  # allocates the KV cache only
  size = sum(x.nbytes for x in jax.tree.leaves(engine.kv_cache.get()))
  out_s = median_s(lambda: (engine.swap_out(), engine.swap_in(),
                             jax.block_until_ready(engine.kv_cache.get())))
  engine.swap_out()
  start = time.perf_counter()
  engine.swap_in()
  jax.block_until_ready(engine.kv_cache.get())
  in_s = time.perf_counter() - start
  start = time.perf_counter()
  engine.swap_out()
  swap_out_s = time.perf_counter() - start
  engine.swap_in()
  return [dict(kind="swap", bytes=size, swap_out_s=swap_out_s, swap_in_s=in_s,
               round_trip_s=out_s, swap_out_gb_per_s=size / swap_out_s / 1e9,
               swap_in_gb_per_s=size / in_s / 1e9)]


def swap_overlap_rows(model: str, swap_model: str, swap_batch: int, swap_max_seq_len: int,
                      max_seq_len: int) -> list[dict]:
  """Engine B swaps its KV cache out to pinned host memory (in a thread) while engine A runs
  decode steps; a profile shows how much of the copy time overlaps A's kernels."""
  runner = Engine.from_pretrained(model, dtype="bfloat16", batch_buckets=(1,), prompt_buckets=(16,),
                                  max_seq_len=max_seq_len, graphs="full", layer_loop="unroll",
                                  prefix_block=64, kv_blocks=-(-max_seq_len // 64),
                                  compilation_cache=False)
  runner.warmup(phases=("step",), progress=False)
  other = Engine.from_pretrained(swap_model, dtype="bfloat16", batch_buckets=(swap_batch,),
                                 prompt_buckets=(16,), max_seq_len=swap_max_seq_len,
                                 prefix_block=64,
                                 kv_blocks=swap_batch * -(-swap_max_seq_len // 64),
                                 compilation_cache=False)
  other.warmup(phases=(), progress=False)  # allocates the KV cache only
  alone = profile.time_decode(runner, 1, position=max_seq_len // 2, steps=32, repeats=3)
  rows = []
  # "cold": the process's first swap, which also grows the pinned-host pool (page-locking new
  # host memory is a driver call that can stall other work); "warm": the pool already holds it.
  for pool in ("cold", "warm"):
    logdir = tempfile.mkdtemp()
    with jax.profiler.trace(logdir):
      swapper = threading.Thread(target=other.swap_out)
      swapper.start()
      during = profile.time_decode(runner, 1, position=max_seq_len // 2, steps=32, repeats=3)
      swapper.join()
    other.swap_in()
    jax.block_until_ready(other.kv_cache.get())
    overlap = profile.copy_overlap(profile.find_trace(logdir))
    rows.append(dict(kind="swap_overlap", pinned_pool=pool, model=model, swap_model=swap_model,
                     batch=1, step_us=alone["step_us"], step_during_swap_us=during["step_us"],
                     **overlap))
  return rows


def offload_in_step_rows(model: str, total_bytes: int, steps: int, max_seq_len: int) -> list[dict]:
  """A cache-sized buffer offloaded by the decode steps themselves: each step's program also
  copies one chunk (total_bytes / steps) to pinned host memory (an output placed in
  `pinned_host`: XLA's copy-start/copy-done on a copy stream, inside the same program), so the
  copy can overlap that step's kernels. A separate transfer (`swap_overlap_rows`) cannot: the
  next program on the compute stream waits for it. Reports the step alone and with the chunk,
  and the overlap share from a profile."""
  import jax.numpy as jnp

  runner = Engine.from_pretrained(model, dtype="bfloat16", batch_buckets=(1,), prompt_buckets=(16,),
                                  max_seq_len=max_seq_len, graphs="full", layer_loop="unroll",
                                  compilation_cache=False)
  decode, state = profile.prepare_decode(runner, 1, max_seq_len // 2)
  if steps > state.room:
    raise ValueError(f"steps must be <= {state.room} (the positions left after max_seq_len // 2)")
  steps_fn, holder = runner.executables.steps, runner.kv_cache
  weights = runner.step_weights
  device = jax.devices()[0]
  # [steps, elements]: distinct device buffers, one per step
  chunks = [jnp.full((total_bytes // steps // 2,), i, jnp.bfloat16) for i in range(steps)]

  def step_and_offload(weights, cache, carry, staged, chunk):
    return steps_fn.step(runner.config.token_buckets[0], weights, cache, carry, staged), chunk

  with_chunk = jax.jit(step_and_offload, donate_argnums=(1, 2, 3),
                       out_shardings=(host_io.on_device(device), host_io.pinned_host(device)))
  with_chunk = with_chunk.lower(weights, holder.get(), jnp.asarray(state.carry),
                                jnp.asarray(state.packed), chunks[0]).compile(
                                    compiler_options=runner.config.xla_options)

  def run(offload: bool) -> tuple[float, list]:
    carry, staged = jnp.array(state.carry), jnp.array(state.packed)
    copies = []
    cache = holder.get()
    jax.block_until_ready(cache)
    start = time.perf_counter()
    for i in range(steps):
      if offload:
        (carry, _, _, cache, staged), copy = with_chunk(weights, cache, carry, staged, chunks[i])
        copies.append(copy)
      else:
        carry, _, _, cache, staged = decode(weights, cache, carry, staged)
    holder.set(cache)
    jax.block_until_ready((carry, copies))
    return (time.perf_counter() - start) / steps, copies

  run(True), run(False)  # warm
  alone = statistics.median(run(False)[0] for _ in range(3))
  during = statistics.median(run(True)[0] for _ in range(3))
  logdir = tempfile.mkdtemp()
  with jax.profiler.trace(logdir):
    _, copies = run(True)
  placed = {c.sharding.memory_kind for c in copies}
  overlap = profile.copy_overlap(profile.find_trace(logdir))
  return [dict(kind="offload_in_step", model=model, batch=1, offloaded_bytes=total_bytes,
               steps=steps, step_us=alone * 1e6, step_during_swap_us=during * 1e6,
               copies_memory_kind=",".join(sorted(placed)), **overlap)]


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
  parser.add_argument("--models", default="gpt2,llama-3.2-1b")
  parser.add_argument("--transfer-bytes", type=int, default=1 << 30)
  parser.add_argument("--max-seq-len", type=int, default=1024)
  parser.add_argument("--swap-model", default="llama-3.2-1b")
  parser.add_argument("--swap-batch", type=int, default=8)
  parser.add_argument("--swap-max-seq-len", type=int, default=4096)
  parser.add_argument("--parts", default="transfer,stream,swap",
                      help="comma list of transfer, stream, swap, swap-overlap, offload-in-step")
  parser.add_argument("--offload-bytes", type=int, default=1 << 30)
  parser.add_argument("--offload-steps", type=int, default=32)
  args = parser.parse_args()
  device = jax.devices()[0]
  commit = git_commit()
  meta = dict(system="cg_jax", gpu=device.device_kind, jax_version=jax.__version__, commit=commit,
              date=datetime.date.today().isoformat())
  parts = args.parts.split(",")
  rows = transfer_rows(device, args.transfer_bytes) if "transfer" in parts else []
  for model in args.models.split(",") if "stream" in parts else ():
    rows += stream_rows(model, 1, 64, "full", args.max_seq_len)
  if "swap" in parts:
    rows += swap_rows(args.swap_model, args.swap_batch, args.swap_max_seq_len)
  if "swap-overlap" in parts:
    rows += swap_overlap_rows(args.models.split(",")[0], args.swap_model, args.swap_batch,
                              args.swap_max_seq_len, args.max_seq_len)
  if "offload-in-step" in parts:
    rows += offload_in_step_rows(args.models.split(",")[0], args.offload_bytes,
                                 args.offload_steps, args.max_seq_len)
  rows = [dict(meta, **r) for r in rows]
  write_rows(args.out, "io_rows.json", rows)
  for r in rows:
    if r["kind"] == "transfer":
      print(f"transfer {r['direction']} {r['host_memory']:8s} {r['gb_per_s']:7.1f} GB/s")
    elif r["kind"] == "stream":
      print(f"stream {r['model']:13s} lag {r['readback_lag']} {r['stream_token_us']:8.1f} us/token "
            f"step {r['step_us']:8.1f} us ratio {r['stream_over_step']:.3f} "
            f"overlap {r.get('overlap_share', float('nan')):.2f}")
    elif r["kind"] == "offload_in_step":
      print(f"offload-in-step {r['model']} {r['offloaded_bytes'] / 1e9:.2f} GB over {r['steps']} "
            f"steps: step {r['step_us']:.1f} us alone, {r['step_during_swap_us']:.1f} us with a "
            f"chunk ({r['copies_memory_kind']}); memcpy {r['memcpy_us']:.0f} us, "
            f"{100 * r['overlap_share']:.1f}% overlapping kernels")
    elif r["kind"] == "swap_overlap":
      print(f"swap-overlap ({r['pinned_pool']} pool) {r['model']} step {r['step_us']:.1f} us alone, "
            f"{r['step_during_swap_us']:.1f} us during the swap; memcpy {r['memcpy_us']:.0f} us, "
            f"{100 * r['overlap_share']:.1f}% overlapping kernels")
    else:
      print(f"swap {r['bytes'] / 1e9:.2f} GB out {r['swap_out_gb_per_s']:.1f} GB/s "
            f"in {r['swap_in_gb_per_s']:.1f} GB/s")


if __name__ == "__main__":
  main()
