"""Start-up time with JAX's persistent compilation cache: a cold start, then a second start.

Each start is its own process (model load + `engine.warmup()` of every executable) against one
fresh cache directory.

  python benchmarks/startup_time.py [--model tiny-llama] [--dtype float32]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

_START = """
import json, time
t0 = time.perf_counter()
from cg_jax import Engine
engine = Engine.from_pretrained({model!r}, dtype={dtype!r})
t1 = time.perf_counter()
engine.warmup(progress=False)
t2 = time.perf_counter()
stats = engine.stats()
print(json.dumps(dict(load_s=t1 - t0, warmup_s=t2 - t1, executables=stats["executables"],
                      cache_hits=stats["persistent_cache_hits"])))
"""


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--model", default="tiny-llama")
  parser.add_argument("--dtype", default="float32")
  args = parser.parse_args()
  cache = tempfile.mkdtemp(prefix="cg_jax_cache_")
  env = dict(os.environ, CG_JAX_COMPILATION_CACHE=cache)
  code = _START.format(model=args.model, dtype=args.dtype)
  for name in ("cold start", "second start"):
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout
    run = json.loads(out.strip().splitlines()[-1])
    print(f"{name:12s} load {run['load_s']:6.2f} s  warmup {run['warmup_s']:7.2f} s  "
          f"({run['executables']} executables, {run['cache_hits']} from the cache)")


if __name__ == "__main__":
  main()
