"""Where a `generate` call's time to first token goes (issue #18): for B prompts of 512 tokens,
`generate(max_new_tokens=1).stats['ttft_s']` (greedy, and sampled), its host timeline (submit ->
engine thread -> prompt call -> dispatched -> outputs ready -> first token emitted -> caller),
the scheduler's "prompts" executable alone on pre-staged inputs, the GPU kernels of one prompt
call, and the host events of a jax.profiler trace of `generate` calls per thread (the raw
traces go to OUT/traces). `--decode-trace` adds a profile of the B=1 decode step and the
optimized HLO of it and of the B=1 prompt executable (OUT/traces).

Runs on any cg_jax tree on PYTHONPATH that has `Engine.generate` (an older commit too: the
prompt executable is called with the arguments its signature takes).

  PYTHONPATH=$PWD python3 benchmarks/ttft_probe.py --checkpoint /tmp/ck/gpt2 --out OUT
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import statistics
import tempfile
import time

import jax
import numpy as np
from bench_util import median_s, prompt_probe_parser
from decode_kernels import step_kernels

from cg_jax import Engine, profile
from cg_jax.core import scheduler as scheduler_module

# Scheduler methods whose entry the timeline marks (engine thread).
_MARKED = ("_iteration", "_prefill", "_first_chunks", "_join", "_deliver")


def timeline(engine, call, runs=9) -> dict[str, float]:
  """Median times (ms, from the submit) of a `generate` call's steps: the engine thread's
  iterations and prompt path (first entry of each marked method), the prompt executable's
  call, return (dispatched) and ready outputs, the first token's emit and the caller's
  return."""
  marks: dict[str, float] = {}
  scheduler, table = engine._scheduler, engine._scheduler.table
  get, submit = table.get, scheduler.submit
  saved = {name: getattr(scheduler_module.Scheduler, name) for name in _MARKED}
  emit = scheduler_module.Group._emit

  def marked(name, method):
    def run(*args, **kwargs):
      marks.setdefault(name, time.perf_counter())
      return method(*args, **kwargs)
    return run

  def timed_get(key):
    executable = get(key)
    if key[0] != "prompts":
      return executable

    def run(*args):
      marks["call"] = time.perf_counter()
      outputs = executable(*args)
      marks["dispatched"] = time.perf_counter()
      jax.block_until_ready(outputs)
      marks["ready"] = time.perf_counter()
      return outputs
    return run

  def timed_submit(*args, **kwargs):
    marks["submit"] = time.perf_counter()
    return submit(*args, **kwargs)

  for name, method in saved.items():
    setattr(scheduler_module.Scheduler, name, marked(name, method))
  scheduler_module.Group._emit = marked("emit", emit)
  table.get, scheduler.submit = timed_get, timed_submit
  rows = []
  try:
    for _ in range(runs):
      marks.clear()
      call()
      marks["returned"] = time.perf_counter()
      rows.append({k: (v - marks["submit"]) * 1e3 for k, v in marks.items() if k != "submit"})
  finally:
    del table.get, scheduler.submit
    for name, method in saved.items():
      setattr(scheduler_module.Scheduler, name, method)
    scheduler_module.Group._emit = emit
  keys = [k for k in rows[-1] if all(k in r for r in rows[1:])]
  return dict(sorted(((k, statistics.median(r[k] for r in rows[1:])) for k in keys),
                     key=lambda kv: kv[1]))


def host_trace(call, logdir: str, calls: int = 5, top: int = 40) -> dict:
  """A jax.profiler trace of `calls` calls (after one untraced; Python functions not traced,
  the runtime's host events verbose): the host events per call by thread and name, the largest
  first, and the device-side launch report."""
  call()
  options = jax.profiler.ProfileOptions()
  options.python_tracer_level, options.host_tracer_level = 0, 3
  with jax.profiler.trace(logdir, profiler_options=options):
    for _ in range(calls):
      call()
  path = profile.find_trace(logdir)
  with gzip.open(path, "rt") as f:
    events = json.load(f)["traceEvents"]
  process = {e["pid"]: e.get("args", {}).get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
  thread = {(e["pid"], e["tid"]): e.get("args", {}).get("name", "") for e in events
            if e.get("ph") == "M" and e.get("name") == "thread_name"}
  totals: dict[tuple[str, str], list[float]] = {}
  for e in events:
    if e.get("ph") != "X" or "/device:" in process.get(e["pid"], ""):
      continue
    key = (thread.get((e["pid"], e["tid"]), str(e["tid"])), e.get("name", "")[:90])
    entry = totals.setdefault(key, [0, 0.0])
    entry[0] += 1
    entry[1] += float(e.get("dur", 0))
  ranked = sorted(totals.items(), key=lambda kv: -kv[1][1])[:top]
  return {"trace": path,
          "host_events": [{"thread": t, "name": n, "per_call": c / calls, "us_per_call": d / calls}
                          for (t, n), (c, d) in ranked],
          "launch": profile.parse_trace(path, calls).as_dict()}


def prompts_alone(engine, batch: int, length: int, rng, repeats: int = 10):
  """The prompts executable on pre-staged inputs, first tokens read back (ms), and a function
  running it once (for the kernel profile)."""
  table = engine.executables
  exe = table.get(("prompts", batch, length))
  weights = table.steps.split.weights
  vocab = engine.model_config.vocab_size
  tokens = rng.integers(0, vocab, (batch, length)).astype(np.int32)
  inputs = [tokens, np.full((batch,), length, np.int32), np.int32(0)]
  # An older tree's prompt executables also take sampling arrays (greedy here).
  if len(table.signature(("prompts", batch, length))[1]) > 5:
    inputs.append(engine._scheduler._sampling([None] * batch, batch))
  inputs = jax.device_put(tuple(inputs), engine.input_placement)

  def once():
    with engine._scheduler.exclusive():
      new, _, cache = exe(weights, engine.kv_cache.get(), *inputs)
      engine.kv_cache.set(cache)
      return np.asarray(new)
  return median_s(once, repeats) * 1e3, once


def decode_trace(engine, position: int, out: str) -> dict:
  """The B=1 greedy decode step's launch report at `position` and its kernels in order (one
  step), with the step's and the B=1 prompt executable's optimized HLO written under `out`."""
  report, path = profile.profile_decode(engine, 1, position=position, steps=10)
  shutil.copy(path, os.path.join(out, "decode_b1.trace.json.gz"))
  table = engine.executables
  for key in (("decode", 1, True), ("prompts", 1, engine.config.buckets.prompt_lengths[0])):
    with gzip.open(os.path.join(out, f"{key[0]}_b1.hlo.txt.gz"), "wt") as f:
      f.write(table.get(key).as_text())
  return {"launch": report.as_dict(),
          "step_kernels": [[name[:80], round(duration, 2), round(start, 2)]
                           for name, duration, start in step_kernels(path, 10)]}


def main():
  ap = prompt_probe_parser()
  ap.add_argument("--label", default=os.environ.get("CG_JAX_COMMIT", "unknown"),
                  help="names this tree's rows (its commit)")
  ap.add_argument("--decode-trace", action="store_true")
  args = ap.parse_args()
  length, batches = args.prompt_len, tuple(int(b) for b in args.batches.split(","))
  name = os.path.basename(args.checkpoint.rstrip("/"))
  traces = os.path.join(args.out, "traces", f"{name}-{args.label[:7]}")
  os.makedirs(traces, exist_ok=True)
  engine = Engine.from_pretrained(args.checkpoint, dtype="bfloat16", max_seq_len=2 * length,
                                  batch_buckets=batches, prompt_buckets=(length,))
  start = time.perf_counter()
  engine.warmup(phases=("prompts", "prefix"), progress=False)
  vocab = engine.model_config.vocab_size
  rng = np.random.default_rng(0)
  result = {"model": name, "commit": args.label, "jax": jax.__version__,
            "device": jax.devices()[0].device_kind, "date": time.strftime("%Y-%m-%d"),
            "warmup_s": time.perf_counter() - start}
  for batch in batches:
    def generate(**sampling):
      prompts = rng.integers(0, vocab, (batch, length)).tolist()
      return engine.generate(prompts, max_new_tokens=1, eos_token_id=[],
                             **sampling).stats["ttft_s"] * 1e3
    sampled = dict(do_sample=True, temperature=0.8, top_p=0.9, seed=1)
    row = {}
    row["prompts_alone_ms"], once = prompts_alone(engine, batch, length, rng)
    generate()
    row["generate_ttft_ms"] = statistics.median(generate() for _ in range(9))
    generate(**sampled)
    row["generate_sampled_ttft_ms"] = statistics.median(generate(**sampled) for _ in range(9))
    row["timeline_ms"] = timeline(engine, generate)
    report = profile.profile_calls(once, 3)
    row["prompts_kernels"] = {"kernels_per_call": report.kernels_per_step,
                              "gpu_busy_us": report.gpu_busy_us,
                              "graph_launches_per_call": report.graph_launches_per_step,
                              "top": [list(k) for k in report.top_kernels]}
    logdir = tempfile.mkdtemp(prefix="ttft_trace_")
    row["generate_trace"] = host_trace(generate, logdir)
    shutil.copy(row["generate_trace"].pop("trace"), os.path.join(traces, f"generate_b{batch}"
                                                                  ".trace.json.gz"))
    result[f"b{batch}"] = row
    print(name, args.label[:7], batch, {k: round(v, 3) for k, v in row.items()
                                        if k.endswith("ms") and isinstance(v, float)},
          {k: round(v, 2) for k, v in row["timeline_ms"].items()},
          round(report.gpu_busy_us), flush=True)
  if args.decode_trace:
    result["decode_b1"] = decode_trace(engine, length, traces)
  with open(os.path.join(args.out, f"ttft_{name}_{args.label[:7]}.json"), "w") as f:
    json.dump(result, f, indent=1)


if __name__ == "__main__":
  main()
