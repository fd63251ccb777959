"""Batch invariance on the GPU (issue #20): does one request's output depend on the batch around
it, and what does `batch_invariant=True` cost per decode step?

For each model, an engine in the default configuration and one with `batch_invariant=True`
(batch buckets 1, 8, 32; cache 1024): a 300-token target prompt, 256 greedy new tokens with
their log-probabilities (top 5), submitted alone, after 7 and after 31 other requests (which
decode alongside it: it lands in slot 7 or 31 and moves as they finish), on an engine without
the prefix cache, and after a request that leaves part of its prompt in the prefix cache. A row
per model, mode and batch: tokens and log-probabilities (float32, compared exactly) identical in
every case, and the decode step at position 512 at that batch with its ratio to the default
mode's.

  PYTHONPATH=$PWD python3 benchmarks/batch_invariance_bench.py --models /tmp/ck/gpt2,/tmp/ck/llama-3.2-1b \
      --out $OUT/batch_invariance.json
  python benchmarks/batch_invariance_bench.py --smoke --out /tmp/bi.json   # CPU, tiny model
"""

from __future__ import annotations

import argparse
import datetime
import json
import os

import jax
import numpy as np

from cg_jax import Engine, profile


def _case(engine, target, others: int, args, rng) -> tuple[list[int], list[float]]:
  """The target's tokens and log-probabilities after `others` requests were submitted."""
  vocab = engine.model_config.vocab_size
  low, high = args.other_lengths
  handles = [engine.submit(rng.integers(0, vocab, (int(rng.integers(low, high)),)).tolist(),
                           args.new_tokens, eos_token_id=[], do_sample=bool(i % 2),
                           temperature=0.8, seed=i) for i in range(others)]
  done = engine.submit(target, args.new_tokens, eos_token_id=[], logprobs=5).result()
  for handle in handles:
    handle.result()
  flat = [done.logprobs[i] for i in range(len(done.tokens))]
  flat += [p for top in done.top_logprobs for _, p in top]
  return done.tokens, flat


def run(model: str, args, invariant: bool, steps: dict | None) -> dict:
  options = dict(max_seq_len=args.max_len, batch_buckets=args.batches)
  if args.smoke:
    options["prompt_buckets"] = (16,)
  else:
    options["dtype"] = "bfloat16"
  engine = Engine.from_pretrained(model, batch_invariant=invariant, **options)
  engine.warmup(phases=("step", "logprobs"),
                progress=False)
  rng = np.random.default_rng(0)
  vocab = engine.model_config.vocab_size
  target = rng.integers(0, vocab, (args.prompt_len,)).tolist()
  results = {}
  engine.reset_prefix_cache()
  results["alone"] = _case(engine, target, 0, args, rng)
  for others in (7, 31) if not args.smoke else (3, 15):
    engine.reset_prefix_cache()
    results[f"among_{others}"] = _case(engine, target, others, args, rng)
  engine.reset_prefix_cache()
  # A request sharing the first 15/16 of the target's prompt: its blocks are a prefix-cache hit.
  shared = target[:args.prompt_len - args.prompt_len // 16] + rng.integers(0, vocab, (8,)).tolist()
  engine.submit(shared, 2, eos_token_id=[]).result()
  results["prefix_hit"] = _case(engine, target, 0, args, rng)
  hit_tokens = engine.stats()["prefix_cache_hit_tokens"]
  engine.close()  # frees its KV cache for the next engine's (sized from device memory on a GPU)
  off = Engine.from_pretrained(model, batch_invariant=invariant, prefix_cache_tokens=0, **options)
  results["prefix_off"] = _case(off, target, 0, args, rng)
  off.close()
  reference = results["alone"]
  row = dict(model=os.path.basename(model.rstrip("/")), batch_invariant=invariant,
             cases=sorted(results), new_tokens=args.new_tokens, prefix_hit_tokens=hit_tokens,
             tokens_identical_across_batches=all(r[0] == reference[0] for r in results.values()),
             logprobs_identical=all(r[1] == reference[1] for r in results.values()),
             first_divergence={name: next((i for i, (a, b) in enumerate(
                 zip(r[0], reference[0])) if a != b), None) for name, r in results.items()})
  position = min(512, args.max_len // 2)
  row["step_us"] = {str(b): profile.time_decode(engine, b, position=position)["step_us"]
                    for b in args.batches if b in (1, 8, 32) or args.smoke}
  if steps is not None:
    row["cost_ratio"] = {b: row["step_us"][b] / steps[b] for b in row["step_us"]}
  engine.close()
  print(json.dumps(row), flush=True)
  return row


def per_batch(row: dict, meta: dict) -> list[dict]:
  """One row per batch (the correctness fields are the run's over every case)."""
  out = []
  for batch, step in row["step_us"].items():
    flat = {k: v for k, v in row.items() if k not in ("step_us", "cost_ratio")}
    flat.update(meta, batch=int(batch), step_us=step)
    if "cost_ratio" in row:
      flat["cost_ratio"] = row["cost_ratio"][batch]
    out.append(flat)
  return out


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--models", default=None)
  parser.add_argument("--out", required=True)
  parser.add_argument("--smoke", action="store_true")
  parser.add_argument("--commit", default=os.environ.get("CG_JAX_COMMIT", "unknown"))
  args = parser.parse_args()
  if args.smoke:
    args.models = args.models or "tiny-llama"
    args.max_len, args.batches, args.prompt_len, args.new_tokens = 64, (1, 4, 16), 37, 12
    args.other_lengths = (3, 30)
  else:
    args.max_len, args.batches, args.prompt_len, args.new_tokens = 1024, (1, 8, 32), 300, 256
    args.other_lengths = (64, 400)
  meta = dict(gpu=jax.devices()[0].device_kind, jax=jax.__version__, commit=args.commit,
              date=datetime.date.today().isoformat())
  rows = []
  for model in args.models.split(","):
    default = run(model, args, False, None)
    invariant = run(model, args, True, default["step_us"])
    rows += per_batch(default, meta) + per_batch(invariant, meta)
    with open(args.out, "w") as f:
      json.dump(dict(meta=meta, rows=rows), f, indent=1)
  print(f"\n{'model':14s} {'invariant':9s} {'B':>3s} {'tokens same':11s} {'logprobs same':13s} "
        f"{'step us':>8s} cost ratio")
  for r in rows:
    print(f"{r['model']:14s} {str(r['batch_invariant']):9s} {r['batch']:3d} "
          f"{str(r['tokens_identical_across_batches']):11s} {str(r['logprobs_identical']):13s} "
          f"{r['step_us']:8.1f} {r.get('cost_ratio', '-')}")


if __name__ == "__main__":
  main()
