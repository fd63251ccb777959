"""Serving workloads through the public API: the continuous-batching scheduler against the
one-call-at-a-time static path and HF transformers' continuous batching, on random weights of a
real shape.

  python benchmarks/make_checkpoints.py --out-dir /tmp/ck --models llama-3.2-1b
  python benchmarks/serving_bench.py --models /tmp/ck/llama-3.2-1b --out serving.json
  python benchmarks/serving_bench.py --system hf_continuous --models /tmp/ck/llama-3.2-1b \
      --out serving_hf.json
  python benchmarks/serving_bench.py --system cg_jax_http,cg_jax --models /tmp/ck/llama-3.2-1b \
      --out serving_http.json
  JAX_PLATFORMS=cpu python benchmarks/serving_bench.py --smoke --system cg_jax_http,cg_jax \
      --workloads serving --out /tmp/smoke.json   # the bundled kjv-llama-6m on the CPU

Workloads (prompts of 64-480 random tokens, 128 new tokens, EOS off, greedy):
  offline        64 requests submitted at once
  offline_same   the same 16 prompts in one generate() call
  concurrent     16 callers from 16 threads, each generate([one prompt]) (the same 16 prompts)
  poisson        requests arriving at --rates per second (--poisson-requests of them)
  shared_prefix  64 requests at once starting with one 384-token prefix (and 16-96 tokens of
                 their own), with the prefix cache on (the default) and off
Systems: cg_jax (the scheduler: submit / generate), cg_jax_static (the static path, one call at
a time under the engine's lock: `static_path.py`, kept for this baseline), hf_continuous
(transformers' `generate_batch`, paged SDPA, same checkpoint; its own process, run with
JAX_PLATFORMS=cpu so that jax takes no GPU memory), cg_jax_http (the same workloads, prompts and
arrivals through `python -m cg_jax serve` over HTTP, see `run_http`; with cg_jax in the same
invocation each of its rows gets `overhead_vs_inprocess` against the matching cg_jax row).
Every measured run gets prompts no earlier run used (or an emptied prefix cache), so no row is
served from cached prefixes unless it says so. Rows carry tokens/s and TTFT /
time-per-output-token percentiles (ms); compile time is apart (`start_s`: cold,
`cached_start_s`: a second engine from the persistent compilation cache, `server_start_s`: the
server's start to its first healthy /health).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import jax
import numpy as np

try:  # the hf_continuous system only
  import torch
  import transformers
  from transformers import AutoModelForCausalLM
  from transformers.generation import GenerationConfig
except ImportError:
  torch = None

try:  # the cg_jax_http system only (openai's own dependency in some environments: httpx2)
  import httpx
except ImportError:
  try:
    import httpx2 as httpx
  except ImportError:
    httpx = None

from static_path import StaticPath

from cg_jax import Engine
from cg_jax.core import host_io
from cg_jax.core.config import EngineConfig
from cg_jax.hub import resolve_model
from models.config import PRESETS

NEW_TOKENS = 128
PROMPT_LENGTHS = (64, 480)
# --smoke (CPU, tiny-llama): shorter prompts and budgets.
SMOKE = dict(NEW_TOKENS=8, PROMPT_LENGTHS=(8, 40), SHARED_PREFIX=24, OWN_TOKENS=(4, 16))


def _prompts(count: int, vocab: int, seed: int) -> list[list[int]]:
  rng = np.random.default_rng(seed)
  low, high = PROMPT_LENGTHS
  return [rng.integers(0, vocab, (int(rng.integers(low, high + 1)),)).tolist()
          for _ in range(count)]


def _percentiles(values, scale=1e3):
  values = np.asarray([v for v in values if v is not None], np.float64) * scale
  if not len(values):
    return None, None
  return round(float(np.percentile(values, 50)), 2), round(float(np.percentile(values, 99)), 2)


def _row(system, model, workload, requests, rate, tokens, wall, ttfts, tpots, base):
  ttft = _percentiles(ttfts)
  tpot = _percentiles(tpots)
  return dict(base, system=system, model=model, workload=workload, requests=requests, rate=rate,
              tokens_per_s=round(tokens / wall, 1), wall_s=round(wall, 3),
              ttft_p50_ms=ttft[0], ttft_p99_ms=ttft[1], tpot_p50_ms=tpot[0],
              tpot_p99_ms=tpot[1])


def _submit_all(engine, prompts, arrivals=None):
  """Submit (at the arrival offsets, when given), wait; (tokens, wall, ttfts, tpots)."""
  start = time.perf_counter()
  handles = []
  for i, prompt in enumerate(prompts):
    if arrivals is not None:
      delay = start + arrivals[i] - time.perf_counter()
      if delay > 0:
        time.sleep(delay)
    handles.append(engine.submit(prompt, NEW_TOKENS, eos_token_id=[]))
  results = [h.result(timeout=600) for h in handles]
  wall = time.perf_counter() - start
  return (sum(len(r.tokens) for r in results), wall, [r.stats["ttft_s"] for r in results],
          [r.stats["per_token_s"] for r in results])


def _threads(call, prompts):
  """One thread per prompt, each `call(prompt)` -> stats; (tokens, wall, ttfts, tpots)."""
  stats = [None] * len(prompts)

  def work(i):
    stats[i] = call(prompts[i])

  threads = [threading.Thread(target=work, args=(i,)) for i in range(len(prompts))]
  start = time.perf_counter()
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  wall = time.perf_counter() - start
  return (sum(s["new_tokens"] for s in stats), wall, [s["ttft_s"] for s in stats],
          [s["per_token_s"] for s in stats])


SHARED_PREFIX, OWN_TOKENS = 384, (16, 96)


def _shared_prefix_prompts(count: int, vocab: int, seed: int) -> list[list[int]]:
  """`count` prompts of one SHARED_PREFIX-token prefix and OWN_TOKENS tokens of their own."""
  rng = np.random.default_rng(seed)
  prefix = rng.integers(0, vocab, (SHARED_PREFIX,)).tolist()
  low, high = OWN_TOKENS
  return [prefix + rng.integers(0, vocab, (int(rng.integers(low, high + 1)),)).tolist()
          for _ in range(count)]


def _engine_options(args) -> dict:
  """The engine options of the cg_jax systems (cg_jax_http's server gets them as flags)."""
  if args.smoke:
    return dict(max_seq_len=64, batch_buckets=(1, 2, 4), prompt_buckets=(16, 48))
  return dict(dtype="bfloat16", max_seq_len=1024, prompt_buckets=(64, 128, 256, 512))


def _engine(model: str, args, **options):
  return Engine.from_pretrained(model, **_engine_options(args), **options)


def _name(model: str) -> str:
  return os.path.basename(os.path.normpath(model))


def prefill_probe(engine, prompts, repeats: int = 5) -> dict:
  """Where a batch's first token goes (ms, medians): the scheduler's "prompts" executable
  alone; the static path's "prefill" + "first"; and each path's TTFT through generate() with
  one new token."""
  table = engine.executables
  rows, longest = len(prompts), max(len(p) for p in prompts)
  size = next(n for n in engine.config.buckets.prompt_lengths if n >= longest)
  tokens = np.zeros((rows, size), np.int32)
  counts = np.array([len(p) for p in prompts], np.int32)
  for b, p in enumerate(prompts):
    tokens[b, :len(p)] = p
  out = {}
  with engine._scheduler.exclusive():
    for name in ("prompts", "prefill"):
      times = []
      for _ in range(repeats + 1):
        start = time.perf_counter()
        if name == "prompts":
          new, _, cache = table.get(("prompts", rows, size))(  # (new tokens, logits, cache)
              engine._split.weights, engine.kv_cache.get(), tokens, counts, np.int32(0))
        else:
          logits, cache = table.get(("prefill", rows, size))(
              engine._split.weights, engine.kv_cache.get(), tokens, counts)
          new = table.get(("first", rows, True))(logits, counts, None)
        engine.kv_cache.set(cache)
        np.asarray(new)
        times.append(time.perf_counter() - start)
      out[f"{name}_exe_ms"] = round(float(np.median(times[1:])) * 1e3, 2)
  # The inputs of that call, to the device in one copy (host_io.stage) or through pinned host
  # memory first (the former staging).
  where = engine.input_placement
  for name, put in (("direct_stage_ms", lambda t: host_io.stage(t, where)),
                    ("pinned_stage_ms", lambda t: jax.device_put(
                        jax.device_put(t, host_io.pinned_host(where)), host_io.on_device(where)))):
    times = []
    for _ in range(repeats * 4):
      begin = time.perf_counter()
      jax.block_until_ready(put((tokens, counts)))
      times.append(time.perf_counter() - begin)
    out[name] = round(float(np.median(times)) * 1e3, 3)
  request = engine.validate(prompts, 1, eos_token_id=[])
  for name, call in (("scheduler", lambda: engine.generate(prompts, 1, eos_token_id=[])),
                     ("static", lambda: StaticPath.of(engine).generate(request))):
    call()
    out[f"{name}_ttft_ms"] = round(float(np.median(
        [call().stats["ttft_s"] for _ in range(repeats)])) * 1e3, 2)
  return out


def first_token_trace(engine, prompts) -> dict:
  """The host's timeline (ms from the call) of one two-token generate() of `prompts` through
  the scheduler and through the static path: each executable call's start and return, and the
  first token."""
  table, out = engine.executables, {}
  original = table.get
  request = engine.validate(prompts, 2, eos_token_id=[])
  for name, call in (("scheduler", lambda: engine.generate(prompts, 2, eos_token_id=[])),
                     ("static", lambda: StaticPath.of(engine).generate(request))):
    events = []

    def traced(key, events=events):
      exe = original(key)

      def run(*args):
        begin = time.perf_counter()
        result = exe(*args)
        events.append(("/".join(map(str, key)), begin, time.perf_counter()))
        return result
      return run

    call()
    engine.reset_prefix_cache()
    table.get = traced
    try:
      start = time.perf_counter()
      ttft = call().stats["ttft_s"]
    finally:
      del table.get
    out[name] = {"ttft_ms": round(ttft * 1e3, 2),
                 "calls": [(key, round((a - start) * 1e3, 2), round((b - start) * 1e3, 2))
                           for key, a, b in events[:12]]}
  return out


def run_model(model: str, args, base) -> list[dict]:
  start = time.perf_counter()
  engine = _engine(model, args)
  engine.warmup(progress=False)
  start_s = time.perf_counter() - start
  name, vocab = _name(model), engine.model_config.vocab_size
  rows = []
  base = dict(base, start_s=round(start_s, 1), executables=len(engine.executables.compiled))

  def emit(row):
    rows.append(row)
    print(json.dumps(row), flush=True)

  def static(prompts):
    request = engine.validate(prompts, NEW_TOKENS, eos_token_id=[])
    return StaticPath.of(engine).generate(request).stats

  def scheduler(prompts):
    return engine.generate(prompts, NEW_TOKENS, eos_token_id=[]).stats

  same = _prompts(16, vocab, 1)
  singles = [[p] for p in same]
  # Warm both paths' executables for these shapes (the static path compiles on first use).
  _threads(static, singles[:2])
  static(same)
  _submit_all(engine, same[:4])
  probe = same[:engine.executables.prompt_batches()[-1]]
  emit(dict(base, system="cg_jax", model=name, workload="prefill_probe", requests=len(probe),
            **prefill_probe(engine, probe)))
  emit(dict(base, system="cg_jax", model=name, workload="first_token_trace",
            requests=len(probe), **first_token_trace(engine, probe)))
  if "serving" in args.workloads:
    for system, call in (("cg_jax", scheduler), ("cg_jax_static", static)):
      engine.reset_prefix_cache()
      result = call(same)
      emit(_row(system, name, "offline_same", 16, None, result["new_tokens"],
                result["total_s"], [result["ttft_s"]], [result["per_token_s"]], base))
      engine.reset_prefix_cache()
      emit(_row(system, name, "concurrent", 16, None, *_threads(call, singles), base))
    emit(_row("cg_jax", name, "offline", 64, None,
              *_submit_all(engine, _prompts(64, vocab, 2)), base))
    for i, rate in enumerate(args.rates):
      prompts = _prompts(args.poisson_requests, vocab, 10 + i)
      arrivals = np.cumsum(np.random.default_rng(4).exponential(1 / rate, len(prompts)))
      emit(_row("cg_jax", name, "poisson", len(prompts), rate,
                *_submit_all(engine, prompts, arrivals), base))
  # The prefix cache on (this engine) and off (a second engine: its start is the cached one).
  start = time.perf_counter()
  off = _engine(model, args, prefix_cache_tokens=0)
  off.warmup(progress=False)
  cached_start_s = round(time.perf_counter() - start, 1)
  shared = (("cg_jax", engine, 20), ("cg_jax_prefix_off", off, 21))
  for system, served, seed in shared if "shared_prefix" in args.workloads else ():
    served.generate(_shared_prefix_prompts(4, vocab, seed + 10), 2, eos_token_id=[])  # warm
    served.reset_prefix_cache()
    row = _row(system, name, "shared_prefix", 64, None,
               *_submit_all(served, _shared_prefix_prompts(64, vocab, seed)), base)
    stats = served.stats()
    emit(dict(row, cached_start_s=cached_start_s, prefix_cache_hits=stats.get(
        "prefix_cache_hits"), prefix_cache_hit_tokens=stats.get("prefix_cache_hit_tokens")))
  off.close()
  emit(dict(base, system="cg_jax", model=name, workload="engine_stats",
            cached_start_s=cached_start_s,
            stats={k: v for k, v in engine.stats().items() if isinstance(v, (int, float, str))}))
  engine.close()
  return rows


def run_hf(model: str, args, base) -> list[dict]:
  """transformers' continuous batching (`generate_batch`, paged SDPA) on the offline requests
  and the 16 prompts of `offline_same`."""
  device = "cuda" if torch.cuda.is_available() else "cpu"
  dtype = torch.float32 if args.smoke else torch.bfloat16
  hf = AutoModelForCausalLM.from_pretrained(model, dtype=dtype, attn_implementation="paged|sdpa")
  hf = hf.to(device).eval()
  vocab = hf.config.vocab_size
  config = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=-1,
                            pad_token_id=0)
  base = dict(base, transformers_version=transformers.__version__,
              torch_version=torch.__version__)
  rows = []
  hf.generate_batch(inputs=_prompts(8, vocab, 5), generation_config=config, progress_bar=False)
  for workload, prompts in (("offline", _prompts(64, vocab, 2)),
                            ("offline_same", _prompts(16, vocab, 1))):
    start = time.perf_counter()
    outputs = hf.generate_batch(inputs=prompts, generation_config=config, progress_bar=False,
                                record_timestamps=True)
    wall = time.perf_counter() - start
    outs = list(outputs.values())
    tokens = sum(len(o.generated_tokens) for o in outs)
    ttfts = [o.timestamps[0] - o.created_time for o in outs if o.timestamps]
    tpots = [(o.timestamps[-1] - o.timestamps[0]) / max(len(o.timestamps) - 1, 1)
             for o in outs if o.timestamps]
    rows.append(_row("hf_continuous", _name(model), workload, len(prompts), None, tokens, wall,
                     ttfts, tpots, base))
    print(json.dumps(rows[-1]), flush=True)
  return rows


