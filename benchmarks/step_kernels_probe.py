"""One source tree (given by PYTHONPATH) at one row, as #32 / #33 compare trees: the time until
its engine is ready, B=1 `generate` TTFT and per token (512-token prompt, 128 new, greedy, EOS
off; 7 runs after 2, medians), decode steps at 1, 8, 32 and 64 rows (`profile.time_decode`,
position 512), device time per B=1 step by kernel and by kernel family
(`profile.profile_decode`, 10 steps), and for trees with a step table the optimized HLO of the
8-token step. Trees without `wait_for_final_steps` (before the token-budgeted step, e.g.
a7ac954) warm up one-row and eight-row executables of 512-token prompts; later ones warm up as
`serve` does and wait for their own decode steps.

  PYTHONSAFEPATH=1 PYTHONPATH=TREE python3 benchmarks/step_kernels_probe.py LABEL MODEL_DIR OUT_DIR

Environment: BATCHES (the step rows, default 1,8,32,64); THROUGHPUT=N adds #33's offline
workload as `bench throughput --client generate` runs it (N prompts of 64-480 random tokens,
128 new; median of three seeds; trees with the token-budgeted step); STEP_HLO=0 skips the HLO
file. (results/split_combine_h100.* came from c33959b's form: one unmeasured prompt set, then
three timed `generate` calls.)

Results: results/step_kernels_h100.*, results/b1_versions_h100.* (its `generate` part, then
benchmarks/b1_versions_probe.py of 1a2ab51, which warmed up one-row executables only)
"""
import collections
import json
import math
import os
import re
import statistics
import sys
import time

START = time.perf_counter()
os.environ.setdefault("CG_JAX_COMPILATION_CACHE", "off")  # (each tree compiles its own)

import jax  # noqa: E402
import numpy as np  # noqa: E402

from cg_jax import Engine, profile  # noqa: E402
from cg_jax.bench import throughput  # noqa: E402

BATCHES = tuple(int(b) for b in os.environ.get("BATCHES", "1,8,32,64").split(","))
THROUGHPUT = int(os.environ.get("THROUGHPUT", "0"))
PROFILED_STEPS = 10


def kernel_times(path: str) -> tuple[dict, dict, float]:
  """({kernel: [us per step, launches per step]}, {family: us per step}, launches per step)
  of a decode-step trace; a family is a kernel name without its numeric suffix."""
  events = profile._load_events(path)
  names = {e["pid"]: e.get("args", {}).get("name", "") for e in events
           if e.get("ph") == "M" and e.get("name") == "process_name"}
  device = {pid for pid, name in names.items() if "/device:" in name and "CPU" not in name}
  time, count = collections.Counter(), collections.Counter()
  for e in events:
    if e.get("ph") == "X" and e["pid"] in device and not re.search(
        "memset|memcpy", e.get("name", ""), re.I):
      time[e["name"]] += float(e.get("dur", 0)) / PROFILED_STEPS
      count[e["name"]] += 1
  families = collections.Counter()
  for name, t in time.items():
    families[re.sub(r"[._]\d+$", "", name)] += t
  kernels = {k: [round(t, 2), count[k] // PROFILED_STEPS] for k, t in time.most_common()}
  return (kernels, {k: round(t, 1) for k, t in families.most_common()},
          sum(count.values()) / PROFILED_STEPS)


def main(label: str, model: str, out_dir: str) -> None:
  engine = Engine.from_pretrained(model, max_seq_len=1024)
  if hasattr(engine, "wait_for_final_steps"):
    engine.warmup(progress=False)
    engine.wait_for_final_steps(600)
  else:
    engine.warmup(batch_sizes=[1, 8], prompt_lengths=[512], progress=False)
  row = {"label": label, "model": os.path.basename(model.rstrip("/")),
         "ready_s": round(time.perf_counter() - START, 1),
         "device": jax.devices()[0].device_kind, "jax": jax.__version__}
  for b in BATCHES:
    row[f"step_us_b{b}"] = profile.time_decode(engine, b, position=512, steps=32,
                                               repeats=5)["step_us"]
  _, path = profile.profile_decode(engine, 1, position=512, steps=PROFILED_STEPS)
  row["kernels_b1"], row["families_b1"], row["launches_b1"] = kernel_times(path)
  prompt = np.random.default_rng(0).integers(0, engine.model_config.vocab_size, 512).tolist()
  stats = [engine.generate([prompt], 128, eos_token_id=[]).stats for _ in range(9)][2:]
  row["b1_ttft_ms"] = statistics.median(s["ttft_s"] * 1e3 for s in stats)
  row["b1_per_token_us"] = statistics.median(s["per_token_s"] * 1e6 for s in stats)
  rate_key = f"throughput_{THROUGHPUT}_tok_s"
  if THROUGHPUT and hasattr(engine, "wait_for_final_steps"):
    # #33's offline workload as `bench throughput --client generate` runs it (THROUGHPUT
    # prompts of 64-480 random tokens, 128 new each, after an unmeasured pass), three seeds
    rates = []
    for seed in range(3):
      prompts, _, unmeasured = throughput.requests(THROUGHPUT, (64, 480), math.inf, seed,
                                                   engine.model_config.vocab_size)
      rates.append(throughput._generate(engine, prompts, unmeasured, 128)["tokens_per_s"])
    row[rate_key] = round(statistics.median(rates))
  if hasattr(engine, "wait_for_final_steps") and os.environ.get("STEP_HLO", "1") == "1":
    hlo = engine.executables.get(("step", 8)).as_text()
    with open(os.path.join(out_dir, f"step8_{label}.hlo.txt"), "w") as f:
      f.write(hlo)
  with open(os.path.join(out_dir, f"step_kernels_{label}.json"), "w") as f:
    json.dump(row, f, indent=1)
  steps = " ".join(f"B={b} {row[f'step_us_b{b}']:.1f}" for b in BATCHES)
  print(f"[{label}] ready {row['ready_s']} s | {steps} | B=1 generate TTFT "
        f"{row['b1_ttft_ms']:.2f} ms, {row['b1_per_token_us']:.1f} us/token; "
        f"{row['launches_b1']:.0f} kernels a B=1 step"
        + (f"; {THROUGHPUT} requests {row[rate_key]} tok/s" if rate_key in row else ""),
        flush=True)
  print("   " + ", ".join(f"{k[:36]} {t}" for k, t in list(row["families_b1"].items())[:16]),
        flush=True)


if __name__ == "__main__":
  main(*sys.argv[1:])
