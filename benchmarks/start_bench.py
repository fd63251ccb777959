"""Engine start-up: cold, from XLA's persistent compilation cache alone, and from the stored
executables, each start in a fresh process sharing one cache directory.

  python benchmarks/start_bench.py --model kjv-llama-6m --out start.json

Each start times the import, `Engine.from_pretrained(model)` and the default `warmup()`, and
generates 8 greedy tokens (all three must agree). Results: `results/start_<device>.*`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

START = """
import json, sys, time
start = time.perf_counter()
from cg_jax import Engine
engine = Engine.from_pretrained(sys.argv[1])
engine.warmup(progress=False)
stats = engine.stats()
print(json.dumps({"start_s": round(time.perf_counter() - start, 1),
                  "executables": stats["executables"],
                  "executables_loaded": stats["executables_loaded"],
                  "xla_cache_hits": stats["persistent_cache_hits"],
                  "tokens": list(engine.generate([[3, 4, 5, 6]], 8, eos_token_id=[]))}))
"""


def start(model: str, cache: str) -> dict:
  env = dict(os.environ, CG_JAX_COMPILATION_CACHE=cache)
  out = subprocess.run([sys.executable, "-c", START, model], env=env, check=True,
                       capture_output=True, text=True).stdout
  return json.loads(out.strip().splitlines()[-1])


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--model", default="kjv-llama-6m")
  parser.add_argument("--out", required=True)
  args = parser.parse_args()
  cache = tempfile.mkdtemp()
  rows = [dict(start(args.model, cache), start="cold")]
  rows.append(dict(start(args.model, cache), start="stored executables"))
  shutil.rmtree(os.path.join(cache, "executables"))
  rows.append(dict(start(args.model, cache), start="XLA persistent cache only"))
  assert all(r["tokens"] == rows[0]["tokens"] for r in rows), rows
  with open(args.out, "w") as f:
    json.dump([dict(r, model=args.model) for r in rows], f, indent=1)
  for r in rows:
    print(f"{r['start']:28s} {r['start_s']:8.1f} s  loaded {r['executables_loaded']:3d}  "
          f"XLA cache hits {r['xla_cache_hits']:3d}")


if __name__ == "__main__":
  main()
