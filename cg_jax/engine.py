"""The engine: the front end over weights on the device, one preallocated KV cache and a table of
executables compiled ahead of time per (phase, bucket).

Request path: validate on the host -> the scheduler's queue -> engine steps, each one
executable over a flat batch of tokens (a token bucket): the running requests' decode tokens and
prompt chunks together. Nothing on that path compiles once `warmup()` has run. The jobs live in their own modules: `cg_jax.core.config` (the
configuration tree), `cg_jax.core.weights` (placement), `cg_jax.core.executables` (the executable table),
`cg_jax.core.scheduler` (continuous batching), `cg_jax.generation` (results and their text),
`cg_jax.core.kv_cache` (the cache's lifecycle), `cg_jax.sampling_params` (a request's sampling
parameters) and `cg_jax.validation` (prompts and requests).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from cg_jax import text, validation
from cg_jax.core import attention, compile_stats
from cg_jax.core.config import (DEFAULT_MEMORY_SHARE, OPTION_NAMES, EngineConfig,
                                blocks_for_memory, on_gpu)
from cg_jax.core.executables import SERVING_PHASES, ExecutableTable
from cg_jax.core.kv_cache import CacheHolder
from cg_jax.core.sampling import TOP_LOGPROBS, unpack_scores
from cg_jax.core.scheduler import Scheduler
from cg_jax.core.sharding import TensorParallel
from cg_jax.core.steps import StepFunctions
from cg_jax.core.weights import abstract_split, canonical, place, random_weights
from cg_jax.generation import GenerationResult, RowText, StreamChunk, final_text
from cg_jax.handles import Group, Handle, row_per_token
from cg_jax.hub import resolve_model
from cg_jax.sampling_params import SamplingParams, check_logprobs
from models import hf
from models.config import PRESETS, DecoderConfig
from models.decoder import cache_bytes

__all__ = ["Engine", "GenerationResult", "Handle", "SamplingParams", "StreamChunk"]

log = logging.getLogger("cg_jax")


class _Stopped(Exception):
  """Raised by `warmup_behind`'s progress check: stop building."""


def default_dtype() -> str:
  """bfloat16 on GPU; float32 elsewhere (bfloat16 arithmetic is emulated on the CPU)."""
  return "bfloat16" if on_gpu() else "float32"


def checkpoint_device(config: DecoderConfig, dtype, limit: int | None, tensor_parallel: int):
  """Where `from_pretrained` assembles a checkpoint's weights (`models.hf.load_checkpoint`): on
  the first device when its memory (`limit` bytes; None: unknown) holds the stored tensors
  (counted as float32, the widest a checkpoint usually stores) and the weights together, as it
  does until the assembly returns; else on the host (None), as for a tensor-parallel engine,
  which splits them there."""
  stored = config.num_parameters() * (4 + jnp.dtype(dtype).itemsize)
  if tensor_parallel > 1 or (limit is not None and stored > limit):
    return None
  return jax.devices()[0]


def _device_memory_bytes(device) -> int | None:
  stats = device.memory_stats() if hasattr(device, "memory_stats") else None
  if stats and "bytes_limit" in stats:
    return int(stats["bytes_limit"])
  if device.platform != "cpu":
    return None
  try:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  except (ValueError, OSError, AttributeError):
    return None


def _model(path: str | os.PathLike) -> tuple[DecoderConfig, str | None]:
  """(the model's config, its checkpoint directory, None for a preset) of what
  `Engine.from_pretrained` takes; nothing but config.json is read."""
  name = os.fspath(path)
  if name in PRESETS and not os.path.isdir(name):
    return PRESETS[name], None
  directory = resolve_model(name)
  return hf.config_from_hf(hf.read_config(directory)), directory


