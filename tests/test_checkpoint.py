"""Checkpoint directories load exhaustively or fail with errors that name the problem."""

import json
import os

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from cg_jax import Engine
from models.hf import CheckpointError
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


def test_not_a_model(tmp_path):
  with pytest.raises(ValueError, match="not a directory, a preset"):
    Engine.from_pretrained(str(tmp_path / "nope"))
