"""B=1 `generate` of one source tree, as #33 compares trees: a 512-token random prompt, 128 new
tokens, greedy, EOS off; nine runs, the first two dropped; TTFT and per-token medians. Trees
without `wait_for_final_steps` (before the token-budgeted step, e.g. a7ac954) warm up only the
executables of one row and a 512-token prompt (`warmup(batch_sizes=[1], prompt_lengths=[512])`);
later ones warm up as `serve` does and wait for their own decode steps.

  PYTHONSAFEPATH=1 PYTHONPATH=TREE python3 benchmarks/b1_versions_probe.py LABEL MODEL_DIR OUT.jsonl

Results: results/b1_versions_h100.*
"""
import json
import os
import statistics
import sys
import time

START = time.perf_counter()
import jax  # noqa: E402
import numpy as np  # noqa: E402

from cg_jax import Engine  # noqa: E402


def main(label: str, model: str, out: str) -> None:
  engine = Engine.from_pretrained(model, max_seq_len=1024)
  if hasattr(engine, "wait_for_final_steps"):
    engine.warmup(progress=False)
    engine.wait_for_final_steps(600)
  else:
    engine.warmup(batch_sizes=[1], prompt_lengths=[512], progress=False)
  ready = time.perf_counter() - START
  prompt = np.random.default_rng(0).integers(0, engine.model_config.vocab_size, 512).tolist()
  stats = [engine.generate([prompt], 128, eos_token_id=[]).stats for _ in range(9)][2:]
  row = dict(label=label, model=os.path.basename(model.rstrip("/")), ready_s=round(ready, 1),
             ttft_ms=[round(s["ttft_s"] * 1e3, 3) for s in stats],
             per_token_us=[round(s["per_token_s"] * 1e6, 1) for s in stats],
             device=jax.devices()[0].device_kind, jax=jax.__version__)
  row["ttft_ms_median"] = statistics.median(row["ttft_ms"])
  row["per_token_us_median"] = statistics.median(row["per_token_us"])
  with open(out, "a") as f:
    f.write(json.dumps(row) + "\n")
  print(f"[{label}] ready {ready:.1f} s  TTFT {row['ttft_ms_median']:.2f} ms  per token "
        f"{row['per_token_us_median']:.1f} us", flush=True)


if __name__ == "__main__":
  main(*sys.argv[1:])
