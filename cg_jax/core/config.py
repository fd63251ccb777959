"""The engine's configuration: one frozen, typed tree, validated once when it is built.

  EngineConfig                       cache length, running requests, step budget, buckets,
  |                                  CUDA-graph mode, readback lag, tensor parallelism, XLA options
  +-- forward: ForwardConfig         attention backend, layer loop, matmul row padding
        +-- prefill_attention: FlashAttentionConfig   (cg_jax.kernels.flash_attention)

Every node checks its own fields when it is made, and a combination that would not take effect is
an error naming both settings. `EngineConfig.create(model, **options)` builds the tree from the
keyword options of `Engine(...)` with the platform's defaults; the tree is passed down whole.
A kernel option is a field of its kernel's config class and nothing else.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping, Sequence
from typing import Any

import jax

from cg_jax.core import graphs as graph_modes
from cg_jax.core.buckets import DEFAULT_BATCH_BUCKETS, Buckets, powers_of_two
from cg_jax.core.sharding import check_tensor_parallel
from cg_jax.core.step_inputs import StepLayout
from cg_jax.core.step_plan import logit_rows
from cg_jax.kernels.flash_attention import FlashAttentionConfig
from models.config import DecoderConfig
from models.decoder import LAYER_LOOPS, cache_bytes

ATTENTION_BACKENDS = ("xla", "pallas")
# Largest readback lag and matmul row padding accepted.
MAX_READBACK_LAG = 8
# The prefill steps' GEMMs: "xla" leaves the choice to XLA (its autotuned Triton GEMM
# fusions, as the decode steps use); "cublas", the default, turns Triton GEMMs off so that the
# long-M products of a prefill go to cuBLAS, in the algorithm its heuristics pick (no
# autotuning). Autotuning the Triton GEMMs of gpt2's prompt steps was most of its cold start
# (97 s), cuBLAS unautotuned started in 34 s with first tokens no later
# (benchmarks/results/compile_time_h100.md).
PREFILL_GEMMS: dict[str, dict[str, Any]] = {
    "xla": {},
    "cublas": {"xla_gpu_enable_triton_gemm": False, "xla_gpu_autotune_level": 0},
}
# Steps of at least this many tokens take the prefill GEMM backend even when every token is a
# decode row (max_num_seqs at least this): products of that many rows are cuBLAS's ground, and
# autotuning Triton GEMMs for them is start-up time.
PREFILL_GEMM_TOKENS = 64
MAX_MATMUL_ROWS = 64
# The prompt chunk of `batch_invariant` engines unless prompt_buckets names one.
INVARIANT_CHUNK = 256
# Prompt tokens one engine step takes at most (`max_num_batched_tokens`) unless given, on a GPU
# and elsewhere (a CPU takes longer per token: smaller steps hold the decode rows for less).
DEFAULT_STEP_TOKENS = {"gpu": 2048, "cpu": 256}
MAX_STEP_TOKENS = 1 << 16
# The most requests one engine runs at once (`max_num_seqs`) may be.
MAX_NUM_SEQS = 4096
# max_num_seqs unless given (or batch_buckets are), on a GPU and elsewhere.
DEFAULT_NUM_SEQS = {"gpu": 256, "cpu": 32}
# The share of a GPU's memory the default KV cache (a full block table per running request)
# may take beside the weights and the activation reserve: a larger one is cut to what it
# leaves (`blocks_for_memory`), and requests wait for blocks.
DEFAULT_MEMORY_SHARE = 0.9
# The smallest token bucket of an engine step (a decode step of up to that many rows), by
# attention backend: the Pallas kernel's, 8 (decode steps run their products on at least
# min_matmul_rows rows anyway); XLA's (the CPU default), 1: it attends for every token of the
# bucket, padding too (the bundled model's B=1 generate on the CPU: 1.6x the time per token at
# 8; benchmarks/results/cpu_step_tokens.md).
MIN_STEP_TOKENS = {"pallas": 8, "xla": 1}
# The KV-cache length when max_seq_len is not given: min(model context, DEFAULT_MAX_SEQ_LEN).
DEFAULT_MAX_SEQ_LEN = 2048
# Kept free beside the weights and the cache for the executables' activations and workspace: at
# least this, or ACTIVATION_TENSORS tensors as wide as the MLP over the largest call.
MIN_ACTIVATION_RESERVE = 1 << 30
ACTIVATION_TENSORS = 4


def _is_int(value) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


def _choice(name: str, value, choices) -> None:
  if value not in choices:
    raise ValueError(f"{name} must be one of {choices}, got {value!r}")


def on_gpu() -> bool:
  return jax.default_backend() == "gpu"


def _platform(platform: str | None) -> str:
  """The platform whose defaults apply, "gpu" or "cpu": `platform` when given, else the
  default backend's (then the backend is asked)."""
  return platform if platform is not None else ("gpu" if on_gpu() else "cpu")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ForwardConfig:
  """How the model's forward paths run.

  attention: "pallas" (the fused kernels of `cg_jax.kernels`; interpreted off the GPU) or "xla".
  layer_loop: every forward path's layer loop, "unroll" (straight-line: one CUDA graph per call,
    no copies of the weights' layer slices) or "scan" (`lax.scan`: faster compiles).
  min_matmul_rows: decode steps with fewer rows run their layers on the hidden state padded to
    this many rows (1 = none), so XLA emits GEMMs instead of its single-row multiply-and-reduce
    rewrite (benchmarks/results/projections_h200.md). Results are unchanged.
  prefill_attention: the Pallas flash kernel's own config (Pallas attention only).
  batch_invariant: the paged kernel's split count depends on the block table's width only
    (`EngineConfig.batch_invariant`: every step also has the one token bucket's shapes).
  """

  attention: str
  layer_loop: str
  min_matmul_rows: int = 8
  prefill_attention: FlashAttentionConfig = FlashAttentionConfig()
  batch_invariant: bool = False

  def __post_init__(self):
    _choice("attention", self.attention, ATTENTION_BACKENDS)
    if not isinstance(self.batch_invariant, bool):
      raise TypeError(f"batch_invariant must be a bool, got {self.batch_invariant!r}")
    _choice("layer_loop", self.layer_loop, LAYER_LOOPS)
    if not _is_int(self.min_matmul_rows) or not 1 <= self.min_matmul_rows <= MAX_MATMUL_ROWS:
      raise ValueError(f"min_matmul_rows must be an int in [1, {MAX_MATMUL_ROWS}], "
                       f"got {self.min_matmul_rows!r}")
    value = self.prefill_attention
    if not isinstance(value, FlashAttentionConfig):
      raise TypeError(f"prefill_attention must be a FlashAttentionConfig, got {value!r}")
    if self.attention != "pallas" and value != FlashAttentionConfig():
      raise ValueError(f"prefill_attention={value} has no effect with "
                       f"attention={self.attention!r}: the kernels run with attention='pallas'")

  @classmethod
  def create(cls, *, attention: str | None = None, layer_loop: str | None = None,
             min_matmul_rows: int | None = None,
             prefill_attention: FlashAttentionConfig | None = None,
             batch_invariant: bool = False, platform: str | None = None) -> "ForwardConfig":
    """The config with the platform's defaults for what is None: Pallas attention and unrolled
    layers on GPU; XLA attention and scanned layers elsewhere; products on at least 8 rows.
    `batch_invariant`: the paged kernel's split count is kept off the batch
    (`cg_jax.core.attention.paged_for_forward`). `platform`: "gpu" or "cpu" instead of the
    default backend's (nothing asks the device)."""
    if attention is None:
      attention = "pallas" if _platform(platform) == "gpu" else "xla"
    if layer_loop is None:
      layer_loop = "unroll" if _platform(platform) == "gpu" else "scan"
    if min_matmul_rows is None:
      min_matmul_rows = 8
    return cls(attention=attention, layer_loop=layer_loop, min_matmul_rows=min_matmul_rows,
               prefill_attention=prefill_attention or FlashAttentionConfig(),
               batch_invariant=batch_invariant)


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig:
  """Everything that sizes an engine's buffers or changes its executables (all hashable).

  max_seq_len: KV-cache length T per row (prompt + generated tokens).
  max_num_seqs: U, the most requests running at once (vLLM's option of that name): the rows of
    the largest decode step and of the carry; more wait in the queue, as they do when the KV
    cache has no blocks for them.
  buckets: the static path's batch and prompt-length buckets (`("prefill", batch, length)`:
    benchmarks' baseline; the engine's steps take token buckets), at most max_num_seqs rows.
  forward: how the forward paths run (`ForwardConfig`).
  graphs: CUDA-graph mode (`cg_jax.core.graphs.GRAPH_MODES`).
  prefill_gemm: the GEMM backend of the prefill steps and static prefills (`PREFILL_GEMMS`).
  readback_lag: decode steps launched ahead of the one whose tokens the host reads (0: each
    step is read synchronously).
  tensor_parallel: devices the model is split over (`cg_jax.core.sharding`).
  max_waiting: requests the scheduler's waiting queue holds; more is a `QueueFull` error.
  prefix_cache_tokens: blocks' worth of tokens the paged cache holds beyond the rows' own
    (`num_blocks`) for finished prompts' cached prefixes: a prompt that starts with cached blocks
    shares them (`cg_jax.core.block_pool`); 0 turns prefix caching off (the field's default;
    `create` turns it on). With `kv_blocks` set, any block no request holds keeps its prefix
    until it is needed, and only 0 versus not 0 matters.
  kv_blocks: N, the paged cache's blocks (at least one max_seq_len sequence's); None: a full
    block table per running request (max_num_seqs) plus the prefix cache's, which `Engine` on
    a GPU cuts to what DEFAULT_MEMORY_SHARE of the device leaves.
  gpu_memory_utilization: None, or the share of the device's memory the engine asks for (it
    must be free), in (0, 1]: `Engine` then sets kv_blocks to what the weights and the
    activation reserve leave of it (`blocks_for_memory`). Off by default: a cache that fills
    the H200 made a 512-token prompt's first token 7% later than one sized for the rows
    (benchmarks/results/paged_engine_v2_h200.md).
  max_num_batched_tokens: the token budget of one engine step: the running requests' decode
    tokens and prompt chunks of many requests run together in one executable over a flat
    batch of up to this many tokens (each request's tokens at its own cache offset); the step
    executables exist per token bucket (`token_buckets`). Batch-invariant engines: the prompt
    tokens of a step, the one prompt bucket.
  prefix_block: tokens per KV-cache block C, the paged cache's page and the prefix cache's unit
    (a prefix is shared in whole blocks); with the Pallas kernel a power of two >= 16.
  compiler_options: extra XLA options for every executable, on top of the graph mode's, as
    sorted (name, value) pairs.
  batch_invariant: a request's logits do not depend on the other requests, their places or the
    load: every step runs the one token bucket (its products, token choice and scores on the
    same shapes), the paged kernel's split count depends on the block table's width only, and
    a step takes one prompt's chunk of the one prompt bucket, at multiples of it (prefix-cache
    hits are used in whole chunks), beside the decode rows.
  token_buckets: the token counts of the step executables, ascending, the last
    max_num_batched_tokens; a step pads its tokens to the smallest that holds them
    (`create`'s default: `default_token_buckets`). Batch-invariant engines: the one,
    max_num_batched_tokens + max_num_seqs.
  """

  max_seq_len: int
  max_num_seqs: int
  buckets: Buckets
  forward: ForwardConfig
  graphs: str = "xla-default"
  readback_lag: int = 2
  prefill_gemm: str = "cublas"
  tensor_parallel: int = 1
  max_waiting: int = 1024
  prefix_cache_tokens: int = 0
  max_num_batched_tokens: int = 256
  prefix_block: int = 16
  kv_blocks: int | None = None
  gpu_memory_utilization: float | None = None
  compiler_options: tuple[tuple[str, Any], ...] = ()
  batch_invariant: bool = False
  token_buckets: tuple[int, ...] = ()

  def __post_init__(self):
    if not _is_int(self.max_seq_len) or self.max_seq_len < 2:
      raise ValueError(f"max_seq_len must be an int >= 2, got {self.max_seq_len!r}")
    if not isinstance(self.buckets, Buckets):
      raise TypeError(f"buckets must be a Buckets, got {self.buckets!r}")
    if not isinstance(self.forward, ForwardConfig):
      raise TypeError(f"forward must be a ForwardConfig, got {self.forward!r}")
    if not _is_int(self.max_num_seqs) or not 1 <= self.max_num_seqs <= MAX_NUM_SEQS:
      raise ValueError(f"max_num_seqs must be an int in [1, {MAX_NUM_SEQS}], got "
                       f"{self.max_num_seqs!r}")
    if self.buckets.max_batch > self.max_num_seqs:
      raise ValueError(f"the largest batch bucket ({self.buckets.max_batch}) must be <= "
                       f"max_num_seqs ({self.max_num_seqs}), the requests that run at once")
    if self.buckets.max_prompt_len >= self.max_seq_len:
      raise ValueError(f"the largest prompt bucket ({self.buckets.max_prompt_len}) must be < "
                       f"max_seq_len ({self.max_seq_len}) to leave room for a new token")
    _choice("graphs", self.graphs, tuple(graph_modes.GRAPH_MODES))
    if not _is_int(self.readback_lag) or not 0 <= self.readback_lag <= MAX_READBACK_LAG:
      raise ValueError(f"readback_lag must be an int in [0, {MAX_READBACK_LAG}], "
                       f"got {self.readback_lag!r}")
    _choice("prefill_gemm", self.prefill_gemm, tuple(PREFILL_GEMMS))
    if not _is_int(self.max_waiting) or self.max_waiting < 1:
      raise ValueError(f"max_waiting must be an int >= 1, got {self.max_waiting!r}")
    if not _is_int(self.max_num_batched_tokens) or not (
        1 <= self.max_num_batched_tokens <= MAX_STEP_TOKENS):
      raise ValueError(f"max_num_batched_tokens must be an int in [1, {MAX_STEP_TOKENS}], got "
                       f"{self.max_num_batched_tokens!r}")
    if not _is_int(self.prefix_block) or not 1 <= self.prefix_block < self.max_seq_len:
      raise ValueError(f"prefix_block must be an int in [1, {self.max_seq_len - 1}] (below "
                       f"max_seq_len), got {self.prefix_block!r}")
    if self.forward.attention == "pallas" and (
        self.prefix_block < 16 or self.prefix_block & (self.prefix_block - 1)):
      raise ValueError(f"prefix_block (the KV-cache page size) must be a power of two >= 16 "
                       f"for the Pallas attention kernel, got {self.prefix_block}")
    if not _is_int(self.prefix_cache_tokens) or not (
        self.prefix_cache_tokens == 0 or self.prefix_cache_tokens >= self.prefix_block):
      raise ValueError(f"prefix_cache_tokens must be 0 (off) or an int >= prefix_block "
                       f"({self.prefix_block}), got {self.prefix_cache_tokens!r}")
    if self.kv_blocks is not None and (not _is_int(self.kv_blocks)
                                       or self.kv_blocks < self.table_width):
      raise ValueError(f"kv_blocks must be None or an int >= {self.table_width} (one sequence of "
                       f"max_seq_len {self.max_seq_len} in blocks of {self.prefix_block}), got "
                       f"{self.kv_blocks!r}")
    utilization = self.gpu_memory_utilization
    if utilization is not None and (isinstance(utilization, bool) or not isinstance(
        utilization, (int, float)) or not 0 < utilization <= 1):
      raise ValueError(f"gpu_memory_utilization must be None or a number in (0, 1], got "
                       f"{utilization!r}")
    if not _is_int(self.tensor_parallel):  # its range depends on the devices: `check_model`
      raise ValueError(f"tensor_parallel must be an int, got {self.tensor_parallel!r}")
    self._check_batch_invariance()
    self._check_token_buckets()
    if not isinstance(self.compiler_options, tuple) or any(
        not isinstance(pair, tuple) or len(pair) != 2 or not isinstance(pair[0], str)
        for pair in self.compiler_options):
      raise TypeError(f"compiler_options must be (name, value) pairs, got "
                      f"{self.compiler_options!r}")

  def _check_token_buckets(self) -> None:
    sizes, budget = self.token_buckets, self.max_num_batched_tokens
    if self.batch_invariant:
      expected = default_token_buckets(budget, self.forward.attention, self.step_rows)
      if sizes != expected:
        raise ValueError(f"batch_invariant=True runs one token bucket, a prompt chunk beside a "
                         f"decode row per running request ({expected}); got token_buckets="
                         f"{sizes!r}")
      return
    if (not isinstance(sizes, tuple) or not sizes or not all(_is_int(t) for t in sizes)
        or list(sizes) != sorted(set(sizes)) or sizes[0] < 1):
      raise ValueError(f"token_buckets must be ascending distinct ints >= 1, got {sizes!r}")
    if sizes[-1] != budget:
      raise ValueError(f"token_buckets must end at max_num_batched_tokens ({budget}), a "
                       f"step's token budget; got {sizes!r}")

  def _check_batch_invariance(self) -> None:
    if not isinstance(self.batch_invariant, bool):
      raise TypeError(f"batch_invariant must be a bool, got {self.batch_invariant!r}")
    f = self.forward
    if f.batch_invariant != self.batch_invariant:
      raise ValueError(f"forward.batch_invariant ({f.batch_invariant}) must equal batch_invariant "
                       f"({self.batch_invariant})")
    if not self.batch_invariant:
      return
    lengths = self.buckets.prompt_lengths
    if len(lengths) != 1:
      raise ValueError(f"batch_invariant=True prefills in chunks of one prompt bucket, got "
                       f"prompt_buckets={lengths}")
    if self.max_num_batched_tokens != lengths[0]:
      raise ValueError(f"batch_invariant=True runs steps of one prompt chunk: "
                       f"max_num_batched_tokens must equal the prompt bucket ({lengths[0]}), got "
                       f"{self.max_num_batched_tokens}")
    if self.prefix_cache_tokens and lengths[0] % self.prefix_block:
      raise ValueError(f"batch_invariant=True with the prefix cache needs prefix_block "
                       f"({self.prefix_block}) to divide the prompt bucket ({lengths[0]})")

  @classmethod
  def create(cls, model: DecoderConfig, *, max_seq_len: int | None = None,
             max_num_seqs: int | None = None, batch_buckets: Sequence[int] | None = None,
             prompt_buckets: Sequence[int] | None = None, graphs: str = "xla-default",
             readback_lag: int = 2, prefill_gemm: str = "cublas", tensor_parallel: int = 1,
             max_waiting: int = 1024, prefix_cache_tokens: int | None = None,
             prefix_block: int | None = None, kv_blocks: int | None = None,
             max_num_batched_tokens: int | None = None,
             gpu_memory_utilization: float | None = None,
             compiler_options: Mapping[str, Any] | None = None,
             batch_invariant: bool = False, token_buckets: Sequence[int] | None = None,
             platform: str | None = None, **forward_options) -> "EngineConfig":
    """The tree from `Engine`'s keyword options, with defaults for what is None: max_seq_len
    min(model context, DEFAULT_MAX_SEQ_LEN); max_num_seqs the platform's DEFAULT_NUM_SEQS, or
    the largest batch bucket when they are given (batch buckets DEFAULT_BATCH_BUCKETS, those up
    to max_num_seqs); prompt
    buckets powers of two from 16 below max_seq_len; a prefix cache of 4 x max_seq_len tokens;
    KV blocks of 64 tokens with the Pallas kernel, else of min(16, max_seq_len - 1), as many as
    `num_blocks` says unless kv_blocks or gpu_memory_utilization is given; steps of up to
    DEFAULT_STEP_TOKENS tokens, at most max_num_seqs x max_seq_len (the prompt bucket when
    batch-invariant), in the token buckets of `default_token_buckets` (given token_buckets: the
    last is the budget); the forward options of `ForwardConfig.create`. With
    `batch_invariant`, one prompt bucket of min(INVARIANT_CHUNK, max_seq_len - 1) tokens.
    Checked against `model`. `platform`: "gpu" or "cpu", whose defaults to take, instead of the
    default backend's; then nothing asks the device (a launcher that must not touch it checks
    options so; the device count is not checked)."""
    if max_seq_len is None:
      max_seq_len = min(model.max_position_embeddings, DEFAULT_MAX_SEQ_LEN)
    if _is_int(max_seq_len) and max_seq_len >= 2:  # (else the tree's own check says why)
      if prompt_buckets is None and batch_invariant is True:
        prompt_buckets = (min(INVARIANT_CHUNK, max_seq_len - 1),)
      if prompt_buckets is None:
        prompt_buckets = powers_of_two(min(16, max_seq_len - 1), max_seq_len - 1)
      if prefix_cache_tokens is None:
        prefix_cache_tokens = 4 * max_seq_len
    if kv_blocks is not None and gpu_memory_utilization is not None:
      raise ValueError(f"gpu_memory_utilization={gpu_memory_utilization!r} has no effect with "
                       f"kv_blocks={kv_blocks!r}: give one (the blocks, or the share of device "
                       f"memory they are sized from)")
    if compiler_options is not None and not isinstance(compiler_options, Mapping):
      raise TypeError(f"compiler_options must be a mapping of XLA option names to values, got "
                      f"{compiler_options!r}")
    given_buckets = batch_buckets
    if batch_buckets is None:
      batch_buckets = DEFAULT_BATCH_BUCKETS
      if _is_int(max_num_seqs) and max_num_seqs >= 1:  # (else the tree's own check says why)
        batch_buckets = tuple(b for b in batch_buckets if b <= max_num_seqs) or (max_num_seqs,)
    buckets = Buckets(tuple(batch_buckets), tuple(prompt_buckets or ()))
    if max_num_seqs is None:
      max_num_seqs = (DEFAULT_NUM_SEQS[_platform(platform)] if given_buckets is None
                      else buckets.max_batch)
    if token_buckets is not None:
      if batch_invariant is True:
        raise ValueError(f"token_buckets={token_buckets!r} has no effect with "
                         f"batch_invariant=True, which runs one token bucket")
      if isinstance(token_buckets, (str, bytes)) or not isinstance(token_buckets, Sequence):
        raise TypeError(f"token_buckets must be a sequence of ints, got {token_buckets!r}")
      token_buckets = tuple(token_buckets)
      if max_num_batched_tokens is None and token_buckets and _is_int(token_buckets[-1]):
        max_num_batched_tokens = token_buckets[-1]
    if max_num_batched_tokens is None and batch_invariant is True:
      max_num_batched_tokens = buckets.prompt_lengths[0]
    elif max_num_batched_tokens is None and _is_int(max_seq_len):
      # (no more than every row's whole context)
      max_num_batched_tokens = min(DEFAULT_STEP_TOKENS[_platform(platform)],
                                   max_num_seqs * max_seq_len)
    forward = ForwardConfig.create(batch_invariant=batch_invariant, platform=platform,
                                   **forward_options)
    if prefix_block is None and _is_int(max_seq_len) and max_seq_len >= 2:
      # Pages of 64 tokens beat 16 in every H200 decode row of the paged kernel.
      pallas = forward.attention == "pallas" and max_seq_len > 64
      prefix_block = 64 if pallas else min(16, max_seq_len - 1)
    if token_buckets is None and _is_int(max_num_batched_tokens) and _is_int(max_num_seqs) and (
        max_num_batched_tokens >= 1):  # (else the tree's own check says why)
      token_buckets = default_token_buckets(max_num_batched_tokens, forward.attention,
                                            max_num_seqs if batch_invariant is True else None)
    config = cls(
        max_seq_len=max_seq_len, max_num_seqs=max_num_seqs, buckets=buckets, forward=forward,
        graphs=graphs, readback_lag=readback_lag, prefill_gemm=prefill_gemm,
        tensor_parallel=tensor_parallel, max_waiting=max_waiting,
        prefix_cache_tokens=prefix_cache_tokens, prefix_block=prefix_block, kv_blocks=kv_blocks,
        max_num_batched_tokens=max_num_batched_tokens,
        gpu_memory_utilization=gpu_memory_utilization,
        compiler_options=tuple(sorted((compiler_options or {}).items())),
        batch_invariant=batch_invariant, token_buckets=token_buckets or ())
    config.check_model(model, count_devices=platform is None)
    return config

  def check_model(self, model: DecoderConfig, count_devices: bool = True) -> None:
    """ValueError unless the cache fits the model's context and `tensor_parallel` divides the
    model over devices that exist (`count_devices`: counted)."""
    if self.max_seq_len > model.max_position_embeddings:
      raise ValueError(f"max_seq_len must be an int in [2, {model.max_position_embeddings}], "
                       f"got {self.max_seq_len}")
    check_tensor_parallel(model, self.tensor_parallel, count_devices)

  @property
  def prefix_blocks(self) -> int:
    """Blocks held for cached prefixes beyond the rows' own (0: prefix caching off)."""
    return self.prefix_cache_tokens // self.prefix_block

  @property
  def step_rows(self) -> int:
    """U (`max_num_seqs`): the requests running at once: the rows of the largest step and of
    the tokens a step hands the next (its carry)."""
    return self.max_num_seqs

  def rows(self, tokens: int) -> int:
    """R: the rows of a step of `tokens` tokens (its block tables)."""
    return min(tokens, self.step_rows)

  def logit_rows(self, tokens: int) -> int:
    """Y: the rows of a step's logits, and of the "draw" executable that reads them."""
    return logit_rows(self.rows(tokens), self.step_rows)

  @property
  def step_layout(self) -> StepLayout:
    """Where a step's index arrays lie in the staged buffer (`cg_jax.core.step_inputs`)."""
    return StepLayout(self.token_buckets, self.step_rows, self.table_width)

  @property
  def table_width(self) -> int:
    """W: blocks in one sequence's block table (max_seq_len tokens)."""
    return -(-self.max_seq_len // self.prefix_block)

  @property
  def num_blocks(self) -> int:
    """N: the paged cache's blocks: `kv_blocks`, else a full block table per running request
    (`max_num_seqs`) plus the prefix cache's. The cache holds one more, the scratch block that
    padding rows write (`scratch_block`)."""
    if self.kv_blocks is not None:
      return self.kv_blocks
    return self.max_num_seqs * self.table_width + self.prefix_blocks

  @property
  def scratch_block(self) -> int:
    """The block padding rows' tables name: written, never read."""
    return self.num_blocks

  @property
  def xla_options(self) -> dict[str, Any]:
    """The XLA options every executable is compiled with: the graph mode's plus the extras."""
    return graph_modes.compiler_options(self.graphs, dict(self.compiler_options))

  @property
  def prefill_xla_options(self) -> dict[str, Any]:
    """The XLA options of the prefill executables (`ExecutableTable.prefills`): `xla_options`
    with the prefill GEMM choice (the extras still win)."""
    return graph_modes.compiler_options(
        self.graphs, {**PREFILL_GEMMS[self.prefill_gemm], **dict(self.compiler_options)})

  def options(self) -> dict[str, Any]:
    """Keyword options that rebuild this tree through `create`."""
    f = self.forward
    return dict(max_seq_len=self.max_seq_len, max_num_seqs=self.max_num_seqs,
                batch_buckets=self.buckets.batch_sizes,
                prompt_buckets=self.buckets.prompt_lengths, graphs=self.graphs,
                readback_lag=self.readback_lag, prefill_gemm=self.prefill_gemm,
                tensor_parallel=self.tensor_parallel, max_waiting=self.max_waiting,
                prefix_cache_tokens=self.prefix_cache_tokens, prefix_block=self.prefix_block,
                max_num_batched_tokens=self.max_num_batched_tokens,
                kv_blocks=None if self.gpu_memory_utilization is not None else self.kv_blocks,
                gpu_memory_utilization=self.gpu_memory_utilization,
                compiler_options=dict(self.compiler_options),
                batch_invariant=self.batch_invariant,
                token_buckets=None if self.token_buckets == default_token_buckets(
                    self.max_num_batched_tokens, f.attention,
                    self.step_rows if self.batch_invariant else None) else self.token_buckets,
                attention=f.attention,
                layer_loop=f.layer_loop, min_matmul_rows=f.min_matmul_rows,
                prefill_attention=f.prefill_attention)

  def as_dict(self) -> dict[str, Any]:
    """The configuration that runs, as plain values (kernel configs as dicts)."""
    out = self.options()
    out["kv_blocks"] = self.num_blocks
    out["token_buckets"] = self.token_buckets
    out["prefill_attention"] = dataclasses.asdict(self.forward.prefill_attention)
    out["xla_options"] = self.xla_options
    out["prefill_xla_options"] = self.prefill_xla_options
    return out


def default_token_buckets(budget: int, attention: str,
                          invariant_rows: int | None = None) -> tuple[int, ...]:
  """The step executables' token counts for a step budget: powers of two from MIN_STEP_TOKENS
  (the attention backend's) up to the budget. Not sparser below 128: a decode step's GEMMs cost
  more at 32 rows than at 16 (llama-3.2-1b, 16 rows: 1370 us in a 16-token step, 1495 us in a
  32-token one; benchmarks/results/compile_time_h100.md). Batch-invariant engines
  (`invariant_rows`: their max_num_seqs): the one, a prompt chunk of `budget` tokens beside a
  decode row per running request."""
  if invariant_rows is not None:
    return (budget + invariant_rows,)
  return powers_of_two(min(MIN_STEP_TOKENS[attention], budget), budget)


def blocks_for_memory(model: DecoderConfig, config: EngineConfig, dtype,
                      memory_bytes: int, in_use_bytes: int = 0) -> int:
  """N for a device of `memory_bytes` with `in_use_bytes` already taken: the engine asks for
  `config.gpu_memory_utilization` of the device (which must be free) and fills what the weights
  and the activation reserve leave with blocks of `config.prefix_block` tokens (one of them the
  scratch block), per device under tensor parallelism. ValueError naming the options when the
  memory is not free or holds less than one max_seq_len sequence (`dtype`: the weights' and
  the cache's)."""
  shards, itemsize = config.tensor_parallel, jax.numpy.dtype(dtype).itemsize
  block = cache_bytes(model, 1, config.prefix_block, dtype) // shards
  weights = model.num_parameters() * itemsize // shards
  # The largest call's tokens (a step, or scoring a whole context), and the float32 logits of
  # the largest batch.
  tokens = max(config.max_num_batched_tokens, config.max_seq_len)
  width = max(model.hidden_size, 2 * model.intermediate_size)
  reserve = max(MIN_ACTIVATION_RESERVE, ACTIVATION_TENSORS * tokens * width * itemsize // shards
                + 2 * config.max_num_seqs * model.vocab_size * 4)
  gib = 2**30
  requested = int(config.gpu_memory_utilization * memory_bytes)
  if requested > memory_bytes - in_use_bytes:
    raise ValueError(
        f"gpu_memory_utilization={config.gpu_memory_utilization} asks for {requested / gib:.2f} "
        f"GiB of the device's {memory_bytes / gib:.2f} GiB, but only "
        f"{(memory_bytes - in_use_bytes) / gib:.2f} GiB are free (another engine or process "
        f"holds the rest); lower gpu_memory_utilization, close the other engine, or give "
        f"kv_blocks")
  free = requested - weights - reserve
  blocks = free // block - 1
  if blocks < config.table_width:
    raise ValueError(
        f"the KV cache needs at least {config.table_width} blocks of {block} bytes (one sequence "
        f"of max_seq_len {config.max_seq_len}), but gpu_memory_utilization="
        f"{config.gpu_memory_utilization} of {memory_bytes / gib:.2f} GiB of device memory, less "
        f"{weights / gib:.2f} GiB of weights and {reserve / gib:.2f} GiB for activations, "
        f"leaves {max(free, 0) / gib:.2f} GiB; raise gpu_memory_utilization or lower "
        f"max_seq_len, or give kv_blocks")
  return blocks


def _keywords(function) -> tuple[str, ...]:
  return tuple(name for name, p in inspect.signature(function).parameters.items()
               if p.kind is inspect.Parameter.KEYWORD_ONLY)


# The keyword options `EngineConfig.create` takes (its own and the forward config's).
# `ForwardConfig.create`'s batch_invariant and max_batch come from the engine's options.
OPTION_NAMES: tuple[str, ...] = tuple(
    name for name in _keywords(EngineConfig.create) if name != "platform") + tuple(
    name for name in _keywords(ForwardConfig.create)
    if name not in ("batch_invariant", "max_batch", "platform"))