# --------------------------------------------------------------------------------------------------
# cg_jax_http: the same workloads through the OpenAI-compatible server, over HTTP

HOST = "127.0.0.1"  # the server listens here and the client sends nowhere else
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SERVER_STOP_S = 90  # SIGTERM, then SIGKILL past this (the server's graceful timeout is 5 s)
# Runs `python -m cg_jax serve ...` (its argv) with PR_SET_PDEATHSIG set to SIGTERM first, so that
# the server also stops if this process dies without its `finally` (SIGKILL).
_TIED_EXEC = ("import ctypes, os, signal, sys\n"
              "try:\n"
              "  ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)\n"
              "except (OSError, AttributeError):\n"
              "  pass\n"
              "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])\n")


def _vocab(model: str) -> int:
  """The model's vocabulary size without loading it (a preset's, or its config.json's)."""
  if model in PRESETS and not os.path.isdir(model):
    return PRESETS[model].vocab_size
  with open(os.path.join(resolve_model(model), "config.json")) as f:
    return int(json.load(f)["vocab_size"])


def _serve_flags(options: dict) -> list[str]:
  """`_engine_options` as `python -m cg_jax serve` flags."""
  flags = []
  for key, value in options.items():
    text = ",".join(map(str, value)) if isinstance(value, (tuple, list)) else str(value)
    flags += ["--" + key.replace("_", "-"), text]
  return flags


