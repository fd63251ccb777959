"""PyTorch / Hugging Face decode-latency baselines, one system per process, beside cg_jax.

Loads a checkpoint written by benchmarks/make_checkpoints.py (random weights, bfloat16; cg_jax
loads the same files) and measures, per batch, one greedy decode step at KV position `--position`
of a cache `--max-len` long, plus the time to first token (TTFT) of a `--position`-token prompt:

  torch_eager       HF forward, one new token per row, preallocated transformers StaticCache;
                    the next token (argmax) is fed back on the device, kernel by kernel.
  torch_cuda_graph  the same step (argmax, token feedback and position increment included)
                    captured once into one torch.cuda.CUDAGraph (warmed up on a side stream);
                    times graph.replay(). Its greedy tokens, logits and the K/V it writes are
                    checked against torch_eager in the same process before anything is timed
                    (assert), so a broken capture cannot report a fast time.
  torch_compile     the gpt-fast recipe: torch.compile(step, mode="reduce-overhead",
                    fullgraph=True) over the static-cache step (CUDA graphs via Inductor's
                    cudagraph trees); compile time reported apart from steady state. Prefill is
                    compiled too (fullgraph, default mode) for its TTFT.
  torch_gptfast     a decoder written out in this file in the style of gpt-fast (no transformers
                    module; the same config.json and safetensors): GPT-2 (LayerNorm, learned
                    positions, GELU-tanh) or Llama (RMSNorm, RoPE with the checkpoint's theta and
                    llama3 scaling, GQA, SwiGLU), a zeroed static K/V cache [B, K, T, hd] written
                    with index_copy_, scaled_dot_product_attention (decode: masked to the valid
                    prefix); the decode step torch.compile(mode="reduce-overhead",
                    fullgraph=True), the prefill torch.compile(fullgraph=True, dynamic=False);
                    Inductor's coordinate-descent tuning on, as gpt-fast sets it. Checked against
                    torch_eager as torch_cuda_graph is (asserted). On a CPU it runs eagerly
                    (`eager_fallback`) unless --gptfast-compile on.
  hf_dynamic        model.generate(greedy, min_new_tokens = max_new_tokens = N), DynamicCache.
  hf_static         the same with cache_implementation="static" (max_cache_len = --max-len). On
                    CUDA, transformers compiles the decode forward itself (its auto-compile).
                    Per token: (t(N tokens) - t(1 token)) / (N - 1); TTFT: t(1 token).

Decode steps are timed back to back (`--steps` per sample, from the same start state each
sample), with CUDA events on the GPU and time.perf_counter after a synchronisation on the CPU;
medians over `--repeats` samples after `--warmup` untimed ones. Rows (one per system x batch)
are appended to the `--out` JSON list; a short table is printed last. Besides step_us and
tokens_per_s (= batch / step): ttft_ms is the prefill forward (last position's logits only) and
its argmax on the device, no host read-back (eager for torch_eager / torch_cuda_graph, compiled
for torch_compile and torch_gptfast); host_dispatch_us is the host time to issue one step into
an empty queue; kernels_per_step, graph_launches_per_step and launches_outside_graphs_per_step
come from a torch.profiler trace of a few steps (GPU only); compile_s is a cold compile
(Inductor's caches are off unless --warm-compile-cache). Each row also records the greedy-token
and max relative logits / K/V differences from torch_eager over the steps computed from equal
inputs (asserted for torch_cuda_graph and torch_gptfast only; with random weights near ties are
common, and a divergence is accepted only at a near tie).

  PYTHONPATH=$PWD python3 benchmarks/torch_baselines.py --system torch_cuda_graph \
      --model-dir /tmp/cg_jax_ckpt/llama-3.2-1b --batches 1,8,32 --position 512 --max-len 1024 \
      --out $OUT/baselines.json

CPU smoke run (tiny checkpoints from `make_checkpoints.py --smoke`; torch_cuda_graph checks its
graph body eagerly and records a `skipped` row, torch_compile runs Inductor on the CPU):

  JAX_PLATFORMS=cpu python benchmarks/torch_baselines.py --smoke --system torch_eager \
      --model-dir /tmp/cg_jax_ckpt_smoke/smoke-llama --out /tmp/torch_baselines_smoke.json
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import gc
import inspect
import json
import math
import os
import statistics
import sys
import time
import traceback
from typing import Callable

import torch
import transformers
from transformers import AutoModelForCausalLM, StaticCache

from bench_util import git_commit

SYSTEMS = ("torch_eager", "torch_cuda_graph", "torch_compile", "torch_gptfast", "hf_dynamic",
           "hf_static")
DECODE_SYSTEMS = ("torch_eager", "torch_cuda_graph", "torch_compile", "torch_gptfast")

# Full-run defaults, then the --smoke overrides (tiny shapes, few steps, on the CPU).
DEFAULTS = dict(position=512, max_len=1024, steps=32, repeats=20, warmup=5, new_tokens=64,
                generate_repeats=5, prefill_repeats=10, check_steps=8, profile_steps=4)
SMOKE_DEFAULTS = dict(position=24, max_len=64, steps=4, repeats=3, warmup=1, new_tokens=6,
                      generate_repeats=2, prefill_repeats=2, check_steps=4, profile_steps=2)
# max|graph - eager| / max|eager| allowed for the logits and for the K/V written by the checked
# steps (bf16 rounding is ~4e-3 of the max; same kernels usually agree exactly). The K/V check is
# the sharp one: with N(0, 0.02) weights a wrong position barely moves the logits (the residual
# stream dominates, greedy decoding mostly repeats its input token) but rotates or misplaces keys.
GRAPH_RELATIVE_TOLERANCE = 1e-2


# ------------------------------------------------------------------------------------------------
# Environment, timing, output


def synchronize(device: torch.device) -> None:
  if device.type == "cuda":
    torch.cuda.synchronize(device)


def time_ms(device: torch.device, run: Callable[[], object]) -> float:
  """Milliseconds that `run` takes, from an idle device: CUDA events on GPU, perf_counter on CPU.

  The device is synchronised first so that no earlier work is counted and the host starts
  launching into an empty queue (a host-bound step then shows up as GPU idle time).
  """
  synchronize(device)
  if device.type == "cuda":
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)
  start_s = time.perf_counter()
  run()
  synchronize(device)
  return (time.perf_counter() - start_s) * 1e3


def median_ms(device: torch.device, run: Callable[[], object], repeats: int, warmup: int = 0,
              reset: Callable[[], object] | None = None) -> float:
  """Median of `repeats` timed calls of `run` after `warmup` untimed ones; `reset` runs untimed
  before every call (to restore the start state)."""
  samples = []
  for index in range(warmup + repeats):
    if reset is not None:
      reset()
    elapsed = time_ms(device, run)
    if index >= warmup:
      samples.append(elapsed)
  return statistics.median(samples)


def host_dispatch_us(device: torch.device, run_one: Callable[[], object], repeats: int,
                     reset: Callable[[], object]) -> float:
  """Median host time to issue one decode step into an empty queue (no sync inside the call)."""
  samples = []
  for _ in range(repeats):
    reset()
    synchronize(device)
    start = time.perf_counter()
    run_one()
    samples.append((time.perf_counter() - start) * 1e6)
  synchronize(device)
  return statistics.median(samples)


def profile_launches(device: torch.device, run_steps: Callable[[int], object], steps: int,
                     reset: Callable[[], object]) -> dict:
  """Per-step counts from a torch.profiler trace of `steps` decode steps (GPU only).

  kernels_per_step: GPU kernels executed (inside graphs or not; memcpy/memset excluded);
  graph_launches_per_step: cudaGraphLaunch calls; launches_outside_graphs_per_step: kernel
  launch calls from the host (cudaLaunchKernel*, cuLaunchKernel*).
  """
  from torch.autograd import DeviceType
  from torch.profiler import ProfilerActivity, profile
  reset()
  synchronize(device)
  with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as trace:
    run_steps(steps)
    synchronize(device)
  kernels = graph_launches = host_launches = 0
  for event in trace.events():
    name = event.name
    if event.device_type == DeviceType.CUDA:
      if not name.startswith(("Memcpy", "Memset")):
        kernels += 1
    elif name.startswith("cudaGraphLaunch"):
      graph_launches += 1
    elif name.startswith(("cudaLaunchKernel", "cuLaunchKernel")):
      host_launches += 1
  return dict(kernels_per_step=kernels / steps, graph_launches_per_step=graph_launches / steps,
              launches_outside_graphs_per_step=host_launches / steps)


def append_rows(path: str, rows: list[dict]) -> None:
  """Append rows to the JSON list at `path` (created if missing), atomically."""
  existing = []
  if os.path.exists(path) and os.path.getsize(path) > 0:
    with open(path) as f:
      existing = json.load(f)
  directory = os.path.dirname(os.path.abspath(path))
  os.makedirs(directory, exist_ok=True)
  temporary = f"{path}.tmp{os.getpid()}"
  with open(temporary, "w") as f:
    json.dump(existing + rows, f, indent=1)
  os.replace(temporary, path)


def sorted_rows(rows: list[dict]) -> list[dict]:
  """Rows grouped by model and cache length, systems in SYSTEMS order, then by batch."""
  def key(row):
    system = row.get("system")
    return (str(row.get("model")), row.get("max_len") or 0,
            SYSTEMS.index(system) if system in SYSTEMS else len(SYSTEMS), row.get("batch") or 0)
  return sorted(rows, key=key)


def format_table(rows: list[dict]) -> str:
  """A short fixed-width table of the headline numbers."""
  columns = [("system", "system", "{}"), ("model", "model", "{}"), ("max_len", "max_len", "{}"),
             ("batch", "batch", "{}"),
             ("step_us", "step us", "{:.1f}"), ("tokens_per_s", "tok/s", "{:.0f}"),
             ("ttft_ms", "ttft ms", "{:.2f}"), ("compile_s", "compile s", "{:.1f}"),
             ("kernels_per_step", "kernels", "{:.0f}"),
             ("graph_launches_per_step", "graphs", "{:.0f}"),
             ("host_dispatch_us", "host us", "{:.1f}"), ("status", "status", "{}")]
  cells = [[title for _, title, _ in columns]]
  for row in rows:
    cells.append(["-" if row.get(key) is None else fmt.format(row[key]) for key, _, fmt in columns])
  widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
  return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(line, widths)) for line in cells)


# ------------------------------------------------------------------------------------------------
# Static-cache prefill and decode step (shared by torch_eager, torch_cuda_graph, torch_compile)


def cache_keyword(model: torch.nn.Module) -> str:
  """The forward's cache argument: `cache` from transformers 5.2x on, `past_key_values` before."""
  parameters = inspect.signature(model.forward).parameters
  return "cache" if "cache" in parameters else "past_key_values"


