"""Hugging Face checkpoints -> `DecoderConfig` and stacked weights.

Reads a local checkpoint directory (config.json with model.safetensors, or a sharded
model.safetensors.index.json) or an in-memory PyTorch state_dict, for GPT2LMHeadModel and
LlamaForCausalLM. The conversion is exhaustive: every expected tensor is consumed and its shape
checked, unknown tensors are errors, and config fields that would change the math but are not
implemented are rejected. torch is never imported here; torch tensors are converted duck-typed.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from models.config import DecoderConfig, RopeScaling

DTYPES: dict[str, Any] = {
    "float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}

SUPPORTED_ARCHITECTURES = ("GPT2LMHeadModel", "LlamaForCausalLM")

# Non-parameter buffers that some checkpoints carry.
_IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq")


class CheckpointError(ValueError):
  """A checkpoint or its config cannot be loaded as written."""


def numpy_dtype(dtype: str | Any):
  """Map "float32" / "bfloat16" / "float16" (or a dtype) to the NumPy dtype; ValueError otherwise."""
  if isinstance(dtype, str):
    if dtype not in DTYPES:
      raise ValueError(f"dtype must be one of {tuple(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]
  name = np.dtype(dtype).name
  if name not in DTYPES:
    raise ValueError(f"dtype must be one of {tuple(DTYPES)}, got {name!r}")
  return DTYPES[name]


# --------------------------------------------------------------------------------------------------
# config.json


def _architecture(hf: Mapping[str, Any]) -> str:
  archs = hf.get("architectures") or []
  for arch in archs:
    if arch in SUPPORTED_ARCHITECTURES:
      return arch
  model_type = hf.get("model_type")
  if not archs and model_type in ("gpt2", "llama"):
    return {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM"}[model_type]
  raise CheckpointError(
      f"unsupported architecture {archs or model_type!r}; supported: {SUPPORTED_ARCHITECTURES}")


def _reject(hf: Mapping[str, Any], field: str, allowed: Callable[[Any], bool], why: str):
  if field in hf and not allowed(hf[field]):
    raise CheckpointError(f"config field {field}={hf[field]!r} is not supported: {why}")


def _eos(value, vocab_size: int) -> tuple[int, ...]:
  """EOS ids inside the vocabulary (random test configs often carry GPT-2's 50256)."""
  if value is None:
    return ()
  ids = [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]
  return tuple(i for i in ids if 0 <= i < vocab_size)


def _rope(hf: Mapping[str, Any]) -> tuple[float, RopeScaling | None]:
  """RoPE theta and scaling from the transformers 5.x (`rope_parameters`) or 4.x layout."""
  params = hf.get("rope_parameters")
  if params is not None:
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    scaling = params
  else:
    theta = hf.get("rope_theta", 10000.0)
    scaling = hf.get("rope_scaling")
  if not scaling:
    return float(theta), None
  rope_type = scaling.get("rope_type", scaling.get("type", "default"))
  if rope_type not in ("default", "linear", "llama3"):
    raise CheckpointError(
        f"rope_type {rope_type!r} is not supported (supported: default, linear, llama3)")
  if rope_type == "default":
    return float(theta), None
  fields = {"rope_type": rope_type, "factor": float(scaling["factor"])}
  if rope_type == "llama3":
    for name in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
      if name not in scaling:
        raise CheckpointError(f"llama3 rope scaling needs {name!r}; got {dict(scaling)}")
      fields[name] = type(getattr(RopeScaling(), name))(scaling[name])
  return float(theta), RopeScaling(**fields)


def config_from_hf(hf: Mapping[str, Any]) -> DecoderConfig:
  """Translate a Hugging Face config dict (config.json) into a `DecoderConfig`.

  Raises:
    CheckpointError: unsupported architecture, an unsupported option that changes the math,
      or an inconsistent shape (e.g. hidden size not divisible by the number of heads).
  """
  arch = _architecture(hf)
  try:
    if arch == "GPT2LMHeadModel":
      return _gpt2_config(hf)
    return _llama_config(hf)
  except KeyError as err:
    raise CheckpointError(f"config.json of {arch} lacks the field {err.args[0]!r}") from None
  except CheckpointError:
    raise
  except ValueError as err:  # DecoderConfig's own consistency checks
    raise CheckpointError(f"inconsistent {arch} config: {err}") from None


def _gpt2_config(hf: Mapping[str, Any]) -> DecoderConfig:
  _reject(hf, "scale_attn_by_inverse_layer_idx", lambda v: not v, "layer-index attention scaling")
  _reject(hf, "scale_attn_weights", bool, "unscaled attention")
  _reject(hf, "add_cross_attention", lambda v: not v, "cross-attention (encoder-decoder)")
  activations = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}
  act = hf.get("activation_function", "gelu_new")
  if act not in activations:
    raise CheckpointError(
        f"config field activation_function={act!r} is not supported: use one of {tuple(activations)}")
  hidden, heads = int(hf["n_embd"]), int(hf["n_head"])
  if hidden % heads:
    raise CheckpointError(f"inconsistent GPT2LMHeadModel config: n_embd ({hidden}) is not "
                          f"divisible by n_head ({heads})")
  return DecoderConfig(
      family="gpt2", vocab_size=int(hf["vocab_size"]), hidden_size=hidden,
      num_layers=int(hf["n_layer"]), num_heads=heads, num_kv_heads=heads, head_dim=hidden // heads,
      intermediate_size=int(hf.get("n_inner") or 4 * hidden),
      max_position_embeddings=int(hf["n_positions"]),
      norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
      tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)), attention_bias=True,
      mlp_bias=True, activation=activations[act], bos_token_id=hf.get("bos_token_id"),
      eos_token_id=_eos(hf.get("eos_token_id"), int(hf["vocab_size"])))


