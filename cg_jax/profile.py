"""Launch accounting and decode-step timing from real profiles.

`profile_decode(engine, batch)` runs N decode steps under `jax.profiler`, then `parse_trace`
reads the Chrome-format trace and reports per step: GPU kernels executed, CUDA-graph launches
(XLA's `cuGraphLaunch` host events), kernel launches outside graphs (device kernels that CUPTI
does not tag with a `cuda_graph_id`), memcpy operations, host time spent dispatching, GPU busy
time and the idle-gap share of the device timeline. Kernels inside a graph's WHILE/CONDITIONAL
child graphs are not reported by CUPTI, so `kernels_per_step` undercounts in that case; the
profiler also slows the host, so `time_decode`'s wall-clock dispatch time is the truer number.
On the CPU the same code runs, but its trace has no device streams and no CUDA graphs: the
counters of those (`GPU_COUNTERS`) are zeros that mean nothing, and
`LaunchReport.as_dict(gpu_counters=False)` gives them as None.

`time_decode(engine, batch)` times steps with the token fed back on the device (pipelined) or
read back to the host each step; `decode_bytes` is the least a step must read (its HBM floor).
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import gzip
import json
import os
import re
import statistics
import tempfile
import time
from typing import Any

import jax
import numpy as np

from models.decoder import KVCache

_MEMCPY = re.compile(r"memcpy|MemcpyHtoD|MemcpyDtoH|MemcpyDtoD|MemcpyH2D|MemcpyD2H|MemcpyD2D",
                     re.IGNORECASE)
_MEMSET = re.compile(r"memset", re.IGNORECASE)
_GRAPH_LAUNCH = re.compile(r"GraphLaunch")
# Host events that cover one Python-to-executable dispatch, most specific first.
_DISPATCH = (re.compile(r"^PjitFunction"), re.compile(r"LoadedExecutable::Execute"),
             re.compile(r"ExecuteHelper"))


# LaunchReport fields that count the GPU's activity (CUPTI's device streams, CUDA-graph launches).
GPU_COUNTERS = ("kernels_per_step", "graph_launches_per_step",
                "kernel_launches_outside_graphs_per_step", "memcpy_per_step", "gpu_busy_us",
                "device_window_us", "idle_gap_share", "top_kernels")


@dataclasses.dataclass(frozen=True)
class LaunchReport:
  """Per-step launch accounting of a profiled run."""

  steps: int
  kernels_per_step: float
  graph_launches_per_step: float
  kernel_launches_outside_graphs_per_step: float
  memcpy_per_step: float
  host_dispatch_us: float
  gpu_busy_us: float
  device_window_us: float
  idle_gap_share: float
  dispatch_event: str | None
  top_kernels: tuple[tuple[str, float], ...] = ()  # (kernel family, device us per step)

  def as_dict(self, gpu_counters: bool = True) -> dict[str, Any]:
    """The fields; with gpu_counters=False (a trace from another backend) the GPU_COUNTERS ones
    are None."""
    fields = dataclasses.asdict(self)
    if not gpu_counters:
      fields.update(dict.fromkeys(GPU_COUNTERS))
    return fields


def _load_events(trace: str | dict) -> list[dict]:
  if isinstance(trace, dict):
    return trace["traceEvents"]
  opener = gzip.open if trace.endswith(".gz") else open
  with opener(trace, "rt") as f:
    return json.load(f)["traceEvents"]


def _union_length(intervals: list[tuple[float, float]]) -> float:
  total, end = 0.0, -float("inf")
  for start, stop in sorted(intervals):
    if stop <= end:
      continue
    total += stop - max(start, end)
    end = stop
  return total


def gpu_pids(events: list[dict]) -> set[int]:
  """The trace processes of the GPUs (jax.profiler names them "/device:GPU:N")."""
  names = {e["pid"]: e.get("args", {}).get("name", "") for e in events
           if e.get("ph") == "M" and e.get("name") == "process_name"}
  return {pid for pid, name in names.items() if "/device:" in name and "CPU" not in name}


def parse_trace(trace: str | dict, steps: int) -> LaunchReport:
  """Launch accounting from a Chrome-format trace (jax.profiler's *.trace.json.gz).

  Args:
    trace: a path to the trace file (gzipped or not) or its parsed JSON.
    steps: decode steps run inside the trace, to report per-step numbers.
  """
  events = _load_events(trace)
  device_pids = gpu_pids(events)
  kernels, memcpys, busy = 0, 0, []
  kernel_time: collections.Counter = collections.Counter()
  graph_launches = kernel_launches = 0
  dispatch: dict[str, list[tuple[float, float]]] = {p.pattern: [] for p in _DISPATCH}
  for e in events:
    if e.get("ph") != "X":
      continue
    name, start, duration = e.get("name", ""), float(e.get("ts", 0)), float(e.get("dur", 0))
    if e["pid"] in device_pids:
      # Classify by the event's own name: a stream's lane name lists every activity kind on it.
      if _MEMCPY.search(name):
        memcpys += 1
      elif not _MEMSET.search(name):
        kernels += 1
        kernel_time[re.sub(r"[._]\d+$", "", name)] += duration
        # CUPTI tags kernels replayed from a CUDA graph with the graph's id.
        if "cuda_graph_id" not in e.get("args", {}):
          kernel_launches += 1
      busy.append((start, start + duration))
      continue
    if _GRAPH_LAUNCH.search(name):
      graph_launches += 1
    for pattern in _DISPATCH:
      if pattern.search(name):
        dispatch[pattern.pattern].append((start, start + duration))
        break
  dispatch_event = next((p for p, d in dispatch.items() if d), None)
  # Union of intervals: nested events of the same kind count once.
  host_dispatch = _union_length(dispatch[dispatch_event]) if dispatch_event else 0.0
  window = (max(b for _, b in busy) - min(a for a, _ in busy)) if busy else 0.0
  busy_total = _union_length(busy)
  per = float(steps)
  return LaunchReport(
      steps=steps, kernels_per_step=kernels / per, graph_launches_per_step=graph_launches / per,
      kernel_launches_outside_graphs_per_step=kernel_launches / per,
      memcpy_per_step=memcpys / per, host_dispatch_us=host_dispatch / per,
      gpu_busy_us=busy_total / per, device_window_us=window / per,
      idle_gap_share=(1.0 - busy_total / window) if window > 0 else 0.0,
      dispatch_event=dispatch_event,
      top_kernels=tuple((k, t / per) for k, t in kernel_time.most_common(8)))


def _intersection_length(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
  """Total length of (union of a) intersected with (union of b)."""
  return _union_length(a) + _union_length(b) - _union_length(a + b)


def copy_overlap(trace: str | dict) -> dict[str, float]:
  """How much of the device's memcpy time ran while a kernel was running.

  Returns {"memcpy_us", "overlapped_us", "overlap_share"} over the whole trace.
  """
  events = _load_events(trace)
  device_pids = gpu_pids(events)
  copies, kernels = [], []
  for e in events:
    if e.get("ph") != "X" or e["pid"] not in device_pids:
      continue
    interval = (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)))
    (copies if _MEMCPY.search(e.get("name", "")) else kernels).append(interval)
  total = _union_length(copies)
  overlapped = _intersection_length(copies, kernels)
  return {"memcpy_us": total, "overlapped_us": overlapped,
          "overlap_share": overlapped / total if total else 0.0}


def find_trace(logdir: str) -> str:
  """The Chrome-format trace file written by `jax.profiler.trace` under `logdir`."""
  for pattern in ("**/*.trace.json.gz", "**/perfetto_trace.json.gz"):
    found = sorted(glob.glob(os.path.join(logdir, pattern), recursive=True))
    if found:
      return found[-1]
  raise FileNotFoundError(f"no trace file under {logdir}")


# --------------------------------------------------------------------------------------------------
# Driving decode steps


@dataclasses.dataclass
class DecodeState:
  """Inputs of repeated decode steps (engine steps of one token per row) for timing. The steps
  advance one position each, as decoding does (each writes the next lengths into the staged
  buffer it donates, as the engine's steps do), from `position` for at most `room` steps, then
  start there again."""

  carry: np.ndarray  # [U] the rows' tokens (the steps feed their outputs back)
  packed: np.ndarray  # [I] the first step's inputs (`cg_jax.core.step_inputs`)
  room: int  # steps before a row reaches max_seq_len


def _inputs(engine, tree):
  """Request arrays placed where the engine's executables take them (one device, or replicated
  over a tensor-parallel mesh)."""
  return jax.device_put(tree, engine.input_placement)


def identity_tables(engine, batch: int) -> np.ndarray:
  """int32 [batch, W]: row b owns blocks b W .. (b + 1) W - 1 of the paged cache (the static
  path's rows). ValueError when the cache has fewer blocks than that."""
  width = engine.config.table_width
  if batch * width > engine.config.num_blocks:
    raise ValueError(f"batch {batch} needs {batch * width} KV blocks for full block tables; the "
                     f"cache has {engine.config.num_blocks} (kv_blocks)")
  return np.arange(batch * width, dtype=np.int32).reshape(batch, width)


def prepare_decode(engine, batch: int, position: int, seed: int = 0) -> tuple[Any, DecodeState]:
  """Compile the engine step that decodes `batch` rows (the smallest token bucket holding them),
  fill the rows' KV blocks with random values (timing on zeros can flatter), and return (step
  executable, state): row b feeds its token from the carry at `position`."""
  if position + 1 >= engine.config.max_seq_len:
    raise ValueError(f"position must be < max_seq_len - 1 ({engine.config.max_seq_len - 1}), "
                     f"got {position}")
  c = engine.config
  if not 1 <= batch <= c.step_rows:
    raise ValueError(f"batch must be in [1, {c.step_rows}] (the engine's running requests), got "
                     f"{batch}")
  size = next(tokens for tokens in c.token_buckets if tokens >= batch)
  rows = c.rows(size)
  step = engine.executables.get(("step", size))
  blocks = identity_tables(engine, batch).size
  key_k, key_v = jax.random.split(jax.random.key(seed))

  def fill(cache):
    # The rows' blocks [L, batch W, C, K, H] in place (the cache is donated: no second copy).
    shape = cache.k.shape[:1] + (blocks,) + cache.k.shape[2:]
    return KVCache(k=cache.k.at[:, :blocks].set(jax.random.normal(key_k, shape, cache.k.dtype)),
                   v=cache.v.at[:, :blocks].set(jax.random.normal(key_v, shape, cache.v.dtype)))

  engine.kv_cache.set(jax.jit(fill, donate_argnums=0)(engine.kv_cache.get()))
  rng = np.random.default_rng(seed)
  carry = rng.integers(0, engine.model_config.vocab_size, (c.step_rows,)).astype(np.int32)
  feed = np.where(np.arange(size) < batch, np.arange(size), -1).astype(np.int32)
  counts = (np.arange(rows) < batch).astype(np.int32)
  starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
  tables = np.full((rows, c.table_width), c.scratch_block, np.int32)
  tables[:batch] = identity_tables(engine, batch)
  lens = np.where(counts > 0, position + 1, 0).astype(np.int32)
  packed = c.step_layout.pack(np.zeros((size,), np.int32), feed, tables, starts, counts, lens)
  return step, DecodeState(carry, packed, c.max_seq_len - 1 - position)


def _run_steps(engine, step, state: DecodeState, steps: int, read_back: bool):
  """Run `steps` decode steps, each fed the tokens of the one before on the device; returns
  (wall seconds, per-call host dispatch seconds)."""
  carry = _inputs(engine, state.carry)
  load = engine.executables.get(("load",))
  staged = np.zeros_like(state.packed)
  weights, holder = engine.step_weights, engine.kv_cache
  cache = holder.get()
  dispatch = []
  jax.block_until_ready(cache)
  start = time.perf_counter()
  for i in range(steps):
    if i % state.room == 0:
      staged = load(staged, state.packed)
    call = time.perf_counter()
    carry, emitted, _, cache, staged = step(weights, cache, carry, staged)
    dispatch.append(time.perf_counter() - call)
    if read_back:
      np.asarray(emitted)
  jax.block_until_ready(carry)
  elapsed = time.perf_counter() - start
  holder.set(cache)
  return elapsed, dispatch


def decode_bytes(engine, batch: int, position: int) -> int:
  """The bytes a decode step of `batch` rows at `position` must read at least: every weight once
  and each row's valid K and V (`position` + 1 tokens, the new one included), in the engine's
  dtype. Its HBM floor is these bytes over the device's copy bandwidth."""
  c = engine.model_config
  kv_tokens = batch * (position + 1)
  kv_values = 2 * c.num_layers * kv_tokens * c.num_kv_heads * c.head_dim
  return (c.num_parameters() + kv_values) * engine.dtype.itemsize


def time_decode(engine, batch: int, *, position: int = 512, steps: int = 64, repeats: int = 7,
                read_back: bool = False) -> dict[str, float]:
  """Decode-step timing, medians in us.

  Returns:
    step_us: wall time per step over `repeats` runs of `steps` back-to-back steps.
    host_dispatch_wall_us: host time of one step call issued into an idle device queue (the
      pure dispatch cost: argument handling, launch).
    pipelined_call_us: host time of one call inside the back-to-back run. When the device is
      the bottleneck the launch queue fills and this approaches step_us (the host waits), so
      it is not a dispatch cost.
  """
  step, state = prepare_decode(engine, batch, position)
  _run_steps(engine, step, state, steps, read_back)  # warm
  walls, pipelined = [], []
  for _ in range(repeats):
    wall, calls = _run_steps(engine, step, state, steps, read_back)
    walls.append(wall / steps)
    pipelined.extend(calls)
  idle_queue = [_run_steps(engine, step, state, 1, read_back)[1][0]
                for _ in range(max(repeats, 16))]
  return {"step_us": statistics.median(walls) * 1e6,
          "host_dispatch_wall_us": statistics.median(idle_queue) * 1e6,
          "pipelined_call_us": statistics.median(pipelined) * 1e6}


def time_prefill(engine, batch: int, prompt_len: int, *, repeats: int = 10,
                 seed: int = 0) -> float:
  """Time to first token (ms, median): the prefill of `batch` random prompts of `prompt_len`
  tokens and the greedy first-token pick, on the device (no host read-back), as the PyTorch
  baselines measure it."""
  bucket = engine.config.buckets.batch_bucket(batch)
  length = engine.config.buckets.length_bucket(prompt_len)
  prefill = engine.executables.get(("prefill", bucket, length))
  first = engine.executables.get(("first", bucket, True))
  rng = np.random.default_rng(seed)
  tokens, lengths, tables = _inputs(engine, (
      rng.integers(0, engine.model_config.vocab_size, (bucket, length)).astype(np.int32),
      np.full((bucket,), prompt_len, np.int32), identity_tables(engine, bucket)))
  weights, holder = engine.step_weights, engine.kv_cache

  def once():
    cache = jax.block_until_ready(holder.get())
    start = time.perf_counter()
    logits, cache = prefill(weights, cache, tokens, lengths, tables)
    jax.block_until_ready(first(logits, lengths, None))
    elapsed = time.perf_counter() - start
    holder.set(cache)
    return elapsed

  once()
  return statistics.median(once() for _ in range(repeats)) * 1e3


def profile_calls(fn, calls: int = 3, logdir: str | None = None) -> LaunchReport:
  """The launch report of `calls` calls of `fn` (a function that waits for its result), after
  one untraced call. The trace is kept under `logdir` when one is given, else deleted."""
  fn()
  with tempfile.TemporaryDirectory(prefix="cg_jax_profile_") as scratch:
    logdir = logdir or scratch
    with jax.profiler.trace(logdir):
      for _ in range(calls):
        fn()
    return parse_trace(find_trace(logdir), calls)


def profile_decode(engine, batch: int, *, position: int = 512, steps: int = 10,
                   logdir: str | None = None) -> tuple[LaunchReport, str]:
  """Profile `steps` pipelined decode steps; returns (report, trace path)."""
  step, state = prepare_decode(engine, batch, position)
  _run_steps(engine, step, state, 3, read_back=False)  # warm
  logdir = logdir or tempfile.mkdtemp(prefix="cg_jax_profile_")
  with jax.profiler.trace(logdir):
    _run_steps(engine, step, state, steps, read_back=False)
  path = find_trace(logdir)
  return parse_trace(path, steps), path