class StaticDecoder:
  """One HF causal LM with one preallocated StaticCache for one batch size.

  The write position lives in each cache layer's `cumulative_length` device tensor, which the
  layer advances in place on every forward (transformers 5.x has no `cache_position` argument);
  `set_length` rewinds it so every timed sample starts from the same state.
  """

  def __init__(self, model: torch.nn.Module, batch: int, max_len: int):
    self.model = model
    self.batch = batch
    self.cache = StaticCache(config=model.config, max_cache_len=max_len)
    self.cache_kwargs = {cache_keyword(model): self.cache}

  def set_length(self, length: int) -> None:
    """Rewind (or advance) every layer's write position to `length` tokens."""
    for layer in self.cache.layers:
      if not hasattr(layer, "cumulative_length"):
        raise RuntimeError(f"transformers {transformers.__version__}: StaticCache layer "
                           f"{type(layer).__name__} has no cumulative_length to rewind")
      if getattr(layer, "is_initialized", True):
        layer.cumulative_length.fill_(length)

  def prefill(self, prompt_ids: torch.Tensor) -> torch.Tensor:
    """Forward the prompt into the cache (from position 0); returns the greedy next tokens [B, 1].

    Only the last position's logits are computed (logits_to_keep=1), as a server would.
    """
    output = self.model(input_ids=prompt_ids, use_cache=True, logits_to_keep=1,
                        **self.cache_kwargs)
    return output.logits[:, -1].argmax(-1, keepdim=True)

  def step(self, tokens: torch.Tensor, positions: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step: tokens [B, 1] at positions [B, 1] -> (greedy next tokens [B, 1],
    logits [B, vocab]). Writes K/V at the cache's current length and advances it by one."""
    output = self.model(input_ids=tokens, position_ids=positions, use_cache=True,
                        **self.cache_kwargs)
    logits = output.logits[:, -1]
    return logits.argmax(-1, keepdim=True), logits


class EagerLoop:
  """torch_eager: decode steps kernel by kernel, the next token fed back on the device."""

  def __init__(self, decoder: StaticDecoder, first_tokens: torch.Tensor, position: int,
               step: Callable | None = None, clone_outputs: bool = False):
    self.decoder, self.first_tokens, self.position = decoder, first_tokens, position
    self.step_fn = step or decoder.step
    self.clone_outputs = clone_outputs  # compiled cudagraph outputs are overwritten next call
    self.reset()

  def reset(self) -> None:
    self.tokens = self.first_tokens.clone()
    self.positions = torch.full_like(self.first_tokens, self.position)
    self.decoder.set_length(self.position)

  def run(self, steps: int, collect: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Run `steps` steps; with `collect`, return each step's (tokens, float32 logits)."""
    collected = []
    for _ in range(steps):
      tokens, logits = self.step_fn(self.tokens, self.positions)
      self.tokens = tokens.clone() if self.clone_outputs else tokens
      self.positions.add_(1)
      if collect:
        collected.append((self.tokens.clone(), logits.float().clone()))
    return collected


class GraphLoop:
  """torch_cuda_graph: one decode step (argmax, token feedback and position increment included)
  captured into one CUDA graph, so `run(n)` is n replays and no other launch.

  Static buffers: tokens [B, 1], position ids [B, 1], logits [B, vocab] (output); the cache
  tensors and their write positions are static already. On a CPU (`capture=False`) the same graph
  body runs eagerly, which checks the buffer/feedback logic but not the capture.
  """

  def __init__(self, decoder: StaticDecoder, first_tokens: torch.Tensor, position: int,
               capture: bool, warmup_iterations: int = 3):
    self.decoder, self.first_tokens, self.position = decoder, first_tokens, position
    self.static_tokens = first_tokens.clone()
    self.static_positions = torch.full_like(first_tokens, position)
    self.static_logits = None
    self.graph = None
    if capture:
      self._capture(warmup_iterations)
    self.reset()

  def _body(self) -> torch.Tensor:
    tokens, logits = self.decoder.step(self.static_tokens, self.static_positions)
    self.static_tokens.copy_(tokens)
    self.static_positions.add_(1)
    return logits

  def _capture(self, warmup_iterations: int) -> None:
    # Warm up on a side stream (lazy initialisation, cuBLAS handles, autotuning), then capture.
    self.reset()
    side_stream = torch.cuda.Stream()
    side_stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side_stream):
      for _ in range(warmup_iterations):
        self._body()
    torch.cuda.current_stream().wait_stream(side_stream)
    torch.cuda.synchronize()
    self.reset()
    self.graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(self.graph):
      self.static_logits = self._body()
    torch.cuda.synchronize()

  def reset(self) -> None:
    self.static_tokens.copy_(self.first_tokens)
    self.static_positions.fill_(self.position)
    self.decoder.set_length(self.position)

  def run(self, steps: int, collect: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
    collected = []
    for _ in range(steps):
      if self.graph is not None:
        self.graph.replay()
        logits = self.static_logits
      else:
        logits = self._body()
      if collect:
        collected.append((self.static_tokens.clone(), logits.float().clone()))
    return collected


def float32_reference(model, prompt: torch.Tensor, first_tokens: torch.Tensor, position: int,
                      max_len: int, trajectory: list) -> tuple[list[torch.Tensor], torch.Tensor]:
  """Logits and written K/V of the same steps from a float32 copy of the model: the same prompt,
  then fed the tokens of `trajectory` (the eager loop's (tokens, logits) per step), so every
  step has the eager step's inputs. The accuracy yardstick for two low-precision loops that
  disagree. Returns (logits per step, K/V at positions [position, position + steps) as
  `written_kv` lays them out)."""
  model32 = copy.deepcopy(model).float()
  decoder = StaticDecoder(model32, prompt.shape[0], max_len)
  decoder.prefill(prompt)
  decoder.set_length(position)
  tokens, positions = first_tokens, torch.full_like(first_tokens, position)
  logits = []
  for step_tokens, _ in trajectory:
    logits.append(decoder.step(tokens, positions)[1].float())
    tokens, positions = step_tokens, positions + 1
  kv = written_kv(decoder, position, len(trajectory))
  del model32, decoder
  return logits, kv


def written_kv(decoder: StaticDecoder, start: int, steps: int) -> torch.Tensor:
  """float32 copy of the keys and values every layer holds at positions [start, start + steps):
  [2 x layers, batch, kv heads, steps, head dim]."""
  return torch.stack([tensor[:, :, start:start + steps].float()
                      for layer in decoder.cache.layers for tensor in (layer.keys, layer.values)])


def relative_max_diff(reference: torch.Tensor, candidate: torch.Tensor) -> float:
  return ((reference - candidate).abs().max() / reference.abs().max().clamp_min(1e-30)).item()


def compare_to_eager(reference: list, reference_kv: torch.Tensor, candidate: list,
                     candidate_kv: torch.Tensor, what: str,
                     tolerance: float = GRAPH_RELATIVE_TOLERANCE) -> dict:
  """Greedy tokens, logits and written K/V of a candidate loop against the eager loop.

  Both loops start from the same state and feed their own argmax back. Once a token differs the
  inputs differ, so logits and K/V are compared only on the steps computed from equal inputs:
  steps 0..d for logits and positions 0..d for K/V, where d is the first step whose tokens
  differ (all steps when none does). A divergence is legitimate only at a near tie: the eager
  logits' top-2 gap at step d must be within 2 x `tolerance` x their max magnitude (the error
  the logits comparison allows on each side).
  """
  steps = min(len(reference), len(candidate))
  diverged = [i for i in range(steps) if not torch.equal(reference[i][0], candidate[i][0])]
  last = diverged[0] if diverged else steps - 1
  logits_diff = max(relative_max_diff(reference[i][1], candidate[i][1]) for i in range(last + 1))
  kv_diff = relative_max_diff(reference_kv[..., :last + 1, :], candidate_kv[..., :last + 1, :])
  near_tie = True
  if diverged:
    logits = reference[last][1]  # [B, V]
    top2 = logits.topk(2, dim=-1).values
    # The top-2 gap of each row whose token differs.
    rows = (reference[last][0] != candidate[last][0]).reshape(-1)
    gaps = (top2[..., 0] - top2[..., 1]).reshape(-1)[rows]
    near_tie = bool((gaps <= 2 * tolerance * logits.abs().max()).all())
  print(f"  {what}: greedy tokens "
        f"{'identical' if not diverged else f'diverge at step {last} (near tie: {near_tie})'} "
        f"over {steps} steps; max|diff| / max|eager| up to there: logits {logits_diff:.2e}, "
        f"written K/V {kv_diff:.2e}", flush=True)
  return dict(tokens_match_eager=not diverged, first_divergent_step=last if diverged else None,
              divergence_at_near_tie=near_tie, logits_max_rel_diff=logits_diff,
              kv_max_rel_diff=kv_diff)


def check_against_float32(check: dict, reference: list, reference_kv: torch.Tensor,
                          candidate: list, candidate_kv: torch.Tensor,
                          exact_logits: list[torch.Tensor], exact_kv: torch.Tensor,
                          system: str = "torch_cuda_graph") -> dict:
  """Asserts that a candidate loop that differs from eager (`check`, from `compare_to_eager`) is
  as accurate as eager against float32 (`float32_reference` of the steps computed from equal
  inputs): its logits' and written K/V's max relative error at most 1.25x eager's (or the graph
  tolerance). Returns the four errors (the candidate's under `*_graph`); `system` names the
  candidate in the assertion."""
  divergent = check["first_divergent_step"]
  equal = len(exact_logits)
  errors = {
      "logits": {name: max(relative_max_diff(exact_logits[i], run[i][1]) for i in range(equal))
                 for name, run in (("eager", reference), ("graph", candidate))},
      "kv": {name: relative_max_diff(exact_kv, kv[..., :equal, :])
             for name, kv in (("eager", reference_kv), ("graph", candidate_kv))}}
  result = {}
  for quantity, error in errors.items():
    result[f"{quantity}_fp32_rel_err_eager"] = error["eager"]
    result[f"{quantity}_fp32_rel_err_graph"] = error["graph"]
    print(f"  {quantity} against float32: eager {error['eager']:.2e}, graph {error['graph']:.2e}",
          flush=True)
    assert error["graph"] <= max(GRAPH_RELATIVE_TOLERANCE, 1.25 * error["eager"]), (
        f"{system}: {quantity} differ from torch_eager by "
        f"{check[f'{quantity}_max_rel_diff']:.2e} of their max (greedy tokens "
        f"{'identical' if divergent is None else f'diverge at step {divergent}'}), and from "
        f"float32 by {error['graph']:.2e} (eager: {error['eager']:.2e})")
  return result


def check_like_graph(system: str, model, prompt: torch.Tensor, first_tokens: torch.Tensor, args,
                     reference: list, reference_kv: torch.Tensor, candidate: list,
                     candidate_kv: Callable[[int, int], torch.Tensor], what: str) -> dict:
  """torch_cuda_graph's check of a candidate loop against torch_eager (both run --check-steps
  steps from `first_tokens` at --position); returns the row's check fields, raises
  AssertionError on a failure. `candidate_kv(start, steps)` is the candidate's `written_kv`.

  Rule: the candidate passes when its logits and K/V are within GRAPH_RELATIVE_TOLERANCE of
  eager's and any token divergence is at a near tie (`compare_to_eager`). Otherwise two
  low-precision loops may have rounded apart over many layers (cuBLAS can pick other algorithms
  under capture, another implementation orders its sums differently), and a token may then flip
  where eager's top-2 gap is wider than the tolerance allows: the candidate must then be as
  accurate as eager against a float32 run of the steps computed from equal inputs (logits and
  written K/V, within 25%), or it fails.
  """
  check = compare_to_eager(reference, reference_kv, candidate,
                           candidate_kv(args.position, args.check_steps), what)
  result = dict(check)
  if (check["logits_max_rel_diff"] > GRAPH_RELATIVE_TOLERANCE
      or check["kv_max_rel_diff"] > GRAPH_RELATIVE_TOLERANCE
      or not check["divergence_at_near_tie"]):
    divergent = check["first_divergent_step"]
    equal = (len(reference) - 1 if divergent is None else divergent) + 1
    exact_logits, exact_kv = float32_reference(model, prompt, first_tokens, args.position,
                                               args.max_len, reference[:equal])
    result.update(check_against_float32(
        check, reference, reference_kv, candidate, candidate_kv(args.position, equal),
        exact_logits, exact_kv, system=system))
  return result


def measure_loop(loop, args, device: torch.device) -> dict:
  """A decode loop's (EagerLoop, GraphLoop or GptFastLoop) step_us (median of --repeats samples
  of --steps back-to-back steps, each from the loop's start state), host_dispatch_us and, on
  the GPU unless --no-profile, the profiler's kernel and launch counts per step."""
  steps_ms = median_ms(device, lambda: loop.run(args.steps), args.repeats, warmup=args.warmup,
                       reset=loop.reset)
  result = dict(step_us=steps_ms * 1e3 / args.steps,
                host_dispatch_us=host_dispatch_us(device, lambda: loop.run(1), args.repeats,
                                                  reset=loop.reset))
  if device.type == "cuda" and not args.no_profile:
    try:
      result.update(profile_launches(device, loop.run, args.profile_steps, reset=loop.reset))
    except Exception as error:  # the profiler is optional; the timing stands without it
      print(f"  profiler failed ({type(error).__name__}: {error}); kernel counts left null")
  return result


# ------------------------------------------------------------------------------------------------
# torch_gptfast: a hand-written decoder in the style of gpt-fast (pytorch-labs/gpt-fast)


@dataclasses.dataclass(frozen=True)
class GptFastSpec:
  """The shapes and options of one checkpoint, read from its config.json (`from_config`).

  Families: `gpt2` = LayerNorm, learned positions, fused QKV and MLP with biases, GELU-tanh;
  `llama` = RMSNorm, RoPE (HF's rotate-half pairing), grouped-query attention, SwiGLU, no biases.
  A config key left out takes the default of transformers' config class. An option this
  implementation does not have (another activation, Llama biases, another RoPE type, GPT-2's
  per-layer attention scaling) is refused, never ignored.
  """

  family: str
  vocab_size: int
  dim: int
  layers: int
  heads: int
  kv_heads: int
  head_dim: int
  intermediate: int
  norm_eps: float
  max_positions: int
  tied: bool  # the output head is the token embedding (else lm_head.weight)
  rope_theta: float = 10000.0
  rope_scaling: dict | None = None  # {"rope_type": "linear" | "llama3", ...}; None: plain RoPE

  @staticmethod
  def from_config(config: dict) -> "GptFastSpec":
    model_type = config.get("model_type")
    if model_type == "gpt2":
      expected = dict(activation_function=("gelu_new", "gelu_pytorch_tanh"),
                      scale_attn_weights=(True,), scale_attn_by_inverse_layer_idx=(False,),
                      reorder_and_upcast_attn=(False,), add_cross_attention=(False,))
      defaults = dict(activation_function="gelu_new", scale_attn_weights=True)
      _refuse_unsupported(config, expected, defaults)
      dim, heads = config["n_embd"], config["n_head"]
      return GptFastSpec(family="gpt2", vocab_size=config["vocab_size"], dim=dim,
                         layers=config["n_layer"], heads=heads, kv_heads=heads,
                         head_dim=dim // heads, intermediate=config.get("n_inner") or 4 * dim,
                         norm_eps=config.get("layer_norm_epsilon", 1e-5),
                         max_positions=config.get("n_positions", 1024),
                         tied=config.get("tie_word_embeddings", True))
    if model_type == "llama":
      expected = dict(hidden_act=("silu",), attention_bias=(False,), mlp_bias=(False,))
      _refuse_unsupported(config, expected, dict(hidden_act="silu"))
      dim, heads = config["hidden_size"], config["num_attention_heads"]
      theta, scaling = _rope_settings(config)
      return GptFastSpec(family="llama", vocab_size=config["vocab_size"], dim=dim,
                         layers=config["num_hidden_layers"], heads=heads,
                         kv_heads=config.get("num_key_value_heads") or heads,
                         head_dim=config.get("head_dim") or dim // heads,
                         intermediate=config["intermediate_size"],
                         norm_eps=config.get("rms_norm_eps", 1e-6),
                         max_positions=config.get("max_position_embeddings", 2048),
                         tied=config.get("tie_word_embeddings", False), rope_theta=theta,
                         rope_scaling=scaling)
    raise ValueError(f"torch_gptfast: model_type {model_type!r} is neither gpt2 nor llama")


def _refuse_unsupported(config: dict, expected: dict, defaults: dict) -> None:
  """Raises unless every key of `expected` (absent: `defaults`' value, else the first allowed
  value) holds one of its allowed values."""
  for key, allowed in expected.items():
    value = config.get(key, defaults.get(key, allowed[0]))
    if value not in allowed:
      raise ValueError(f"torch_gptfast: {key}={value!r} is not implemented (only {allowed})")


def _rope_settings(config: dict) -> tuple[float, dict | None]:
  """(theta, scaling) of a Llama config. transformers 5 writes `rope_parameters` (theta inside);
  4.x wrote `rope_theta` beside `rope_scaling`. Scaling is None for plain RoPE."""
  parameters = config.get("rope_parameters")
  if parameters is None:
    parameters = dict(config.get("rope_scaling") or {})
    parameters.setdefault("rope_theta", config.get("rope_theta", 10000.0))
  rope_type = parameters.get("rope_type", parameters.get("type", "default"))
  if rope_type not in ("default", "linear", "llama3"):
    raise ValueError(f"torch_gptfast: rope_type {rope_type!r} is not implemented")
  scaling = None if rope_type == "default" else dict(parameters, rope_type=rope_type)
  return float(parameters.get("rope_theta", 10000.0)), scaling


def rope_inverse_frequencies(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
  """float32 [head_dim // 2]: theta^(-2i / head_dim) for pair i, then scaled.

  linear: every frequency / factor. llama3 (Llama 3.1's rule): with r = original context length
  / wavelength (wavelength = 2 pi / frequency) and s = (r - low_freq_factor) /
  (high_freq_factor - low_freq_factor) clamped to [0, 1], the frequency becomes
  (1 - s) * f / factor + s * f: slow pairs (r <= low) are divided by factor, fast ones
  (r >= high) kept, and those between interpolated.
  """
  exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
  frequencies = 1.0 / theta ** exponents
  if scaling is None:
    return frequencies
  factor = float(scaling["factor"])
  if scaling["rope_type"] == "linear":
    return frequencies / factor
  low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
  periods = float(scaling["original_max_position_embeddings"]) * frequencies / (2 * math.pi)
  blend = ((periods - low) / (high - low)).clamp(0.0, 1.0)
  return (1.0 - blend) * frequencies / factor + blend * frequencies


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
  """Rotates x [B, N, S, hd] by the angles of its positions: cos, sin [S, hd] (each pair's angle
  twice, halves layout: element j pairs with j + hd / 2, as HF's Llama checkpoints expect)."""
  half = x.shape[-1] // 2
  # [B, N, S, hd]: (-x2, x1), the quarter-turn of each (x1, x2) pair.
  turned = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
  return x * cos + turned * sin


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
  """x / rms(x) * weight over the last axis, the statistics in float32 (as HF's Llama)."""
  x32 = x.float()
  x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
  return weight * x32.to(x.dtype)


def gptfast_weights(spec: GptFastSpec, tensors: dict[str, torch.Tensor]
                    ) -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
  """HF checkpoint tensors -> (model-level weights, one dict per layer), every matrix in
  F.linear's [out, in] layout. GPT-2's Conv1D weights are stored [in, out] and are transposed;
  Llama's q/k/v projections are concatenated into one `qkv` [(H + 2K) hd, D] (one matmul, as
  gpt-fast's wqkv). Names: embedding, positions (GPT-2), final_norm(_bias), head (untied only);
  per layer attn_norm(_bias), qkv(_bias), out(_bias), mlp_norm(_bias), up(_bias), gate (Llama),
  down(_bias)."""
  def conv1d(name):  # GPT-2 Conv1D [in, out] -> [out, in]
    return tensors[name].t().contiguous()

  layers = []
  if spec.family == "gpt2":
    top = dict(embedding=tensors["transformer.wte.weight"],
               positions=tensors["transformer.wpe.weight"],
               final_norm=tensors["transformer.ln_f.weight"],
               final_norm_bias=tensors["transformer.ln_f.bias"])
    for i in range(spec.layers):
      p = f"transformer.h.{i}."
      layers.append(dict(
          attn_norm=tensors[p + "ln_1.weight"], attn_norm_bias=tensors[p + "ln_1.bias"],
          qkv=conv1d(p + "attn.c_attn.weight"), qkv_bias=tensors[p + "attn.c_attn.bias"],
          out=conv1d(p + "attn.c_proj.weight"), out_bias=tensors[p + "attn.c_proj.bias"],
          mlp_norm=tensors[p + "ln_2.weight"], mlp_norm_bias=tensors[p + "ln_2.bias"],
          up=conv1d(p + "mlp.c_fc.weight"), up_bias=tensors[p + "mlp.c_fc.bias"],
          down=conv1d(p + "mlp.c_proj.weight"), down_bias=tensors[p + "mlp.c_proj.bias"]))
  else:
    top = dict(embedding=tensors["model.embed_tokens.weight"],
               final_norm=tensors["model.norm.weight"])
    for i in range(spec.layers):
      p = f"model.layers.{i}."
      qkv = torch.cat([tensors[p + f"self_attn.{n}_proj.weight"] for n in "qkv"], dim=0)
      layers.append(dict(
          attn_norm=tensors[p + "input_layernorm.weight"], qkv=qkv,
          out=tensors[p + "self_attn.o_proj.weight"],
          mlp_norm=tensors[p + "post_attention_layernorm.weight"],
          gate=tensors[p + "mlp.gate_proj.weight"], up=tensors[p + "mlp.up_proj.weight"],
          down=tensors[p + "mlp.down_proj.weight"]))
  if not spec.tied:
    top["head"] = tensors["lm_head.weight"]
  return top, layers


def read_safetensors(model_dir: str) -> dict[str, torch.Tensor]:
  """Every tensor of model.safetensors, or of the shards model.safetensors.index.json lists."""
  from safetensors.torch import load_file
  index = os.path.join(model_dir, "model.safetensors.index.json")
  if os.path.exists(index):
    with open(index) as f:
      files = sorted(set(json.load(f)["weight_map"].values()))
  else:
    files = ["model.safetensors"]
  tensors = {}
  for file in files:
    tensors.update(load_file(os.path.join(model_dir, file)))
  return tensors


class GptFastLayer(torch.nn.Module):
  """One decoder layer: its weights (parameters, absent biases None) and, after
  `GptFastDecoder.setup_caches`, its K/V cache buffers k_cache, v_cache [B, K, T, hd]."""

  def __init__(self, weights: dict[str, torch.Tensor]):
    super().__init__()
    for name in ("attn_norm", "attn_norm_bias", "qkv", "qkv_bias", "out", "out_bias", "mlp_norm",
                 "mlp_norm_bias", "gate", "up", "up_bias", "down", "down_bias"):
      value = weights.get(name)
      self.register_parameter(
          name, None if value is None else torch.nn.Parameter(value, requires_grad=False))
    self.register_buffer("k_cache", None, persistent=False)
    self.register_buffer("v_cache", None, persistent=False)


class GptFastDecoder(torch.nn.Module):
  """A GPT-2 or Llama decoder written out with torch ops (no transformers module) over a static
  K/V cache, gpt-fast's design.

  Rules: every row of the batch is at the same positions (`input_pos` [S], shared); K/V of the S
  positions are written into cache slots input_pos with index_copy_; a prefill is a prompt from
  position 0 and attends causally among its own tokens; a decode step at position p attends to
  cache slots 0..p only (slots past p hold stale K/V of earlier runs and are masked out). Queries
  that share a K/V head are folded into one head's rows for the decode attention (the same
  result as scaled_dot_product_attention(enable_gqa=True), with no backend repeating K/V).
  """

  def __init__(self, spec: GptFastSpec, tensors: dict[str, torch.Tensor], dtype: torch.dtype,
               device: torch.device):
    super().__init__()
    if spec.heads % spec.kv_heads:
      raise ValueError(f"torch_gptfast: {spec.heads} heads are not a multiple of "
                       f"{spec.kv_heads} K/V heads")
    self.spec = spec
    self.group = spec.heads // spec.kv_heads
    top, layers = gptfast_weights(spec, tensors)

    def parameter(tensor):
      return torch.nn.Parameter(tensor.to(device=device, dtype=dtype), requires_grad=False)

    self.embedding = parameter(top["embedding"])
    self.positions = parameter(top["positions"]) if "positions" in top else None
    self.final_norm = parameter(top["final_norm"])
    self.final_norm_bias = parameter(top["final_norm_bias"]) if spec.family == "gpt2" else None
    self.head = self.embedding if spec.tied else parameter(top["head"])
    self.layers = torch.nn.ModuleList(
        GptFastLayer({k: v.to(device=device, dtype=dtype) for k, v in weights.items()})
        for weights in layers)
    for name in ("slots", "rope_cos", "rope_sin"):  # set by setup_caches
      self.register_buffer(name, None, persistent=False)
    self.batch = self.max_len = None

  @property
  def device(self) -> torch.device:
    return self.embedding.device

  def setup_caches(self, batch: int, max_len: int) -> None:
    """Preallocates zeroed K/V caches [batch, K, max_len, hd] per layer (replacing earlier ones),
    the slot indices [max_len] of the decode mask and, for Llama, the RoPE cos/sin tables
    [max_len, hd] (angles in float32, then the model dtype, as HF rounds them)."""
    spec, dtype, device = self.spec, self.embedding.dtype, self.device
    if spec.family == "gpt2" and max_len > spec.max_positions:
      raise ValueError(f"torch_gptfast: a {max_len}-slot cache needs more than the "
                       f"checkpoint's {spec.max_positions} learned positions")
    self.batch, self.max_len = batch, max_len
    shape = (batch, spec.kv_heads, max_len, spec.head_dim)
    for layer in self.layers:
      for name in ("k_cache", "v_cache"):
        cache = torch.zeros(shape, dtype=dtype, device=device)
        torch._dynamo.mark_static_address(cache)  # cudagraphs: written in place, never copied
        layer.register_buffer(name, cache, persistent=False)
    self.register_buffer("slots", torch.arange(max_len, device=device), persistent=False)
    if spec.family == "llama":
      frequencies = rope_inverse_frequencies(spec.head_dim, spec.rope_theta, spec.rope_scaling)
      # [T, hd / 2] angles; each pair's angle twice (halves layout) -> [T, hd].
      angles = torch.outer(torch.arange(max_len, dtype=torch.float32), frequencies)
      angles = torch.cat((angles, angles), dim=-1)
      self.register_buffer("rope_cos", angles.cos().to(device=device, dtype=dtype),
                           persistent=False)
      self.register_buffer("rope_sin", angles.sin().to(device=device, dtype=dtype),
                           persistent=False)

  def _norm(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
            ) -> torch.Tensor:
    if self.spec.family == "gpt2":
      return torch.nn.functional.layer_norm(x, (x.shape[-1],), weight, bias, self.spec.norm_eps)
    return rms_norm(x, weight, self.spec.norm_eps)

  def _attention(self, layer: GptFastLayer, x: torch.Tensor, input_pos: torch.Tensor,
                 rope: tuple | None, visible: torch.Tensor | None) -> torch.Tensor:
    """x [B, S, D] at positions input_pos [S] -> attention output [B, S, D]; writes K/V.
    `visible` [G * S, T] (decode) masks the cache; None means a prefill from position 0."""
    spec, sdpa = self.spec, torch.nn.functional.scaled_dot_product_attention
    batch, length, _ = x.shape
    heads, kv_heads, head_dim = spec.heads, spec.kv_heads, spec.head_dim
    # [B, S, (H + 2K) hd] -> q [B, S, H hd], k and v [B, S, K hd]
    q, k, v = torch.nn.functional.linear(x, layer.qkv, layer.qkv_bias).split(
        [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    # [B, S, N hd] -> [B, N, S, hd]
    q = q.view(batch, length, heads, head_dim).transpose(1, 2)
    k = k.view(batch, length, kv_heads, head_dim).transpose(1, 2)
    v = v.view(batch, length, kv_heads, head_dim).transpose(1, 2)
    if rope is not None:
      q, k = apply_rope(q, *rope), apply_rope(k, *rope)
    # cache [B, K, T, hd]: slots input_pos along T get this call's [B, K, S, hd].
    layer.k_cache.index_copy_(2, input_pos, k)
    layer.v_cache.index_copy_(2, input_pos, v)
    if visible is None:
      # [B, H, S, hd]: the prompt's own keys, causally (slot j visible from i iff j <= i).
      y = sdpa(q, k, v, is_causal=True, enable_gqa=self.group > 1)
    else:
      # Query head h = j G + g uses K/V head j (HF's repeat_kv order): [B, H, S, hd] ->
      # [B, K, G S, hd], row g S + s; `visible` repeats each position's mask row G times alike.
      folded = q.reshape(batch, kv_heads, self.group * length, head_dim)
      y = sdpa(folded, layer.k_cache, layer.v_cache, attn_mask=visible)
      y = y.view(batch, heads, length, head_dim)
    # [B, H, S, hd] -> [B, S, H hd] -> [B, S, D]
    y = y.transpose(1, 2).reshape(batch, length, heads * head_dim)
    return torch.nn.functional.linear(y, layer.out, layer.out_bias)

  def _mlp(self, layer: GptFastLayer, x: torch.Tensor) -> torch.Tensor:
    linear = torch.nn.functional.linear
    if self.spec.family == "gpt2":
      hidden = torch.nn.functional.gelu(linear(x, layer.up, layer.up_bias), approximate="tanh")
    else:
      hidden = torch.nn.functional.silu(linear(x, layer.gate)) * linear(x, layer.up)
    return linear(hidden, layer.down, layer.down_bias)

  def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor, prefill: bool,
              all_positions: bool = False) -> torch.Tensor:
    """tokens [B, S] at positions input_pos [S] -> logits [B, V] of the last position ([B, S, V]
    with `all_positions`), in the model dtype. `prefill`: the tokens are a prompt from position 0
    (input_pos = 0..S-1); else each position attends to the cache slots up to itself."""
    # [B, S, D]
    x = torch.nn.functional.embedding(tokens, self.embedding)
    rope = None
    if self.positions is not None:
      x = x + torch.nn.functional.embedding(input_pos, self.positions)  # + [S, D]
    else:
      rope = self.rope_cos[input_pos], self.rope_sin[input_pos]  # [S, hd] each
    visible = None
    if not prefill:
      # [S, T]: slot t visible from position p iff t <= p; -> [G S, T], row g S + s = row s.
      visible = (self.slots[None, :] <= input_pos[:, None]).repeat(self.group, 1)
    for layer in self.layers:
      x = x + self._attention(layer, self._norm(x, layer.attn_norm, layer.attn_norm_bias),
                              input_pos, rope, visible)
      x = x + self._mlp(layer, self._norm(x, layer.mlp_norm, layer.mlp_norm_bias))
    if not all_positions:
      x = x[:, -1]  # [B, D]
    x = self._norm(x, self.final_norm, self.final_norm_bias)
    return torch.nn.functional.linear(x, self.head)

  def written_kv(self, start: int, steps: int) -> torch.Tensor:
    """float32 copy of every layer's K and V at positions [start, start + steps), laid out as
    `written_kv` lays out a StaticDecoder's: [2 x layers, B, K, steps, hd]."""
    return torch.stack([cache[:, :, start:start + steps].float() for layer in self.layers
                        for cache in (layer.k_cache, layer.v_cache)])


def load_gptfast(model_dir: str, dtype: torch.dtype, device: torch.device) -> GptFastDecoder:
  """The hand-written decoder of a local HF checkpoint (config.json + safetensors)."""
  with open(os.path.join(model_dir, "config.json")) as f:
    spec = GptFastSpec.from_config(json.load(f))
  return GptFastDecoder(spec, read_safetensors(model_dir), dtype, device)


def gptfast_prefill(model: GptFastDecoder, prompt: torch.Tensor) -> torch.Tensor:
  """Prompt [B, P] into the cache from position 0 -> the greedy next tokens [B, 1] (only the
  last position's logits are computed)."""
  input_pos = torch.arange(prompt.shape[1], device=prompt.device)
  return model(prompt, input_pos, prefill=True).argmax(-1, keepdim=True)


def gptfast_decode_step(model: GptFastDecoder, tokens: torch.Tensor, input_pos: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor]:
  """gpt-fast's decode_one_token, greedy: tokens [B, 1] at position input_pos [1] -> (next
  tokens [B, 1], logits [B, V]); writes the step's K/V at input_pos."""
  logits = model(tokens, input_pos, prefill=False)
  return logits.argmax(-1, keepdim=True), logits


class GptFastLoop:
  """torch_gptfast's decode loop (gpt-fast's decode_n_tokens, greedy): the step's tokens are fed
  back cloned (a cudagraph replay's outputs are overwritten by the next replay) and the shared
  position input_pos [1] advances in place on the device. Same interface as EagerLoop."""

  def __init__(self, model: GptFastDecoder, step: Callable, first_tokens: torch.Tensor,
               position: int):
    self.model, self.step_fn, self.first_tokens = model, step, first_tokens
    self.position = position
    self.input_pos = torch.full((1,), position, dtype=torch.int64, device=first_tokens.device)
    self.reset()

  def reset(self) -> None:
    self.tokens = self.first_tokens.clone()
    self.input_pos.fill_(self.position)

  def run(self, steps: int, collect: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Run `steps` steps; with `collect`, return each step's (tokens, float32 logits)."""
    collected = []
    for _ in range(steps):
      tokens, logits = self.step_fn(self.model, self.tokens, self.input_pos)
      self.tokens = tokens.clone()
      self.input_pos += 1
      if collect:
        collected.append((self.tokens.clone(), logits.float().clone()))
    return collected


# ------------------------------------------------------------------------------------------------
# Systems


def run_decode_system(system: str, model, prompt: torch.Tensor, args, device) -> dict:
  """torch_eager / torch_cuda_graph / torch_compile for one batch; returns the row's numbers
  (torch_gptfast: `run_gptfast_system`)."""
  batch = prompt.shape[0]
  decoder = StaticDecoder(model, batch, args.max_len)
  result: dict = {}

  def eager_prefill():
    decoder.set_length(0)
    return decoder.prefill(prompt)

  first_tokens = eager_prefill()  # also allocates the cache (lazy initialisation)
  synchronize(device)
  eager = EagerLoop(decoder, first_tokens, args.position)
  eager.reset()
  reference = eager.run(args.check_steps, collect=True)
  reference_kv = written_kv(decoder, args.position, args.check_steps)

  if system == "torch_compile":
    torch._dynamo.reset()
    compile_start = time.perf_counter()
    compiled_prefill = torch.compile(decoder.prefill, fullgraph=True)
    for _ in range(2):
      decoder.set_length(0)
      compiled_prefill(prompt)
    synchronize(device)
    result["prefill_compile_s"] = time.perf_counter() - compile_start

    def timed_prefill():
      decoder.set_length(0)
      return compiled_prefill(prompt)
    result["prefill"] = "torch.compile(fullgraph=True)"
  else:
    timed_prefill = eager_prefill
    result["prefill"] = "eager"
  result["ttft_ms"] = median_ms(device, timed_prefill, args.prefill_repeats, warmup=1)

  if system == "torch_eager":
    loop = eager
  elif system == "torch_cuda_graph":
    loop = GraphLoop(decoder, first_tokens, args.position, capture=device.type == "cuda")
    loop.reset()
    replayed = loop.run(args.check_steps, collect=True)
    what = "CUDA graph vs eager" if loop.graph is not None else "graph body (eager, CPU) vs eager"
    result.update(check_like_graph(
        "torch_cuda_graph", model, prompt, first_tokens, args, reference, reference_kv, replayed,
        lambda start, steps: written_kv(decoder, start, steps), what))
    if loop.graph is None:
      raise SkipSystem("CUDA graphs need a GPU; the graph body was checked against torch_eager "
                       "eagerly on the CPU, no time reported", result)
  else:  # torch_compile, the gpt-fast recipe
    compiled_step = torch.compile(decoder.step, mode="reduce-overhead", fullgraph=True)
    loop = EagerLoop(decoder, first_tokens, args.position, step=compiled_step,
                     clone_outputs=True)
    compile_start = time.perf_counter()
    loop.reset()
    loop.run(3)  # 1: compile + warm up, 2: record the CUDA graph, 3: first replay
    synchronize(device)
    result["compile_s"] = time.perf_counter() - compile_start
    eager_prefill()  # the compiled prefill's slightly different K/V would blur the comparison
    loop.reset()
    compiled = loop.run(args.check_steps, collect=True)
    result.update(compare_to_eager(reference, reference_kv, compiled,
                                   written_kv(decoder, args.position, args.check_steps),
                                   "torch.compile vs eager (reported, not asserted)"))

  if system == "torch_cuda_graph":
    result["graph_launches_per_step"] = 1
  result.update(measure_loop(loop, args, device))
  return result


def gptfast_compiles(args, device: torch.device) -> bool:
  """Whether torch_gptfast compiles its prefill and decode step: --gptfast-compile on / off;
  auto (the default) compiles on CUDA only and runs the same functions eagerly on a CPU (a
  reduce-overhead compile there has no CUDA graphs to make and only costs test time)."""
  if args.gptfast_compile == "auto":
    return device.type == "cuda"
  return args.gptfast_compile == "on"


def run_gptfast_system(model, gptfast: GptFastDecoder, prompt: torch.Tensor, args,
                       device: torch.device) -> dict:
  """torch_gptfast for one batch; returns the row's numbers.

  The hand-written decoder's prefill is compiled with torch.compile(fullgraph=True,
  dynamic=False) for this prompt shape and timed as TTFT like the other decode systems' (prefill
  plus the greedy token, on the device); its decode step with torch.compile(mode=
  "reduce-overhead", fullgraph=True) (Inductor's CUDA graph trees), compile_s being its first
  three calls. Decoding starts from torch_eager's first tokens at --position, and before
  anything is timed its greedy tokens, logits and written K/V over --check-steps steps are
  checked against torch_eager (the HF model) exactly as torch_cuda_graph's are (asserted).
  Without compilation (`gptfast_compiles`) the same functions run eagerly, flagged
  `eager_fallback`.
  """
  from torch._dynamo.utils import counters
  batch = prompt.shape[0]
  compiled = gptfast_compiles(args, device)
  result: dict = dict(
      prefill="torch.compile(fullgraph=True, dynamic=False)" if compiled else "eager",
      decode='torch.compile(mode="reduce-overhead", fullgraph=True)' if compiled else "eager",
      eager_fallback=not compiled)

  # torch_eager's steps from the same prompt: the yardstick of the check.
  decoder = StaticDecoder(model, batch, args.max_len)
  first_tokens = decoder.prefill(prompt)
  eager = EagerLoop(decoder, first_tokens, args.position)
  reference = eager.run(args.check_steps, collect=True)
  reference_kv = written_kv(decoder, args.position, args.check_steps)
  del eager, decoder  # the HF cache is not needed any more

  gptfast.setup_caches(batch, args.max_len)
  torch._dynamo.reset()
  skips_before = counters["inductor"]["cudagraph_skips"]
  prefill, step = gptfast_prefill, gptfast_decode_step
  if compiled:
    compile_start = time.perf_counter()
    prefill = torch.compile(gptfast_prefill, fullgraph=True, dynamic=False)
    for _ in range(2):
      prefill(gptfast, prompt)
    synchronize(device)
    result["prefill_compile_s"] = time.perf_counter() - compile_start
  prefill_tokens = prefill(gptfast, prompt)
  result["prefill_tokens_match_eager"] = bool(torch.equal(prefill_tokens, first_tokens))
  result["ttft_ms"] = median_ms(device, lambda: prefill(gptfast, prompt), args.prefill_repeats,
                                warmup=1)

  if compiled:
    step = torch.compile(gptfast_decode_step, mode="reduce-overhead", fullgraph=True)
  loop = GptFastLoop(gptfast, step, first_tokens, args.position)
  if compiled:
    compile_start = time.perf_counter()
    loop.run(3)  # 1: compile + warm up, 2: record the CUDA graph, 3: first replay
    synchronize(device)
    result["compile_s"] = time.perf_counter() - compile_start
  loop.reset()
  candidate = loop.run(args.check_steps, collect=True)
  what = "torch_gptfast vs eager" + ("" if compiled else " (uncompiled)")
  result.update(check_like_graph("torch_gptfast", model, prompt, first_tokens, args, reference,
                                 reference_kv, candidate, gptfast.written_kv, what))
  result["cudagraph_skips"] = counters["inductor"]["cudagraph_skips"] - skips_before
  result.update(measure_loop(loop, args, device))
  return result


def run_generate_system(system: str, model, prompt: torch.Tensor, args, device) -> dict:
  """hf_dynamic / hf_static for one batch: TTFT and per-token latency from model.generate."""
  static = system == "hf_static"
  pad_token_id = model.generation_config.pad_token_id
  if pad_token_id is None:
    eos = model.generation_config.eos_token_id
    pad_token_id = (eos[0] if isinstance(eos, list) else eos) if eos is not None else 0
  attention_mask = torch.ones_like(prompt)

  def generate(new_tokens: int) -> torch.Tensor:
    options = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                   attention_mask=attention_mask, pad_token_id=pad_token_id)
    if static:
      options.update(cache_implementation="static", max_cache_len=args.max_len)
    return model.generate(prompt, **options)

  result: dict = {"new_tokens": args.new_tokens}
  first_start = time.perf_counter()
  output = generate(args.new_tokens)  # on CUDA, hf_static compiles its decode forward here
  synchronize(device)
  first_call_s = time.perf_counter() - first_start
  expected = (prompt.shape[0], prompt.shape[1] + args.new_tokens)
  assert tuple(output.shape) == expected, f"generate returned {tuple(output.shape)}, not {expected}"
  generate(1)
  one_ms = median_ms(device, lambda: generate(1), args.generate_repeats, warmup=1)
  all_ms = median_ms(device, lambda: generate(args.new_tokens), args.generate_repeats, warmup=1)
  result["ttft_ms"] = one_ms
  result["step_us"] = (all_ms - one_ms) * 1e3 / (args.new_tokens - 1)
  result["generate_ms"] = all_ms
  if static and device.type == "cuda":
    result["hf_auto_compile"] = True
    result["compile_s"] = max(first_call_s - all_ms / 1e3, 0.0)  # first call's excess
  return result


class SkipSystem(Exception):
  """The system cannot be timed here (e.g. CUDA graphs on a CPU); recorded as `skipped`, with
  whatever was measured or checked before (`partial`) but no step time."""

  def __init__(self, reason: str, partial: dict | None = None):
    super().__init__(reason)
    self.partial = dict(partial or {})


# ------------------------------------------------------------------------------------------------
# Main


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--system", choices=SYSTEMS, help="required unless --table")
  parser.add_argument("--model-dir",
                      help="checkpoint from make_checkpoints.py; its basename names the model")
  parser.add_argument("--table", metavar="JSON",
                      help="only print the table of a rows file (e.g. baselines.json) and exit")
  parser.add_argument("--batches", default="1,8,32")
  parser.add_argument("--position", type=int, help="KV position of the timed decode step = "
                      "prompt length for TTFT (default 512; smoke 24)")
  parser.add_argument("--max-len", type=int, help="KV cache length (default 1024; smoke 64)")
  parser.add_argument("--steps", type=int, help="back-to-back decode steps per timed sample")
  parser.add_argument("--repeats", type=int, help="timed samples (median)")
  parser.add_argument("--warmup", type=int, help="untimed samples first")
  parser.add_argument("--new-tokens", type=int, help="N for hf_dynamic / hf_static (default 64)")
  parser.add_argument("--generate-repeats", type=int, help="timed generate calls of each length")
  parser.add_argument("--prefill-repeats", type=int, help="timed prefills (TTFT)")
  parser.add_argument("--check-steps", type=int, help="decode steps compared with torch_eager")
  parser.add_argument("--profile-steps", type=int, help="decode steps under torch.profiler")
  parser.add_argument("--no-profile", action="store_true", help="skip the kernel-count profile")
  parser.add_argument("--gptfast-compile", default="auto", choices=("auto", "on", "off"),
                      help="torch_gptfast: compile its prefill and decode step (auto: on CUDA "
                           "only; off, or auto on a CPU: the same functions eagerly, flagged "
                           "eager_fallback in the row)")
  parser.add_argument("--warm-compile-cache", action="store_true",
                      help="let Inductor reuse its on-disk caches (default: disabled, so "
                           "compile_s is a cold compile)")
  parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
  parser.add_argument("--device", default=None, help="default: cuda if available, else cpu "
                      "(--smoke: cpu)")
  parser.add_argument("--seed", type=int, default=0, help="seed of the random prompt")
  parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "benchmarks/results"),
                                                    "torch_baselines.json"),
                      help="JSON list the rows are appended to")
  parser.add_argument("--smoke", action="store_true",
                      help="CPU, tiny shapes, few steps (with make_checkpoints.py --smoke)")
  args = parser.parse_args(argv)
  if args.table:
    return args
  if not args.system or not args.model_dir:
    parser.error("--system and --model-dir are required (unless --table)")
  for key, value in (SMOKE_DEFAULTS if args.smoke else DEFAULTS).items():
    if getattr(args, key) is None:
      setattr(args, key, value)
  if args.device is None:
    args.device = "cpu" if args.smoke or not torch.cuda.is_available() else "cuda"
  longest = args.position + max(args.steps, args.check_steps, args.profile_steps, 3)
  if args.system.startswith("hf_"):
    longest = args.position + args.new_tokens
    if args.new_tokens < 2:
      parser.error("--new-tokens must be at least 2")
  if longest > args.max_len:
    parser.error(f"--position {args.position} + steps needs {longest} cache slots > "
                 f"--max-len {args.max_len}")
  return args


def main(argv=None) -> int:
  args = parse_args(argv)
  if args.table:
    with open(args.table) as f:
      print(format_table(sorted_rows(json.load(f))))
    return 0
  device = torch.device(args.device)
  if args.smoke:
    torch.set_num_threads(1)  # tiny shapes: threads only add scheduling noise on a shared CPU
  gptfast_compiled = args.system == "torch_gptfast" and gptfast_compiles(args, device)
  if args.system in ("torch_compile", "hf_static") or gptfast_compiled:
    import torch._inductor.config as inductor_config
    if not args.warm_compile_cache:
      inductor_config.force_disable_caches = True  # compile_s: a cold compile, every batch
    if gptfast_compiled:
      inductor_config.coordinate_descent_tuning = True  # gpt-fast's Inductor setting
  dtype = getattr(torch, args.dtype)
  model_name = os.path.basename(os.path.normpath(args.model_dir))
  batches = [int(b) for b in args.batches.split(",")]
  meta = dict(gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              torch_version=torch.__version__, transformers_version=transformers.__version__,
              commit=git_commit(), date=datetime.date.today().isoformat(), dtype=args.dtype,
              position=args.position, max_len=args.max_len, device=device.type)
  print(f"{args.system} on {meta['gpu']}: {model_name}, batches {batches}, position "
        f"{args.position}, max_len {args.max_len}, {args.dtype}, torch {torch.__version__}, "
        f"transformers {transformers.__version__}", flush=True)

  load_start = time.perf_counter()
  model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=dtype,
                                               attn_implementation="sdpa").to(device).eval()
  print(f"  loaded in {time.perf_counter() - load_start:.1f} s "
        f"({model.num_parameters() / 1e6:.1f} M parameters)", flush=True)
  gptfast = None
  if args.system == "torch_gptfast":
    load_start = time.perf_counter()
    gptfast = load_gptfast(args.model_dir, dtype, device)
    meta["gptfast_coordinate_descent_tuning"] = gptfast_compiled
    print(f"  torch_gptfast: {gptfast.spec.family} decoder loaded in "
          f"{time.perf_counter() - load_start:.1f} s", flush=True)
  vocab_size = model.config.vocab_size
  generator = torch.Generator().manual_seed(args.seed)

  rows, failures = [], 0
  for batch in batches:
    prompt = torch.randint(0, vocab_size, (batch, args.position), generator=generator).to(device)
    row = dict(system=args.system, model=model_name, batch=batch, step_us=None, ttft_ms=None,
               tokens_per_s=None, compile_s=None, kernels_per_step=None,
               graph_launches_per_step=None, host_dispatch_us=None, **meta, status="ok",
               error=None)
    if args.system in DECODE_SYSTEMS:
      row.update(steps=args.steps, repeats=args.repeats)
    try:
      with torch.no_grad():
        if args.system == "torch_gptfast":
          numbers = run_gptfast_system(model, gptfast, prompt, args, device)
        elif args.system in DECODE_SYSTEMS:
          numbers = run_decode_system(args.system, model, prompt, args, device)
        else:
          numbers = run_generate_system(args.system, model, prompt, args, device)
      row.update(numbers)
      row["tokens_per_s"] = batch * 1e6 / row["step_us"]
    except SkipSystem as reason:
      row.update(reason.partial)
      row.update(status="skipped", error=str(reason), step_us=None)
      print(f"  batch {batch}: SKIPPED: {reason}", flush=True)
    except Exception as error:  # recorded, and the next batch still runs
      failures += 1
      row.update(status="failed", error=f"{type(error).__name__}: {error}"[:2000])
      traceback.print_exc()
      print(f"  batch {batch}: FAILED: {row['error'][:300]}", flush=True)
    if row["status"] == "ok":
      print(f"  batch {batch}: step {row['step_us']:.1f} us ({row['tokens_per_s']:.0f} tok/s), "
            f"TTFT {row['ttft_ms']:.2f} ms", flush=True)
    rows.append(row)
    append_rows(args.out, [row])
    gc.collect()  # graphs, caches and compiled code of this batch
    if device.type == "cuda":
      torch.cuda.empty_cache()

  print(f"\nrows appended to {args.out}\n")
  print(format_table(rows))
  return 1 if failures else 0


if __name__ == "__main__":
  sys.exit(main())
