"""The executable table: one ahead-of-time compiled executable per (phase, bucket).

Keys (plain tuples, as `keys()` lists them):
  ("cache",)                      allocate the zeroed paged KV cache
  ("load",)                       a step's index arrays, packed on the host, into the staged
                                  buffer (in place: `cg_jax.core.step_inputs`)
  ("step", tokens)                one engine step: decode rows and prompt chunks of up to
                                  `rows(tokens)` requests in a flat batch of `tokens` (a token
                                  bucket), each at its cache offset over its block table
  ("draw", rows)                  the tokens of a step with a sampling row, drawn from its
                                  logits of `rows` rows (`EngineConfig.logit_rows`)
  ("token_logprobs", rows)        the scores of the tokens a step chose, from its logits of
                                  `rows` rows
  ("score", length)               the log-probability of each token of a prompt (`echo`)
  ("prefill", batch, length)      prompts of a (batch, prompt-length) bucket (the static path)
  ("first", batch, greedy)        the static path's first token from its prompt logits (greedy
                                  True: without sampling arrays)

Every executable that reads or writes the cache takes the block tables of its rows (int32
[rows, W]; `cg_jax.core.steps`): no executable copies cache blocks. The scheduler
(`cg_jax.core.scheduler`) uses the serving phase (`SERVING_PHASES`: load, step and draw) and, for
requests with log-probabilities, "logprobs" (token_logprobs, score: compiled on first use unless
warmed up); the static "prefill" and "first" serve benchmarks. A key is built once: `get` of a
key that a warm-up is building (a server's, while it serves) waits for that build.
The prefill executables (`prefills`: steps of more tokens than rows or of PREFILL_GEMM_TOKENS
tokens or more, "score", "prefill") compile with `EngineConfig.prefill_xla_options` (their GEMM
backend), the others (decode steps of fewer rows) with `EngineConfig.xla_options`.
Every executable takes its inputs on the device (or the tensor-parallel mesh). The outputs the
host reads (new tokens, scores) are written to pinned host memory by the executable itself: a
device output would cost a transfer of its own after it is ready, on the time to first token
(benchmarks/results/ttft_host_path_h200.md). The step's state (cache, carry, staged inputs)
is donated, so each output reuses its input's buffer from step to step.

With a store directory (the engine's compilation cache directory), each compiled executable is
also kept there serialized, named by a digest of the key, the model and engine configs, the
dtype, the jax version, the device kind and the source of `cg_jax` and `models`: a later
engine of the same build loads it without tracing, lowering or compiling (one device only).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import hashlib
import os
import pathlib
import pickle
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import serialize_executable
from jax.sharding import SingleDeviceSharding
from tqdm.auto import tqdm

import models
from cg_jax import kernels
from cg_jax.core import compile_stats, host_io
from cg_jax.core.config import PREFILL_GEMM_TOKENS, EngineConfig
from cg_jax.core.sampling import SamplingArrays
from cg_jax.core.sharding import TensorParallel
from cg_jax.core.step_plan import PlanConfig
from cg_jax.core.steps import StepFunctions
from models.config import DecoderConfig
from models.decoder import KVCache, init_cache

PHASES = ("step", "logprobs", "prefill", "first")
SERVING_PHASES = ("step",)
# The last element of a stand-in's key: (*key, STAND_IN), see `ExecutableTable.stand_in_keys`.
STAND_IN = "stand-in"


class ExecutableTable:
  """Lowers, compiles and holds the executables of one engine.

  Args:
    model: the model's config; config: the engine's.
    steps: the step functions; dtype: the cache's dtype.
    parallel: the tensor-parallel placements, or None on one device.
    store: a directory for serialized executables, or None (see the module docstring).
  """

  def __init__(self, model: DecoderConfig, config: EngineConfig, steps: StepFunctions, dtype,
               parallel: TensorParallel | None, store: str | os.PathLike | None = None):
    self.model, self.config, self.steps, self.dtype = model, config, steps, dtype
    self.parallel = parallel
    self.compiled: dict[tuple, Any] = {}
    self.compile_seconds: dict[tuple, float] = {}
    self.loaded = 0  # executables loaded from the store
    # Builds in flight, shared by `compile` and `get` (`_claim`).
    self._building: dict[tuple, concurrent.futures.Future] = {}
    self._building_lock = threading.Lock()
    self.stand_ins = self.starts_on_stand_ins(config, jax.devices()[0].platform)
    self._store = None
    if store is not None and parallel is None:
      self._store = pathlib.Path(store) / "executables"
      self._build_digest = _build_digest(model, config, dtype)

  def keys(self, batch_sizes: Sequence[int] | None = None,
           prompt_lengths: Sequence[int] | None = None,
           phases: Sequence[str] = SERVING_PHASES, *, max_step_tokens: int | None = None,
           draws: bool = True) -> list[tuple]:
    """Every key the request path can use, optionally restricted to some buckets and phases:
    `max_step_tokens` leaves out the steps of token buckets above the one that holds that many
    tokens (the most one step of the work to come can hold: its prompts' tokens and a decode
    token per request), `draws=False` the draws (greedy work only)."""
    if max_step_tokens is not None and (not isinstance(max_step_tokens, int) or isinstance(
        max_step_tokens, bool) or max_step_tokens < 1):
      raise ValueError(f"max_step_tokens must be an int >= 1 or None, got {max_step_tokens!r}")
    b = self.config.buckets
    batch_sizes = b.batch_sizes if batch_sizes is None else batch_sizes
    prompt_lengths = b.prompt_lengths if prompt_lengths is None else prompt_lengths
    unknown = set(phases) - set(PHASES)
    if unknown:
      raise ValueError(f"phases must be among {PHASES}, got {sorted(unknown)}")
    for name, values, allowed in (("batch_sizes", batch_sizes, b.batch_sizes),
                                  ("prompt_lengths", prompt_lengths, b.prompt_lengths)):
      odd = [v for v in values if v not in allowed]
      if odd:
        raise ValueError(f"{name} {odd} are not buckets of this engine; allowed {allowed}")
    keys: list[tuple] = [("cache",)]
    steps = self.config.token_buckets
    if max_step_tokens is not None:
      # (the bucket the scheduler gives a step of that many tokens, at most the budget)
      plan = PlanConfig.of(self.config)
      largest = plan.token_bucket(min(max_step_tokens, plan.max_tokens))
      steps = tuple(t for t in steps if t <= largest)
    rows = sorted({self.config.logit_rows(tokens) for tokens in steps})
    if "step" in phases:
      # Steps pick greedily; a step with a sampling row draws from its logits.
      keys += [("load",)] + [("step", tokens) for tokens in steps]
      keys += [("draw", r) for r in rows] if draws else []
    if "logprobs" in phases:
      keys += [("token_logprobs", r) for r in rows]
      keys += [("score", length) for length in self.score_lengths()
               if length in prompt_lengths or length > b.max_prompt_len]
    for batch in batch_sizes:
      if "prefill" in phases:
        keys += [("prefill", batch, length) for length in prompt_lengths]
      if "first" in phases:
        keys += [("first", batch, True), ("first", batch, False)]
    return list(dict.fromkeys(keys))

  def score_lengths(self) -> tuple[int, ...]:
    """The lengths of the "score" executables: the prompt buckets and the whole context
    (max_seq_len), so that a prompt that fills the context can be scored (`echo`)."""
    return (*self.config.buckets.prompt_lengths, self.config.max_seq_len)

  def prefills(self, key: tuple) -> bool:
    """Whether a key's executable takes the prefill GEMM backend: it runs prompts (more tokens
    than rows), or its GEMMs have PREFILL_GEMM_TOKENS rows or more (a step of that many decode
    rows), or it is a stand-in."""
    return key[0] in ("score", "prefill") or key[-1] == STAND_IN or (key[0] == "step" and (
        key[1] > self.config.rows(key[1]) or key[1] >= PREFILL_GEMM_TOKENS))

  @staticmethod
  def starts_on_stand_ins(config: EngineConfig, platform: str) -> bool:
    """Whether decode steps start on stand-ins (`stand_in_keys`): on a GPU, with the prefill
    GEMMs on cuBLAS, unless batch-invariant (a stand-in's GEMMs round otherwise than the step's
    own)."""
    return platform == "gpu" and config.prefill_gemm == "cublas" and not config.batch_invariant

  def stand_in_keys(self, keys: Sequence[tuple]) -> list[tuple]:
    """The keys among `keys` that a warm-up builds as stand-ins first (when `stand_ins`): the
    decode steps (XLA autotunes their Triton GEMMs: most of a cold start's compile time) that
    are neither built nor stored. A stand-in, (*key, STAND_IN), is the same step on the prefill
    GEMM backend (cuBLAS, not autotuned: quick to build, slower to run); `get(key)` returns it
    until the key's own executable is built, which then replaces it."""
    if not self.stand_ins:
      return []
    return [key for key in keys if key[0] == "step" and not self.prefills(key)
            and key not in self.compiled and not ((path := self._stored(key)) and path.exists())]

  def builds(self, keys: Sequence[tuple]) -> tuple[list[tuple], list[tuple]]:
    """(what a warm-up of `keys` builds: each of `stand_in_keys(keys)` as its stand-in, those
    keys)."""
    stand_ins = self.stand_in_keys(keys)
    return [(*key, STAND_IN) if key in stand_ins else key for key in keys], stand_ins

  def on_stand_ins(self) -> int:
    """How many steps run on their stand-ins now."""
    return sum(key[-1] == STAND_IN for key in list(self.compiled))

  def retire_stand_ins(self, keys: Sequence[tuple]) -> None:
    """Drop the stand-ins of `keys` (their own executables are built)."""
    for key in keys:
      self.compiled.pop((*key, STAND_IN), None)

  def cache_spec(self) -> KVCache:
    """The paged cache: [L, N + 1, C, K, H] per key and value (N blocks and the scratch one)."""
    c, e = self.model, self.config
    shape = (c.num_layers, e.num_blocks + 1, e.prefix_block, c.num_kv_heads, c.head_dim)
    spec = jax.ShapeDtypeStruct(shape, self.dtype)
    return KVCache(k=spec, v=spec)

  def signature(self, key: tuple):
    """(function, abstract arguments, donated argument numbers, input placements, output
    placements) of a key; placements name "weights", "cache" or "replicated"."""
    phase = key[0]
    steps, weights, cache = self.steps, self.steps.split.specs(), self.cache_spec()
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    rep, state = "replicated", ("weights", "cache")
    if phase == "cache":
      c, e = self.model, self.config
      return (lambda: init_cache(c, e.num_blocks + 1, e.prefix_block, self.dtype)), (), (), (), \
          "cache"
    width = self.config.table_width
    staged = i32(self.config.step_layout.size)
    if phase == "load":
      return steps.load, (staged, staged), (0,), (rep, rep), rep
    if phase == "step":
      tokens, carry = key[1], self.config.step_rows
      return (functools.partial(steps.step, tokens), (weights, cache, i32(carry), staged),
              (1, 2, 3), state + (rep,) * 2, (rep, "host", rep, "cache", rep))
    if phase == "draw":
      rows = key[1]
      logits = jax.ShapeDtypeStruct((rows, self.model.vocab_size), jnp.float32)
      return (steps.draw, (logits, staged, SamplingArrays.spec(rows),
                           i32(self.config.step_rows)), (3,), (rep,) * 4, (rep, "host"))
    if phase == "score":
      return steps.score, (weights, i32(1, key[1])), (), ("weights", rep), rep
    if phase == "token_logprobs":
      rows = key[1]
      logits = jax.ShapeDtypeStruct((rows, self.model.vocab_size), jnp.float32)
      return steps.token_logprobs, (logits, i32(self.config.step_rows)), (), (rep, rep), "host"
    _, batch, extra = key
    if phase == "prefill":
      return (steps.prefill, (weights, cache, i32(batch, extra), i32(batch), i32(batch, width)),
              (1,), state + (rep,) * 3, (rep, "cache"))
    sampling = None if extra else SamplingArrays.spec(batch)
    if phase == "first":
      logits = jax.ShapeDtypeStruct((batch, self.model.vocab_size), jnp.float32)
      return (steps.first_token, (logits, i32(batch), sampling), (), (rep, rep, rep), "host")
    raise KeyError(key)

  def lower(self, key: tuple):
    """The `jax.stages.Lowered` of a key."""
    fn, args, donate, inputs, outputs = self.signature(key)
    if self.parallel is None:
      device = SingleDeviceSharding(jax.devices()[0])
      placement = {"weights": device, "cache": device, "replicated": device,
                   "host": device.with_memory_kind(host_io.PINNED_HOST)}
    else:
      placement = {"weights": [w.sharding for w in self.steps.split.weights],
                   "cache": KVCache(k=self.parallel.cache(), v=self.parallel.cache()),
                   "replicated": self.parallel.replicated(),
                   "host": self.parallel.replicated(host_io.PINNED_HOST)}
    outs = (tuple(placement[n] for n in outputs) if isinstance(outputs, tuple)
            else placement[outputs])
    # keep_unused: a donated input the function only overwrites (draw's carry) keeps its buffer.
    ins = tuple(placement[n] for n in inputs)
    if self._store is not None:
      fn = _named(fn, f"{key[0]}_{self._build_digest[:16]}")
    return jax.jit(fn, donate_argnums=donate, keep_unused=True, in_shardings=ins,
                   out_shardings=outs).lower(*args)

  def get(self, key: tuple):
    """The compiled executable of a key (or its stand-in, until it is built): built now if no
    one has, or, while a warm-up is building it, once that build is done (never built
    twice)."""
    while True:
      exe = self.compiled.get(key)
      if exe is None and key[0] == "step":
        exe = self.compiled.get((*key, STAND_IN))
      if exe is not None:
        return exe
      future, mine = self._claim(key)
      if future is None:  # (published since the look above)
        continue
      if mine:
        self._run(future, key)
      try:
        return future.result()[0]
      except concurrent.futures.CancelledError:  # a stopped warm-up never started it
        continue

  def _claim(self, key: tuple) -> tuple[concurrent.futures.Future | None, bool]:
    """The future of a key's build: the one in flight (False), or a new one the caller must
    run or submit (True); when it completes, its executable is published to `compiled`.
    (None, False) if the key is published already: a build that completed between a caller's
    look at `compiled` and its claim is not started again."""
    with self._building_lock:
      if key in self.compiled:
        return None, False
      future = self._building.get(key)
      if future is not None:
        return future, False
      future = self._building[key] = concurrent.futures.Future()
      future.add_done_callback(functools.partial(self._publish, key))
      return future, True

  def _run(self, future: concurrent.futures.Future, key: tuple) -> None:
    """Build a claimed key in this thread into its future (unless it was cancelled)."""
    if future.set_running_or_notify_cancel():
      try:
        future.set_result(self._build(key))
      except BaseException as error:  # noqa: BLE001 - the future's waiters get it
        future.set_exception(error)

  def _publish(self, key: tuple, future: concurrent.futures.Future) -> None:
    with self._building_lock:
      del self._building[key]
      if not future.cancelled() and future.exception() is None:
        exe, seconds, loaded = future.result()
        self.compiled[key], self.compile_seconds[key] = exe, seconds
        self.loaded += loaded

  def _stored(self, key: tuple) -> pathlib.Path | None:
    if self._store is None:
      return None
    name = hashlib.sha256(f"{self._build_digest}{key!r}".encode()).hexdigest()[:32]
    return self._store / f"{'-'.join(map(str, key))}-{name}.exe"

  def _build(self, key: tuple):
    """(executable, seconds, loaded): loaded from the store, or else compiled (and stored)."""
    start = time.perf_counter()
    path = self._stored(key)
    exe = None if path is None else _load(path)
    if exe is not None:
      return exe, time.perf_counter() - start, True
    return *self._compile(key), False

  def _compile(self, key: tuple):
    start = time.perf_counter()
    options = (self.config.prefill_xla_options if self.prefills(key)
               else self.config.xla_options)
    hits = compile_stats.thread_cache_hit_count()
    exe = self.lower(key).compile(compiler_options=options)
    path = self._stored(key)
    # An executable that XLA's persistent cache supplied is not stored: serialized again, it
    # loads without its kernels on the CPU ("Function ... not found" when run).
    if path is not None and compile_stats.thread_cache_hit_count() == hits:
      _save(path, exe)
    return exe, time.perf_counter() - start

  def compile(self, keys: Sequence[tuple], progress: bool = True, workers: int | None = None,
              on_progress: Callable[[int, int], None] | None = None) -> dict[str, float]:
    """Load the stored executables of `keys` and compile the others, on `workers` threads
    (None: one per CPU core; XLA compiles and deserializes mostly outside the GIL); {name:
    compile or load seconds of that key}.

    With `progress`, a bar on stderr counts the executables compiled here (its total: those
    neither compiled before nor stored; no bar when there are none). It redraws at most every
    `_bar_interval()` seconds: often on a terminal, rarely into a log file.
    `on_progress(done, total)` is called at the start and after each key is loaded or compiled:
    `done` of the `total` distinct keys are ready, the ones compiled before included. An
    exception from it stops the work: executables not yet started are not built, those
    building finish, then it propagates.
    """
    unique = list(dict.fromkeys(keys))
    done = sum(key in self.compiled for key in unique)
    if on_progress is not None:
      on_progress(done, len(unique))
    todo = [key for key in unique if key not in self.compiled]
    seconds = {key: self.compile_seconds.get(key, 0.0) for key in unique}
    if todo:
      stored = sum(path is not None and path.exists() for path in map(self._stored, todo))
      workers = max(1, min(len(todo), workers or os.cpu_count() or 1))
      pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="cg_jax-compile",
                                                   initializer=compile_stats.warming_thread)
      bar = tqdm(total=len(todo) - stored, desc="compiling", unit="exe",
                 disable=not progress or len(todo) == stored, file=sys.stderr,
                 mininterval=_bar_interval())
      claimed = []
      try:
        futures = {}
        for key in todo:  # (a key another thread builds already is waited for, not built again)
          future, mine = self._claim(key)
          if future is None:  # (another thread's build was published since `todo`)
            future = concurrent.futures.Future()
            future.set_result((self.compiled[key], self.compile_seconds.get(key, 0.0), False))
          elif mine:
            claimed.append(future)
            pool.submit(self._run, future, key)
          futures[future] = key
        for future in concurrent.futures.as_completed(futures):
          key = futures[future]
          if future.cancelled():  # (another thread's warm-up stopped before building it)
            self.get(key)
            seconds[key], loaded = self.compile_seconds[key], False
          else:
            _, seconds[key], loaded = future.result()
          if not loaded:
            bar.update()
          done += 1
          if on_progress is not None:
            on_progress(done, len(unique))
      finally:  # on an error, the builds not started are dropped; the running ones finish
        for future in claimed:
          future.cancel()  # (only those not started: `get` builds them when asked)
        pool.shutdown(wait=True)
        bar.close()
    return {"/".join(map(str, k)): seconds[k] for k in keys}

  def compile_behind(self, keys: Sequence[tuple]) -> None:
    """Start compiling those of `keys` that are not stored, on a background thread (a `compile`
    or `get` of them waits for their builds; a failed build is raised to whoever waits). Stored
    ones are left to `compile`: loading them is quick, and beside a checkpoint read it only
    slowed the read (benchmarks/results/compile_while_loading_cpu.md)."""
    todo = [key for key in keys if not (path := self._stored(key)) or not path.exists()]

    def run():
      with contextlib.suppress(Exception):  # (raised again to the key's waiters)
        self.compile(todo, progress=False)
    if todo:
      threading.Thread(target=run, name="cg_jax-compile-behind", daemon=True).start()

  def priming(self, keys: Sequence[tuple]) -> tuple[list[tuple], int]:
    """(the step keys among `keys` that `prime` runs, how often each). On a GPU: every step
    (a first call loads its kernels), twice with command buffers (XLA runs a first call kernel
    by kernel and records the CUDA graphs on the second). Elsewhere the smallest step, once:
    there a first call costs mostly the first touch of the weights, which any step does, and
    each run costs a forward over its tokens (benchmarks/results/startup_cpu.md)."""
    steps = sorted((key for key in keys if key[0] == "step"), key=lambda key: key[1])
    if jax.devices()[0].platform != "gpu":
      return steps[:1], 1
    return steps, 2 if self.config.graphs != "off" else 1

  def prime(self, keys: Sequence[tuple], weights: list, cache: KVCache,
            staged) -> tuple[KVCache, Any]:
    """Run the "load", "step" and "draw" executables of `priming(keys)` on inputs that write
    nothing (every row empty, block tables naming the scratch block, greedy rows), so that the
    first requests do not pay for first calls. `staged`: the staged buffer [I] to run on, the
    one the requests' steps will read, so that the graphs record its address.
    Returns (the cache, the staged buffer): both donated to each step."""
    c = self.config
    i32 = lambda shape, value=0: np.full(shape, value, np.int32)  # noqa: E731
    primed = set()
    steps, runs = self.priming(keys)
    for key in steps:
      tokens, rows = key[1], c.rows(key[1])
      draw = ("draw", c.logit_rows(tokens))
      empty = c.step_layout.pack(i32((tokens,)), i32((tokens,), -1),
                                 i32((rows, c.table_width), c.scratch_block), i32((rows + 1,)),
                                 i32((rows,)), i32((rows,)))
      for _ in range(runs):
        staged = self.get(("load",))(staged, empty)
        carry, _, logits, cache, staged = self.get(key)(weights, cache, i32((c.step_rows,)),
                                                        staged)
        if draw in keys and draw not in primed:
          greedy = SamplingArrays.host(draw[1], temperature=0.0, top_k=0, top_p=1.0, seed=0,
                                       rows=i32((0,)))
          self.get(draw)(logits, staged, greedy, carry)
      primed.add(draw)
    return jax.block_until_ready((cache, staged))

  def share(self, other: "ExecutableTable", *, except_kinds: tuple[str, ...] = ()) -> None:
    """Use `other`'s executables (same configuration and weights) instead of compiling again;
    with `except_kinds`, take those of the other kinds as they are now (the tables differ in
    the kinds named)."""
    if not except_kinds:
      self.compiled, self.compile_seconds = other.compiled, other.compile_seconds
      return
    for key, exe in list(other.compiled.items()):
      if key[0] not in except_kinds:
        self.compiled[key] = exe
        self.compile_seconds[key] = other.compile_seconds.get(key, 0.0)