def _llama_config(hf: Mapping[str, Any]) -> DecoderConfig:
  _reject(hf, "hidden_act", lambda v: v == "silu", "only SwiGLU with silu is implemented")
  _reject(hf, "pretraining_tp", lambda v: v in (None, 1), "tensor-parallel pretraining splits")
  hidden, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
  head_dim = hf.get("head_dim")
  if head_dim is None:
    if hidden % heads:
      raise CheckpointError(f"inconsistent LlamaForCausalLM config: hidden_size ({hidden}) is "
                            f"not divisible by num_attention_heads ({heads}) and no head_dim")
    head_dim = hidden // heads
  theta, scaling = _rope(hf)
  return DecoderConfig(
      family="llama", vocab_size=int(hf["vocab_size"]), hidden_size=hidden,
      num_layers=int(hf["num_hidden_layers"]), num_heads=heads,
      num_kv_heads=int(hf.get("num_key_value_heads") or heads), head_dim=int(head_dim),
      intermediate_size=int(hf["intermediate_size"]),
      max_position_embeddings=int(hf["max_position_embeddings"]),
      norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
      tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
      attention_bias=bool(hf.get("attention_bias", False)), mlp_bias=bool(hf.get("mlp_bias", False)),
      activation="silu", rope_theta=theta, rope_scaling=scaling,
      bos_token_id=hf.get("bos_token_id"), eos_token_id=_eos(hf.get("eos_token_id"), int(hf["vocab_size"])))


# --------------------------------------------------------------------------------------------------
# Tensors


def _to_numpy(tensor) -> np.ndarray:
  """A NumPy view of a NumPy, JAX or PyTorch tensor (torch bfloat16 goes through float32)."""
  if hasattr(tensor, "detach"):  # torch.Tensor, without importing torch
    tensor = tensor.detach().cpu()
    if str(tensor.dtype) == "torch.bfloat16":
      return tensor.float().numpy().astype(ml_dtypes.bfloat16)
    return tensor.numpy()
  return np.asarray(tensor)


def _canonical(name: str) -> str:
  for prefix in ("transformer.", "model."):
    if name.startswith(prefix):
      return name[len(prefix):]
  return name