class Engine:
  """Bucketed, ahead-of-time compiled decoder inference.

  Args:
    config: the model's `DecoderConfig`.
    weights: {weight kind: array} as produced by `models.hf`, or a function of a device that
      returns them, there if it is not None (called once the executables of
      `compile_while_loading` are building, with `checkpoint_device`'s choice: `from_pretrained`
      reads its checkpoint so); None initialises random weights (normal(0.02), seeded by
      `seed`) for smoke tests and benchmarks.
    dtype: "float32", "bfloat16" or "float16"; None: bfloat16 on GPU, float32 elsewhere.
    tokenizer: a `tokenizers.Tokenizer` for text prompts and stop strings, or None.
    engine_config: a whole `EngineConfig` tree; or else
    **options: its keyword options, with the platform's defaults for those left out (see
      `EngineConfig.create` and `ForwardConfig.create`): max_seq_len, max_num_seqs,
      max_num_batched_tokens, token_buckets, batch_buckets, prompt_buckets, graphs, readback_lag,
      prefill_gemm, tensor_parallel, batch_invariant, prefix_cache_tokens, prefix_block,
      kv_blocks, gpu_memory_utilization, compiler_options, attention, layer_loop,
      min_matmul_rows, prefill_attention (a `FlashAttentionConfig`).
      With gpu_memory_utilization (as vLLM's, e.g. 0.9) the KV blocks fill that share of the
      device beside the weights and an activation reserve
      (`cg_jax.core.config.blocks_for_memory`); else kv_blocks, else `EngineConfig.num_blocks`'
      default.
    compilation_cache: persistent compilation cache directory, True for the user default,
      False to leave it off. The compiled executables are stored there too, serialized: a
      second engine of the same build and configuration starts without compiling.
    memory_limit_bytes: the device memory to size the KV blocks from (with
      gpu_memory_utilization) and to check against (default: what the device reports).
    seed: weight-initialisation seed when `weights` is None.
    compile_while_loading: phases (as `warmup` takes them) whose executables start building on
      background threads before the weights are read and placed (compiling needs their shapes
      only); a later `warmup` of those phases waits for them. `serve` builds its engine so.
  """

  def __init__(self, config: DecoderConfig, weights: Mapping[str, Any] | None = None, *,
               dtype: str | None = None, tokenizer=None,
               engine_config: EngineConfig | None = None, compilation_cache: str | bool = True,
               memory_limit_bytes: int | None = None, seed: int = 0,
               compile_while_loading: Sequence[str] = (), **options):
    given = engine_config
    if engine_config is None:
      validation.reject_unknown("Engine()", {k: v for k, v in options.items()
                                              if k not in OPTION_NAMES})
      engine_config = EngineConfig.create(config, **options)
    elif options:
      raise TypeError(f"pass either engine_config or keyword options, not both (got "
                      f"{sorted(options)})")
    else:
      engine_config.check_model(config)
    dtype = default_dtype() if dtype is None else dtype
    self.dtype = jnp.dtype(hf.numpy_dtype(dtype))
    if not on_gpu() and self.dtype != jnp.float32:
      warnings.warn(f"dtype={dtype} on the CPU is emulated and much slower than float32 (about "
                    f"40x per token with the bundled model); float32 is the CPU default",
                    UserWarning, stacklevel=2)
    self._memory_limit = memory_limit_bytes
    engine_config = self._sized(config, engine_config, memory_limit_bytes)
    self.model_config, self.config, self.tokenizer = config, engine_config, tokenizer
    # The options as given, for `with_options` (defaults are resolved again there).
    self._options = dict(options) if given is None else given.options()
    e = engine_config
    self._parallel = TensorParallel.over(e.tensor_parallel) if e.tensor_parallel > 1 else None
    # The device's memory: as given, else what it reports (None: unknown).
    device_bytes = (memory_limit_bytes if memory_limit_bytes is not None
                    else _device_memory_bytes(jax.local_devices()[0]))
    self._check_memory(device_bytes)
    self.compilation_cache_dir = compile_stats.configure_compilation_cache(compilation_cache)

    mesh = None if self._parallel is None else self._parallel.mesh
    # The steps are traced over the weights' shapes: the executables can build before the
    # weights exist.
    steps = StepFunctions(abstract_split(config, self.dtype, self._parallel), e.forward,
                          attention.for_forward(e.forward, mesh),
                          attention.paged_for_forward(e.forward, mesh), e.tensor_parallel,
                          layout=e.step_layout)
    # Compiled executables are also stored serialized beside the compilation cache.
    store = None if compilation_cache is False else self.compilation_cache_dir
    self.executables = ExecutableTable(config, e, steps, self.dtype, self._parallel, store=store)
    if compile_while_loading:
      self.executables.compile_behind(
          self.executables.builds(self.executable_keys(phases=compile_while_loading))[0])
    # Seconds of the start's phases before warm-up (`stats()`): reading the checkpoint (when
    # `weights` is a function: onto the device where `checkpoint_device` says) and placing them
    # on the device (random ones made first; a tensor-parallel engine splits them).
    self._load_seconds = {"checkpoint_read_s": None, "weights_place_s": None}
    start = time.perf_counter()
    if callable(weights):
      weights = weights(checkpoint_device(config, self.dtype, device_bytes, e.tensor_parallel))
      self._load_seconds["checkpoint_read_s"] = time.perf_counter() - start
      start = time.perf_counter()
    if weights is None:
      weights = random_weights(config, self.dtype, seed)
    self._split = place(config, weights, self.dtype, self._parallel)
    self._load_seconds["weights_place_s"] = time.perf_counter() - start
    if self._parallel is None:
      inputs_at = cache_at = jax.devices()[0]
    else:
      inputs_at, cache_at = self._parallel.replicated(), self._parallel.cache()
    # The paged KV cache (its blocks: `stats()`, `cg_jax.core.block_pool`).
    self.kv_cache = CacheHolder(lambda: self.executables.get(("cache",))(), cache_at)
    # Where request arrays go: the first device, or replicated over the tensor-parallel mesh.
    self.input_placement = inputs_at
    self._lock = threading.RLock()
    self._scheduler = Scheduler(e, self.executables, self.kv_cache, self._split.weights,
                                inputs_at, tokenizer, self._lock)
    self._logits_fn = jax.jit(lambda w, t: self._split.merge(w).logits(
        t, attention=steps.attention, shards=e.tensor_parallel))
    self._compiles_at_warmup: int | None = None
    self._warmup_wall_s: float | None = None
    self._final_steps = threading.Event()  # no step runs on a stand-in (`warmup`)
    self._final_steps.set()
    self._final_steps_s: float | None = None

  # ------------------------------------------------------------------------------------------------
  # Construction

  @classmethod
  def from_pretrained(cls, path: str | os.PathLike, dtype: str | None = None, **options):
    """Load a local Hugging Face checkpoint directory, a bundled model's name, a preset name
    (random weights, no tokenizer), or a Hugging Face model name from the local HF cache."""
    config, directory = _model(path)
    if directory is None:
      return cls(config, None, dtype=dtype, **options)
    dtype = default_dtype() if dtype is None else dtype
    options.setdefault("tokenizer", text.load_tokenizer(directory))
    return cls(config, lambda device: hf.load_checkpoint(directory, dtype, device)[1],
               dtype=dtype, **options)

  @staticmethod
  def check_options(path: str | os.PathLike, **options) -> None:
    """ValueError or TypeError, naming the option, if `options` (`from_pretrained`'s) make no
    engine of the model at `path` on a GPU nor on the CPU (each platform's defaults for the
    rest), checked without touching a device or reading weights: for a launcher whose engine
    starts in another process (`serve`). The device count is not checked."""
    config, _ = _model(path)
    options = dict(options)
    dtype = options.pop("dtype", None)
    if dtype is not None:
      hf.numpy_dtype(dtype)
    validation.reject_unknown("Engine()", {k: v for k, v in options.items()
                                            if k not in OPTION_NAMES})
    errors = []
    for platform in ("gpu", "cpu"):
      try:
        EngineConfig.create(config, platform=platform, **options)
        return
      except (ValueError, TypeError) as error:
        errors.append(error)
    raise errors[0]

  @classmethod
  def from_state_dict(cls, hf_config: Mapping[str, Any] | DecoderConfig,
                      state_dict: Mapping[str, Any], dtype: str | None = None, **options):
    """Build from an in-memory (PyTorch) state_dict and a HF config dict (or a DecoderConfig)."""
    config = hf_config if isinstance(hf_config, DecoderConfig) else hf.config_from_hf(hf_config)
    dtype = default_dtype() if dtype is None else dtype
    return cls(config, hf.convert_state_dict(config, state_dict, dtype), dtype=dtype, **options)

  def weights(self) -> dict[str, jax.Array]:
    """The device weights as {weight kind: array} (shared, not copied; with tensor_parallel > 1,
    copies in the canonical column layout)."""
    return canonical(self.model_config, self._split, self._parallel)

  @property
  def step_weights(self) -> list[jax.Array]:
    """The placed weights as the executables take them (their first argument: flat, stacked
    over layers, in `executables.steps.split`'s order, which holds only their shapes)."""
    return self._split.weights

  def with_options(self, **options) -> "Engine":
    """A new engine over the same device weights with other options (e.g. another graph mode
    or layer loop), for side-by-side comparisons in one process. It shares this engine's
    executables when its configuration differs only in host-side settings (the readback lag,
    the queue's size). When this engine's cache is sized from device memory, it is allocated
    first and the new engine's comes from the memory left: give the new one kv_blocks or a
    gpu_memory_utilization that fits."""
    if self.config.gpu_memory_utilization is not None:
      self.kv_cache.get()  # sized from memory: the new engine's blocks come from what is left
    engine = Engine(self.model_config, self.weights(), dtype=self.dtype.name,
                    tokenizer=self.tokenizer, memory_limit_bytes=self._memory_limit,
                    **{**self._options, **options})
    host_only = {"readback_lag": 0, "max_waiting": 0}
    mine, theirs = ({**e.config.options(), **host_only, "kv_blocks": e.config.num_blocks}
                    for e in (self, engine))
    if mine == theirs:
      engine.executables.share(self.executables)
    return engine

  def _sized(self, model: DecoderConfig, config: EngineConfig,
             limit: int | None) -> EngineConfig:
    """`config` with `kv_blocks` sized from the device's memory (`limit`, else what the GPU
    reports, less what is in use) when gpu_memory_utilization is set; on a GPU without it or
    kv_blocks, the default cache cut to what DEFAULT_MEMORY_SHARE of the memory leaves (when
    it does not fit there; `_check_memory` says why when not even that works)."""
    if config.gpu_memory_utilization is not None:
      return dataclasses.replace(config, kv_blocks=self._blocks_for(model, config, limit))
    if config.kv_blocks is not None or not on_gpu():
      return config
    share = dataclasses.replace(config, gpu_memory_utilization=DEFAULT_MEMORY_SHARE)
    try:
      fit = self._blocks_for(model, share, limit)
    except ValueError:
      return config
    return config if fit >= config.num_blocks else dataclasses.replace(config, kv_blocks=fit)

  def _blocks_for(self, model: DecoderConfig, config: EngineConfig, limit: int | None) -> int:
    """`blocks_for_memory` of the device (`limit`, else what the GPU reports, less what is in
    use) at config.gpu_memory_utilization."""
    device = jax.local_devices()[0]
    memory = limit if limit is not None else (_device_memory_bytes(device) if on_gpu() else None)
    if memory is None:
      raise ValueError(f"gpu_memory_utilization={config.gpu_memory_utilization} has no effect "
                       f"on a {device.platform} device that reports no memory size: give "
                       f"kv_blocks or memory_limit_bytes")
    stats = (device.memory_stats() or {}) if limit is None else {}
    in_use = int(stats.get("bytes_in_use", 0))
    return blocks_for_memory(model, config, self.dtype, memory, in_use)

  def _check_memory(self, limit: int | None) -> None:
    config, engine = self.model_config, self.config
    # The paged cache: the rows' blocks, the prefix cache's and the scratch block.
    kv = cache_bytes(config, engine.num_blocks + 1, engine.prefix_block, self.dtype)
    weights = config.num_parameters() * self.dtype.itemsize
    # Per device, approximately: weights and cache over the devices (the replicated embeddings,
    # norms and LM head make the true share somewhat larger).
    kv, weights = kv // engine.tensor_parallel, weights // engine.tensor_parallel
    if limit is not None and kv + weights > limit:
      gib = 2**30
      raise ValueError(
          f"the KV cache for max_num_seqs {engine.max_num_seqs} x max_seq_len "
          f"{engine.max_seq_len} (and a prefix cache of {engine.prefix_cache_tokens} tokens) "
          f"needs {kv} bytes ({kv / gib:.2f} GiB) and the weights "
          f"{weights} bytes ({weights / gib:.2f} GiB), more than the {limit} bytes "
          f"({limit / gib:.2f} GiB) of device memory; lower max_seq_len, max_num_seqs or "
          f"prefix_cache_tokens")

  # ------------------------------------------------------------------------------------------------
  # Ahead-of-time compilation

  def executable_keys(self, batch_sizes: Sequence[int] | None = None,
                      prompt_lengths: Sequence[int] | None = None,
                      phases: Sequence[str] = SERVING_PHASES, *,
                      max_step_tokens: int | None = None, draws: bool = True) -> list[tuple]:
    """Every (phase, bucket) executable the request path can use, optionally restricted
    (`cg_jax.core.executables.ExecutableTable.keys`)."""
    return self.executables.keys(batch_sizes, prompt_lengths, phases,
                                 max_step_tokens=max_step_tokens, draws=draws)

  def warmup(self, *, batch_sizes: Sequence[int] | None = None,
             prompt_lengths: Sequence[int] | None = None,
             phases: Sequence[str] = SERVING_PHASES, max_step_tokens: int | None = None,
             draws: bool = True, progress: bool = True, workers: int | None = None,
             on_progress: Callable[[int, int], None] | None = None) -> dict[str, float]:
    """Compile every (phase, bucket) executable ahead of time, in parallel on `workers` threads
    (None: one per CPU core), allocate the KV cache and run the steps on empty rows
    (`ExecutableTable.priming`: on a GPU each, twice) on the buffers the requests' steps will
    read (`Scheduler.prime`: the first requests do not pay for first calls).

    By default the executables that `generate`, `stream` and `submit` use: a step per token
    bucket (`EngineConfig.token_buckets`: decode rows and prompt chunks together), the draw of
    a step's sampling rows per logit row count (`EngineConfig.logit_rows`), and the paged cache
    (`executable_keys()` lists them); `phases=cg_jax.core.executables.PHASES`
    adds the log-probability and static-path ones. Narrow it to the work you will run: the
    steps up to the token bucket of `max_step_tokens` (the most tokens one step can hold: the
    prompts' tokens and one per request, when they are known), no draws for greedy work
    (`draws=False`), the static path's `batch_sizes` and `prompt_lengths`; a step left out is
    compiled when first needed. The persistent compilation cache makes a second start fast.

    Requests may run meanwhile: the compiles hold no lock (a request that needs an executable
    being built waits for that build, `ExecutableTable.get`), only the priming does.

    On a GPU the decode steps not built before first run on stand-ins, the same steps on cuBLAS
    without autotuning (`ExecutableTable.stand_in_keys`): the warm-up returns once those are
    ready, and a background thread builds the steps on XLA's autotuned Triton GEMMs, which
    replace them between two steps (primed first): their autotuning was most of a cold start,
    and they decode faster than the stand-ins (benchmarks/results/stand_ins_h100.md).
    `wait_for_final_steps()` waits for them (steady-state measurements); a second start loads
    them from the store.

    With `progress`, a bar on stderr counts the executables to compile (none: no bar).
    `on_progress(done, total)` is called at the start and after each executable is ready (done
    of total, the ones ready before included); an exception from it stops the warm-up once the
    compiles in flight finish, and propagates (`ExecutableTable.compile`).

    Returns:
      {executable name: compile seconds} (small when served from the persistent cache);
      `stats()["warmup_wall_s"]` is the whole warm-up's wall time.
    """
    start = time.perf_counter()
    keys = self.executable_keys(batch_sizes, prompt_lengths, phases,
                                max_step_tokens=max_step_tokens, draws=draws)
    built, stand_ins = self.executables.builds(keys)
    times = self._build_and_prime(built, progress, workers, on_progress)
    self._compiles_at_warmup = compile_stats.unplanned_count()
    self._warmup_wall_s = time.perf_counter() - start
    if stand_ins:
      self._final_steps.clear()
      threading.Thread(target=self._build_final_steps, args=(stand_ins, start),
                       name="cg_jax-final-steps", daemon=True).start()
    return times

  def _build_final_steps(self, keys: list[tuple], start: float) -> None:
    """Build the steps of `keys` (running on stand-ins), prime them and retire the stand-ins;
    stops early once the engine is closed (the stand-ins then stay)."""
    try:
      if self._build_behind(keys, lambda: self.closed, "the decode steps' own executables",
                            "their stand-ins keep serving"):
        self.executables.retire_stand_ins(keys)
        self._final_steps_s = time.perf_counter() - start
        log.info("the decode steps run on their own executables, %.1f s after the warm-up "
                 "began", self._final_steps_s)
    finally:
      self._final_steps.set()

  def wait_for_final_steps(self, timeout: float | None = None) -> bool:
    """Wait until no step runs on a stand-in (`warmup`); False if `timeout` passed first."""
    return self._final_steps.wait(timeout)

  def _build_and_prime(self, keys: list[tuple], progress: bool, workers: int | None,
                       on_progress: Callable[[int, int], None] | None) -> dict[str, float]:
    """Build `keys` and prime the steps among them (`warmup`'s work, without its stats)."""
    # (compiles need no lock: requests keep running while a warm-up adds executables)
    times = self.executables.compile(keys, progress=progress, workers=workers,
                                     on_progress=on_progress)
    with self._lock:  # (at most a step's wait: the engine thread holds it for one iteration)
      self._scheduler.prime(keys)
    return times

  def warmup_behind(self, phases: Sequence[str], stopping: Callable[[], bool]) -> None:
    """`warmup(phases=phases)` while the engine serves (a server builds its log-probability
    executables so, once its serving ones are ready), logging its end or its failure (the
    requests that need those executables then build them); it stops early once `stopping()`.
    The warm-up's stats stay those of the last `warmup` (a compile on the request path
    meanwhile still counts in `compiles_since_warmup`)."""
    start, before = time.monotonic(), len(self.executables.compiled)
    if self._build_behind(self.executable_keys(phases=phases), stopping,
                          f"the {'/'.join(phases)} executables", "a request that needs one "
                          "builds it"):
      log.info("%d more executables (%s) ready in %.1f s",
               len(self.executables.compiled) - before, "/".join(phases), time.monotonic() - start)

  def _build_behind(self, keys: list[tuple], stopping: Callable[[], bool], what: str,
                    otherwise: str) -> bool:
    """Build and prime `keys` while the engine serves: True when done; False when `stopping()`
    stopped it, or when it failed (logged, naming `what` and what happens `otherwise`)."""
    def check(done: int, total: int) -> None:
      if stopping():
        raise _Stopped()

    try:
      self._build_and_prime(keys, False, None, check)
    except _Stopped:
      return False
    except Exception as error:  # noqa: BLE001 - logged; see above
      log.warning("building %s behind the requests failed (%s: %s); %s", what,
                  type(error).__name__, error, otherwise)
      return False
    return True

  def stats(self) -> dict[str, Any]:
    """Compile counters, and the configuration that runs (`EngineConfig.as_dict`)."""
    count = compile_stats.compile_count()
    return {
        "compiles_total": count,
        "compiles_since_warmup": None if self._compiles_at_warmup is None
        else compile_stats.unplanned_count() - self._compiles_at_warmup,
        "compile_seconds_total": compile_stats.compile_seconds(),
        "persistent_cache_hits": compile_stats.cache_hit_count(),
        "executables_loaded": self.executables.loaded,
        "executables": len(self.executables.compiled),
        "warmup_seconds": sum(self.executables.compile_seconds.values()),
        "warmup_wall_s": self._warmup_wall_s,
        "final_steps_s": self._final_steps_s,
        "steps_on_stand_ins": self.executables.on_stand_ins(),
        **self._load_seconds,
        "compilation_cache_dir": self.compilation_cache_dir,
        "dtype": self.dtype.name,
        **self._scheduler.stats(),
        **self.config.as_dict(),
    }

  # ------------------------------------------------------------------------------------------------
  # Requests

  def logits(self, input_ids) -> np.ndarray:
    """Full-sequence float32 logits [B, S, V] without cache (an analysis/test path; it compiles
    per input shape)."""
    rows = validation.prompts(input_ids, self.model_config.vocab_size)
    if len({len(r) for r in rows}) != 1:
      raise ValueError("logits() needs equal-length rows (a rectangular [B, S] array)")
    if len(rows[0]) > self.model_config.max_position_embeddings:
      raise ValueError(f"sequence length {len(rows[0])} exceeds the model context "
                       f"({self.model_config.max_position_embeddings})")
    return np.asarray(self._logits_fn(self._split.weights, np.stack(rows)))

  def _encode(self, inputs):
    is_text = isinstance(inputs, str) or (
        isinstance(inputs, (list, tuple)) and inputs and all(isinstance(x, str) for x in inputs))
    if not is_text:
      return inputs
    if self.tokenizer is None:
      raise TypeError("text prompts need a tokenizer (tokenizer.json in the checkpoint "
                      "directory); pass token ids instead")
    texts = [inputs] if isinstance(inputs, str) else list(inputs)
    return [self.tokenizer.encode(t).ids for t in texts]

  def validate(self, inputs, max_new_tokens: int | None = None, *,
               params: SamplingParams | None = None, **sampling) -> validation.Request:
    """Validate a request on the host without running it (nothing touches the device); raises
    the ValueError / TypeError that `generate` would (a bad sampling value: a `ParamError`
    naming it)."""
    params = SamplingParams.of(params, sampling, "generate()", max_new_tokens)
    return validation.request(
        self._encode(inputs), params,
        vocab_size=self.model_config.vocab_size, max_seq_len=self.config.max_seq_len,
        default_eos=self.model_config.eos_token_id, has_tokenizer=self.tokenizer is not None)

  def generate(self, inputs, max_new_tokens: int | None = None, *,
               params: SamplingParams | None = None, **sampling) -> GenerationResult:
    """Generate continuations.

    Args:
      inputs: a list of token-id lists (any lengths), a 2-D int array, or text (a string or a
        list of strings) when the engine has a tokenizer.
      params: a `SamplingParams` (max_new_tokens, do_sample, temperature, top_k, top_p, seed,
        eos_token_id, stop, logprobs: its docstring says what each means); or else
      max_new_tokens, **sampling: its fields as keywords (the defaults for those left out:
        32 new tokens, greedy, the model's EOS ids). Both forms at once are a TypeError.
    Returns:
      A `GenerationResult`: a list of new-token lists (EOS included when hit), with `.texts`
      (when a tokenizer exists) and `.stats`, times in seconds from this call's start (after
      validation): ttft_s (the batch's first token, any row), ttft_s_rows (each row's first
      token, in row order), ttft_s_last (the last row's to get one: their max), total_s,
      new_tokens, per_token_s_rows (each row's time per token after its own first token:
      `cg_jax.handles.row_per_token`), per_token_s (their median over the rows that made more
      than one token), tokens_per_s, greedy, readback_lag.
    Raises:
      `ParamError` (a ValueError; a TypeError too for a wrong type) for a bad sampling value,
      ValueError / TypeError for bad prompts; nothing runs.
    """
    request = self.validate(inputs, max_new_tokens, params=params, **sampling)
    start = time.perf_counter()
    group = self._scheduler.submit(request)
    try:
      group.wait()
    finally:
      group.cancel()  # an interrupted wait frees its blocks
    texts = None
    if self.tokenizer is not None:
      texts = [final_text(self.tokenizer, tokens, request.stop) for tokens in group.tokens]
    return GenerationResult([list(t) for t in group.tokens], texts,
                            self._call_stats(request, group, start))

  def stream(self, inputs, max_new_tokens: int | None = None, *,
             params: SamplingParams | None = None, **sampling) -> Iterator[StreamChunk]:
    """Like `generate` (the same arguments), but yields a `StreamChunk` per step as tokens are
    produced (with a tokenizer, each row's text delta too).

    Validation happens at call time, before the first chunk is requested.
    """
    request = self.validate(inputs, max_new_tokens, params=params, **sampling)
    return self._stream(request, self._scheduler.submit(request))

  def _stream(self, request: validation.Request, group) -> Iterator[StreamChunk]:
    rows = None
    if self.tokenizer is not None:
      rows = [RowText(self.tokenizer, request.stop) for _ in request.rows]
    step = 0
    try:
      for tokens in group.events():
        texts = None if rows is None else {row: rows[row].push(t) for row, t in tokens.items()}
        yield StreamChunk(step, tokens, texts)
        step += 1
      if rows is not None:
        rest = {i: delta for i, row in enumerate(rows) if (delta := row.finish())}
        if rest:
          yield StreamChunk(step, {}, rest)
    finally:
      group.cancel()  # a stream closed early frees its blocks

  def submit(self, prompt, max_new_tokens: int | None = None, *,
             params: SamplingParams | None = None, timeout: float | None = None,
             **sampling) -> Handle:
    """Queue one request from any thread; returns its `Handle` at once.

    Args:
      prompt: a string (with a tokenizer) or a list of token ids.
      params, max_new_tokens, **sampling: as `generate`. With `logprobs`, each new token's
        log-probability and its most likely alternatives come in the `Delta`s and the
        `Completion`; their executables compile at warm-up with
        `phases=(*SERVING_PHASES, "logprobs")`, else on first use.
      timeout: seconds the request may take from now (None: no limit); past it the handle's
        `result()` raises `cg_jax.handles.RequestTimeout`.
    Raises:
      ValueError / TypeError for a bad request (a `ParamError` for a bad sampling value;
      nothing is queued); `cg_jax.handles.QueueFull` when `max_waiting` requests wait
      already.
    """
    validation.timeout(timeout)
    if isinstance(prompt, np.ndarray):
      prompt = prompt.tolist()
    if not isinstance(prompt, (str, list, tuple)):
      raise TypeError(f"prompt must be a string or a list of token ids, got "
                      f"{type(prompt).__name__}")
    return self.submit_validated(self.validate([prompt], max_new_tokens, params=params,
                                               **sampling), timeout=timeout)

  def submit_validated(self, request: validation.Request, *,
                       timeout: float | None = None) -> Handle:
    """`submit` of a one-prompt request validated already (`validate`'s, or the serving front
    end's own checks: one validation pass a request)."""
    validation.timeout(timeout)
    return Handle(self._scheduler.submit(request, timeout), self.tokenizer, request.stop,
                  request.logprobs)

  def enqueue(self, request: validation.Request, *, timeout: float | None = None,
              group: Callable[[list[int], Callable[[], None]], Group] = Group) -> Group:
    """Queue a request validated already, its tokens going to `group(prompt lengths,
    on_cancel)`: how the engine-core process (`cg_jax.core.process`) runs its front ends'
    requests."""
    return self._scheduler.submit(request, timeout, group)

  def on_step(self, callback: Callable[[], None] | None) -> None:
    """`callback` (or None) is called on the engine thread once each step's tokens and ends
    went to their groups: how the engine-core process sends a step's outputs in one message."""
    self._scheduler.on_delivered = callback

  def score(self, prompt, top: int = 0) -> list[tuple[float, tuple[tuple[int, float], ...]]]:
    """The log-probability of each prompt token after the first given the tokens before it,
    with its `top` most likely alternatives: [(logprob, ((token, logprob), ...)), ...], one
    per token from the second (what `echo` with `logprobs` reports). The prompt may fill the
    context (max_seq_len tokens; it is padded to the smallest prompt bucket or the context);
    the ("score", length) executables compile at warm-up with
    `phases=(*SERVING_PHASES, "logprobs")`, else on first use."""
    rows = validation.prompts(self._encode([prompt] if isinstance(prompt, str) else [prompt]),
                              self.model_config.vocab_size)
    top = check_logprobs(top, min(TOP_LOGPROBS, self.model_config.vocab_size), "top")
    row = rows[0]
    lengths = self.executables.score_lengths()
    if len(row) > lengths[-1]:
      raise ValueError(f"a scored prompt may have at most {lengths[-1]} tokens (max_seq_len), "
                       f"got {len(row)}")
    size = next(n for n in lengths if n >= len(row))
    tokens = np.zeros((1, size), np.int32)
    tokens[0, :len(row)] = row
    scores = np.asarray(self.executables.get(("score", size))(
        self._split.weights, tokens))
    return [unpack_scores(scores[i], top) for i in range(len(row) - 1)]

  def _call_stats(self, request: validation.Request, group, start: float) -> dict[str, Any]:
    end = group.finished_at or time.perf_counter()
    first = group.first_token_at or end
    rows = [(at or end) - start for at in group.row_first_token_at]
    total = sum(len(t) for t in group.tokens)
    per_token = [row_per_token(group, row) or 0.0 for row in range(len(group.tokens))]
    # The rows that made more than one token (every row when none did)
    timed = [t for t, made in zip(per_token, group.tokens) if len(made) > 1] or per_token
    return dict(ttft_s=first - start, ttft_s_rows=rows, ttft_s_last=max(rows),
                total_s=end - start, new_tokens=total, per_token_s_rows=per_token,
                per_token_s=float(np.median(timed)),
                tokens_per_s=total / max(end - start, 1e-9),
                greedy=request.settings.greedy,
                readback_lag=self.config.readback_lag)

  @property
  def closed(self) -> bool:
    """True after `close()`: the engine takes no more requests."""
    return self._scheduler.closed

  def reset_prefix_cache(self) -> None:
    """Forget every cached prefix (waits until no request is queued or running); the counters
    in `stats()` stay."""
    with self._scheduler.exclusive():
      self._scheduler.blocks.reset()

  def close(self) -> None:
    """Finish: every queued or running request fails with `cg_jax.handles.EngineClosed`, the
    engine thread stops and the KV cache's memory is freed. The engine takes no more
    requests."""
    self._scheduler.close()
    self.kv_cache.release()

  def __del__(self):
    scheduler = getattr(self, "_scheduler", None)
    if scheduler is not None:
      scheduler.close(wait=False)  # its thread ends; nothing else holds the engine's requests

  def __enter__(self) -> "Engine":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  # ------------------------------------------------------------------------------------------------
  # KV-cache offload

  def swap_out(self) -> None:
    """Move the KV cache to pinned host memory, freeing its device memory; running requests
    pause (a suspended `stream()` continues exactly) until `swap_in()` or a new request, which
    brings the cache back."""
    with self._lock:
      self._scheduler.pause()
      self.kv_cache.swap_out()

  def swap_in(self) -> None:
    """Bring a swapped-out KV cache back to device memory."""
    with self._lock:
      self.kv_cache.swap_in()
    self._scheduler.resume()

  @property
  def kv_cache_memory_kind(self) -> str | None:
    """"device", "pinned_host" (swapped out) or None (not allocated yet)."""
    return self.kv_cache.memory_kind
