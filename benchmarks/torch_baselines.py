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
for torch_compile); host_dispatch_us is the host time to issue one step into an empty queue;
kernels_per_step, graph_launches_per_step and launches_outside_graphs_per_step come from a
torch.profiler trace of a few steps (GPU only); compile_s is a cold compile (Inductor's caches
are off unless --warm-compile-cache). Each row also records the greedy-token and max relative
logits / K/V differences from torch_eager over the steps computed from equal inputs (asserted for
torch_cuda_graph only; with random weights near ties are common, and a divergence is accepted
only at a near tie).

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
import datetime
import gc
import inspect
import json
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

SYSTEMS = ("torch_eager", "torch_cuda_graph", "torch_compile", "hf_dynamic", "hf_static")
DECODE_SYSTEMS = ("torch_eager", "torch_cuda_graph", "torch_compile")

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
                          exact_logits: list[torch.Tensor], exact_kv: torch.Tensor) -> dict:
  """Asserts that a candidate loop that differs from eager (`check`, from `compare_to_eager`) is
  as accurate as eager against float32 (`float32_reference` of the steps computed from equal
  inputs): its logits' and written K/V's max relative error at most 1.25x eager's (or the graph
  tolerance). Returns the four errors."""
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
        f"torch_cuda_graph: {quantity} differ from torch_eager by "
        f"{check[f'{quantity}_max_rel_diff']:.2e} of their max (greedy tokens "
        f"{'identical' if divergent is None else f'diverge at step {divergent}'}), and from "
        f"float32 by {error['graph']:.2e} (eager: {error['eager']:.2e})")
  return result


# ------------------------------------------------------------------------------------------------
# Systems


def run_decode_system(system: str, model, prompt: torch.Tensor, args, device) -> dict:
  """torch_eager / torch_cuda_graph / torch_compile for one batch; returns the row's numbers."""
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
    check = compare_to_eager(reference, reference_kv, replayed,
                             written_kv(decoder, args.position, args.check_steps), what)
    result.update(check)
    if (check["logits_max_rel_diff"] > GRAPH_RELATIVE_TOLERANCE
        or check["kv_max_rel_diff"] > GRAPH_RELATIVE_TOLERANCE
        or not check["divergence_at_near_tie"]):
      # Two low-precision loops may round apart over many layers (cuBLAS can pick other
      # algorithms under capture), and a token may then flip where eager's top-2 gap is wider
      # than the tolerance allows. Then the graph must be as accurate as eager against a float32
      # run of the steps computed from equal inputs (logits and written K/V, within 25%), or it
      # fails.
      divergent = check["first_divergent_step"]
      equal = (len(reference) - 1 if divergent is None else divergent) + 1
      exact_logits, exact_kv = float32_reference(model, prompt, first_tokens, args.position,
                                                 args.max_len, reference[:equal])
      result.update(check_against_float32(
          check, reference, reference_kv, replayed, written_kv(decoder, args.position, equal),
          exact_logits, exact_kv))
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

  steps_ms = median_ms(device, lambda: loop.run(args.steps), args.repeats, warmup=args.warmup,
                       reset=loop.reset)
  result["step_us"] = steps_ms * 1e3 / args.steps
  result["host_dispatch_us"] = host_dispatch_us(device, lambda: loop.run(1), args.repeats,
                                                reset=loop.reset)
  if system == "torch_cuda_graph":
    result["graph_launches_per_step"] = 1
  if device.type == "cuda" and not args.no_profile:
    try:
      result.update(profile_launches(device, loop.run, args.profile_steps, reset=loop.reset))
    except Exception as error:  # the profiler is optional; the timing stands without it
      print(f"  profiler failed ({type(error).__name__}: {error}); kernel counts left null")
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
  if args.system in ("torch_compile", "hf_static") and not args.warm_compile_cache:
    import torch._inductor.config as inductor_config
    inductor_config.force_disable_caches = True  # compile_s: a cold compile, every batch
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
        if args.system in DECODE_SYSTEMS:
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
