"""Shared test helpers (no PyTorch): tolerances, comparisons, HF-format checkpoints from NumPy."""

from __future__ import annotations

import json
import os
import time

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

# Relative tolerance per dtype: |ours - ref| <= tol * max|ref|.
RELATIVE_TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 1e-2}


def assert_close_relative(actual, reference, rel: float, what: str = "values"):
  """max|actual - reference| <= rel * max|reference|, reporting headroom and where it failed."""
  actual = np.asarray(actual, np.float64)
  reference = np.asarray(reference, np.float64)
  assert actual.shape == reference.shape, (actual.shape, reference.shape)
  diff = np.abs(actual - reference)
  bound = rel * np.max(np.abs(reference))
  worst = np.unravel_index(np.argmax(diff), diff.shape)
  assert diff.max() <= bound, (
      f"{what}: max|diff| {diff.max():.3e} at {worst} exceeds {rel} x max|ref| = {bound:.3e} "
      f"({100 * diff.max() / bound:.0f}% of the tolerance)")


def hf_gpt2_config(**overrides) -> dict:
  config = dict(architectures=["GPT2LMHeadModel"], model_type="gpt2", vocab_size=261, n_embd=48,
                n_layer=2, n_head=4, n_positions=128, n_inner=None, layer_norm_epsilon=1e-5,
                activation_function="gelu_new", tie_word_embeddings=True, bos_token_id=260,
                eos_token_id=260)
  config.update(overrides)
  return config


def hf_llama_config(**overrides) -> dict:
  config = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=261,
                hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                rms_norm_eps=1e-5, hidden_act="silu", tie_word_embeddings=False,
                rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                 "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 32},
                bos_token_id=0, eos_token_id=1)
  config.update(overrides)
  return config


def hf_tensor_shapes(config: dict) -> dict[str, tuple[int, ...]]:
  """HF tensor names and shapes of a GPT2LMHeadModel / LlamaForCausalLM (written out by hand,
  independently of the converter)."""
  shapes = {}
  if config["model_type"] == "gpt2":
    d, v = config["n_embd"], config["vocab_size"]
    f = config["n_inner"] or 4 * d
    shapes["transformer.wte.weight"] = (v, d)
    shapes["transformer.wpe.weight"] = (config["n_positions"], d)
    for i in range(config["n_layer"]):
      p = f"transformer.h.{i}."
      shapes.update({p + "ln_1.weight": (d,), p + "ln_1.bias": (d,),
                     p + "attn.c_attn.weight": (d, 3 * d), p + "attn.c_attn.bias": (3 * d,),
                     p + "attn.c_proj.weight": (d, d), p + "attn.c_proj.bias": (d,),
                     p + "ln_2.weight": (d,), p + "ln_2.bias": (d,),
                     p + "mlp.c_fc.weight": (d, f), p + "mlp.c_fc.bias": (f,),
                     p + "mlp.c_proj.weight": (f, d), p + "mlp.c_proj.bias": (d,)})
    shapes["transformer.ln_f.weight"] = (d,)
    shapes["transformer.ln_f.bias"] = (d,)
    if not config["tie_word_embeddings"]:
      shapes["lm_head.weight"] = (v, d)
  else:
    d, v, f = config["hidden_size"], config["vocab_size"], config["intermediate_size"]
    hd = config["head_dim"]
    q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    shapes["model.embed_tokens.weight"] = (v, d)
    for i in range(config["num_hidden_layers"]):
      p = f"model.layers.{i}."
      shapes.update({p + "input_layernorm.weight": (d,),
                     p + "self_attn.q_proj.weight": (q, d), p + "self_attn.k_proj.weight": (kv, d),
                     p + "self_attn.v_proj.weight": (kv, d), p + "self_attn.o_proj.weight": (d, q),
                     p + "post_attention_layernorm.weight": (d,),
                     p + "mlp.gate_proj.weight": (f, d), p + "mlp.up_proj.weight": (f, d),
                     p + "mlp.down_proj.weight": (d, f)})
    shapes["model.norm.weight"] = (d,)
    if not config["tie_word_embeddings"]:
      shapes["lm_head.weight"] = (v, d)
  return shapes


def random_tensors(config: dict, seed: int = 0) -> dict[str, np.ndarray]:
  """Random float32 tensors for every HF name: weights ~N(0, 0.1), norm scales ~1 + N(0, 0.1)."""
  rng = np.random.default_rng(seed)
  tensors = {}
  for name, shape in hf_tensor_shapes(config).items():
    value = rng.normal(0.0, 0.1, shape).astype(np.float32)
    if ("ln_" in name or "norm" in name) and name.endswith("weight"):
      value += 1.0
    tensors[name] = value
  return tensors


def write_checkpoint(path, config: dict, tensors: dict[str, np.ndarray], *, shards: int = 1,
                     dtype: str = "float32") -> str:
  """Write config.json and model.safetensors (or `shards` files plus an index) like HF does."""
  os.makedirs(path, exist_ok=True)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(config, f)
  cast = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}[dtype]
  tensors = {k: np.ascontiguousarray(v.astype(cast)) for k, v in tensors.items()}
  if shards == 1:
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return str(path)
  names = sorted(tensors)
  weight_map = {}
  for s in range(shards):
    file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
    part = {n: tensors[n] for n in names[s::shards]}
    save_file(part, os.path.join(path, file), metadata={"format": "pt"})
    weight_map.update({n: file for n in part})
  with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
    json.dump({"metadata": {}, "weight_map": weight_map}, f)
  return str(path)


def wait_blocks_released(engine, timeout: float = 10.0) -> dict:
  """The engine's stats once no KV-cache block is in use: a finished request's blocks go back
  when the engine thread retires it (its next iteration, after the steps in flight that still
  write them), a moment after its result is delivered."""
  deadline = time.monotonic() + timeout
  while engine.stats()["kv_blocks_used"] and time.monotonic() < deadline:
    time.sleep(0.01)
  return engine.stats()