def _layer_tensors(config: DecoderConfig) -> dict[str, list[tuple[str, tuple[int, ...], bool]]]:
  """Per weight kind: the HF tensors (name template, HF shape, transpose?) concatenated into it."""
  c = config
  d, f = c.hidden_size, c.intermediate_size
  q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
  if c.family == "gpt2":  # Conv1D weights are stored [in, out] already.
    return {
        "attn_norm_scale": [("h.{i}.ln_1.weight", (d,), False)],
        "attn_norm_bias": [("h.{i}.ln_1.bias", (d,), False)],
        "qkv_kernel": [("h.{i}.attn.c_attn.weight", (d, 3 * d), False)],
        "qkv_bias": [("h.{i}.attn.c_attn.bias", (3 * d,), False)],
        "out_kernel": [("h.{i}.attn.c_proj.weight", (d, d), False)],
        "out_bias": [("h.{i}.attn.c_proj.bias", (d,), False)],
        "mlp_norm_scale": [("h.{i}.ln_2.weight", (d,), False)],
        "mlp_norm_bias": [("h.{i}.ln_2.bias", (d,), False)],
        "mlp_in_kernel": [("h.{i}.mlp.c_fc.weight", (d, f), False)],
        "mlp_in_bias": [("h.{i}.mlp.c_fc.bias", (f,), False)],
        "mlp_out_kernel": [("h.{i}.mlp.c_proj.weight", (f, d), False)],
        "mlp_out_bias": [("h.{i}.mlp.c_proj.bias", (d,), False)],
    }
  # nn.Linear weights are stored [out, in]: transpose to [in, out].
  attn, mlp = "layers.{i}.self_attn.", "layers.{i}.mlp."
  kinds = {
      "attn_norm_scale": [("layers.{i}.input_layernorm.weight", (d,), False)],
      "qkv_kernel": [(attn + "q_proj.weight", (q, d), True), (attn + "k_proj.weight", (kv, d), True),
                     (attn + "v_proj.weight", (kv, d), True)],
      "out_kernel": [(attn + "o_proj.weight", (d, q), True)],
      "mlp_norm_scale": [("layers.{i}.post_attention_layernorm.weight", (d,), False)],
      "mlp_in_kernel": [(mlp + "gate_proj.weight", (f, d), True), (mlp + "up_proj.weight", (f, d), True)],
      "mlp_out_kernel": [(mlp + "down_proj.weight", (d, f), True)],
  }
  if c.attention_bias:
    kinds["qkv_bias"] = [(attn + "q_proj.bias", (q,), False), (attn + "k_proj.bias", (kv,), False),
                         (attn + "v_proj.bias", (kv,), False)]
    kinds["out_bias"] = [(attn + "o_proj.bias", (d,), False)]
  if c.mlp_bias:
    kinds["mlp_in_bias"] = [(mlp + "gate_proj.bias", (f,), False), (mlp + "up_proj.bias", (f,), False)]
    kinds["mlp_out_bias"] = [(mlp + "down_proj.bias", (d,), False)]
  return kinds


def _global_tensors(config: DecoderConfig) -> dict[str, tuple[str, tuple[int, ...], bool]]:
  c = config
  d, v = c.hidden_size, c.vocab_size
  if c.family == "gpt2":
    kinds = {"embed": ("wte.weight", (v, d), False),
             "position_embed": ("wpe.weight", (c.max_position_embeddings, d), False),
             "final_norm_scale": ("ln_f.weight", (d,), False),
             "final_norm_bias": ("ln_f.bias", (d,), False)}
  else:
    kinds = {"embed": ("embed_tokens.weight", (v, d), False),
             "final_norm_scale": ("norm.weight", (d,), False)}
  if not c.tie_word_embeddings:
    kinds["lm_head"] = ("lm_head.weight", (v, d), True)
  return kinds


# Where a weight kind comes from: per layer (one entry for a kind that is not stacked) the stored
# tensors concatenated along its last axis, each (name as stored, transposed?).
Layout = dict[str, tuple[bool, list[list[tuple[str, bool]]]]]


def stored_layout(config: DecoderConfig, shapes: Mapping[str, tuple[int, ...]]) -> Layout:
  """{weight kind: (stacked over layers?, sources)} for a checkpoint whose tensors have `shapes`
  ({name as stored: shape}); reads no tensor data.

  Raises:
    CheckpointError: a tensor is missing, unexpected, or has the wrong shape.
  """
  by_canonical: dict[str, str] = {}
  for name in shapes:
    by_canonical.setdefault(_canonical(name), name)
  consumed: set[str] = set()

  def source(canonical: str, shape: tuple[int, ...], transpose: bool) -> tuple[str, bool]:
    if canonical not in by_canonical:
      raise CheckpointError(f"missing tensor {canonical!r} (expected shape {shape})")
    stored = tuple(shapes[by_canonical[canonical]])
    if stored != shape:
      raise CheckpointError(f"tensor {canonical!r} has shape {stored}, expected {shape}")
    consumed.add(canonical)
    return by_canonical[canonical], transpose

  layout: Layout = {kind: (False, [[source(*spec)]])
                    for kind, spec in _global_tensors(config).items()}
  for kind, parts in _layer_tensors(config).items():
    layout[kind] = (True, [[source(tpl.format(i=i), shape, tr) for tpl, shape, tr in parts]
                           for i in range(config.num_layers)])
  if config.tie_word_embeddings and "lm_head.weight" in by_canonical:
    consumed.add("lm_head.weight")  # a redundant copy of the tied embedding
  unexpected = sorted(
      c for c in by_canonical if c not in consumed and not c.endswith(_IGNORED_SUFFIXES))
  if unexpected:
    shown = ", ".join(repr(u) for u in unexpected[:5])
    raise CheckpointError(f"{len(unexpected)} unexpected tensor(s) in checkpoint: {shown}")
  return layout


