"""What a user of `Engine.generate` sees: time to first token and time per new token, beside the
decode step and the prompt executable's device time, per prefill GEMM backend.

For each model and `prefill_gemm` choice: an engine in the default configuration except for the
buckets (batch 1 and 8, prompts of 512: the executables these calls use), warmed up; then for
B = 1 and 8, `generate` on fresh random 512-token prompts (never a prefix-cache hit), 128 new
tokens, EOS off, greedy: `stats["ttft_s"]` and `stats["per_token_s"]` (medians of --repeats
calls); the pipelined decode step at position 512 (`profile.time_decode`); and the prompt
executable alone on the device (`prompts` call + first token on the host).

  PYTHONPATH=$PWD python3 benchmarks/user_latency_bench.py --models /tmp/ck/gpt2,/tmp/ck/llama-3.2-1b \
      --out $OUT/user_latency.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time

import jax
import numpy as np

from cg_jax import Engine, profile

def prompts_call_ms(engine, batch: int, rng, args) -> float:
  """The ("prompts", batch, prompt length) executable on fresh prompts with its first tokens on
  the host."""
  prompt = args.prompt_len
  exe = engine.executables.get(("prompts", batch, prompt))
  weights = engine.executables.steps.split.weights
  times = []
  for _ in range(args.repeats + 1):
    tokens = rng.integers(0, engine.model_config.vocab_size, (batch, prompt)).astype(np.int32)
    inputs = jax.device_put((tokens, np.full((batch,), prompt, np.int32), np.int32(0)),
                            engine.input_placement)
    cache = jax.block_until_ready(engine.kv_cache.get())
    start = time.perf_counter()
    first, _, cache = exe(weights, cache, *inputs)
    np.asarray(first)
    times.append(time.perf_counter() - start)
    engine.kv_cache.set(cache)
  return statistics.median(times[1:]) * 1e3


def run(model_dir: str, gemm: str, args, rng) -> list[dict]:
  prompt = args.prompt_len
  engine = Engine.from_pretrained(model_dir, dtype=args.dtype, max_seq_len=args.max_len,
                                  batch_buckets=(1, 8), prompt_buckets=(prompt,),
                                  prefill_gemm=None if gemm == "default" else gemm)
  start = time.perf_counter()
  engine.warmup(progress=False)
  warmup_s = time.perf_counter() - start
  rows = []
  vocab = engine.model_config.vocab_size
  for batch in (1, 8):
    ttft, per_token = [], []
    for _ in range(args.repeats + 1):
      prompts = rng.integers(0, vocab, (batch, prompt)).tolist()
      stats = engine.generate(prompts, max_new_tokens=args.new_tokens, eos_token_id=[]).stats
      ttft.append(stats["ttft_s"] * 1e3)
      per_token.append(stats["per_token_s"] * 1e6)
    step = profile.time_decode(engine, batch, position=prompt)["step_us"]
    row = dict(model=os.path.basename(model_dir.rstrip("/")), system="cg_jax", batch=batch,
               prefill_gemm=engine.config.prefill_gemm, prompt_len=prompt,
               new_tokens=args.new_tokens,
               ttft_ms=statistics.median(ttft[1:]), generate_token_us=statistics.median(
                   per_token[1:]), step_us=step,
               prompts_call_ms=prompts_call_ms(engine, batch, rng, args),
               warmup_s=warmup_s, executables=len(engine.executable_keys()))
    row["generate_token_over_step"] = row["generate_token_us"] / step
    rows.append(row)
    print(json.dumps(row), flush=True)
  engine.close()
  return rows


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--models", required=True, help="comma-separated checkpoint directories")
  parser.add_argument("--gemms", default="cublas,xla",
                      help="prefill_gemm values; 'default' is the engine's choice for the model")
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--prompt-len", type=int, default=512)
  parser.add_argument("--max-len", type=int, default=1024)
  parser.add_argument("--new-tokens", type=int, default=128)
  parser.add_argument("--dtype", default="bfloat16")
  parser.add_argument("--commit", default=os.environ.get("CG_JAX_COMMIT", "unknown"))
  parser.add_argument("--out", required=True)
  args = parser.parse_args()
  rng = np.random.default_rng(0)
  meta = dict(gpu=jax.devices()[0].device_kind, jax=jax.__version__, commit=args.commit,
              date=datetime.date.today().isoformat())
  rows = []
  for model in args.models.split(","):
    for gemm in args.gemms.split(","):
      try:
        rows += run(model, gemm, args, rng)
      except Exception as error:  # a failed configuration is a row
        rows.append(dict(model=model, prefill_gemm=gemm, error=f"{type(error).__name__}: "
                                                             f"{error}"[:500]))
      with open(args.out, "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
  print(f"\n{'model':14s} {'gemm':7s} {'B':>2s} {'ttft ms':>8s} {'prompts ms':>10s} "
        f"{'gen us/tok':>10s} {'step us':>8s} {'ratio':>6s}")
  for r in rows:
    if "error" in r:
      print(f"{r['model']:14s} {r['prefill_gemm']:7s} FAILED {r['error'][:100]}")
      continue
    print(f"{r['model']:14s} {r['prefill_gemm']:7s} {r['batch']:2d} {r['ttft_ms']:8.2f} "
          f"{r['prompts_call_ms']:10.2f} {r['generate_token_us']:10.1f} {r['step_us']:8.1f} "
          f"{r['generate_token_over_step']:6.3f}")


if __name__ == "__main__":
  main()
