"""Time to first token under each CUDA-graph mode of the prompt executables (issue #18): for B
prompts of 512 tokens, `generate(max_new_tokens=1)`'s `ttft_s` (back to back, and after 50 ms
idle) with the engine's executables in graph mode `full` (the default) or `off`, and one
prompt call's profile (kernels, graph launches, host dispatch). With one new token no decode
step runs, so the mode acts on the prompt executable alone.

  PYTHONPATH=$PWD python3 benchmarks/prefill_graphs_probe.py --checkpoints /tmp/ck/gpt2,... --out F
"""

from __future__ import annotations

import argparse
import datetime
import json
import os

import jax
import numpy as np

from bench_util import generate_ttft_ms
from cg_jax import Engine, profile


def prompt_profile(engine, batch, length, calls=3):
  rng = np.random.default_rng(0)
  vocab = engine.model_config.vocab_size
  prompts = rng.integers(0, vocab, (batch, length)).tolist()
  report = profile.profile_calls(
      lambda: engine.generate(prompts, max_new_tokens=1, eos_token_id=[]), calls)
  return {k: report.as_dict()[k] for k in ("kernels_per_step", "graph_launches_per_step",
                                           "host_dispatch_us", "gpu_busy_us")}


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--checkpoints", required=True)
  ap.add_argument("--out", required=True)
  ap.add_argument("--modes", default="full,off")
  ap.add_argument("--prompt-len", type=int, default=512, help="CPU smoke run: 64")
  args = ap.parse_args()
  length = args.prompt_len
  meta = dict(gpu=jax.devices()[0].device_kind, jax=jax.__version__,
              commit=os.environ.get("CG_JAX_COMMIT"), date=datetime.date.today().isoformat(),
              prompt_len=length, max_seq_len=2 * length)
  rows = []
  for checkpoint in args.checkpoints.split(","):
    for mode in args.modes.split(","):
      engine = Engine.from_pretrained(checkpoint, dtype="bfloat16", max_seq_len=2 * length,
                                      batch_buckets=(1, 8), prompt_buckets=(length,),
                                      graphs=mode, compilation_cache=False)
      engine.warmup(progress=False)  # the serving phases: nothing compiles inside the profile
      for batch in (1, 8):
        row = dict(model=os.path.basename(checkpoint.rstrip("/")), graphs=mode, batch=batch,
                   ttft_ms=generate_ttft_ms(engine, batch, length, np.random.default_rng(batch), 8),
                   ttft_idle_ms=generate_ttft_ms(engine, batch, length,
                                                 np.random.default_rng(batch), 8, idle_s=0.05),
                   **prompt_profile(engine, batch, length))
        rows.append(row)
        print(json.dumps(row), flush=True)
        with open(args.out, "w") as f:
          json.dump(dict(meta=meta, rows=rows), f, indent=1)
      engine.close()
  print(f"\n{'model':14s} {'graphs':6s} {'B':>2s} {'ttft':>7s} {'idle':>7s} {'kernels':>7s} "
        f"{'graphs':>6s} {'dispatch':>8s} {'busy':>7s}")
  for r in rows:
    print(f"{r['model']:14s} {r['graphs']:6s} {r['batch']:2d} {r['ttft_ms']:7.2f} "
          f"{r['ttft_idle_ms']:7.2f} {r['kernels_per_step']:7.0f} "
          f"{r['graph_launches_per_step']:6.1f} {r['host_dispatch_us']:8.0f} "
          f"{r['gpu_busy_us']:7.0f}")


if __name__ == "__main__":
  main()
