"""One source tree (given by PYTHONPATH) at one row, as #32 / #33 compare trees (several in one
device call: `trees_ab.sh`): the time until its engine is ready and its slowest compiles, B=1
`generate` TTFT and per token (a fresh 512-token prompt each run, 128 new, greedy, EOS off; 7
runs after 2, medians; GENERATE_BATCHES=1,8,32 for B prompts a run, their first and last rows'
TTFT, the call's total and its steady decode: (total - last TTFT) / 127),
decode steps at 1, 8, 32 and 64 rows
(`profile.time_decode`, position 512), device time per step by kernel and by kernel family
(`profile.profile_decode`, 10 steps) with its launch accounting (`profile.parse_trace`: graph
launches, kernels outside graphs, GPU-busy time), and for trees with a step table the
optimized HLO of the 8-token step. Trees without `wait_for_final_steps` (before the
token-budgeted step, e.g. a7ac954) warm up one-row and eight-row executables of 512-token
prompts; later ones warm up as `serve` does and wait for their own decode steps.

  PYTHONSAFEPATH=1 PYTHONPATH=TREE python3 benchmarks/step_kernels_probe.py LABEL MODEL_DIR OUT_DIR

Environment: BATCHES (the step rows, default 1,8,32,64); PROFILE_ROWS (default 1) the rows of
the profiled steps; THROUGHPUT=N[,N2..] adds #33's offline workload as `bench throughput
--client generate` runs it (N prompts of 64-480 random tokens, 128 new; median of three seeds;
trees with the token-budgeted step), and PROFILE_THROUGHPUT=1 one more run of the first N under
the profiler (GPU-busy time against the wall, kernels by family and by executable); STEP_HLO=0
skips the HLO file; ENGINE_OPTIONS a JSON object of more `Engine` options; RAGGED_DECODE a
JSON object of the ragged kernel's decode-tile config fields (e.g. '{"min_programs": 256}');
PROFILE_PROMPTS=1,32 traces the first tokens of one `generate` of that many more 512-token
prompts (`prompt_profile`, `prompts_32_profile`: wall, GPU busy, kernels by family and by
executable); GENERATE_PROFILE=1,8 traces `generate`'s own decode steps at those rows
(`generate_steps`).
(results/split_combine_h100.* came from c33959b's form: one unmeasured prompt set, then three
timed `generate` calls. Until 2026-12-07 the B=1 rows repeated one
prompt, so their TTFT after the first run was a prefix-cache hit of seven of its eight pages.)

Results: results/step_kernels_h100.*, results/b1_versions_h100.*, results/split_combine_*,
results/page_size_h100.*, results/first_tokens_behind_h100.*, results/decode_min_programs_h100.*,
results/wide_decode_h100.*
"""
import collections
import dataclasses
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
try:  # (trees before `cg_jax bench`, e.g. a7ac954, have no throughput rows)
  from cg_jax.bench import throughput  # noqa: E402
except ImportError:
  throughput = None

BATCHES = tuple(int(b) for b in os.environ.get("BATCHES", "1,8,32,64").split(","))
PROFILE_ROWS = tuple(int(b) for b in os.environ.get("PROFILE_ROWS", "1").split(",") if b)
GENERATE_BATCHES = tuple(int(b) for b in os.environ.get("GENERATE_BATCHES", "1").split(","))
PROFILE_PROMPTS = tuple(int(b) for b in os.environ.get("PROFILE_PROMPTS", "").split(",") if b)
GENERATE_PROFILE = tuple(int(b) for b in os.environ.get("GENERATE_PROFILE", "").split(",") if b)
THROUGHPUT = tuple(int(n) for n in os.environ.get("THROUGHPUT", "").split(",") if n and int(n))
PROFILED_STEPS = 10
OPTIONS = json.loads(os.environ.get("ENGINE_OPTIONS", "{}"))  # more `Engine` options
# Fields of the ragged kernel's decode-tile config (`RaggedPagedAttentionConfig`) for A/B runs:
# the engine's paged attention is built with them (steps of at most max_num_seqs tokens).
RAGGED_DECODE = json.loads(os.environ.get("RAGGED_DECODE", "{}"))
if RAGGED_DECODE:
  from cg_jax.core import attention as _attention
  _paged_for_forward = _attention.paged_for_forward

  def _paged_with_decode_config(config, mesh=None):
    paged = _paged_for_forward(config, mesh)
    return dataclasses.replace(paged, config=dataclasses.replace(paged.config, **RAGGED_DECODE))
  _attention.paged_for_forward = _paged_with_decode_config


