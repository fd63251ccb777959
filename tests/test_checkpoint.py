"""Checkpoint directories load exhaustively or fail with errors that name the problem."""

import json
import os

import jax
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from cg_jax import Engine
from cg_jax.engine import checkpoint_device
from models.hf import (CheckpointError, config_from_hf, load_checkpoint, mapped_tensors,
                       save_checkpoint)
from tests.helpers import (RELATIVE_TOLERANCE, assert_close_relative, hf_gpt2_config,
                           hf_llama_config, random_tensors, write_checkpoint)

CONFIGS = {"gpt2": hf_gpt2_config(), "llama": hf_llama_config()}
ENGINE = dict(batch_buckets=(1, 2), prompt_buckets=(16, 32))


def _tokens(config, seed=0, shape=(2, 24)):
  return np.random.default_rng(seed).integers(0, config["vocab_size"], shape).tolist()


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_sharded_equals_single_file(tmp_path, family):
  config = CONFIGS[family]
  tensors = random_tensors(config)
  single = Engine.from_pretrained(write_checkpoint(tmp_path / "single", config, tensors), **ENGINE)
  sharded = Engine.from_pretrained(
      write_checkpoint(tmp_path / "sharded", config, tensors, shards=3), **ENGINE)
  tokens = _tokens(config)
  np.testing.assert_array_equal(single.logits(tokens), sharded.logits(tokens))


@pytest.mark.parametrize("family", sorted(CONFIGS))
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision_close_to_float32(tmp_path, family, dtype):
  config = CONFIGS[family]
  path = write_checkpoint(tmp_path / "ckpt", config, random_tensors(config))
  tokens = _tokens(config)
  reference = Engine.from_pretrained(path, dtype="float32", **ENGINE).logits(tokens)
  low = Engine.from_pretrained(path, dtype=dtype, **ENGINE).logits(tokens)
  assert low.dtype == np.float32
  assert_close_relative(low, reference, RELATIVE_TOLERANCE[dtype], f"{dtype} logits")


def test_bfloat16_file_loads(tmp_path):
  config = CONFIGS["llama"]
  tensors = random_tensors(config)
  path = write_checkpoint(tmp_path / "bf16", config, tensors, dtype="bfloat16")
  engine = Engine.from_pretrained(path, dtype="bfloat16", **ENGINE)
  assert engine.dtype.name == "bfloat16"
  assert np.all(np.isfinite(engine.logits(_tokens(config))))


def test_prefix_free_names_and_ignored_buffers(tmp_path):
  """The Hub's gpt2 file has no `transformer.` prefix and carries attn.bias buffers."""
  config = CONFIGS["gpt2"]
  tensors = random_tensors(config)
  reference = Engine.from_pretrained(write_checkpoint(tmp_path / "a", config, tensors), **ENGINE)
  renamed = {k.removeprefix("transformer."): v for k, v in tensors.items()}
  for i in range(config["n_layer"]):
    renamed[f"h.{i}.attn.bias"] = np.tril(np.ones((1, 1, 8, 8), np.float32))
  other = Engine.from_pretrained(write_checkpoint(tmp_path / "b", config, renamed), **ENGINE)
  tokens = _tokens(config)
  np.testing.assert_array_equal(reference.logits(tokens), other.logits(tokens))


def _rewrite(path, change):
  file = os.path.join(path, "model.safetensors")
  tensors = load_file(file)
  change(tensors)
  save_file(tensors, file)