def assemble(layout: Layout, get: Callable[[str], Any], dtype="float32", xp=np) -> dict[str, Any]:
  """{weight kind: array} from the stored tensors (`get(name)`) as `layout` says: cast to
  `dtype`, transposed, concatenated and stacked with `xp`, NumPy on the host (arrays that may
  be views of the tensors) or jax.numpy inside a jit (on the device)."""
  target = numpy_dtype(dtype)

  def part(name: str, transpose: bool):
    array = get(name).astype(target, copy=False)
    return array.T if transpose else array

  weights = {}
  for kind, (stacked, layers) in layout.items():
    # [*shape] per layer: its parts side by side
    per_layer = [part(*parts[0]) if len(parts) == 1 else
                 xp.concatenate([part(*p) for p in parts], axis=-1) for parts in layers]
    # [L, *shape] or [*shape]
    weights[kind] = xp.stack(per_layer) if stacked else per_layer[0]
  return weights


def convert_weights(config: DecoderConfig, get: Callable[[str], Any], names: list[str],
                    dtype="float32") -> dict[str, np.ndarray]:
  """Assemble stacked weights from Hugging Face tensors on the host.

  Args:
    config: the model config (from `config_from_hf`).
    get: returns the tensor stored under one of `names` (original spelling).
    names: every tensor name in the checkpoint.
    dtype: target dtype name.
  Returns:
    {weight kind: C-contiguous NumPy array}, layer weights stacked [L, ...], ready for `Decoder`.
  Raises:
    CheckpointError: a tensor is missing, unexpected, or has the wrong shape.
  """
  layout = stored_layout(config, {name: tuple(get(name).shape) for name in names})
  weights = assemble(layout, lambda name: _to_numpy(get(name)), dtype)
  return {kind: np.ascontiguousarray(array) for kind, array in weights.items()}


def convert_state_dict(config: DecoderConfig, state_dict: Mapping[str, Any],
                       dtype="float32") -> dict[str, np.ndarray]:
  """Stacked weights from an in-memory (PyTorch) state_dict."""
  return convert_weights(config, state_dict.__getitem__, list(state_dict), dtype)


# --------------------------------------------------------------------------------------------------
# Checkpoint directories


def read_config(path: str | os.PathLike) -> dict[str, Any]:
  """The parsed config.json of a checkpoint directory.

  Raises:
    CheckpointError: no config.json, or one that is not a JSON object (the message names the
      file, and the line and column of invalid JSON).
  """
  config_path = os.path.join(path, "config.json")
  if not os.path.isfile(config_path):
    raise CheckpointError(f"no config.json in checkpoint directory {os.fspath(path)!r}")
  try:
    with open(config_path, encoding="utf-8") as f:
      hf = json.load(f)
  except json.JSONDecodeError as err:
    raise CheckpointError(f"{config_path} is not valid JSON: {err.msg} at line {err.lineno}, "
                          f"column {err.colno}") from None
  except UnicodeDecodeError as err:
    raise CheckpointError(f"{config_path} is not UTF-8 text: {err.reason} at byte "
                          f"{err.start}") from None
  if not isinstance(hf, dict):
    kind = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(hf), "a number")
    raise CheckpointError(f"{config_path} must hold a JSON object {{...}}, got {kind}")
  return hf


def _safetensors_files(path: str) -> dict[str, str]:
  """Tensor name -> file path, from model.safetensors or a sharded index."""
  index_path = os.path.join(path, "model.safetensors.index.json")
  single_path = os.path.join(path, "model.safetensors")
  if os.path.isfile(index_path):
    with open(index_path) as f:
      weight_map = json.load(f).get("weight_map")
    if not isinstance(weight_map, dict):
      raise CheckpointError(f"{index_path} has no 'weight_map' object")
    for shard in sorted(set(weight_map.values())):
      if not os.path.isfile(os.path.join(path, shard)):
        raise CheckpointError(f"missing shard file {shard!r} listed in {index_path}")
    return {name: os.path.join(path, shard) for name, shard in weight_map.items()}
  if os.path.isfile(single_path):
    return {name: single_path for name in mapped_tensors(single_path)}
  found = sorted(os.listdir(path))
  raise CheckpointError(
      f"no model.safetensors or model.safetensors.index.json in {path!r} (found: {found}); "
      "only safetensors checkpoints are supported")


