"""Serving workloads through the public API: the continuous-batching scheduler against the
one-call-at-a-time static path, on random weights of a real shape.

  python benchmarks/serving_bench.py --models llama-3.2-1b,gpt2 --out serving.json

Workloads (prompts of 64-480 random tokens, 128 new tokens, EOS off, greedy):
  offline       64 requests submitted at once
  offline_same  the same 16 prompts in one generate() call
  concurrent    16 callers from 16 threads, each generate([one prompt])
  poisson       requests arriving at --rates per second (--poisson-requests of them)
Systems: cg_jax (the scheduler: submit / generate), cg_jax_static (the static path, one call at
a time under the engine's lock: `Engine._generator`, kept for this baseline). Rows carry
tokens/s and TTFT / time-per-output-token percentiles (ms); compile time is apart.
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

from cg_jax import Engine

NEW_TOKENS = 128
PROMPT_LENGTHS = (64, 480)
# --smoke (CPU, tiny-llama): shorter prompts and budgets.
SMOKE = dict(NEW_TOKENS=8, PROMPT_LENGTHS=(8, 40))


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


def run_model(model: str, args, base) -> list[dict]:
  start = time.perf_counter()
  if args.smoke:
    engine = Engine.from_pretrained(model, max_seq_len=64, batch_buckets=(1, 2, 4),
                                    prompt_buckets=(16, 48))
  else:
    engine = Engine.from_pretrained(model, dtype="bfloat16", max_seq_len=1024,
                                    prompt_buckets=(64, 128, 256, 512))
  engine.warmup(progress=False)
  compile_s = time.perf_counter() - start
  vocab = engine.model_config.vocab_size
  rows = []
  base = dict(base, compile_s=round(compile_s, 1))

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
  for system, call in (("cg_jax", scheduler), ("cg_jax_static", static)):
    result = call(same)
    rows.append(_row(system, model, "offline_same", 16, None, result["new_tokens"],
                     result["total_s"], [result["ttft_s"]], [result["per_token_s"]], base))
    print(json.dumps(rows[-1]), flush=True)
    rows.append(_row(system, model, "concurrent", 16, None, *_threads(call, singles), base))
    print(json.dumps(rows[-1]), flush=True)
  offline = _prompts(64, vocab, 2)
  rows.append(_row("cg_jax", model, "offline", 64, None, *_submit_all(engine, offline), base))
  print(json.dumps(rows[-1]), flush=True)
  for rate in args.rates:
    prompts = _prompts(args.poisson_requests, vocab, 3)
    arrivals = np.cumsum(np.random.default_rng(4).exponential(1 / rate, len(prompts)))
    rows.append(_row("cg_jax", model, "poisson", len(prompts), rate,
                     *_submit_all(engine, prompts, arrivals), base))
    print(json.dumps(rows[-1]), flush=True)
  rows.append(dict(base, system="cg_jax", model=model, workload="engine_stats",
                   stats={k: v for k, v in engine.stats().items()
                          if isinstance(v, (int, float, str))}))
  engine.close()
  return rows


def table(rows) -> str:
  lines = ["| system | model | workload | requests | rate | tokens/s | TTFT p50 / p99 ms | "
           "TPOT p50 / p99 ms |", "|---|---|---|---|---|---|---|---|"]
  for r in rows:
    if r["workload"] == "engine_stats":
      continue
    lines.append(f"| {r['system']} | {r['model']} | {r['workload']} | {r['requests']} | "
                 f"{r['rate'] or ''} | {r['tokens_per_s']} | {r['ttft_p50_ms']} / "
                 f"{r['ttft_p99_ms']} | {r['tpot_p50_ms']} / {r['tpot_p99_ms']} |")
  return "\n".join(lines)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--models", default="llama-3.2-1b")
  parser.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")], default=[8, 32])
  parser.add_argument("--poisson-requests", type=int, default=64)
  parser.add_argument("--commit", default=os.environ.get("CG_JAX_COMMIT"))
  parser.add_argument("--smoke", action="store_true", help="tiny-llama on the CPU, short runs")
  parser.add_argument("--out", required=True)
  args = parser.parse_args()
  if args.smoke:
    globals().update(SMOKE)
    args.models, args.poisson_requests = "tiny-llama", 8
  commit = args.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                         capture_output=True, text=True).stdout.strip()
  base = dict(gpu=jax.devices()[0].device_kind, jax_version=jax.__version__,
              date=datetime.date.today().isoformat(), commit=commit)
  rows = []
  for model in args.models.split(","):
    rows += run_model(model, args, base)
    with open(args.out, "w") as f:
      json.dump(rows, f, indent=1)
  print(table(rows))


if __name__ == "__main__":
  main()
