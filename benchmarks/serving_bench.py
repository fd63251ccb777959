"""Serving workloads through the public API: the continuous-batching scheduler against the
one-call-at-a-time static path and HF transformers' continuous batching, on random weights of a
real shape.

  python benchmarks/make_checkpoints.py --out-dir /tmp/ck --models llama-3.2-1b
  python benchmarks/serving_bench.py --models /tmp/ck/llama-3.2-1b --out serving.json
  python benchmarks/serving_bench.py --system hf_continuous --models /tmp/ck/llama-3.2-1b \
      --out serving_hf.json

Workloads (prompts of 64-480 random tokens, 128 new tokens, EOS off, greedy):
  offline        64 requests submitted at once
  offline_same   the same 16 prompts in one generate() call
  concurrent     16 callers from 16 threads, each generate([one prompt]) (the same 16 prompts)
  poisson        requests arriving at --rates per second (--poisson-requests of them)
  shared_prefix  64 requests at once starting with one 384-token prefix (and 16-96 tokens of
                 their own), with the prefix cache on (the default) and off
Systems: cg_jax (the scheduler: submit / generate), cg_jax_static (the static path, one call at
a time under the engine's lock: `Engine._generator`, kept for this baseline), hf_continuous
(transformers' `generate_batch`, paged SDPA, same checkpoint; its own process, run with
JAX_PLATFORMS=cpu so that jax takes no GPU memory). Every measured run gets prompts no earlier run used (or an
emptied prefix cache), so no row is served from cached prefixes unless it says so. Rows carry
tokens/s and TTFT / time-per-output-token percentiles (ms); compile time is apart (`start_s`:
cold, `cached_start_s`: a second engine from the persistent compilation cache).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import threading
import time

import jax
import numpy as np

try:  # the hf_continuous system only
  import torch
  import transformers
  from transformers import AutoModelForCausalLM
  from transformers.generation import GenerationConfig
except ImportError:
  torch = None

from cg_jax import Engine, host_io

NEW_TOKENS = 128
PROMPT_LENGTHS = (64, 480)
# --smoke (CPU, tiny-llama): shorter prompts and budgets.
SMOKE = dict(NEW_TOKENS=8, PROMPT_LENGTHS=(8, 40), SHARED_PREFIX=24, OWN_TOKENS=(4, 16))


def _prompts(count: int, vocab: int, seed: int) -> list[list[int]]:
  rng = np.random.default_rng(seed)
  low, high = PROMPT_LENGTHS
  return [rng.integers(0, vocab, (int(rng.integers(low, high + 1)),)).tolist()
          for _ in range(count)]


def _percentiles(values, scale=1e3):
  values = np.asarray([v for v in values if v is not None], np.float64) * scale
  if not len(values):
    return None, None
  return round(float(np.percentile(values, 50)), 2), round(float(np.percentile(values, 99)), 2)


def _row(system, model, workload, requests, rate, tokens, wall, ttfts, tpots, base):
  ttft = _percentiles(ttfts)
  tpot = _percentiles(tpots)
  return dict(base, system=system, model=model, workload=workload, requests=requests, rate=rate,
              tokens_per_s=round(tokens / wall, 1), wall_s=round(wall, 3),
              ttft_p50_ms=ttft[0], ttft_p99_ms=ttft[1], tpot_p50_ms=tpot[0],
              tpot_p99_ms=tpot[1])


def _submit_all(engine, prompts, arrivals=None):
  """Submit (at the arrival offsets, when given), wait; (tokens, wall, ttfts, tpots)."""
  start = time.perf_counter()
  handles = []
  for i, prompt in enumerate(prompts):
    if arrivals is not None:
      delay = start + arrivals[i] - time.perf_counter()
      if delay > 0:
        time.sleep(delay)
    handles.append(engine.submit(prompt, NEW_TOKENS, eos_token_id=[]))
  results = [h.result(timeout=600) for h in handles]
  wall = time.perf_counter() - start
  return (sum(len(r.tokens) for r in results), wall, [r.stats["ttft_s"] for r in results],
          [r.stats["per_token_s"] for r in results])


def _threads(call, prompts):
  """One thread per prompt, each `call(prompt)` -> stats; (tokens, wall, ttfts, tpots)."""
  stats = [None] * len(prompts)

  def work(i):
    stats[i] = call(prompts[i])

  threads = [threading.Thread(target=work, args=(i,)) for i in range(len(prompts))]
  start = time.perf_counter()
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  wall = time.perf_counter() - start
  return (sum(s["new_tokens"] for s in stats), wall, [s["ttft_s"] for s in stats],
          [s["per_token_s"] for s in stats])


SHARED_PREFIX, OWN_TOKENS = 384, (16, 96)


def _shared_prefix_prompts(count: int, vocab: int, seed: int) -> list[list[int]]:
  """`count` prompts of one SHARED_PREFIX-token prefix and OWN_TOKENS tokens of their own."""
  rng = np.random.default_rng(seed)
  prefix = rng.integers(0, vocab, (SHARED_PREFIX,)).tolist()
  low, high = OWN_TOKENS
  return [prefix + rng.integers(0, vocab, (int(rng.integers(low, high + 1)),)).tolist()
          for _ in range(count)]


def _engine(model: str, args, **options):
  if args.smoke:
    return Engine.from_pretrained(model, max_seq_len=64, batch_buckets=(1, 2, 4),
                                  prompt_buckets=(16, 48), **options)
  return Engine.from_pretrained(model, dtype="bfloat16", max_seq_len=1024,
                                prompt_buckets=(64, 128, 256, 512), **options)


def _name(model: str) -> str:
  return os.path.basename(os.path.normpath(model))


def prefill_probe(engine, prompts, repeats: int = 5) -> dict:
  """Where a batch's first token goes (ms, medians): the scheduler's "prompts" executable
  alone; the static path's "prefill" + "first"; and each path's TTFT through generate() with
  one new token."""
  table = engine.executables
  rows, longest = len(prompts), max(len(p) for p in prompts)
  size = next(n for n in engine.config.buckets.prompt_lengths if n >= longest)
  tokens = np.zeros((rows, size), np.int32)
  counts = np.array([len(p) for p in prompts], np.int32)
  for b, p in enumerate(prompts):
    tokens[b, :len(p)] = p
  sampling = engine._scheduler._sampling([None] * rows, rows)
  out = {}
  with engine._scheduler.exclusive():
    for name in ("prompts", "prefill"):
      times = []
      for _ in range(repeats + 1):
        start = time.perf_counter()
        if name == "prompts":
          new, cache = table.get(("prompts", rows, size))(
              engine._split.weights, engine.kv_cache.get(), tokens, counts, np.int32(0), sampling)
        else:
          logits, cache = table.get(("prefill", rows, size))(
              engine._split.weights, engine.kv_cache.get(), tokens, counts)
          new = table.get(("first", rows, True))(logits, counts, None)
        engine.kv_cache.set(cache)
        np.asarray(new)
        times.append(time.perf_counter() - start)
      out[f"{name}_exe_ms"] = round(float(np.median(times[1:])) * 1e3, 2)
  # The inputs of that call, to the device in one copy (host_io.stage) or through pinned host
  # memory first (the former staging).
  where = engine.input_placement
  for name, put in (("direct_stage_ms", lambda t: host_io.stage(t, where)),
                    ("pinned_stage_ms", lambda t: jax.device_put(
                        jax.device_put(t, host_io.pinned_host(where)), host_io.on_device(where)))):
    times = []
    for _ in range(repeats * 4):
      begin = time.perf_counter()
      jax.block_until_ready(put((tokens, counts, sampling)))
      times.append(time.perf_counter() - begin)
    out[name] = round(float(np.median(times)) * 1e3, 3)
  request = engine.validate(prompts, 1, eos_token_id=[])
  for name, call in (("scheduler", lambda: engine.generate(prompts, 1, eos_token_id=[])),
                     ("static", lambda: engine._generator.generate(request))):
    call()
    out[f"{name}_ttft_ms"] = round(float(np.median(
        [call().stats["ttft_s"] for _ in range(repeats)])) * 1e3, 2)
  return out


def first_token_trace(engine, prompts) -> dict:
  """The host's timeline (ms from the call) of one two-token generate() of `prompts` through
  the scheduler and through the static path: each executable call's start and return, and the
  first token."""
  table, out = engine.executables, {}
  original = table.get
  request = engine.validate(prompts, 2, eos_token_id=[])
  for name, call in (("scheduler", lambda: engine.generate(prompts, 2, eos_token_id=[])),
                     ("static", lambda: engine._generator.generate(request))):
    events = []

    def traced(key, events=events):
      exe = original(key)

      def run(*args):
        begin = time.perf_counter()
        result = exe(*args)
        events.append(("/".join(map(str, key)), begin, time.perf_counter()))
        return result
      return run

    call()
    engine.reset_prefix_cache()
    table.get = traced
    try:
      start = time.perf_counter()
      ttft = call().stats["ttft_s"]
    finally:
      del table.get
    out[name] = {"ttft_ms": round(ttft * 1e3, 2),
                 "calls": [(key, round((a - start) * 1e3, 2), round((b - start) * 1e3, 2))
                           for key, a, b in events[:12]]}
  return out


def run_model(model: str, args, base) -> list[dict]:
  start = time.perf_counter()
  engine = _engine(model, args)
  engine.warmup(progress=False)
  start_s = time.perf_counter() - start
  name, vocab = _name(model), engine.model_config.vocab_size
  rows = []
  base = dict(base, start_s=round(start_s, 1), executables=len(engine.executables.compiled))

  def emit(row):
    rows.append(row)
    print(json.dumps(row), flush=True)

  def static(prompts):
    request = engine.validate(prompts, NEW_TOKENS, eos_token_id=[])
    return engine._generator.generate(request).stats

  def scheduler(prompts):
    return engine.generate(prompts, NEW_TOKENS, eos_token_id=[]).stats

  same = _prompts(16, vocab, 1)
  singles = [[p] for p in same]
  # Warm both paths' executables for these shapes (the static path compiles on first use).
  _threads(static, singles[:2])
  static(same)
  _submit_all(engine, same[:4])
  probe = same[:engine.executables.prompt_batches()[-1]]
  emit(dict(base, system="cg_jax", model=name, workload="prefill_probe", requests=len(probe),
            **prefill_probe(engine, probe)))
  emit(dict(base, system="cg_jax", model=name, workload="first_token_trace",
            requests=len(probe), **first_token_trace(engine, probe)))
  if "serving" in args.workloads:
    for system, call in (("cg_jax", scheduler), ("cg_jax_static", static)):
      engine.reset_prefix_cache()
      result = call(same)
      emit(_row(system, name, "offline_same", 16, None, result["new_tokens"],
                result["total_s"], [result["ttft_s"]], [result["per_token_s"]], base))
      engine.reset_prefix_cache()
      emit(_row(system, name, "concurrent", 16, None, *_threads(call, singles), base))
    emit(_row("cg_jax", name, "offline", 64, None,
              *_submit_all(engine, _prompts(64, vocab, 2)), base))
    for i, rate in enumerate(args.rates):
      prompts = _prompts(args.poisson_requests, vocab, 10 + i)
      arrivals = np.cumsum(np.random.default_rng(4).exponential(1 / rate, len(prompts)))
      emit(_row("cg_jax", name, "poisson", len(prompts), rate,
                *_submit_all(engine, prompts, arrivals), base))
  # The prefix cache on (this engine) and off (a second engine: its start is the cached one).
  start = time.perf_counter()
  off = _engine(model, args, prefix_cache_tokens=0)
  off.warmup(progress=False)
  cached_start_s = round(time.perf_counter() - start, 1)
  shared = (("cg_jax", engine, 20), ("cg_jax_prefix_off", off, 21))
  for system, served, seed in shared if "shared_prefix" in args.workloads else ():
    served.generate(_shared_prefix_prompts(4, vocab, seed + 10), 2, eos_token_id=[])  # warm
    served.reset_prefix_cache()
    row = _row(system, name, "shared_prefix", 64, None,
               *_submit_all(served, _shared_prefix_prompts(64, vocab, seed)), base)
    stats = served.stats()
    emit(dict(row, cached_start_s=cached_start_s, prefix_cache_hits=stats.get(
        "prefix_cache_hits"), prefix_cache_hit_tokens=stats.get("prefix_cache_hit_tokens")))
  off.close()
  emit(dict(base, system="cg_jax", model=name, workload="engine_stats",
            cached_start_s=cached_start_s,
            stats={k: v for k, v in engine.stats().items() if isinstance(v, (int, float, str))}))
  engine.close()
  return rows


def run_hf(model: str, args, base) -> list[dict]:
  """transformers' continuous batching (`generate_batch`, paged SDPA) on the offline requests
  and the 16 prompts of `offline_same`."""
  device = "cuda" if torch.cuda.is_available() else "cpu"
  dtype = torch.float32 if args.smoke else torch.bfloat16
  hf = AutoModelForCausalLM.from_pretrained(model, dtype=dtype, attn_implementation="paged|sdpa")
  hf = hf.to(device).eval()
  vocab = hf.config.vocab_size
  config = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=-1,
                            pad_token_id=0)
  base = dict(base, transformers_version=transformers.__version__,
              torch_version=torch.__version__)
  rows = []
  hf.generate_batch(inputs=_prompts(8, vocab, 5), generation_config=config, progress_bar=False)
  for workload, prompts in (("offline", _prompts(64, vocab, 2)),
                            ("offline_same", _prompts(16, vocab, 1))):
    start = time.perf_counter()
    outputs = hf.generate_batch(inputs=prompts, generation_config=config, progress_bar=False,
                                record_timestamps=True)
    wall = time.perf_counter() - start
    outs = list(outputs.values())
    tokens = sum(len(o.generated_tokens) for o in outs)
    ttfts = [o.timestamps[0] - o.created_time for o in outs if o.timestamps]
    tpots = [(o.timestamps[-1] - o.timestamps[0]) / max(len(o.timestamps) - 1, 1)
             for o in outs if o.timestamps]
    rows.append(_row("hf_continuous", _name(model), workload, len(prompts), None, tokens, wall,
                     ttfts, tpots, base))
    print(json.dumps(rows[-1]), flush=True)
  return rows


def table(rows) -> str:
  lines = ["| system | model | workload | requests | rate | tokens/s | TTFT p50 / p99 ms | "
           "TPOT p50 / p99 ms |", "|---|---|---|---|---|---|---|---|"]
  for r in rows:
    if r["workload"] in ("engine_stats", "prefill_probe", "first_token_trace"):
      continue
    lines.append(f"| {r['system']} | {r['model']} | {r['workload']} | {r['requests']} | "
                 f"{r['rate'] or ''} | {r['tokens_per_s']} | {r['ttft_p50_ms']} / "
                 f"{r['ttft_p99_ms']} | {r['tpot_p50_ms']} / {r['tpot_p99_ms']} |")
  return "\n".join(lines)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--models", default="llama-3.2-1b",
                      help="comma-separated presets (random weights) or checkpoint directories")
  parser.add_argument("--system", default="cg_jax", choices=("cg_jax", "hf_continuous"),
                      help="cg_jax: the cg_jax systems; hf_continuous: transformers alone")
  parser.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")],
                      default=[2, 8, 32])
  parser.add_argument("--poisson-requests", type=int, default=200)
  parser.add_argument("--workloads", default="serving,shared_prefix",
                      help="serving (offline_same, concurrent, offline, poisson) and/or "
                           "shared_prefix; the probes always run")
  parser.add_argument("--commit", default=os.environ.get("CG_JAX_COMMIT"))
  parser.add_argument("--smoke", action="store_true", help="tiny models on the CPU, short runs")
  parser.add_argument("--out", required=True)
  args = parser.parse_args()
  if args.smoke:
    globals().update(SMOKE)
    args.poisson_requests = 8
  commit = args.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                         capture_output=True, text=True).stdout.strip()
  base = dict(date=datetime.date.today().isoformat(), commit=commit)
  if args.system == "hf_continuous":
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
  else:
    gpu, base["jax_version"] = jax.devices()[0].device_kind, jax.__version__
  base["gpu"] = gpu
  run = run_hf if args.system == "hf_continuous" else run_model
  rows = []
  for model in args.models.split(","):
    rows += run(model, args, base)
    with open(args.out, "w") as f:
      json.dump(rows, f, indent=1)
  print(table(rows))


if __name__ == "__main__":
  main()