# safetensors' dtype names -> NumPy dtypes (the floating and integer ones a checkpoint may hold).
_STORED_DTYPES: dict[str, Any] = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
    "BOOL": np.bool_}


def mapped_tensors(file: str) -> dict[str, np.ndarray]:
  """{name: read-only NumPy view} of one safetensors file's tensors, memory-mapped: nothing is
  read until a view's elements are (the format: an 8-byte little-endian header length, a JSON
  header naming each tensor's dtype, shape and byte range, then the data). A caller that keeps
  an array must copy it out of the mapping.

  Raises:
    CheckpointError: the file is not a well-formed safetensors file (the message names it).
  """
  size = os.path.getsize(file)
  if size < 8:
    raise CheckpointError(f"{file} is not a safetensors file: {size} bytes")
  mapping = np.memmap(file, dtype=np.uint8, mode="r")
  length = int(mapping[:8].view("<u8")[0])
  if length > mapping.size - 8:
    raise CheckpointError(f"{file} is not a safetensors file: its header length {length} "
                          f"exceeds the file ({mapping.size} bytes)")
  try:
    header = json.loads(bytes(mapping[8:8 + length]))
  except (UnicodeDecodeError, json.JSONDecodeError) as err:
    raise CheckpointError(f"{file} has an unreadable safetensors header: {err}") from None
  if not isinstance(header, dict):
    raise CheckpointError(f"{file} has a safetensors header that is not a JSON object")
  data = mapping[8 + length:]
  views = {}
  for name, entry in header.items():
    if name == "__metadata__":
      continue
    try:
      dtype, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
    except (TypeError, KeyError, ValueError):
      raise CheckpointError(f"{file}: tensor {name!r} has a malformed header entry "
                            f"{entry!r}") from None
    if dtype not in _STORED_DTYPES:
      raise CheckpointError(f"{file}: tensor {name!r} has dtype {dtype!r}; supported: "
                            f"{', '.join(_STORED_DTYPES)}")
    size = int(np.prod(shape, dtype=np.int64)) * np.dtype(_STORED_DTYPES[dtype]).itemsize
    if not 0 <= begin <= end <= data.size or end - begin != size:
      raise CheckpointError(f"{file}: tensor {name!r} of dtype {dtype} and shape {shape} has "
                            f"data_offsets [{begin}, {end}] (file data: {data.size} bytes)")
    views[name] = data[begin:end].view(_STORED_DTYPES[dtype]).reshape(shape)
  return views


def read_tensors(path: str | os.PathLike) -> tuple[DecoderConfig, dict[str, np.ndarray]]:
  """A checkpoint directory's config and every tensor as stored ({name: read-only view of the
  memory-mapped files}, HF layouts and dtypes): what `convert_weights` takes."""
  path = os.fspath(path)
  config = config_from_hf(read_config(path))
  files = _safetensors_files(path)
  views = {}
  for file in sorted(set(files.values())):
    views.update(mapped_tensors(file))
  missing = sorted(name for name in files if name not in views)
  if missing:
    raise CheckpointError(f"tensors listed in the index are not in its files: {missing[:5]}")
  return config, {name: views[name] for name in files}


def load_checkpoint(path: str | os.PathLike, dtype="float32",
                    device: jax.Device | None = None) -> tuple[DecoderConfig, dict[str, Any]]:
  """Load a local Hugging Face checkpoint directory.

  Args:
    dtype: the weights' dtype.
    device: where to assemble them. None: on the host. A device: each tensor is copied there
      as stored, straight from the files' mapping, and cast, transposed, concatenated and
      stacked there by one compiled function (the stored tensors and the weights are both on
      the device until it returns).
  Returns:
    (config, stacked weights: host NumPy arrays in `dtype`, none of them a view of the files, or
    arrays on `device`).
  """
  # The tensors are read where they are converted, straight from the files' mappings: no copy of
  # them is made first (benchmarks/results/checkpoint_load_cpu.md, checkpoint_mapped_cpu.md); on
  # a GPU, assembling them there shortens a start (results/startup_device_load_h100.md).
  config, tensors = read_tensors(path)
  layout = stored_layout(config, {name: array.shape for name, array in tensors.items()})
  if device is not None:
    used = {name: tensors[name] for _, layers in layout.values() for parts in layers
            for name, _ in parts}
    on_device = jax.device_put(used, device)
    return config, jax.jit(lambda stored: assemble(layout, stored.__getitem__, dtype, jnp))(
        on_device)
  weights = assemble(layout, tensors.__getitem__, dtype)
  # (a tensor used as stored, e.g. an embedding in the target dtype, is still a view: copied)
  return config, {kind: array if array.flags.owndata and array.flags.c_contiguous else
                  np.array(array, order="C") for kind, array in weights.items()}


