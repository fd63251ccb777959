"""Accuracy against Hugging Face transformers (PyTorch) on tiny random models built in the test."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from cg_jax import Engine  # noqa: E402
from tests.helpers import RELATIVE_TOLERANCE, assert_close_relative  # noqa: E402

pytestmark = pytest.mark.torch

LLAMA = dict(vocab_size=389, hidden_size=64, intermediate_size=112, num_hidden_layers=3,
             max_position_embeddings=512, rms_norm_eps=1e-5, bos_token_id=0, eos_token_id=1)
VARIANTS = {
    "gpt2-tied": ("gpt2", dict(vocab_size=389, n_embd=64, n_layer=3, n_head=4, n_positions=512)),
    "gpt2-untied": ("gpt2", dict(vocab_size=389, n_embd=64, n_layer=2, n_head=8, n_positions=512,
                                 tie_word_embeddings=False)),
    "llama-mha-default-rope": ("llama", dict(LLAMA, num_attention_heads=4, num_key_value_heads=4,
                                             tie_word_embeddings=False, rope_theta=10000.0)),
    "llama-gqa-llama3-rope-tied": ("llama", dict(
        LLAMA, num_attention_heads=8, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
        rope_theta=50000.0, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    "llama-mqa-linear-rope-bias": ("llama", dict(
        LLAMA, num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=False,
        attention_bias=True, mlp_bias=True, rope_theta=10000.0,
        rope_scaling={"rope_type": "linear", "factor": 2.0})),
}


def hf_model(variant: str, seed: int = 0):
  """A random HF model with non-trivial norm weights and biases, float32, eval mode."""
  family, kwargs = VARIANTS[variant]
  torch.manual_seed(seed)
  if family == "gpt2":
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**kwargs))
  else:
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kwargs))
  with torch.no_grad():
    for name, param in model.named_parameters():
      if name.endswith("bias"):
        param.normal_(0.0, 0.1)
      elif "ln_" in name or "norm" in name:
        param.copy_(1.0 + 0.1 * torch.randn_like(param))
      else:
        param.normal_(0.0, 0.1)
  model.generation_config.eos_token_id = None
  model.generation_config.pad_token_id = 0
  return model.eval()


def engine_for(model, **options):
  options.setdefault("batch_buckets", (1, 2, 4))
  options.setdefault("prompt_buckets", (64, 128))
  return Engine.from_state_dict(model.config.to_dict(), model.state_dict(), **options)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_full_sequence_logits_match_pytorch(variant):
  model = hf_model(variant)
  tokens = np.random.default_rng(1).integers(0, model.config.vocab_size, (2, 320))
  with torch.no_grad():
    reference = model(torch.as_tensor(tokens)).logits.numpy()
  ours = engine_for(model).logits(tokens.tolist())
  # The bound: max|diff| <= 1e-4 x max|ref| on 300+ token prompts.
  assert_close_relative(ours, reference, 1e-4, f"{variant} logits")


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_greedy_matches_hf_generate(variant):
  model = hf_model(variant, seed=2)
  rng = np.random.default_rng(3)
  prompts = [rng.integers(2, model.config.vocab_size, (n,)).tolist() for n in (7, 45, 20)]
  engine = engine_for(model)
  ours = engine.generate(prompts, max_new_tokens=32, eos_token_id=[])
  for prompt, row in zip(prompts, ours):
    with torch.no_grad():
      out = model.generate(torch.as_tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                           max_new_tokens=32, do_sample=False)
    expected = out[0, len(prompt):].tolist()
    assert row == expected


def test_saved_checkpoint_matches_pytorch(tmp_path):
  """save_pretrained output (single file and sharded) loads with the same logits."""
  model = hf_model("llama-gqa-llama3-rope-tied", seed=4)
  tokens = np.random.default_rng(5).integers(0, model.config.vocab_size, (2, 40))
  with torch.no_grad():
    reference = model(torch.as_tensor(tokens)).logits.numpy()
  model.save_pretrained(tmp_path / "single")
  model.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
  assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
  for directory in ("single", "sharded"):
    ours = Engine.from_pretrained(tmp_path / directory, batch_buckets=(2,), prompt_buckets=(64,))
    assert_close_relative(ours.logits(tokens.tolist()), reference, RELATIVE_TOLERANCE["float32"] * 10,
                          directory)


def test_saved_gpt2_bfloat16_close_to_float32(tmp_path):
  model = hf_model("gpt2-tied", seed=6)
  model.save_pretrained(tmp_path / "gpt2")
  tokens = np.random.default_rng(7).integers(0, model.config.vocab_size, (2, 40)).tolist()
  f32 = Engine.from_pretrained(tmp_path / "gpt2", dtype="float32").logits(tokens)
  bf16 = Engine.from_pretrained(tmp_path / "gpt2", dtype="bfloat16").logits(tokens)
  assert_close_relative(bf16, f32, RELATIVE_TOLERANCE["bfloat16"], "bfloat16 logits")


def test_torch_bfloat16_state_dict():
  model = hf_model("llama-mha-default-rope", seed=8)
  tokens = np.random.default_rng(9).integers(0, model.config.vocab_size, (1, 30)).tolist()
  f32 = engine_for(model).logits(tokens)
  bf16_state = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
  bf16 = Engine.from_state_dict(model.config.to_dict(), bf16_state, dtype="bfloat16",
                                batch_buckets=(1,), prompt_buckets=(64,)).logits(tokens)
  assert_close_relative(bf16, f32, RELATIVE_TOLERANCE["bfloat16"], "bfloat16 state_dict")


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_save_checkpoint_loads_in_transformers(tmp_path, variant):
  """Our writer's checkpoints load in transformers with the original model's logits."""
  from models.hf import config_from_hf, convert_state_dict, save_checkpoint

  model = hf_model(variant, seed=10)
  config = config_from_hf(model.config.to_dict())
  save_checkpoint(tmp_path, config, convert_state_dict(config, model.state_dict()))
  reloaded = type(model).from_pretrained(tmp_path).eval()
  tokens = torch.as_tensor(np.random.default_rng(11).integers(0, model.config.vocab_size, (2, 50)))
  with torch.no_grad():
    np.testing.assert_array_equal(reloaded(tokens).logits.numpy(), model(tokens).logits.numpy())