def _free_port() -> int:
  with socket.socket() as s:
    s.bind((HOST, 0))
    return s.getsockname()[1]


def _raise_exit(signum, frame):
  raise SystemExit(128 + signum)  # so that `finally` stops the server


class _Server:
  """`python -m cg_jax serve` in a subprocess on HOST at a free port, as a context manager: up and
  healthy (GET /health answers 200 once the warm-up is done) on entry, stopped (SIGTERM, wait;
  SIGKILL past SERVER_STOP_S) on exit, however the block ends. Its output goes to `log_path`."""

  def __init__(self, model: str, name: str, args, log_path: str):
    self.model, self.name, self.args, self.log_path = model, name, args, log_path
    self.proc = None

  def __enter__(self):
    if httpx is None:
      raise SystemExit("cg_jax_http needs httpx (or httpx2): pip install httpx")
    self.port = _free_port()
    self.url = f"http://{HOST}:{self.port}"
    command = ["-m", "cg_jax", "serve", "--model", self.model, "--served-model-name", self.name,
               "--host", HOST, "--port", str(self.port),
               *_serve_flags(_engine_options(self.args)), "--graceful-timeout", "5",
               "--log-level", "warning"]
    self.command = " ".join(["python", *command])
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    self._previous = signal.signal(signal.SIGTERM, _raise_exit)
    start = time.perf_counter()
    try:
      with open(self.log_path, "w") as log:
        self.proc = subprocess.Popen([sys.executable, "-c", _TIED_EXEC, *command], cwd=ROOT,
                                     env=env, stdin=subprocess.DEVNULL, stdout=log,
                                     stderr=subprocess.STDOUT)
      self._wait_healthy(self.args.server_timeout)
    except BaseException:
      self.stop()
      raise
    self.start_s = time.perf_counter() - start
    print(f"server up in {self.start_s:.1f} s: {self.command}", file=sys.stderr, flush=True)
    return self

  def __exit__(self, *exc):
    self.stop()

  def tail(self, lines: int = 30) -> str:
    with open(self.log_path, errors="replace") as f:
      return "".join(f.readlines()[-lines:])

  def _wait_healthy(self, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    with httpx.Client(base_url=self.url, trust_env=False, timeout=5) as client:
      while True:
        if self.proc.poll() is not None:
          raise RuntimeError(f"the server exited ({self.proc.returncode}) before it answered "
                             f"/health; {self.log_path} ends:\n{self.tail()}")
        try:
          if client.get("/health").status_code == 200:
            return
        except httpx.TransportError:
          pass
        if time.monotonic() > deadline:
          raise TimeoutError(f"the server did not answer /health in {timeout:.0f} s; "
                             f"{self.log_path} ends:\n{self.tail()}")
        time.sleep(0.5)

  def stop(self) -> None:
    try:
      if self.proc is not None and self.proc.poll() is None:
        self.proc.send_signal(signal.SIGTERM)
        try:
          self.proc.wait(timeout=SERVER_STOP_S)
        except subprocess.TimeoutExpired:
          print(f"the server ignored SIGTERM for {SERVER_STOP_S} s: SIGKILL", file=sys.stderr)
          self.proc.kill()
          self.proc.wait()
        print(f"server stopped (exit {self.proc.returncode}); log: {self.log_path}",
              file=sys.stderr, flush=True)
    finally:
      if getattr(self, "_previous", None) is not None:
        signal.signal(signal.SIGTERM, self._previous)
        self._previous = None


class _Client:
  """Streamed /v1/completions requests from one asyncio client (any number in flight): prompts as
  token ids, greedy, EOS ignored (the server's `ignore_eos`), `return_token_ids` so that every
  token has its chunk (a token whose text is held back still counts) and the usage chunk."""

  def __init__(self, url: str, model: str):
    self.model = model
    self.http = httpx.AsyncClient(base_url=url, trust_env=False,
                                  timeout=httpx.Timeout(600.0, connect=30.0),
                                  limits=httpx.Limits(max_connections=None,
                                                      max_keepalive_connections=256))

  async def close(self):
    await self.http.aclose()

  def body(self, prompt, max_tokens: int) -> dict:
    return {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True,
            "return_token_ids": True}

  async def request(self, prompt, max_tokens: int | None = None):
    """One request (`prompt`: a token-id list, or a list of them: one choice each); (its
    completion tokens from the usage chunk, per choice (ttft_s, per_token_s), the request's
    (ttft_s, per_token_s)) from the chunks' arrival times: a choice's TTFT to its first token,
    TPOT (last - first) / (tokens - 1) as the scheduler's per-request stats; the request's TTFT
    to the first token of any choice and TPOT over its longest choice's steps, as a
    generate() call's stats."""
    max_tokens = NEW_TOKENS if max_tokens is None else max_tokens  # (--smoke changes it)
    first, last, counts, usage = {}, {}, {}, None
    sent = time.perf_counter()
    async with self.http.stream("POST", "/v1/completions",
                                json=self.body(prompt, max_tokens)) as response:
      if response.status_code != 200:
        raise RuntimeError(f"/v1/completions answered {response.status_code}: "
                           f"{(await response.aread()).decode(errors='replace')[:500]}")
      async for line in response.aiter_lines():
        if not line.startswith("data: "):
          continue
        now = time.perf_counter()
        if line == "data: [DONE]":
          break
        chunk = json.loads(line[6:])
        if "error" in chunk:
          raise RuntimeError(f"error event in the stream: {chunk['error']}")
        if chunk.get("usage"):
          usage = chunk["usage"]
        for choice in chunk["choices"]:
          tokens = len(choice.get("token_ids") or ())
          if tokens or choice.get("text"):
            index = choice["index"]
            first.setdefault(index, now)
            last[index] = now
            counts[index] = counts.get(index, 0) + tokens
    if usage is None:
      raise RuntimeError("the stream ended without its usage chunk")
    if sum(counts.values()) != usage["completion_tokens"]:
      raise RuntimeError(f"{sum(counts.values())} streamed token ids, usage says "
                         f"{usage['completion_tokens']}")
    short = [n for n in counts.values() if n != max_tokens]
    if short:
      print(f"warning: choices with {short} tokens, not {max_tokens}", file=sys.stderr)
    start, end, steps = min(first.values()), max(last.values()), max(counts.values()) - 1
    choices = [(first[i] - sent, (last[i] - first[i]) / max(counts[i] - 1, 1))
               for i in sorted(first)]
    return usage["completion_tokens"], choices, (start - sent, (end - start) / max(steps, 1))

  async def run(self, prompts, arrivals=None, one_request: bool = False,
                max_tokens: int | None = None):
    """Every prompt a request of its own, all at once or at the arrival offsets (or all of them
    in one request, timed as one generate() call); (tokens, wall, ttfts, tpots, http requests)
    as `_submit_all`."""
    start = time.perf_counter()

    async def one(i):
      if arrivals is not None:
        delay = start + arrivals[i] - time.perf_counter()
        if delay > 0:
          await asyncio.sleep(delay)
      return await self.request(prompts[i], max_tokens)

    if one_request:
      results = [await self.request(prompts, max_tokens)]
    else:
      results = await asyncio.gather(*(one(i) for i in range(len(prompts))))
    wall = time.perf_counter() - start
    times = [r[2] for r in results] if one_request else [c for r in results for c in r[1]]
    return (sum(r[0] for r in results), wall, [t[0] for t in times], [t[1] for t in times],
            len(results))

  async def prefix_gauges(self) -> dict[str, float]:
    """The prefix cache's gauges on /metrics ({"prefix_cache_hits": ..., ...}; {} when off)."""
    response = await self.http.get("/metrics")
    response.raise_for_status()
    out = {}
    for line in response.text.splitlines():
      if line.startswith("cg_jax_prefix_cache_"):
        key, _, value = line.partition(" ")
        out[key.removeprefix("cg_jax_")] = float(value)
    return out

  async def flush_prefix_cache(self, vocab: int, seed: int) -> None:
    """Empty the prefix cache of the prompts sent so far (the server has no reset: what
    `engine.reset_prefix_cache()` does for the in-process rows): prefill fresh random prompts
    until the pool has evicted as many blocks as it held. Eviction is least recently used first
    and the fresh blocks are newer than every old one, so none of those is left."""
    before = await self.prefix_gauges()
    held = before.get("prefix_cache_blocks_used", 0)
    if not held:
      return
    block = EngineConfig.prefix_block
    length = PROMPT_LENGTHS[1] // block * block
    count = math.ceil(before["prefix_cache_blocks"] * block / length)
    rng = np.random.default_rng(seed)
    for _ in range(8):
      prompts = rng.integers(0, vocab, (count, length)).tolist()
      await self.request(prompts, 1)
      gauges = await self.prefix_gauges()
      if gauges["prefix_cache_evictions"] - before["prefix_cache_evictions"] >= held:
        return
    raise RuntimeError(f"the prefix cache kept old blocks after 8 flushes: {gauges}")


def run_http(model: str, args, base) -> list[dict]:
  """The cg_jax rows' workloads (their prompts, seeds and arrivals) through `python -m cg_jax
  serve` (the engine options of `_engine_options`) from one asyncio client in this process:
  offline_same is one request of the 16 prompts (16 choices; its TTFT / TPOT are the request's,
  as the in-process row's are the generate() call's), concurrent 16 requests at once, offline
  64, poisson at the arrival times, shared_prefix 64 (the prefix cache on only: serve has no
  option to turn it off). TTFT / TPOT come from chunk arrival times (each request's, from just
  before it is sent), tokens from the usage chunks. The prefix cache is flushed where the
  in-process rows reset it; each row has the prefix-cache hits the server counted during it."""
  name, vocab = _name(model), _vocab(model)
  log_path = f"{args.out}.server-{name}.log"
  with _Server(model, name, args, log_path) as server:
    base = dict(base, server_start_s=round(server.start_s, 1), server_command=server.command)
    return asyncio.run(_http_workloads(server.url, name, vocab, args, base))


async def _http_workloads(url: str, name: str, vocab: int, args, base) -> list[dict]:
  rows = []
  client = _Client(url, name)
  flushes = iter(range(1000, 2000))

  async def measure(workload, prompts, rate=None, arrivals=None, one_request=False,
                    flush=False):
    if flush:
      await client.flush_prefix_cache(vocab, next(flushes))
    before = await client.prefix_gauges()
    tokens, wall, ttfts, tpots, requests = await client.run(prompts, arrivals, one_request)
    after = await client.prefix_gauges()
    row = dict(_row("cg_jax_http", name, workload, len(prompts), rate, tokens, wall, ttfts, tpots,
                    base), http_requests=requests)
    for key in ("prefix_cache_hits", "prefix_cache_hit_tokens"):
      if key in after:
        row[key] = int(after[key] - before.get(key, 0))
    rows.append(row)
    print(json.dumps(row), flush=True)

  try:
    same = _prompts(16, vocab, 1)
    await client.run(same[:4])  # warm the client, the connections and the server's paths
    await client.run(same[:4], one_request=True)
    if "serving" in args.workloads:
      await measure("offline_same", same, one_request=True, flush=True)
      await measure("concurrent", same, flush=True)
      await measure("offline", _prompts(64, vocab, 2))
      for i, rate in enumerate(args.rates):
        prompts = _prompts(args.poisson_requests, vocab, 10 + i)
        arrivals = np.cumsum(np.random.default_rng(4).exponential(1 / rate, len(prompts)))
        await measure("poisson", prompts, rate, arrivals)
    if "shared_prefix" in args.workloads:
      await client.run(_shared_prefix_prompts(4, vocab, 30), one_request=True, max_tokens=2)
      await measure("shared_prefix", _shared_prefix_prompts(64, vocab, 20), flush=True)
  finally:
    await client.close()
  return rows


def add_overheads(rows, earlier=()) -> None:
  """Each cg_jax_http row's `overhead_vs_inprocess` against the cg_jax row of its model,
  workload and rate (from `rows`, else from `earlier`): throughput ratio (HTTP / in-process
  tokens/s) and the TTFT and TPOT p50 differences (ms, HTTP minus in-process)."""
  inprocess = {(r["model"], r["workload"], r.get("rate")): r for r in (*earlier, *rows)
               if r["system"] == "cg_jax" and "tokens_per_s" in r}
  for r in rows:
    match = inprocess.get((r["model"], r["workload"], r.get("rate")))
    if r["system"] != "cg_jax_http" or match is None:
      continue

    def diff(key):
      if r[key] is None or match[key] is None:
        return None
      return round(r[key] - match[key], 2)

    r["overhead_vs_inprocess"] = dict(
        throughput_ratio=round(r["tokens_per_s"] / match["tokens_per_s"], 3),
        ttft_p50_diff_ms=diff("ttft_p50_ms"), tpot_p50_diff_ms=diff("tpot_p50_ms"))


def table(rows) -> str:
  overheads = any("overhead_vs_inprocess" in r for r in rows)
  extra = " HTTP / in-process tokens/s, TTFT p50 +ms |" if overheads else ""
  lines = ["| system | model | workload | requests | rate | tokens/s | TTFT p50 / p99 ms | "
           "TPOT p50 / p99 ms |" + extra, "|---|---|---|---|---|---|---|---|" + "---|" * overheads]
  for r in rows:
    if r["workload"] in ("engine_stats", "prefill_probe", "first_token_trace"):
      continue
    line = (f"| {r['system']} | {r['model']} | {r['workload']} | {r['requests']} | "
            f"{r['rate'] or ''} | {r['tokens_per_s']} | {r['ttft_p50_ms']} / "
            f"{r['ttft_p99_ms']} | {r['tpot_p50_ms']} / {r['tpot_p99_ms']} |")
    if overheads:
      o = r.get("overhead_vs_inprocess")
      line += f" {o['throughput_ratio']}, {o['ttft_p50_diff_ms']} |" if o else " |"
    lines.append(line)
  return "\n".join(lines)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--models", default=None,
                      help="comma-separated presets (random weights) or checkpoint directories; "
                           "default llama-3.2-1b, with --smoke the bundled kjv-llama-6m")
  parser.add_argument("--system", default="cg_jax",
                      help="comma-separated: cg_jax (the in-process cg_jax systems), cg_jax_http "
                           "(the same workloads through `python -m cg_jax serve`; run first, "
                           "while this process holds no GPU memory), or hf_continuous alone "
                           "(transformers)")
  parser.add_argument("--server-timeout", type=float, default=1800,
                      help="cg_jax_http: seconds the server may take to start (warm-up)")
  parser.add_argument("--compare", default=None, metavar="JSON",
                      help="cg_jax_http: an earlier run's output whose cg_jax rows the HTTP rows "
                           "are compared with where this run has none (same models and options)")
  parser.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")],
                      default=[2, 8, 32])
  parser.add_argument("--poisson-requests", type=int, default=200)
  parser.add_argument("--workloads", default="serving,shared_prefix",
                      help="serving (offline_same, concurrent, offline, poisson) and/or "
                           "shared_prefix; the probes always run")
  parser.add_argument("--commit", default=os.environ.get("CG_JAX_COMMIT"))
  parser.add_argument("--smoke", action="store_true", help="tiny models on the CPU, short runs")
  parser.add_argument("--out", required=True)
  args = parser.parse_args()
  systems = args.system.split(",")
  for system in systems:
    if system not in ("cg_jax", "cg_jax_http", "hf_continuous"):
      parser.error(f"unknown system {system!r}: cg_jax, cg_jax_http or hf_continuous")
  if "hf_continuous" in systems and len(systems) > 1:
    parser.error("hf_continuous runs alone (its own process, with JAX_PLATFORMS=cpu)")
  if args.models is None:
    args.models = "kjv-llama-6m" if args.smoke else "llama-3.2-1b"
  if args.smoke:
    globals().update(SMOKE)
    args.poisson_requests = 8
  commit = args.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                         capture_output=True, text=True).stdout.strip()
  base = dict(date=datetime.date.today().isoformat(), commit=commit)
  models = args.models.split(",")
  rows = []

  def save():
    with open(args.out, "w") as f:
      json.dump(rows, f, indent=1)

  if systems == ["hf_continuous"]:
    base["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    for model in models:
      rows += run_hf(model, args, base)
      save()
    print(table(rows))
    return
  base["jax_version"] = jax.__version__
  # The servers first, each alone on the device: this process touches no device (which would
  # take its memory) until they are done.
  if "cg_jax_http" in systems:
    for model in models:
      rows += run_http(model, args, base)
      save()
  base["gpu"] = jax.devices()[0].device_kind
  for row in rows:
    row["gpu"] = base["gpu"]
  earlier = []
  if args.compare:
    with open(args.compare) as f:
      earlier = json.load(f)
  add_overheads(rows, earlier)
  if "cg_jax" in systems:
    for model in models:
      rows += run_model(model, args, base)
      add_overheads(rows, earlier)
      save()
  for row in rows:
    if "overhead_vs_inprocess" in row:
      print(json.dumps({k: row[k] for k in ("system", "model", "workload", "rate",
                                            "overhead_vs_inprocess")}))
  save()
  print(table(rows))


if __name__ == "__main__":
  main()
