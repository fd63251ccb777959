"""Shared pieces of the study scripts beside it: call timing, errors and their rows.
(`cg_jax.bench.rows.git_commit` names the commit.)"""

from __future__ import annotations

import json
import os
import statistics
import time

# The H200's measured device-to-device copy bandwidth (../shared/gpu-facts.md): the HBM ceiling
# every floor and bandwidth share is computed against.
HBM_BYTES_PER_S = 4.2e12


def median_s(fn, repeats: int = 5) -> float:
  """Median wall seconds of `fn()` (called once first, untimed): for calls that finish their
  own work (block or read back) before returning."""
  fn()
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def median_call_us(fn, *args, calls: int = 20, rounds: int = 7) -> float:
  """Per-call time (us) of `calls` back-to-back calls of a JAX function (the queue stays full,
  so host dispatch hides behind the kernels as in a decode step), median over rounds; the
  first call (compile, warm-up) is excluded."""
  import jax

  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(rounds):
    start = time.perf_counter()
    for _ in range(calls):
      out = fn(*args)
    jax.block_until_ready(out)
    times.append((time.perf_counter() - start) / calls)
  return statistics.median(times) * 1e6


def fastest(candidates, timing, *args):
  """The fastest of `candidates`, (label, function) pairs, each called on `args` and timed with
  `timing(function, *args)` (microseconds): returns (us, label, function)."""
  best = None
  for label, function in candidates:
    us = timing(function, *args)
    if best is None or us < best[0]:
      best = (us, label, function)
  return best


def relative_error(out, reference) -> float:
  """max|out - reference| / max|reference|, in float64."""
  import numpy as np

  out, reference = np.asarray(out, np.float64), np.asarray(reference, np.float64)
  return float(np.max(np.abs(out - reference)) / max(np.max(np.abs(reference)), 1e-30))


def write_rows(out_dir: str, name: str, rows: list) -> str:
  """Write benchmark rows as a JSON list to out_dir/name; returns the path."""
  os.makedirs(out_dir, exist_ok=True)
  path = os.path.join(out_dir, name)
  with open(path, "w") as f:
    json.dump(rows, f, indent=1)
  return path


def failed_row(meta: dict, error: BaseException, label: str, **fields) -> dict:
  """A row for a configuration that raised (the run goes on with the next one): prints it."""
  message = f"{type(error).__name__}: {error}"[:2000]
  print(f"{label}: FAILED {message[:300]}", flush=True)
  return dict(meta, **fields, status="failed", error=message)
