"""PyTorch and Hugging Face peers of `python -m cg_jax bench`: the same workload options (the
bench modules' own), the same rows (`cg_jax.bench.rows`, JSON lines), the same checkpoint files
(benchmarks/make_checkpoints.py writes them; cg_jax loads the same directory).

  python benchmarks/torch_peers.py latency --system torch_gptfast --model /tmp/ck/llama-3.2-1b \
      --batch 1,8,32 --prompt-len 512 --output-len 128 --max-seq-len 1024 --output rows.jsonl
  python benchmarks/torch_peers.py throughput --system hf_continuous --model /tmp/ck/gpt2 \
      --num-requests 64 --prompt-len 64:480 --output-len 128 --output rows.jsonl

Systems:
  torch_compile  (latency) transformers' model over a preallocated StaticCache; the decode step
                 torch.compile(mode="reduce-overhead", fullgraph=True) (CUDA graphs through
                 Inductor's cudagraph trees), the prefill torch.compile(fullgraph=True).
  torch_gptfast  (latency) a GPT-2 / Llama decoder written out with torch ops in gpt-fast's style
                 (no transformers module; the checkpoint's config.json and safetensors): fused
                 QKV, a static K/V cache [B, K, T, hd] written with index_copy_,
                 scaled_dot_product_attention; compiled as torch_compile, with Inductor's
                 coordinate-descent tuning on, as gpt-fast sets it.
  hf_continuous  (throughput) transformers' continuous batching, `generate_batch` (paged
                 attention), every request at once (`--rate inf`).

Rules, per workload (see `cg_jax.bench.latency` and `.throughput` for cg_jax's side):
  latency: per batch size one unmeasured call, then `--repeats` calls on fresh seeded random
    prompts; a call is the prefill with the first tokens read to the host (TTFT: all rows get
    theirs together), then output_len - 1 greedy decode steps with the tokens fed back on the
    device, all read to the host at the end. `step_us`: back-to-back decode steps at the bench's
    `step_position`, wall time after a synchronisation, median of 3 runs of 16. Before anything
    is timed, the system's decode logits over 4 steps (fed the reference's tokens after its own
    prefill) are asserted equal to the uncompiled transformers model's within the dtype's
    tolerance, so a broken compile cannot report a fast time.
  throughput: `cg_jax.bench.throughput.requests`' prompts (the same seed, the same token ids),
    after an unmeasured pass of the same shapes; each request's submit, first and last token
    times from generate_batch's timestamps.

On a CPU the compiled systems run eagerly unless `--compile on` (their rows are then named
`<system> (eager)`); CI runs them so on tiny checkpoints.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the row helpers import jax; the GPU is torch's

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from torch._inductor import config as inductor_config  # noqa: E402
from transformers import AutoModelForCausalLM, StaticCache  # noqa: E402

from cg_jax.bench import latency, options, rows, throughput  # noqa: E402

SYSTEMS = {"latency": ("torch_compile", "torch_gptfast"), "throughput": ("hf_continuous",)}
# Max relative difference of a system's decode logits from the uncompiled transformers model's
# (max |a - b| / max |b|): bfloat16 rounding of two kernel orders (measured 0.014-0.033 on the
# H200), float32 for the CPU tests.
LOGITS_TOLERANCE = {torch.bfloat16: 6e-2, torch.float16: 2e-2, torch.float32: 1e-4}
CHECK_STEPS = 4


# ------------------------------------------------------------------------------------------------
# torch_gptfast's decoder, in the style of gpt-fast (pytorch-labs/gpt-fast)


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




# ------------------------------------------------------------------------------------------------
# The decode systems: prefill, seek and step over their own static caches


def _cache_keyword(model: torch.nn.Module) -> str:
  """The forward's cache argument: `cache` from transformers 5.2x on, `past_key_values` before."""
  import inspect
  return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class StaticHF:
  """torch_compile (and, uncompiled, every system's reference): the transformers model over one
  StaticCache for one batch size. The write position lives in each cache layer's
  `cumulative_length` device tensor, advanced in place by every forward; `seek` sets it."""

  def __init__(self, model: torch.nn.Module, batch: int, max_len: int, compiled: bool):
    self.model = model
    self.cache = StaticCache(config=model.config, max_cache_len=max_len)
    self.kwargs = {_cache_keyword(model): self.cache}
    self.positions = torch.zeros((batch, 1), dtype=torch.int64, device=model.device)
    # The cache allocates itself on its first forward: eagerly here, so its tensors get static
    # addresses (allocated inside a compiled call, they are mutated inputs: no CUDA graphs).
    self.prefill_eager(torch.zeros((batch, 1), dtype=torch.int64, device=model.device))
    self._prefill, self._step = self.prefill_eager, self.step_eager
    if compiled:
      self._prefill = torch.compile(self.prefill_eager, fullgraph=True)
      self._step = torch.compile(self.step_eager, mode="reduce-overhead", fullgraph=True)

  def prefill_eager(self, prompt: torch.Tensor) -> torch.Tensor:
    logits = self.model(input_ids=prompt, use_cache=True, logits_to_keep=1, **self.kwargs).logits
    return logits[:, -1].argmax(-1, keepdim=True)

  def step_eager(self, tokens: torch.Tensor, positions: torch.Tensor):
    logits = self.model(input_ids=tokens, position_ids=positions, use_cache=True,
                        **self.kwargs).logits[:, -1]
    return logits.argmax(-1, keepdim=True), logits

  def seek(self, position: int) -> None:
    for layer in self.cache.layers:
      if getattr(layer, "is_initialized", True):  # (allocated lazily by the first forward)
        layer.cumulative_length.fill_(position)
    self.positions.fill_(position)

  def prefill(self, prompt: torch.Tensor) -> torch.Tensor:
    """Prompt [B, P] into the cache from position 0 -> greedy next tokens [B, 1]."""
    self.seek(0)
    tokens = self._prefill(prompt)
    self.seek(prompt.shape[1])
    return tokens

  def step(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens [B, 1] at the current position -> (next tokens [B, 1], logits [B, V]). The tokens
    are cloned (a graph replay overwrites its outputs); the logits are valid until the next step."""
    tokens, logits = self._step(tokens, self.positions)
    self.positions.add_(1)
    return tokens.clone(), logits


class GptFast:
  """torch_gptfast: the hand-written decoder with its caches for one batch size; the shared
  position input_pos [1] advances in place on the device (gpt-fast's decode_n_tokens)."""

  def __init__(self, model: GptFastDecoder, batch: int, max_len: int, compiled: bool):
    model.setup_caches(batch, max_len)
    self.model = model
    self.input_pos = torch.zeros(1, dtype=torch.int64, device=model.device)
    self._prefill, self._step = gptfast_prefill, gptfast_decode_step
    if compiled:
      inductor_config.coordinate_descent_tuning = True
      self._prefill = torch.compile(gptfast_prefill, fullgraph=True, dynamic=False)
      self._step = torch.compile(gptfast_decode_step, mode="reduce-overhead", fullgraph=True)

  def seek(self, position: int) -> None:
    self.input_pos.fill_(position)

  def prefill(self, prompt: torch.Tensor) -> torch.Tensor:
    tokens = self._prefill(self.model, prompt)
    self.seek(prompt.shape[1])
    return tokens

  def step(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    tokens, logits = self._step(self.model, tokens, self.input_pos)
    self.input_pos += 1
    return tokens.clone(), logits


def _synchronize(device: torch.device) -> None:
  if device.type == "cuda":
    torch.cuda.synchronize(device)


def check(system, reference: StaticHF, prompt: torch.Tensor, dtype: torch.dtype) -> float:
  """The system's decode logits against the reference's over CHECK_STEPS steps from the same
  prompt (each fed the reference's tokens); asserts the max relative difference is within
  LOGITS_TOLERANCE and returns it."""
  tokens = reference.prefill(prompt)
  expected = []
  for _ in range(CHECK_STEPS):
    fed = tokens
    tokens, logits = reference.step(fed)
    expected.append((fed, logits.float().clone()))
  system.prefill(prompt)
  worst = 0.0
  for fed, want in expected:
    _, logits = system.step(fed)
    worst = max(worst, float((logits.float() - want).abs().max() / want.abs().max()))
  assert worst <= LOGITS_TOLERANCE[dtype], (
      f"decode logits differ from the uncompiled transformers model's by {worst:.3g} (max "
      f"relative), above the {dtype} tolerance {LOGITS_TOLERANCE[dtype]}")
  return worst


def generate(system, prompt: torch.Tensor, output_len: int) -> tuple[torch.Tensor, dict]:
  """One call: ([B, output_len] tokens on the host, stats as `Engine.generate`'s)."""
  _synchronize(prompt.device)
  start = time.perf_counter()
  tokens = system.prefill(prompt)
  made = [tokens.cpu()]  # the user's first tokens
  first = time.perf_counter()
  for _ in range(output_len - 1):
    tokens, _ = system.step(tokens)
    made.append(tokens)
  made = torch.cat([t.to("cpu") for t in made], dim=1)
  end = time.perf_counter()
  batch = prompt.shape[0]
  return made, dict(ttft_s=first - start, ttft_s_last=first - start,
                    per_token_s=(end - first) / max(output_len - 1, 1),
                    tokens_per_s=batch * output_len / (end - start))


def step_us(system, tokens: torch.Tensor, position: int, steps: int = 16, runs: int = 3) -> float:
  """Median per-step wall time of `steps` back-to-back steps from `position` (one run unmeasured
  first)."""
  times = []
  for _ in range(runs + 1):
    system.seek(position)
    fed = tokens
    _synchronize(tokens.device)
    start = time.perf_counter()
    for _ in range(steps):
      fed, _ = system.step(fed)
    _synchronize(tokens.device)
    times.append((time.perf_counter() - start) / steps)
  return statistics.median(times[1:]) * 1e6


# ------------------------------------------------------------------------------------------------
# Workloads


@dataclasses.dataclass
class Setup:
  """What every workload takes: the arguments, the device, the dtype, the row's system name."""

  args: argparse.Namespace
  device: torch.device
  dtype: torch.dtype
  compiled: bool

  @property
  def system(self) -> str:
    return self.args.system + ("" if self.compiled or self.args.kind == "throughput"
                               else " (eager)")


def _max_len(setup: Setup, config: dict) -> int:
  """--max-seq-len, or cg_jax's default: min(the model's context, 2048)."""
  context = config.get("max_position_embeddings") or config.get("n_positions") or 2048
  return options.integer("--max-seq-len", setup.args.max_seq_len, 2, optional=True) or min(
      context, 2048)


def _hf_model(setup: Setup, attention: str):
  model = AutoModelForCausalLM.from_pretrained(setup.args.model, dtype=setup.dtype,
                                               attn_implementation=attention)
  return model.to(setup.device).eval()


def run_latency(setup: Setup) -> list[rows.Row]:
  args = setup.args
  batches = options.int_list("--batch", args.batch)
  prompt_len = options.integer("--prompt-len", args.prompt_len)
  output_len = options.integer("--output-len", args.output_len)
  repeats = options.integer("--repeats", args.repeats)
  with open(os.path.join(args.model, "config.json")) as f:
    config = json.load(f)
  max_len = _max_len(setup, config)
  options.fits(prompt_len, output_len, max_len)
  position = latency.step_position(prompt_len, output_len, max_len)
  hf = _hf_model(setup, "sdpa")
  gptfast = load_gptfast(args.model, setup.dtype, setup.device) if (
      args.system == "torch_gptfast") else None
  rng = np.random.default_rng(args.seed)
  found = []
  for batch in batches:
    def prompt():  # [batch, prompt_len]
      return torch.tensor(rng.integers(0, config["vocab_size"], (batch, prompt_len)),
                          device=setup.device)

    reference = StaticHF(hf, batch, max_len, compiled=False)
    torch._dynamo.reset()
    system = (StaticHF(hf, batch, max_len, setup.compiled) if gptfast is None
              else GptFast(gptfast, batch, max_len, setup.compiled))
    compile_start = time.perf_counter()
    made, _ = generate(system, prompt(), output_len)  # compiles; unmeasured
    compile_s = time.perf_counter() - compile_start
    print(f"  batch {batch}: compiled and warm in {compile_s:.1f} s", flush=True)
    if made.shape != (batch, output_len):
      raise RuntimeError(f"{args.system} made {tuple(made.shape)} tokens, not "
                         f"({batch}, {output_len})")
    with torch.no_grad():
      logits_diff = check(system, reference, prompt(), setup.dtype)
    del reference
    stats = [generate(system, prompt(), output_len)[1] for _ in range(repeats)]
    figures = dict(latency.figures(stats), compile_s=compile_s, logits_rel_diff=logits_diff,
                   step_us=step_us(system, made[:, :1].to(setup.device), position))
    workload = latency.workload(batch, prompt_len, output_len, repeats,
                                str(setup.dtype).removeprefix("torch."), max_len)
    found.append(_row(setup, workload, figures))
    print(f"  batch {batch}: step {figures['step_us']:.1f} us, TTFT "
          f"{figures['ttft_ms_p50']:.2f} ms, compile {compile_s:.1f} s", flush=True)
  return found


def run_throughput(setup: Setup) -> list[rows.Row]:
  from transformers.generation import GenerationConfig
  args = setup.args
  count = options.integer("--num-requests", args.num_requests)
  lengths = options.length_range("--prompt-len", args.prompt_len)
  output_len = options.integer("--output-len", args.output_len)
  per_s = options.rate("--rate", args.rate)
  if math.isfinite(per_s):
    raise ValueError(f"--rate {args.rate}: hf_continuous takes every request at once "
                     "(generate_batch); allowed: inf")
  # generate_batch needs paged attention; transformers 5.23 on chooses it itself.
  paged = tuple(int(x) for x in transformers.__version__.split(".")[:2]) < (5, 23)
  hf = _hf_model(setup, "paged|sdpa" if paged else "sdpa")
  options.fits(lengths[1], output_len, _max_len(setup, hf.config.to_dict()))
  prompts, _, unmeasured = throughput.requests(count, lengths, per_s, args.seed,
                                               hf.config.vocab_size)
  config = GenerationConfig(max_new_tokens=output_len, do_sample=False, eos_token_id=-1,
                            pad_token_id=0)
  hf.generate_batch(inputs=unmeasured, generation_config=config, progress_bar=False)
  outputs = list(hf.generate_batch(inputs=prompts, generation_config=config, progress_bar=False,
                                   record_timestamps=True).values())
  made = [len(o.generated_tokens) for o in outputs]
  if made != [output_len] * count:
    raise RuntimeError(f"generate_batch made {made} tokens, not --output-len {output_len} each")
  figures = throughput.figures([o.created_time for o in outputs],
                               [o.timestamps[0] for o in outputs],
                               [o.timestamps[-1] for o in outputs], made)
  # One call over all prompts: the workload of cg_jax's offline client (`--client generate`).
  workload = throughput.workload(count, lengths, output_len, per_s, args.seed,
                                 str(setup.dtype).removeprefix("torch."), "generate")
  return [_row(setup, workload, figures)]


def _row(setup: Setup, workload: dict, figures: dict) -> rows.Row:
  device = (torch.cuda.get_device_name(setup.device) if setup.device.type == "cuda" else "cpu")
  row = options.row(setup.args, workload, figures, device)
  return dataclasses.replace(row, system=setup.system, software={
      "torch": torch.__version__, "transformers": transformers.__version__})


def parse_args(argv: list[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  kinds = parser.add_subparsers(dest="kind", required=True)
  for kind, module in (("latency", latency), ("throughput", throughput)):
    sub = kinds.add_parser(kind)
    module.add_arguments(sub)
    sub.add_argument("--system", required=True, choices=SYSTEMS[kind])
    sub.add_argument("--output", default=None, help="JSON-lines file the rows are appended to")
    sub.add_argument("--compile", choices=("auto", "on", "off"), default="auto",
                     help="torch.compile the decode systems; auto = on CUDA only")
  args = parser.parse_args(argv)
  for flag in ("batch_buckets", "prompt_buckets"):
    if getattr(args, flag) is not None:
      parser.error(f"--{flag.replace('_', '-')} is a cg_jax engine option; the peers have none")
  if not os.path.isfile(os.path.join(args.model, "config.json")):
    parser.error(f"--model {args.model!r}: a peer needs a checkpoint directory (config.json and "
                 "safetensors; benchmarks/make_checkpoints.py writes them)")
  return args


def main(argv: list[str] | None = None) -> int:
  args = parse_args(argv)
  device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
  dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
  compiled = args.compile == "on" or (args.compile == "auto" and device.type == "cuda")
  setup = Setup(args, device, dtype, compiled)
  with torch.no_grad():
    found = (run_latency if args.kind == "latency" else run_throughput)(setup)
  rows.write(args.output, found)
  print(rows.compare(found))
  return 0


if __name__ == "__main__":
  sys.exit(main())
