"""The kernels of one greedy decode step, in order, and grouped by kernel kind (issue #18): the
engine's default configuration, batch B, position --position of a 2 x position cache; the step
time (`profile.time_decode`) and one step's kernels from a trace of 10 pipelined steps.

Kinds are kernel names without XLA's numeric suffix (`loop_add_fusion_3` -> `loop_add_fusion`),
with their count and summed duration per step; the optimized HLO names what each fusion holds.

  PYTHONPATH=$PWD python3 benchmarks/decode_kernels.py --checkpoint /tmp/ck/gpt2 --batch 32 \
      --out OUT
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import re
import time

import jax

from bench_util import git_commit
from cg_jax import Engine, profile


def step_kernels(path: str, steps: int) -> list[tuple[str, float, float]]:
  """(name, duration us, start us from the step's first kernel) of the trace's last step."""
  with gzip.open(path, "rt") as f:
    events = json.load(f)["traceEvents"]
  process = {e["pid"]: e.get("args", {}).get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
  kernels = sorted((float(e["ts"]), e.get("name", ""), float(e.get("dur", 0))) for e in events
                   if e.get("ph") == "X" and "/device:" in process.get(e["pid"], "")
                   and "CPU" not in process.get(e["pid"], ""))
  step = kernels[-(len(kernels) // steps):]
  return [(name, duration, start - step[0][0]) for start, name, duration in step]


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--checkpoint", required=True)
  ap.add_argument("--batch", type=int, default=1)
  ap.add_argument("--position", type=int, default=512)
  ap.add_argument("--compiler-option", action="append", default=[], metavar="NAME=VALUE",
                  help="an XLA option for every executable (Engine compiler_options)")
  ap.add_argument("--out", required=True)
  args = ap.parse_args()
  options = {}
  for item in args.compiler_option:
    key, value = item.split("=", 1)
    options[key] = {"true": True, "false": False}.get(value.lower(), value)
  name = os.path.basename(args.checkpoint.rstrip("/"))
  engine = Engine.from_pretrained(args.checkpoint, dtype="bfloat16",
                                  max_seq_len=2 * args.position, batch_buckets=(args.batch,),
                                  prompt_buckets=(min(64, args.position),),
                                  compiler_options=options)
  start = time.perf_counter()
  engine.warmup(phases=("decode",), progress=False)
  warmup_s = time.perf_counter() - start
  timing = profile.time_decode(engine, args.batch, position=args.position)
  report, path = profile.profile_decode(engine, args.batch, position=args.position, steps=10)
  kernels = step_kernels(path, 10)
  kinds = collections.defaultdict(lambda: [0, 0.0])
  for kernel, duration, _ in kernels:
    kind = kinds[re.sub(r"(_\d+)+$", "", kernel)[:60]]
    kind[0] += 1
    kind[1] += duration
  result = {"model": name, "batch": args.batch, "position": args.position,
            "commit": git_commit(), "jax": jax.__version__,
            "device": jax.devices()[0].device_kind, "date": time.strftime("%Y-%m-%d"),
            "compiler_options": options, "warmup_s": warmup_s, "step_us": timing["step_us"],
            "launch": report.as_dict(),
            "kinds": {k: {"kernels": c, "us": round(d, 1)}
                      for k, (c, d) in sorted(kinds.items(), key=lambda kv: -kv[1][1])},
            "step_kernels": [[k[:80], round(d, 2), round(s, 2)] for k, d, s in kernels]}
  label = "".join(f"_{k.removeprefix('xla_gpu_')}-{v}" for k, v in options.items())
  stem = f"decode_kernels_{name}_b{args.batch}{label}"
  with open(os.path.join(args.out, stem + ".json"), "w") as f:
    json.dump(result, f, indent=1)
  with gzip.open(os.path.join(args.out, stem + ".hlo.txt.gz"), "wt") as f:
    f.write(engine.executables.get(("decode", args.batch, True)).as_text())
  span = kernels[-1][2] + kernels[-1][1] if kernels else 0.0  # no device kernels on a CPU
  print(name, args.batch, options, f"warm-up {warmup_s:.1f} s, step {timing['step_us']:.1f} us,",
        f"{len(kernels)} kernels, span {span:.1f} us")
  for kind, row in list(result["kinds"].items())[:12]:
    print(f"  {kind:60s} {row['kernels']:4d} {row['us']:8.1f}")


if __name__ == "__main__":
  main()