def _bar_interval() -> float:
  """Seconds between redraws of the compile bar: 0.1 on a terminal; 10 when stderr is a file or
  a pipe (each redraw there is one more carriage-return segment in the log)."""
  try:
    return 0.1 if sys.stderr.isatty() else 10.0
  except (AttributeError, ValueError):  # no stderr, or a closed one
    return 10.0


def _named(fn: Callable, name: str) -> Callable:
  """`fn` under `name`, the name of its XLA module. A stored table names its executables by
  its build digest: the persistent compilation cache keys them by that name too, so a new build
  (an upgrade) compiles them afresh and stores them, instead of taking the old build's from that
  cache, which are not stored (see `_compile`) and would be traced, lowered and fetched again at
  every start."""
  def named(*args):
    return fn(*args)

  named.__name__ = named.__qualname__ = name
  return named


def _build_digest(model: DecoderConfig, config: EngineConfig, dtype) -> str:
  """What an executable depends on besides its key: configs, dtype, versions, device kind and
  the source of the step functions (the runtime core, the kernels and the models)."""
  digest = hashlib.sha256(repr((model, config, str(dtype), jax.__version__,
                                jax.devices()[0].device_kind)).encode())
  for package in (pathlib.Path(__file__).parent, pathlib.Path(kernels.__file__).parent,
                  pathlib.Path(models.__file__).parent):
    for source in sorted(package.rglob("*.py")):
      digest.update(source.read_bytes())
  return digest.hexdigest()


def _load(path: pathlib.Path):
  """A stored executable, or None (absent, or unreadable: then it is compiled again)."""
  if not path.exists():
    return None
  try:
    with open(path, "rb") as f:
      payload, in_tree, out_tree = pickle.load(f)
    return serialize_executable.deserialize_and_load(payload, in_tree, out_tree)
  except Exception as error:  # noqa: BLE001 - a bad file costs a compile, not the engine
    warnings.warn(f"could not load the stored executable {path} ({error!r}); compiling it",
                  stacklevel=3)
    return None


def _save(path: pathlib.Path, exe) -> None:
  """Store an executable (written to a temporary file, then renamed: readers never see half a
  file); an executable that does not serialize is simply not stored."""
  try:
    blob = pickle.dumps(serialize_executable.serialize(exe))
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path.parent, delete=False) as f:
      f.write(blob)
    os.replace(f.name, path)
  except Exception as error:  # noqa: BLE001
    warnings.warn(f"could not store the executable {path.name} ({error!r})", stacklevel=3)