def test_missing_tensor_is_named(tmp_path):
  config = CONFIGS["llama"]
  path = write_checkpoint(tmp_path, config, random_tensors(config))
  _rewrite(path, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
  with pytest.raises(CheckpointError, match=r"missing tensor 'layers\.1\.mlp\.up_proj\.weight'"):
    Engine.from_pretrained(path, **ENGINE)


def test_wrong_shape_names_tensor_and_shapes(tmp_path):
  config = CONFIGS["gpt2"]
  path = write_checkpoint(tmp_path, config, random_tensors(config))

  def shrink(t):
    t["transformer.h.0.mlp.c_fc.weight"] = t["transformer.h.0.mlp.c_fc.weight"][:, :7].copy()

  _rewrite(path, shrink)
  with pytest.raises(CheckpointError, match=r"h\.0\.mlp\.c_fc\.weight.*\(48, 7\).*\(48, 192\)"):
    Engine.from_pretrained(path, **ENGINE)


def test_unexpected_tensor_is_an_error(tmp_path):
  config = CONFIGS["llama"]
  path = write_checkpoint(tmp_path, config, random_tensors(config))
  _rewrite(path, lambda t: t.update({"model.layers.0.self_attn.q_norm.weight": np.ones(16, np.float32)}))
  with pytest.raises(CheckpointError, match="unexpected tensor.*q_norm"):
    Engine.from_pretrained(path, **ENGINE)


def test_mapped_tensors_equal_the_safetensors_reader(tmp_path):
  rng = np.random.default_rng()
  tensors = {"f32": rng.standard_normal((3, 5)).astype(np.float32),
             "f16": rng.standard_normal((7,)).astype(np.float16),
             "bf16": rng.standard_normal((2, 3, 4)).astype(ml_dtypes.bfloat16),
             "i64": rng.integers(-2**40, 2**40, (4,)), "flags": rng.random((6,)) < 0.5,
             "scalar": np.array(rng.standard_normal(), np.float64),
             "empty": np.zeros((0, 3), np.float32)}
  save_file(tensors, str(tmp_path / "t.safetensors"), metadata={"format": "np"})
  mapped = mapped_tensors(str(tmp_path / "t.safetensors"))
  expected = load_file(str(tmp_path / "t.safetensors"))
  assert sorted(mapped) == sorted(expected) == sorted(tensors)
  for name, array in expected.items():
    assert mapped[name].dtype == array.dtype and mapped[name].shape == array.shape, name
    assert mapped[name].tobytes() == array.tobytes() == tensors[name].tobytes(), name
    assert not mapped[name].flags.writeable


def test_loaded_weights_do_not_alias_the_files(tmp_path):
  # A bfloat16 file loaded as bfloat16 uses the embedding as stored: still a copy, so a
  # checkpoint rewritten in place after loading leaves the weights as they were.
  config = CONFIGS["llama"]
  path = write_checkpoint(tmp_path, config, random_tensors(config), dtype="bfloat16")
  _, weights = load_checkpoint(path, "bfloat16")
  before = {kind: array.copy() for kind, array in weights.items()}
  file = os.path.join(path, "model.safetensors")
  with open(file, "r+b") as f:
    length = int.from_bytes(f.read(8), "little")
    f.seek(8 + length)
    f.write(b"\0" * (os.path.getsize(file) - 8 - length))
  for kind, array in weights.items():
    assert array.tobytes() == before[kind].tobytes(), kind
  assert not np.any(load_checkpoint(path, "bfloat16")[1]["embed"].astype(np.float32))


def _rewrite_header(file, edit):
  with open(file, "rb") as f:
    length = int.from_bytes(f.read(8), "little")
    header, data = json.loads(f.read(length)), f.read()
  edit(header)
  text = json.dumps(header).encode()
  with open(file, "wb") as f:
    f.write(len(text).to_bytes(8, "little") + text + data)


@pytest.mark.parametrize("damage, match", [
    ("truncated", r"tensor '.*' of dtype F32 and shape .* has data_offsets"),
    ("empty", "is not a safetensors file: 0 bytes"),
    ("header length", "header length .* exceeds the file"),
    ("dtype", "tensor 'model.norm.weight' has dtype 'F8_E4M3'; supported: F64"),
    ("offsets", r"tensor 'model.norm.weight' .* has data_offsets \[0, 4\]"),
    ("header", "unreadable safetensors header"),
])
def test_damaged_safetensors_file_is_named(tmp_path, damage, match):
  config = CONFIGS["llama"]
  path = write_checkpoint(tmp_path, config, random_tensors(config))
  file = os.path.join(path, "model.safetensors")
  if damage == "truncated":
    os.truncate(file, os.path.getsize(file) - 4)
  elif damage == "empty":
    os.truncate(file, 0)
  elif damage == "header length":
    with open(file, "r+b") as f:
      f.write((1 << 40).to_bytes(8, "little"))
  elif damage == "dtype":
    _rewrite_header(file, lambda h: h["model.norm.weight"].update(dtype="F8_E4M3"))
  elif damage == "offsets":
    _rewrite_header(file, lambda h: h["model.norm.weight"].update(data_offsets=[0, 4]))
  else:
    with open(file, "r+b") as f:
      f.seek(8)
      f.write(b"\xff")
  with pytest.raises(CheckpointError, match=match):
    load_checkpoint(path)


def test_missing_shard_is_named(tmp_path):
  config = CONFIGS["llama"]
  path = write_checkpoint(tmp_path, config, random_tensors(config), shards=2)
  os.remove(os.path.join(path, "model-00002-of-00002.safetensors"))
  with pytest.raises(CheckpointError, match="missing shard file 'model-00002-of-00002.safetensors'"):
    Engine.from_pretrained(path, **ENGINE)


@pytest.mark.parametrize("mutate, match", [
    (lambda c: c.update(architectures=["MistralForCausalLM"], model_type="mistral"),
     "unsupported architecture"),
    (lambda c: c.update(hidden_size=50, head_dim=None), "not divisible"),
])
def test_bad_config_in_directory(tmp_path, mutate, match):
  config = CONFIGS["llama"]
  path = write_checkpoint(tmp_path, config, random_tensors(config))
  with open(os.path.join(path, "config.json")) as f:
    data = json.load(f)
  mutate(data)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(data, f)
  with pytest.raises(CheckpointError, match=match):
    Engine.from_pretrained(path, **ENGINE)


def test_no_weights_file(tmp_path):
  config = CONFIGS["llama"]
  os.makedirs(tmp_path / "empty")
  with open(tmp_path / "empty" / "config.json", "w") as f:
    json.dump(config, f)
  with pytest.raises(CheckpointError, match="only safetensors"):
    Engine.from_pretrained(tmp_path / "empty", **ENGINE)


def test_not_a_model(tmp_path, monkeypatch):
  monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
  with pytest.raises(ValueError, match="not a directory, a bundled model .*, a preset"):
    Engine.from_pretrained("no-such-model")
  with pytest.raises(ValueError) as info:
    Engine.from_pretrained(str(tmp_path / "nope"))
  assert str(info.value) == (
      f"model {str(tmp_path / 'nope')!r}: there is no checkpoint directory at {tmp_path / 'nope'}")


ROUND_TRIP_CONFIGS = {
    **CONFIGS,
    "gpt2-untied-ffn": hf_gpt2_config(tie_word_embeddings=False, n_inner=72,
                                      activation_function="gelu"),
    "llama-linear-rope-bias-tied": hf_llama_config(
        tie_word_embeddings=True, attention_bias=True, mlp_bias=True,
        rope_parameters={"rope_type": "linear", "rope_theta": 5000.0, "factor": 2.0}),
    "llama-default-rope-mqa": hf_llama_config(
        num_key_value_heads=1, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
}


def _variant_tensors(config, seed):
  tensors = random_tensors(config, seed=seed)
  if config.get("attention_bias"):  # the helper writes no Llama biases; add them by hand
    rng = np.random.default_rng(seed + 1)
    for name, value in list(tensors.items()):
      if name.endswith(("_proj.weight")):
        tensors[name[:-len("weight")] + "bias"] = rng.normal(0, 0.1, value.shape[:1]).astype(np.float32)
  return tensors


@pytest.mark.parametrize("variant", sorted(ROUND_TRIP_CONFIGS))
def test_save_checkpoint_round_trip(tmp_path, variant):
  """save_checkpoint writes the same HF tensors (and an equivalent config) that were loaded."""
  config = ROUND_TRIP_CONFIGS[variant]
  tensors = _variant_tensors(config, seed=11)
  ours, weights = load_checkpoint(write_checkpoint(tmp_path / "in", config, tensors))
  save_checkpoint(tmp_path / "out", ours, weights)
  again, _ = load_checkpoint(tmp_path / "out")
  assert again == ours
  written = load_file(str(tmp_path / "out" / "model.safetensors"))
  assert sorted(written) == sorted(tensors)
  for name, value in tensors.items():
    np.testing.assert_array_equal(written[name], value, err_msg=name)


@pytest.mark.parametrize("variant", sorted(ROUND_TRIP_CONFIGS))
@pytest.mark.parametrize("stored, dtype", [("float32", "bfloat16"), ("bfloat16", "float32")])
def test_weights_assembled_on_the_device_equal_the_hosts(tmp_path, variant, stored, dtype):
  """load_checkpoint(device=...) copies the tensors as stored and casts, transposes,
  concatenates and stacks them there: bit for bit the host's weights."""
  config = ROUND_TRIP_CONFIGS[variant]
  path = write_checkpoint(tmp_path, config, _variant_tensors(config, seed=3), dtype=stored)
  _, host = load_checkpoint(path, dtype)
  device = jax.devices()[0]
  _, placed = load_checkpoint(path, dtype, device)
  assert sorted(placed) == sorted(host)
  for kind, array in placed.items():
    assert isinstance(array, jax.Array) and array.devices() == {device}, kind
    assert array.dtype == host[kind].dtype and array.shape == host[kind].shape, kind
    np.testing.assert_array_equal(np.asarray(array), host[kind], err_msg=kind)


def test_checkpoint_assembled_on_the_device_only_where_both_fit():
  """The device takes the stored tensors (counted as float32) beside the weights, or the host
  assembles them (so too for tensor-parallel engines, which split them there)."""
  config = config_from_hf(CONFIGS["llama"])
  both = config.num_parameters() * (4 + 2)  # float32 tensors, bfloat16 weights
  device = jax.devices()[0]
  assert checkpoint_device(config, "bfloat16", None, 1) == device
  assert checkpoint_device(config, "bfloat16", both, 1) == device
  assert checkpoint_device(config, "bfloat16", both - 1, 1) is None
  assert checkpoint_device(config, "bfloat16", None, 2) is None


def test_a_bad_checkpoint_fails_before_the_device_gets_a_tensor(tmp_path, monkeypatch):
  config = CONFIGS["llama"]
  path = write_checkpoint(tmp_path, config, random_tensors(config))
  _rewrite(path, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))

  def refused(*args, **kwargs):
    raise AssertionError("a tensor went to the device")

  monkeypatch.setattr(jax, "device_put", refused)
  with pytest.raises(CheckpointError, match=r"missing tensor 'layers\.1\.mlp\.up_proj\.weight'"):
    load_checkpoint(path, "float32", jax.devices()[0])


def test_save_checkpoint_rejects_wrong_layer_count(tmp_path):
  config = CONFIGS["llama"]
  ours, weights = load_checkpoint(write_checkpoint(tmp_path / "in", config, random_tensors(config)))
  weights["qkv_kernel"] = weights["qkv_kernel"][:1]
  with pytest.raises(ValueError, match="qkv_kernel.*1 layers, expected 2"):
    save_checkpoint(tmp_path / "out", ours, weights)


@pytest.mark.parametrize("text, problem", [
    ('{"model_type": "llama",\n "vocab_size": }',
     "is not valid JSON: Expecting value at line 2, column 16"),
    ('{"model_type": "llama",}',
     "is not valid JSON: Expecting property name enclosed in double quotes at line 1, column 24"),
    ("", "is not valid JSON: Expecting value at line 1, column 1"),
    ('[{"model_type": "llama"}]', "must hold a JSON object {...}, got an array"),
    ('"llama"', "must hold a JSON object {...}, got a string"),
    (b'{"model_type": "\xff"}', "is not UTF-8 text: invalid start byte at byte 16"),
])
def test_bad_config_json_names_the_file(tmp_path, text, problem):
  (tmp_path / "config.json").write_bytes(text if isinstance(text, bytes) else text.encode())
  with pytest.raises(CheckpointError) as info:
    Engine.from_pretrained(tmp_path)
  assert str(info.value) == f"{tmp_path / 'config.json'} {problem}"
