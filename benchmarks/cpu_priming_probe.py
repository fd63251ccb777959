"""What a step's first call costs off the GPU, and what priming buys against it (CPU).

One fresh engine per run (its weights untouched since they were placed): the serving
executables built (stored or compiled), then, with `--prime none`, nothing else, with
`--prime warmup`, `Engine.warmup()` (its priming, `ExecutableTable.priming`), and with
`--prime all`, every step run once on empty rows as warm-up did before a881e17. Then two
requests (prompts of 30 and 200 random ids, 4 new tokens, greedy) timed through `generate`,
and the same two again: "first" minus "again" is what the first requests pay for first calls.

  python benchmarks/cpu_priming_probe.py --model DIR --prime none|warmup|all

Results: results/startup_cpu.md.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from cg_jax import Engine
from cg_jax.core.executables import SERVING_PHASES


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", required=True)
  parser.add_argument("--prime", choices=("none", "warmup", "all"), required=True)
  args = parser.parse_args()
  engine = Engine.from_pretrained(args.model, max_seq_len=512)
  keys = engine.executable_keys(phases=SERVING_PHASES)
  start = time.perf_counter()
  engine.executables.compile(keys, progress=False)
  built = time.perf_counter() - start
  if args.prime == "warmup":
    engine.warmup(progress=False)
  elif args.prime == "all":
    table, scheduler = engine.executables, engine._scheduler
    with engine._lock:  # (each step once: what warm-up's priming did off the GPU before)
      table.priming = lambda keys: (sorted((k for k in keys if k[0] == "step"),
                                           key=lambda k: k[1]), 1)
      scheduler.prime(keys)
      del table.priming
  primed = time.perf_counter() - start - built
  rng = np.random.default_rng(0)

  def timed(length: int) -> float:
    prompt = rng.integers(5, 200, (length,)).tolist()
    start = time.perf_counter()
    engine.generate([prompt], max_new_tokens=4, eos_token_id=[])
    return time.perf_counter() - start

  first = [timed(n) for n in (30, 200)]
  again = [timed(n) for n in (30, 200)]
  print(json.dumps(dict(model=args.model, prime=args.prime, executables_s=round(built, 3),
                        priming_s=round(primed, 3), first_s=[round(x, 3) for x in first],
                        again_s=[round(x, 3) for x in again])))
  engine.close()


if __name__ == "__main__":
  main()
