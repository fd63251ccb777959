"""Presets have the real shapes (checked abstractly), and HF configs translate or fail loudly."""

import jax
import numpy as np
import pytest
from flax import nnx

from models import PRESETS, Decoder, DecoderConfig, preset
from models.hf import CheckpointError, config_from_hf
from tests.helpers import hf_gpt2_config, hf_llama_config

# Parameter counts that Hugging Face reports for the real checkpoints.
REAL_PARAMETER_COUNTS = {
    "gpt2": 124_439_808, "gpt2-medium": 354_823_168, "gpt2-large": 774_030_080,
    "gpt2-xl": 1_557_611_200, "llama-3.2-1b": 1_235_814_400, "llama-3.2-3b": 3_212_749_824,
    "llama-3.1-8b": 8_030_261_248,
}


@pytest.mark.parametrize("name", sorted(REAL_PARAMETER_COUNTS))
def test_preset_shapes_without_allocating(name):
  config = preset(name)
  abstract = nnx.eval_shape(lambda: Decoder(config, dtype="bfloat16", rngs=nnx.Rngs(0)))
  leaves = jax.tree.leaves(nnx.state(abstract))
  assert all(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in leaves)
  assert sum(int(np.prod(leaf.shape)) for leaf in leaves) == REAL_PARAMETER_COUNTS[name]
  assert config.num_parameters() == REAL_PARAMETER_COUNTS[name]
  # Weights are stacked over layers: a step takes about 15-20 arrays, not hundreds.
  assert len(leaves) <= 17
  assert abstract.qkv_kernel.shape == (config.num_layers, config.hidden_size, config.qkv_width)


def test_unknown_preset_lists_known_names():
  with pytest.raises(ValueError, match="tiny-llama"):
    preset("gpt5")


def test_rope_config_layouts_4x_and_5x_agree():
  scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
             "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
  v5 = hf_llama_config(rope_parameters={**scaling, "rope_theta": 5e5})
  v4 = hf_llama_config(rope_theta=5e5, rope_scaling=scaling)
  del v4["rope_parameters"]
  v4_legacy_key = hf_llama_config(rope_theta=5e5, rope_scaling={**scaling, "type": "llama3"})
  del v4_legacy_key["rope_parameters"]
  del v4_legacy_key["rope_scaling"]["rope_type"]
  a, b, c = config_from_hf(v5), config_from_hf(v4), config_from_hf(v4_legacy_key)
  assert a == b == c
  assert a.rope_theta == 5e5 and a.rope_scaling.rope_type == "llama3"
  plain = hf_llama_config(rope_theta=1e4)
  del plain["rope_parameters"]
  assert config_from_hf(plain).rope_scaling is None


@pytest.mark.parametrize("overrides, match", [
    ({"architectures": ["BertModel"], "model_type": "bert"}, "unsupported architecture"),
    ({"n_embd": 50}, "not divisible"),
    ({"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx"),
    ({"activation_function": "relu"}, "activation_function"),
    ({"add_cross_attention": True}, "cross-attention"),
])
def test_bad_gpt2_configs(overrides, match):
  with pytest.raises(CheckpointError, match=match):
    config_from_hf(hf_gpt2_config(**overrides))


@pytest.mark.parametrize("overrides, match", [
    ({"num_key_value_heads": 3}, "divisible by num_kv_heads"),
    ({"hidden_size": 50, "head_dim": None}, "not divisible"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"pretraining_tp": 2}, "pretraining_tp"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "yarn"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 4.0, "rope_theta": 1e4}},
     "low_freq_factor"),
])
def test_bad_llama_configs(overrides, match):
  with pytest.raises(CheckpointError, match=match):
    config_from_hf(hf_llama_config(**overrides))


def test_missing_config_field_is_named():
  config = hf_llama_config()
  del config["intermediate_size"]
  with pytest.raises(CheckpointError, match="intermediate_size"):
    config_from_hf(config)


def test_config_is_frozen_and_hashable():
  config = PRESETS["tiny-llama"]
  assert hash(config) == hash(preset("tiny-llama"))
  with pytest.raises(Exception):
    config.hidden_size = 3  # type: ignore[misc]
  with pytest.raises(ValueError, match="num_layers"):
    DecoderConfig(**{**config.__dict__, "num_layers": 0})
