"""The inference engine: weights on the device, one preallocated KV cache, and a table of
executables compiled ahead of time per (phase, bucket).

Request path: validate on the host -> pad to the smallest (batch, length) bucket -> prefill ->
first token -> decode steps (one host call per token, or K tokens per call in the device loop).
Nothing on that path compiles once `warmup()` has run.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from cg_jax import compile_stats, graphs as graph_modes, host_io, text, validation
from cg_jax.buckets import DEFAULT_BATCH_BUCKETS, Buckets, powers_of_two
from cg_jax.hub import resolve_model
from cg_jax.sampling import SamplingArrays
from cg_jax.sharding import TensorParallel, check_tensor_parallel, from_shard_major, to_shard_major
from cg_jax.steps import LoopState, SplitModel, StepFunctions
from models import hf
from models.attention import (CACHE_WRITES, DECODE_COMBINES, DECODE_QKV, DECODE_SPLITS,
                              check_backend, default_backend as default_attention)
from models.config import PRESETS, DecoderConfig
from models.decoder import (LAYER_LOOPS, Decoder, KVCache, cache_bytes, check_linear_backend,
                            init_cache)


PHASES = ("prefill", "first", "decode", "loop")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  """Static, buffer-sizing settings of an engine (all hashable).

  max_seq_len: KV-cache length T (prompt + generated tokens per row).
  buckets: batch and prompt-length buckets; the cache holds `buckets.max_batch` rows.
  attention: attention backend ("xla" or "pallas").
  layer_loop: decode steps' layer loop, "scan" (one while loop) or "unroll" (straight-line).
  graphs: CUDA-graph mode (`cg_jax.graphs.GRAPH_MODES`).
  decode_loop_steps: K, tokens per host call in the device loop.
  readback_lag: steps launched ahead of the one whose tokens the host reads (0: synchronous).
  min_matmul_rows: decode steps pad the layers' products to at least this many rows.
  linear: decode steps' projections, "xla" or "pallas" (fused norm/matmul/epilogue kernels).
  tensor_parallel: devices the model is split over (`cg_jax.sharding`).
  cache_write: decode steps' cache write with Pallas attention, "fused" or "scatter".
  decode_splits: the fused decode kernel's split of each row's keys, "fixed" or "length".
  decode_combine: what merges the fused decode kernel's split-K partials, "xla" or "pallas".
  decode_qkv: who slices the QKV output and applies RoPE in decode steps, "xla" or "kernel".
  compiler_options: XLA options applied to every executable (the graph mode's, plus extras).
  """

  max_seq_len: int
  buckets: Buckets
  attention: str = "xla"
  layer_loop: str = "scan"
  graphs: str = "xla-default"
  decode_loop_steps: int = 16
  readback_lag: int = 2
  min_matmul_rows: int = 8
  linear: str = "xla"
  tensor_parallel: int = 1
  cache_write: str = "fused"
  decode_splits: str = "fixed"
  decode_combine: str = "xla"
  decode_qkv: str = "xla"
  compiler_options: tuple[tuple[str, Any], ...] = ()


@dataclasses.dataclass(frozen=True)
class StreamChunk:
  """Tokens produced in one step: {row index in the request: token id}, and text deltas."""

  step: int
  tokens: dict[int, int]
  texts: dict[int, str] | None = None


class GenerationResult(list):
  """The new token ids per prompt (a list of lists), with `.texts` and `.stats` attached."""

  def __init__(self, tokens: list[list[int]], texts: list[str] | None, stats: dict[str, Any]):
    super().__init__(tokens)
    self.texts = texts
    self.stats = stats


@dataclasses.dataclass(frozen=True)
class _Batch:
  """One run of a request, padded to its bucket, inputs already staged on the device."""

  row_start: int
  real: int
  batch: int
  length: int
  tokens: jax.Array
  lengths: jax.Array
  sampling: SamplingArrays | None


@dataclasses.dataclass
class _Request:
  rows: list[np.ndarray]
  max_new_tokens: int
  settings: validation.SamplingSettings
  device_loop: bool
  stats: dict[str, Any] = dataclasses.field(default_factory=dict)


def _physical_memory_bytes() -> int | None:
  try:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  except (ValueError, OSError, AttributeError):
    return None


def _device_memory_bytes(device) -> int | None:
  stats = device.memory_stats() if hasattr(device, "memory_stats") else None
  if stats and "bytes_limit" in stats:
    return int(stats["bytes_limit"])
  return _physical_memory_bytes() if device.platform == "cpu" else None


class Engine:
  """Bucketed, ahead-of-time compiled decoder inference.

  Args:
    config: the model's `DecoderConfig`.
    weights: {weight kind: array} as produced by `models.hf`; None initialises random weights
      (normal(0.02), seeded by `seed`) for smoke tests and benchmarks.
    dtype: "float32", "bfloat16" or "float16".
    tokenizer: a `tokenizers.Tokenizer` for text prompts, or None.
    max_seq_len: KV-cache length per row (default: min(model context, 2048)).
    batch_buckets: batch buckets (default 1, 2, 4, 8, 16, 32).
    prompt_buckets: prompt-length buckets (default powers of two from 16 up to max_seq_len).
    attention: "pallas" (fused Pallas kernels; the default on GPU) or "xla" (the default
      elsewhere; on CPU the Pallas kernels run in the interpreter, for tests).
    layer_loop: the decode steps' layer loop: "unroll" (the default on GPU: with it a decode
      step is one CUDA graph; benchmarks/results/graphs_h200.md) or "scan" (the default
      elsewhere: faster compiles).
    graphs: CUDA-graph mode: "off", "xla-default" (default) or "full".
    decode_loop_steps: tokens generated per host call in the device loop.
    readback_lag: decode steps launched ahead of the step whose tokens are being read back
      (asynchronous device-to-host copies); 0 reads every step synchronously.
    min_matmul_rows: decode steps with fewer batch rows run their layers on the hidden state
      zero-padded to this many rows (1 = no padding), so XLA emits GEMMs instead of its
      single-row multiply-and-reduce rewrite. Results are unchanged. Default 8, measured on the
      H200 at batch 1 (benchmarks/results/projections_h200.md): gpt2 647 -> 393 us, llama-3.2-1b
      1429 -> 1032 us per step (16 rows: 374 and 1063 us).
    linear: "xla" (default) or "pallas": in decode steps each projection with its norm, bias,
      activation and residual runs as one fused Pallas kernel (`cg_jax.kernels.fused_linear`;
      interpreted off the GPU). Needs 16-aligned widths.
    tensor_parallel: split the model over this many devices (Megatron style over a 1-D mesh,
      `cg_jax.sharding`): heads and MLP columns per device, one all-reduce per row-parallel
      projection, the KV cache split by KV head. It must divide the heads, KV heads and MLP
      width; needs linear="xla". Everything else (buckets, graphs, sampling, streaming,
      swapping) is unchanged.
    cache_write: with Pallas attention and unrolled layers, "fused" (default): the decode
      attention kernel also stores the step's new key and value, in place in the donated cache;
      "scatter": an XLA scatter per layer writes them first (the XLA backend always scatters).
    decode_splits: with the fused cache write, how the decode kernel spreads each row's valid
      keys over its split-K programs: "fixed" (default) cuts the whole cache into fixed windows
      (programs past a row's length idle); "length" shares the row's keys among the programs.
    decode_combine: with the fused cache write, what merges the decode kernel's split-K
      partials: "xla" (default; two XLA kernels per layer) or "pallas" (one Pallas kernel,
      `cg_jax.kernels.split_combine`).
    decode_qkv: "xla" (default): XLA slices each decode step's fused QKV output into q, k, v
      and applies RoPE; "kernel": with Pallas attention, unrolled layers and the fused cache
      write, the attention kernel reads them from that output in place and rotates q and the new
      key itself (one device only).
    compiler_options: extra XLA options for every executable, on top of the graph mode's.
    compilation_cache: persistent compilation cache directory, True for the user default,
      False to leave it off.
    memory_limit_bytes: override the device-memory budget used by the start-up check.
    seed: weight-initialisation seed when `weights` is None.
  """

  def __init__(self, config: DecoderConfig, weights: Mapping[str, Any] | None = None, *,
               dtype: str = "float32", tokenizer=None, max_seq_len: int | None = None,
               batch_buckets: Sequence[int] = DEFAULT_BATCH_BUCKETS,
               prompt_buckets: Sequence[int] | None = None, attention: str | None = None,
               layer_loop: str | None = None, graphs: str = "xla-default",
               decode_loop_steps: int = 16, readback_lag: int = 2, min_matmul_rows: int = 8,
               linear: str = "xla", tensor_parallel: int = 1, cache_write: str = "fused",
               decode_splits: str = "fixed", decode_combine: str = "xla",
               decode_qkv: str = "xla", compiler_options: Mapping[str, Any] | None = None,
               compilation_cache: str | bool = True, memory_limit_bytes: int | None = None,
               seed: int = 0):
    self.model_config = config
    self.dtype = jnp.dtype(hf.numpy_dtype(dtype))
    self.tokenizer = tokenizer
    attention = default_attention() if attention is None else attention
    check_backend(attention)
    if layer_loop is None:
      layer_loop = "unroll" if jax.default_backend() == "gpu" else "scan"
    if layer_loop not in LAYER_LOOPS:
      raise ValueError(f"layer_loop must be one of {LAYER_LOOPS}, got {layer_loop!r}")
    self._extra_compiler_options = dict(compiler_options or {})
    options = graph_modes.compiler_options(graphs, compiler_options)
    if max_seq_len is None:
      max_seq_len = min(config.max_position_embeddings, 2048)
    if not isinstance(max_seq_len, int) or not 2 <= max_seq_len <= config.max_position_embeddings:
      raise ValueError(f"max_seq_len must be an int in [2, {config.max_position_embeddings}], "
                       f"got {max_seq_len!r}")
    if prompt_buckets is None:
      prompt_buckets = powers_of_two(min(16, max_seq_len - 1), max_seq_len - 1)
    buckets = Buckets(tuple(batch_buckets), tuple(prompt_buckets))
    if buckets.max_prompt_len >= max_seq_len:
      raise ValueError(f"the largest prompt bucket ({buckets.max_prompt_len}) must be < "
                       f"max_seq_len ({max_seq_len}) to leave room for a new token")
    if not isinstance(decode_loop_steps, int) or decode_loop_steps < 1:
      raise ValueError(f"decode_loop_steps must be an int >= 1, got {decode_loop_steps!r}")
    if not isinstance(readback_lag, int) or not 0 <= readback_lag <= 8:
      raise ValueError(f"readback_lag must be an int in [0, 8], got {readback_lag!r}")
    if (not isinstance(min_matmul_rows, int) or isinstance(min_matmul_rows, bool)
        or not 1 <= min_matmul_rows <= 64):
      raise ValueError(f"min_matmul_rows must be an int in [1, 64], got {min_matmul_rows!r}")
    check_linear_backend(config, linear)
    for name, value, choices in (("cache_write", cache_write, CACHE_WRITES),
                                 ("decode_splits", decode_splits, DECODE_SPLITS),
                                 ("decode_combine", decode_combine, DECODE_COMBINES),
                                 ("decode_qkv", decode_qkv, DECODE_QKV)):
      if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
    if decode_qkv == "kernel" and tensor_parallel != 1:
      raise ValueError(f"decode_qkv='kernel' needs tensor_parallel=1, got {tensor_parallel}")
    check_tensor_parallel(config, tensor_parallel, linear)
    self.config = EngineConfig(
        max_seq_len=max_seq_len, buckets=buckets, attention=attention, layer_loop=layer_loop,
        graphs=graphs, decode_loop_steps=decode_loop_steps, readback_lag=readback_lag,
        min_matmul_rows=min_matmul_rows, linear=linear, tensor_parallel=tensor_parallel,
        cache_write=cache_write, decode_splits=decode_splits, decode_combine=decode_combine,
        decode_qkv=decode_qkv,
        compiler_options=tuple(sorted(options.items())))
    self._parallel = TensorParallel.over(tensor_parallel) if tensor_parallel > 1 else None
    self._check_memory(memory_limit_bytes)
    self.compilation_cache_dir = compile_stats.configure_compilation_cache(compilation_cache)

    if weights is None:
      def init():
        return nnx.to_pure_dict(nnx.state(Decoder(config, dtype=self.dtype, rngs=nnx.Rngs(seed))))
      weights = jax.jit(init)()
    abstract = nnx.eval_shape(lambda: Decoder(config, dtype=self.dtype, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    expected = nnx.to_pure_dict(state)
    if set(expected) != set(weights):
      raise ValueError(f"weights have kinds {sorted(weights)}, expected {sorted(expected)}")
    for name, spec in expected.items():
      if tuple(weights[name].shape) != tuple(spec.shape):
        raise ValueError(f"weight {name!r} has shape {tuple(weights[name].shape)}, "
                         f"expected {tuple(spec.shape)}")
    if self._parallel is None:
      device = jax.devices()[0]  # also when `weights` come split from a tensor-parallel engine
      device_weights = {n: jax.device_put(jnp.asarray(w, dtype=self.dtype), device)
                        for n, w in weights.items()}
    else:
      host = {n: np.asarray(w).astype(self.dtype) for n, w in weights.items()}
      device_weights = {n: jax.device_put(w, self._parallel.weight(n))
                        for n, w in to_shard_major(config, host, tensor_parallel).items()}
    nnx.replace_by_pure_dict(state, device_weights)
    self._split = SplitModel.from_state(graphdef, state)
    mesh = None if self._parallel is None else self._parallel.mesh
    self._steps = StepFunctions(self._split, attention, layer_loop, decode_loop_steps,
                                min_matmul_rows, linear, mesh, cache_write, decode_splits,
                                decode_combine, decode_qkv)
    self._executables: dict[tuple, Any] = {}
    self._compile_times: dict[tuple, float] = {}
    self._cache: KVCache | None = None
    self._host_cache: KVCache | None = None  # the cache while swapped out to pinned host memory
    # Where request inputs go and where the cache lives (and returns to after a swap).
    if self._parallel is None:
      self._inputs_at = self._cache_at = jax.devices()[0]
    else:
      self._inputs_at, self._cache_at = self._parallel.replicated(), self._parallel.cache()
    self._logits_fn = jax.jit(lambda w, t: self._split.merge(w).logits(t, attention=attention,
                                                                       mesh=mesh))
    self._lock = threading.RLock()
    self._compiles_at_warmup: int | None = None

  # ------------------------------------------------------------------------------------------------
  # Construction

  @classmethod
  def from_pretrained(cls, path: str | os.PathLike, dtype: str = "float32", **engine_options):
    """Load a local Hugging Face checkpoint directory, a preset name (random weights), or a
    Hugging Face model name from the local HF cache."""
    name = os.fspath(path)
    if name in PRESETS and not os.path.isdir(name):
      return cls(PRESETS[name], None, dtype=dtype, **engine_options)
    directory = resolve_model(name)
    config, weights = hf.load_checkpoint(directory, dtype)
    engine_options.setdefault("tokenizer", text.load_tokenizer(directory))
    return cls(config, weights, dtype=dtype, **engine_options)

  @classmethod
  def from_state_dict(cls, hf_config: Mapping[str, Any] | DecoderConfig, state_dict: Mapping[str, Any],
                      dtype: str = "float32", **engine_options):
    """Build from an in-memory (PyTorch) state_dict and a HF config dict (or a DecoderConfig)."""
    config = hf_config if isinstance(hf_config, DecoderConfig) else hf.config_from_hf(hf_config)
    return cls(config, hf.convert_state_dict(config, state_dict, dtype), dtype=dtype,
               **engine_options)

  def weights(self) -> dict[str, jax.Array]:
    """The device weights as {weight kind: array} (shared, not copied; with tensor_parallel > 1,
    copies in the canonical column layout)."""
    weights = nnx.to_pure_dict(jax.tree.unflatten(self._split.treedef, self._split.weights))
    if self._parallel is not None:
      weights = from_shard_major(self.model_config, weights, self._parallel.size)
    return weights

  def with_options(self, **engine_options) -> "Engine":
    """A new engine over the same device weights with other engine options (e.g. another graph
    mode or layer loop), for side-by-side comparisons in one process."""
    options = dict(dtype=self.dtype.name, tokenizer=self.tokenizer,
                   max_seq_len=self.config.max_seq_len,
                   batch_buckets=self.config.buckets.batch_sizes,
                   prompt_buckets=self.config.buckets.prompt_lengths,
                   attention=self.config.attention, layer_loop=self.config.layer_loop,
                   graphs=self.config.graphs, decode_loop_steps=self.config.decode_loop_steps,
                   readback_lag=self.config.readback_lag,
                   min_matmul_rows=self.config.min_matmul_rows, linear=self.config.linear,
                   tensor_parallel=self.config.tensor_parallel,
                   cache_write=self.config.cache_write,
                   decode_splits=self.config.decode_splits,
                   decode_combine=self.config.decode_combine,
                   decode_qkv=self.config.decode_qkv,
                   compiler_options=self._extra_compiler_options)
    options.update(engine_options)
    engine = Engine(self.model_config, self.weights(), **options)
    if dataclasses.replace(engine.config, readback_lag=0) == dataclasses.replace(self.config,
                                                                                readback_lag=0):
      # Same executables: share them (the weights are the same arrays) instead of recompiling.
      engine._executables, engine._compile_times = self._executables, self._compile_times
    return engine

  def _check_memory(self, limit: int | None) -> None:
    config, engine = self.model_config, self.config
    kv = cache_bytes(config, engine.buckets.max_batch, engine.max_seq_len, self.dtype)
    weights = config.num_parameters() * self.dtype.itemsize
    limit = limit if limit is not None else _device_memory_bytes(jax.devices()[0])
    # Per device, approximately: weights and cache over the devices (the replicated embeddings,
    # norms and LM head make the true share somewhat larger).
    kv, weights = kv // engine.tensor_parallel, weights // engine.tensor_parallel
    if limit is not None and kv + weights > limit:
      gib = 2**30
      raise ValueError(
          f"the KV cache for max batch {engine.buckets.max_batch} x max_seq_len "
          f"{engine.max_seq_len} needs {kv} bytes ({kv / gib:.2f} GiB) and the weights "
          f"{weights} bytes ({weights / gib:.2f} GiB), more than the {limit} bytes "
          f"({limit / gib:.2f} GiB) of device memory; lower max_seq_len or batch_buckets")

  # ------------------------------------------------------------------------------------------------
  # Ahead-of-time compilation

  def _specs(self):
    weights = [jax.ShapeDtypeStruct(w.shape, w.dtype) for w in self._split.weights]
    c, e = self.model_config, self.config
    shape = (c.num_layers, e.buckets.max_batch, e.max_seq_len, c.num_kv_heads, c.head_dim)
    cache = KVCache(k=jax.ShapeDtypeStruct(shape, self.dtype), v=jax.ShapeDtypeStruct(shape, self.dtype))
    return weights, cache

  def _jit(self, fn, donate_argnums=(), inputs=None, outputs=None):
    """jax.jit of a step. With tensor parallelism, `inputs` / `outputs` name each argument's /
    result's placement ("weights", "cache", or "replicated" for request arrays and tokens), so
    every executable takes and returns the same shardings and donation keeps the cache in place.
    """
    if self._parallel is None:
      return jax.jit(fn, donate_argnums=donate_argnums)
    placement = {"weights": [w.sharding for w in self._split.weights],
                 "cache": KVCache(k=self._parallel.cache(), v=self._parallel.cache()),
                 "replicated": self._parallel.replicated()}
    pick = lambda names: tuple(placement[n] for n in names)  # noqa: E731
    outs = pick(outputs) if isinstance(outputs, tuple) else placement[outputs]
    return jax.jit(fn, donate_argnums=donate_argnums, in_shardings=pick(inputs or ()),
                   out_shardings=outs)

  def _lower(self, key: tuple):
    """Lower one executable: key = (phase, batch bucket, length bucket or greedy flag)."""
    phase = key[0]
    steps, (weights, cache) = self._steps, self._specs()
    vocab = self.model_config.vocab_size
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    rep, state = "replicated", ("weights", "cache")
    if phase == "cache":
      c, e = self.model_config, self.config
      return self._jit(lambda: init_cache(c, e.buckets.max_batch, e.max_seq_len, self.dtype),
                       outputs="cache").lower()
    _, batch, extra = key
    if phase == "prefill":
      return self._jit(steps.prefill, (1,), state + (rep, rep), (rep, "cache")).lower(
          weights, cache, i32(batch, extra), i32(batch))
    sampling = None if extra else SamplingArrays.spec(batch)
    if phase == "first":
      logits = jax.ShapeDtypeStruct((batch, vocab), jnp.float32)
      return self._jit(steps.first_token, (), (rep, rep, rep), rep).lower(
          logits, i32(batch), sampling)
    # The decode state (cache, tokens, positions) is donated, so each output reuses its input's
    # buffer and keeps its address from step to step. (XLA still re-records the graph commands
    # that touch the fresh `emitted` output and temporaries: benchmarks/results/dispatch_h200.md.)
    if phase == "decode":
      return self._jit(steps.decode, (1, 2, 3), state + (rep, rep, rep),
                       (rep, rep, rep, "cache")).lower(weights, cache, i32(batch), i32(batch),
                                                       sampling)
    if phase == "loop":
      return self._jit(steps.decode_loop, (1, 2), state + (rep, rep, rep),
                       (rep, rep, "cache")).lower(
          weights, cache, LoopState.spec(batch), i32(validation.MAX_EOS_IDS), sampling)
    raise KeyError(key)

  def _executable(self, key: tuple):
    """The compiled executable for `key`, compiling it now if warmup did not."""
    exe = self._executables.get(key)
    if exe is None:
      start = time.perf_counter()
      exe = self._lower(key).compile(compiler_options=dict(self.config.compiler_options))
      self._compile_times[key] = time.perf_counter() - start
      self._executables[key] = exe
    return exe

  def executable_keys(self, batch_sizes: Sequence[int] | None = None,
                      prompt_lengths: Sequence[int] | None = None,
                      phases: Sequence[str] = PHASES) -> list[tuple]:
    """Every (phase, bucket) executable the request path can use, optionally restricted."""
    b = self.config.buckets
    batch_sizes = b.batch_sizes if batch_sizes is None else batch_sizes
    prompt_lengths = b.prompt_lengths if prompt_lengths is None else prompt_lengths
    unknown = set(phases) - set(PHASES)
    if unknown:
      raise ValueError(f"phases must be among {PHASES}, got {sorted(unknown)}")
    keys: list[tuple] = [("cache",)]
    for batch in batch_sizes:
      if "prefill" in phases:
        keys += [("prefill", batch, length) for length in prompt_lengths]
      for phase in ("first", "decode", "loop"):
        if phase in phases:
          keys += [(phase, batch, True), (phase, batch, False)]
    return keys

  def warmup(self, *, batch_sizes: Sequence[int] | None = None,
             prompt_lengths: Sequence[int] | None = None, phases: Sequence[str] = PHASES,
             progress: bool = True) -> dict[str, float]:
    """Compile every (phase, bucket) executable ahead of time and allocate the KV cache.

    Args:
      batch_sizes, prompt_lengths, phases: restrict to these (default: all).
      progress: show a progress bar.
    Returns:
      {executable name: compile seconds} (small when served from the persistent cache).
    """
    from tqdm.auto import tqdm

    keys = self.executable_keys(batch_sizes, prompt_lengths, phases)
    with self._lock:
      for key in tqdm(keys, desc="compiling", disable=not progress, unit="exe"):
        self._executable(key)
      self._ensure_cache()
      self._compiles_at_warmup = compile_stats.compile_count()
    return {"/".join(map(str, k)): self._compile_times.get(k, 0.0) for k in keys}

  def _ensure_cache(self) -> KVCache:
    if self._host_cache is not None:
      self.swap_in()
    if self._cache is None or self._cache.k.is_deleted() or self._cache.v.is_deleted():
      self._cache = self._executable(("cache",))()
    return self._cache

  def stats(self) -> dict[str, Any]:
    """Compile counters and engine settings."""
    count = compile_stats.compile_count()
    return {
        "compiles_total": count,
        "compiles_since_warmup": None if self._compiles_at_warmup is None
        else count - self._compiles_at_warmup,
        "compile_seconds_total": compile_stats.compile_seconds(),
        "persistent_cache_hits": compile_stats.cache_hit_count(),
        "executables": len(self._executables),
        "warmup_seconds": sum(self._compile_times.values()),
        "compilation_cache_dir": self.compilation_cache_dir,
        "attention": self.config.attention,
        "layer_loop": self.config.layer_loop,
        "graphs": self.config.graphs,
        "readback_lag": self.config.readback_lag,
        "min_matmul_rows": self.config.min_matmul_rows,
        "linear": self.config.linear,
        "tensor_parallel": self.config.tensor_parallel,
        "cache_write": self.config.cache_write,
        "decode_splits": self.config.decode_splits,
        "decode_combine": self.config.decode_combine,
        "decode_qkv": self.config.decode_qkv,
        "compiler_options": dict(self.config.compiler_options),
        "max_seq_len": self.config.max_seq_len,
        "batch_buckets": self.config.buckets.batch_sizes,
        "prompt_buckets": self.config.buckets.prompt_lengths,
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

  def _encode(self, inputs) -> tuple[Any, bool]:
    is_text = isinstance(inputs, str) or (
        isinstance(inputs, (list, tuple)) and inputs and all(isinstance(x, str) for x in inputs))
    if not is_text:
      return inputs, False
    if self.tokenizer is None:
      raise TypeError("text prompts need a tokenizer (tokenizer.json in the checkpoint "
                      "directory); pass token ids instead")
    texts = [inputs] if isinstance(inputs, str) else list(inputs)
    return [self.tokenizer.encode(t).ids for t in texts], True

  def validate(self, inputs, max_new_tokens: int = 32, do_sample: bool = False,
               temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
               seed: int | None = None, eos_token_id: int | Sequence[int] | None = None,
               device_loop: bool = False) -> _Request:
    """Validate a request on the host without running it (nothing touches the device); raises
    the ValueError / TypeError that `generate` would."""
    input_ids, _ = self._encode(inputs)
    rows = validation.prompts(input_ids, self.model_config.vocab_size)
    validation.lengths(rows, max_prompt_len=self.config.buckets.max_prompt_len,
                       max_seq_len=self.config.max_seq_len, max_new_tokens=max_new_tokens)
    settings = validation.sampling(
        do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
        eos_token_id=eos_token_id, default_eos=self.model_config.eos_token_id,
        vocab_size=self.model_config.vocab_size)
    if not isinstance(device_loop, (bool, np.bool_)):
      raise TypeError(f"device_loop must be a bool, got {device_loop!r}")
    return _Request(rows, max_new_tokens, settings, bool(device_loop))

  def generate(self, inputs, max_new_tokens: int = 32, do_sample: bool = False,
               temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
               seed: int | None = None, eos_token_id: int | Sequence[int] | None = None,
               device_loop: bool = False) -> GenerationResult:
    """Generate continuations.

    Args:
      inputs: a list of token-id lists (any lengths), a 2-D int array, or text (a string or a
        list of strings) when the engine has a tokenizer.
      max_new_tokens: tokens to generate per prompt (>= 1); a row also stops after an EOS id.
      do_sample: False for greedy; True samples with temperature / top_k / top_p (temperature 0
        is greedy).
      seed: sampling seed (None: random). The same seed gives the same tokens.
      eos_token_id: an id or a list of ids; None uses the model's; [] disables EOS.
      device_loop: generate `decode_loop_steps` tokens per host call inside one executable.
    Returns:
      A `GenerationResult`: a list of new-token lists (EOS included when hit), with `.texts`
      (when a tokenizer exists) and `.stats` (ttft_s, per_token_s, tokens_per_s, ...).
    """
    request = self.validate(inputs, max_new_tokens, do_sample=do_sample, temperature=temperature,
                            top_k=top_k, top_p=top_p, seed=seed, eos_token_id=eos_token_id,
                            device_loop=device_loop)
    tokens: list[list[int]] = [[] for _ in request.rows]
    for chunk in self._run(request):
      for row, token in chunk.tokens.items():
        tokens[row].append(token)
    texts = None
    if self.tokenizer is not None:
      texts = [text.decode(self.tokenizer, t) for t in tokens]
    return GenerationResult(tokens, texts, request.stats)

  def stream(self, inputs, max_new_tokens: int = 32, do_sample: bool = False,
             temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
             seed: int | None = None, eos_token_id: int | Sequence[int] | None = None,
             device_loop: bool = False) -> Iterator[StreamChunk]:
    """Like `generate`, but yields a `StreamChunk` per step as tokens are produced.

    Validation happens at call time, before the first chunk is requested.
    """
    request = self.validate(inputs, max_new_tokens, do_sample=do_sample, temperature=temperature,
                            top_k=top_k, top_p=top_p, seed=seed, eos_token_id=eos_token_id,
                            device_loop=device_loop)
    return self._stream_text(request) if self.tokenizer is not None else self._run(request)

  def _stream_text(self, request: _Request) -> Iterator[StreamChunk]:
    ids: dict[int, list[int]] = {}
    shown: dict[int, str] = {}
    for chunk in self._run(request):
      deltas = {}
      for row, token in chunk.tokens.items():
        ids.setdefault(row, []).append(token)
        full = text.decode(self.tokenizer, ids[row])
        deltas[row] = full[len(shown.get(row, "")):]
        shown[row] = full
      yield dataclasses.replace(chunk, texts=deltas)

  # ------------------------------------------------------------------------------------------------
  # The decode loops

  def _run(self, request: _Request) -> Iterator[StreamChunk]:
    """Run a validated request batch by batch; yields one chunk per step.

    The next batch's inputs are staged (pinned host -> device) while the current one runs.
    """
    with self._lock:
      start = time.perf_counter()
      first_token_at = None
      total_tokens = 0
      steps = 0
      runs = self.config.buckets.split(len(request.rows))
      batch = self._prepare_batch(request, *runs[0])
      for index in range(len(runs)):
        following = runs[index + 1] if index + 1 < len(runs) else None
        prepare_next = (lambda r=following: self._prepare_batch(request, *r)) if following else None
        chunks = self._run_batch(request, batch, prepare_next)
        while True:
          try:
            chunk = next(chunks)
          except StopIteration as stop:
            batch = stop.value
            break
          if first_token_at is None:
            first_token_at = time.perf_counter()
          total_tokens += len(chunk.tokens)
          steps += 1
          yield chunk
      end = time.perf_counter()
      decode_steps = max(steps - 1, 1)
      request.stats.update(
          ttft_s=first_token_at - start, total_s=end - start, new_tokens=total_tokens,
          per_token_s=(end - first_token_at) / decode_steps,
          tokens_per_s=total_tokens / (end - start), device_loop=request.device_loop,
          greedy=request.settings.greedy, readback_lag=self.config.readback_lag)

  def _prepare_batch(self, request: _Request, row_start: int, row_stop: int) -> _Batch:
    """Pad one run of rows to its bucket and stage its inputs on the device (asynchronously)."""
    rows = request.rows[row_start:row_stop]
    settings, real = request.settings, len(rows)
    buckets = self.config.buckets
    batch = buckets.batch_bucket(real)
    length = buckets.length_bucket(max(len(r) for r in rows))
    # Right-padded prompts; padding rows are one token long and finish at once.
    tokens = np.zeros((batch, length), np.int32)
    lengths = np.ones((batch,), np.int32)
    for i, row in enumerate(rows):
      tokens[i, :len(row)] = row
      lengths[i] = len(row)
    sampling = None
    if not settings.greedy:
      sampling = SamplingArrays.host(
          batch, temperature=settings.temperature, top_k=settings.top_k, top_p=settings.top_p,
          seed=settings.seed, rows=np.arange(row_start, row_stop))
    staged_tokens, staged_lengths, staged_sampling = host_io.stage(
        (tokens, lengths, sampling), self._inputs_at)
    return _Batch(row_start=row_start, real=real, batch=batch, length=length,
                  tokens=staged_tokens, lengths=staged_lengths,
                  sampling=staged_sampling)

  def _run_batch(self, request: _Request, batch: _Batch, prepare_next) -> Iterator[StreamChunk]:
    """Prefill and decode one staged batch; returns the next staged batch (or None)."""
    settings, real, row_start = request.settings, batch.real, batch.row_start
    greedy, sampling = settings.greedy, batch.sampling
    weights = self._split.weights
    eos = np.asarray(settings.eos_ids, np.int32)
    lag = self.config.readback_lag

    logits, self._cache = self._executable(("prefill", batch.batch, batch.length))(
        weights, self._ensure_cache(), batch.tokens, batch.lengths)
    first = self._executable(("first", batch.batch, greedy))(logits, batch.lengths, sampling)
    first.copy_to_host_async()
    following = prepare_next() if prepare_next else None  # overlaps this batch's compute
    host_tokens = np.asarray(first)
    budget = np.full((batch.batch,), request.max_new_tokens - 1, np.int32)
    done = np.arange(batch.batch) >= real
    done |= np.isin(host_tokens, eos) | (budget <= 0)
    yield StreamChunk(0, {row_start + i: int(host_tokens[i]) for i in range(real)})
    step, calls, reader = 1, 0, host_io.AsyncReader()

    if request.device_loop:
      eos_padded = np.full((validation.MAX_EOS_IDS,), -1, np.int32)
      eos_padded[:len(eos)] = eos
      loop = self._executable(("loop", batch.batch, greedy))
      max_calls = -(-(request.max_new_tokens - 1) // self.config.decode_loop_steps)
      state = LoopState(tokens=first, positions=batch.lengths, done=done, budget=budget)
      while True:
        # Keep up to `lag` further calls queued behind the one being read.
        while not np.all(done) and calls < max_calls and len(reader) <= lag:
          state, out, self._cache = loop(weights, self._cache, state, eos_padded, sampling)
          reader.push(out)
          calls += 1
        if not len(reader):
          return following
        out, _ = reader.pop()
        for column in out.T:
          emitted = {row_start + i: int(column[i]) for i in range(real) if column[i] >= 0}
          if not emitted:
            done[:] = True  # every row finished inside the loop
            break
          yield StreamChunk(step, emitted)
          step += 1

    decode = self._executable(("decode", batch.batch, greedy))
    tokens, positions = first, batch.lengths
    while True:
      # Launch step N+1 (up to `lag` steps ahead) before reading step N's tokens.
      while not np.all(done) and calls < request.max_new_tokens - 1 and len(reader) <= lag:
        emitted_tokens, tokens, positions, self._cache = decode(
            weights, self._cache, tokens, positions, sampling)
        reader.push(emitted_tokens)
        calls += 1
      if not len(reader):
        return following
      host_tokens, _ = reader.pop()
      emitted = {row_start + i: int(host_tokens[i]) for i in range(real) if not done[i]}
      budget = np.where(done, budget, budget - 1)
      done = done | np.isin(host_tokens, eos) | (budget <= 0)
      if emitted:
        yield StreamChunk(step, emitted)
        step += 1

  # ------------------------------------------------------------------------------------------------
  # KV-cache offload

  def swap_out(self) -> None:
    """Move the KV cache to pinned host memory, freeing its device memory. A suspended
    `stream()` continues exactly after `swap_in()`."""
    with self._lock:
      if self._cache is None or self._host_cache is not None:
        return
      self._host_cache = host_io.to_host(self._cache, self._cache_at)
      jax.block_until_ready(self._host_cache)
      for array in (self._cache.k, self._cache.v):
        array.delete()
      self._cache = None

  def swap_in(self) -> None:
    """Bring a swapped-out KV cache back to device memory."""
    with self._lock:
      if self._host_cache is None:
        return
      self._cache = host_io.to_device(self._host_cache, self._cache_at)
      self._host_cache = None

  @property
  def kv_cache_memory_kind(self) -> str | None:
    """"device", "pinned_host" (swapped out) or None (not allocated yet)."""
    cache = self._cache if self._cache is not None else self._host_cache
    return None if cache is None else cache.k.sharding.memory_kind