# --------------------------------------------------------------------------------------------------
# Writing checkpoints (the inverse of the above)


def config_to_hf(config: DecoderConfig) -> dict[str, Any]:
  """A Hugging Face config.json dict for `config` (`config_from_hf` inverts it exactly)."""
  c = config
  eos = list(c.eos_token_id)
  eos_field = None if not eos else eos[0] if len(eos) == 1 else eos
  if c.family == "gpt2":
    activations = {"gelu_tanh": "gelu_new", "gelu": "gelu"}
    return dict(architectures=["GPT2LMHeadModel"], model_type="gpt2", vocab_size=c.vocab_size,
                n_embd=c.hidden_size, n_layer=c.num_layers, n_head=c.num_heads,
                n_inner=c.intermediate_size, n_positions=c.max_position_embeddings,
                layer_norm_epsilon=c.norm_eps, tie_word_embeddings=c.tie_word_embeddings,
                activation_function=activations[c.activation], bos_token_id=c.bos_token_id,
                eos_token_id=eos_field)
  rope = {"rope_type": "default", "rope_theta": c.rope_theta}
  if c.rope_scaling is not None:
    rope.update(dataclasses.asdict(c.rope_scaling))
    if c.rope_scaling.rope_type == "linear":
      for name in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
        rope.pop(name)
  return dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=c.vocab_size,
              hidden_size=c.hidden_size, num_hidden_layers=c.num_layers,
              num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
              head_dim=c.head_dim, intermediate_size=c.intermediate_size,
              max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.norm_eps,
              tie_word_embeddings=c.tie_word_embeddings, attention_bias=c.attention_bias,
              mlp_bias=c.mlp_bias, hidden_act="silu", rope_theta=c.rope_theta,
              rope_parameters=rope, bos_token_id=c.bos_token_id, eos_token_id=eos_field)


def export_weights(config: DecoderConfig, weights: Mapping[str, Any],
                   dtype="float32") -> dict[str, np.ndarray]:
  """Stacked weights -> Hugging Face tensors (names and layouts `convert_weights` reads)."""
  target = numpy_dtype(dtype)
  prefix = "transformer." if config.family == "gpt2" else "model."

  def put(name: str, array, transpose: bool) -> tuple[str, np.ndarray]:
    array = np.asarray(array).astype(target)
    full = name if name == "lm_head.weight" else prefix + name
    return full, np.ascontiguousarray(array.T if transpose else array)

  tensors = dict(put(name, weights[kind], tr)
                 for kind, (name, _, tr) in _global_tensors(config).items())
  for kind, parts in _layer_tensors(config).items():
    stacked = np.asarray(weights[kind])
    if stacked.shape[0] != config.num_layers:
      raise ValueError(f"weights[{kind!r}] has {stacked.shape[0]} layers, expected "
                       f"{config.num_layers}")
    # Each part's width along the last (output) axis, in the order they were concatenated.
    widths = [shape[0] if tr else shape[-1] for _, shape, tr in parts]
    for i in range(config.num_layers):
      pieces = np.split(stacked[i], np.cumsum(widths)[:-1], axis=-1)
      tensors.update(put(tpl.format(i=i), piece, tr) for (tpl, _, tr), piece in zip(parts, pieces))
  return tensors


def save_checkpoint(path: str | os.PathLike, config: DecoderConfig, weights: Mapping[str, Any],
                    dtype="float32") -> None:
  """Write a Hugging Face checkpoint directory (config.json + model.safetensors) that
  `load_checkpoint` and transformers' `from_pretrained` both read."""
  from safetensors.numpy import save_file

  path = os.fspath(path)
  os.makedirs(path, exist_ok=True)
  hf = dict(config_to_hf(config), torch_dtype=np.dtype(numpy_dtype(dtype)).name)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(hf, f, indent=2)
  save_file(export_weights(config, weights, dtype), os.path.join(path, "model.safetensors"),
            metadata={"format": "pt"})