def device_kernels(events: list[dict]) -> list[dict]:
  """The GPU's kernel events ("X") among a trace's events (trees without `profile.gpu_pids`,
  e.g. a7ac954: the processes jax.profiler names "/device:GPU:N")."""
  if hasattr(profile, "gpu_pids"):
    device = profile.gpu_pids(events)
  else:
    names = {e["pid"]: e.get("args", {}).get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    device = {pid for pid, name in names.items() if "/device:GPU" in name}
  return [e for e in events if e.get("ph") == "X" and e["pid"] in device]


def kernel_times(kernels: list[dict], steps: int = PROFILED_STEPS) -> tuple[dict, dict, float]:
  """({kernel: [us per step, launches per step]}, {family: us per step}, launches per step)
  of the kernel events of `steps` steps, copies left out; a family is a kernel name without its
  numeric suffix."""
  time, count = collections.Counter(), collections.Counter()
  for e in kernels:
    if not re.search("memset|memcpy", e.get("name", ""), re.I):
      time[e["name"]] += float(e.get("dur", 0)) / steps
      count[e["name"]] += 1
  families = collections.Counter()
  for name, t in time.items():
    families[re.sub(r"[._]\d+$", "", name)] += t
  by_kernel = {k: [round(t, 2), count[k] // steps] for k, t in time.most_common()}
  return (by_kernel, {k: round(t, 1) for k, t in families.most_common()},
          sum(count.values()) / steps)


def traced(run, name: str, unit: str, top: int) -> dict:
  """run() under the profiler (trace in /tmp/name): its wall and GPU-busy time, kernels, and
  kernel time by executable (overlaps counted twice) and by family (the `top` first), in `unit`
  ("ms" or "us")."""
  logdir = os.path.join("/tmp", name)
  with jax.profiler.trace(logdir):
    start = time.perf_counter()
    run()
    wall = time.perf_counter() - start
  events = profile._load_events(profile.find_trace(logdir))
  kernels = device_kernels(events)
  _, families, launches = kernel_times(kernels, steps=1)
  busy = profile.parse_trace({"traceEvents": events}, steps=1).gpu_busy_us
  modules = collections.Counter()
  for e in kernels:
    if "hlo_module" in e.get("args", {}):
      modules[e["args"]["hlo_module"]] += float(e.get("dur", 0))
  per = {"ms": 1e3, "us": 1.0}[unit]  # microseconds a unit
  return {f"wall_{unit}": round(wall * 1e6 / per, 1), f"gpu_busy_{unit}": round(busy / per, 1),
          "kernels": launches,
          f"modules_{unit}": {k: round(v / per, 1) for k, v in modules.most_common(12)},
          f"families_{unit}": {k: round(v / per, 2) for k, v in list(families.items())[:top]}}


def generate_steps(engine, rows: int, rng, label: str) -> dict:
  """`generate`'s own decode steps at `rows` rows: two traced calls on fresh 512-token prompts,
  of 1 and of 129 new tokens; their difference over 128 steps (wall, GPU busy, kernels, device
  time by kernel family; us a step)."""
  def run(new):
    prompts = [rng.integers(0, engine.model_config.vocab_size, 512).tolist() for _ in range(rows)]
    return traced(lambda: engine.generate(prompts, new, eos_token_id=[]),
                  f"gen_trace_{label}_{rows}_{new}", "us", 1000)
  short, long = run(1), run(129)
  diff = {key: round((long[key] - short[key]) / 128, 2)
          for key in ("wall_us", "gpu_busy_us", "kernels")}
  families = collections.Counter(long["families_us"])
  families.subtract(short["families_us"])
  diff["families_us"] = {k: round(t / 128, 2) for k, t in families.most_common(14)}
  return diff


def main(label: str, model: str, out_dir: str) -> None:
  engine = Engine.from_pretrained(model, max_seq_len=1024, **OPTIONS)
  if hasattr(engine, "wait_for_final_steps"):
    compiles = engine.warmup(progress=False)
    engine.wait_for_final_steps(600)
  else:
    compiles = engine.warmup(batch_sizes=sorted({1, 8, *GENERATE_BATCHES}), prompt_lengths=[512],
                             progress=False)
  row = {"label": label, "model": os.path.basename(model.rstrip("/")),
         "ready_s": round(time.perf_counter() - START, 1),
         "device": jax.devices()[0].device_kind, "jax": jax.__version__,
         # the warm-up's slowest compiles (the decode steps built behind it are not among them)
         "compile_s": sorted(((str(k), round(v, 1)) for k, v in (compiles or {}).items()),
                             key=lambda kv: -kv[1])[:8]}
  for b in BATCHES:
    row[f"step_us_b{b}"] = profile.time_decode(engine, b, position=512, steps=32,
                                               repeats=5)["step_us"]
  for b in PROFILE_ROWS:
    _, path = profile.profile_decode(engine, b, position=512, steps=PROFILED_STEPS)
    events = profile._load_events(path)
    row[f"kernels_b{b}"], row[f"families_b{b}"], row[f"launches_b{b}"] = kernel_times(
        device_kernels(events))
    # graph launches, kernels launched outside graphs, GPU-busy time and idle share per step
    row[f"launch_b{b}"] = profile.parse_trace({"traceEvents": events},
                                              steps=PROFILED_STEPS).as_dict()
  # B fresh prompts each run: a repeated one would hit the prefix cache (the first seven pages)
  rng = np.random.default_rng(0)
  for b in GENERATE_BATCHES:
    stats = [engine.generate(
        [rng.integers(0, engine.model_config.vocab_size, 512).tolist() for _ in range(b)], 128,
        eos_token_id=[]).stats for _ in range(9)][2:]
    row[f"b{b}_ttft_ms"] = statistics.median(s["ttft_s"] * 1e3 for s in stats)
    row[f"b{b}_ttft_last_ms"] = statistics.median(s.get("ttft_s_last", math.nan) * 1e3
                                                  for s in stats)
    row[f"b{b}_per_token_us"] = statistics.median(s["per_token_s"] * 1e6 for s in stats)
    row[f"b{b}_total_ms"] = statistics.median(s.get("total_s", math.nan) * 1e3 for s in stats)
    # the decode steps once every row has its first token: (total - last row's first token) over
    # the 127 tokens after it (a7ac954's per_token_s, whose batch prefilled in one call)
    row[f"b{b}_steady_us"] = statistics.median(
        (s.get("total_s", math.nan) - s.get("ttft_s_last", math.nan)) / 127 * 1e6 for s in stats)
  for b in GENERATE_PROFILE:
    row[f"generate_steps_b{b}"] = generate_steps(engine, b, rng, label)
  for b in PROFILE_PROMPTS:
    # b more fresh 512-token prompts, one new token each, under the profiler: where their
    # first tokens' time goes (wall against GPU busy, kernels by family and by executable)
    prompts = [rng.integers(0, engine.model_config.vocab_size, 512).tolist() for _ in range(b)]
    row["prompt_profile" if b == 1 else f"prompts_{b}_profile"] = traced(
        lambda: engine.generate(prompts, 1, eos_token_id=[]), f"prompt_trace_{label}_{b}", "us",
        16)
  for count in THROUGHPUT if throughput and hasattr(engine, "wait_for_final_steps") else ():
    # #33's offline workload as `bench throughput --client generate` runs it (`count` prompts
    # of 64-480 random tokens, 128 new each, after an unmeasured pass), three seeds
    rates = []
    for seed in range(3):
      prompts, _, unmeasured = throughput.requests(count, (64, 480), math.inf, seed,
                                                   engine.model_config.vocab_size)
      rates.append(throughput._generate(engine, prompts, unmeasured, 128)["tokens_per_s"])
    row[f"throughput_{count}_tok_s"] = round(statistics.median(rates))
    if os.environ.get("PROFILE_THROUGHPUT") == "1" and count == THROUGHPUT[0]:
      # one more run under the profiler, of prompts no earlier run had (no prefix-cache hit),
      # after its own unmeasured pass: GPU-busy time against the wall, and the kernels of the
      # whole run by family (ms, not per step)
      prompts, _, unmeasured = throughput.requests(count, (64, 480), math.inf, 3,
                                                   engine.model_config.vocab_size)
      engine.generate(unmeasured, 128, eos_token_id=[])
      row[f"throughput_{count}_profile"] = traced(
          lambda: engine.generate(prompts, 128, eos_token_id=[]), f"tp_trace_{label}", "ms", 24)
  if hasattr(engine, "wait_for_final_steps") and os.environ.get("STEP_HLO", "1") == "1":
    hlo = engine.executables.get(("step", 8)).as_text()
    with open(os.path.join(out_dir, f"step8_{label}.hlo.txt"), "w") as f:
      f.write(hlo)
  with open(os.path.join(out_dir, f"step_kernels_{label}.json"), "w") as f:
    json.dump(row, f, indent=1)
  steps = " ".join(f"B={b} {row[f'step_us_b{b}']:.1f}" for b in BATCHES)
  generated = "; ".join(f"B={b} {row[f'b{b}_ttft_ms']:.2f} ({row[f'b{b}_ttft_last_ms']:.2f}) ms, "
                        f"{row[f'b{b}_per_token_us']:.1f} us, {row[f'b{b}_total_ms']:.1f} ms"
                        for b in GENERATE_BATCHES)
  print(f"[{label}] ready {row['ready_s']} s | {steps} | generate TTFT (last), per token, "
        f"total: {generated}; "
        f"{row.get('launches_b1', 0):.0f} kernels a B=1 step"
        + "".join(f"; {n} requests {row[f'throughput_{n}_tok_s']} tok/s" for n in THROUGHPUT
                  if f"throughput_{n}_tok_s" in row), flush=True)
  for b in PROFILE_ROWS:
    families = list(row[f"families_b{b}"].items())[:16]
    launch = row[f"launch_b{b}"]
    print(f"   B={b}: {launch['graph_launches_per_step']:.0f} graph launches, "
          f"{launch['kernel_launches_outside_graphs_per_step']:.0f} kernels outside graphs, "
          f"GPU busy {launch['gpu_busy_us']:.0f} us a step; "
          + ", ".join(f"{k[:36]} {t}" for k, t in families), flush=True)
  for key in [k for k in row if k.endswith("_profile") or k.startswith("generate_steps")]:
    print(f"   {key}: {row[key]}", flush=True)


if __name__ == "__main__":
  main(*sys.argv[1:])
