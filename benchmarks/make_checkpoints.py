"""Random-weight Hugging Face checkpoints that every benchmarked system loads (identical weights).

Writes `<out-dir>/<name>/` with config.json, generation_config.json and bfloat16 safetensors
(`save_pretrained`) for the shapes below. Weights are drawn from one seeded generator: every
matrix, embedding and bias ~ N(0, 0.02), every norm gain = 1, so a given seed and model name
always give the same tensors, whatever transformers version builds the module. Llama ties its
output head to the embedding (as Llama-3.2-1B does); GPT-2 always does.

  python benchmarks/make_checkpoints.py --out-dir /tmp/cg_jax_ckpt \
      [--models gpt2,gpt2-large,llama-3.2-1b] [--seed 0]
  python benchmarks/make_checkpoints.py --out-dir /tmp/cg_jax_ckpt_smoke --smoke   # tiny, CPU

cg_jax loads them with `cg_jax.Engine.from_pretrained(dir, dtype="bfloat16")`, the PyTorch
peers (benchmarks/torch_peers.py) with `AutoModelForCausalLM.from_pretrained(dir)`.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import zlib

import torch
import transformers
from transformers import (GPT2Config, GPT2LMHeadModel, LlamaConfig,
                          LlamaForCausalLM)

INIT_STD = 0.02
LLAMA3_EOS = [128001, 128008, 128009]


def gpt2_config(hidden: int, layers: int, heads: int, *, vocab: int = 50257,
                positions: int = 1024) -> GPT2Config:
  """GPT-2 shapes (GELU-tanh MLP 4x wide, tied head, learned positions)."""
  end_of_text = vocab - 1
  return GPT2Config(vocab_size=vocab, n_positions=positions, n_embd=hidden, n_layer=layers,
                    n_head=heads, n_inner=None, activation_function="gelu_new",
                    layer_norm_epsilon=1e-5, tie_word_embeddings=True,
                    bos_token_id=end_of_text, eos_token_id=end_of_text)


def llama_config(hidden: int, layers: int, heads: int, kv_heads: int, head_dim: int,
                 intermediate: int, *, vocab: int = 128256, max_positions: int = 131072,
                 rope_factor: float = 32.0, original_max_positions: int = 8192,
                 bos: int = 128000, eos: list[int] | None = None) -> LlamaConfig:
  """Llama-3 shapes: RoPE with llama3 frequency scaling, RMSNorm, SwiGLU, GQA, tied head."""
  rope_parameters = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": rope_factor,
                     "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": original_max_positions}
  return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                     num_hidden_layers=layers, num_attention_heads=heads,
                     num_key_value_heads=kv_heads, head_dim=head_dim, hidden_act="silu",
                     max_position_embeddings=max_positions, rms_norm_eps=1e-5,
                     tie_word_embeddings=True, attention_bias=False, mlp_bias=False,
                     rope_parameters=rope_parameters, bos_token_id=bos,
                     eos_token_id=LLAMA3_EOS if eos is None else eos)


# name -> (model class, config factory)
FULL_MODELS = {
    "gpt2": (GPT2LMHeadModel, lambda: gpt2_config(768, 12, 12)),
    "gpt2-large": (GPT2LMHeadModel, lambda: gpt2_config(1280, 36, 20)),
    "llama-3.2-1b": (LlamaForCausalLM, lambda: llama_config(2048, 16, 32, 8, 64, 8192)),
}
SMOKE_MODELS = {
    "smoke-gpt2": (GPT2LMHeadModel, lambda: gpt2_config(64, 2, 4, vocab=512, positions=256)),
    "smoke-llama": (LlamaForCausalLM, lambda: llama_config(
        64, 2, 4, 2, 16, 160, vocab=512, max_positions=256, rope_factor=8.0,
        original_max_positions=64, bos=0, eos=[1])),
}


def is_norm(module: torch.nn.Module) -> bool:
  """LayerNorm (GPT-2) or RMSNorm (Llama): gains start at 1, biases at 0."""
  return isinstance(module, torch.nn.LayerNorm) or type(module).__name__.endswith("RMSNorm")


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int) -> None:
  """Overwrite every parameter from one seeded CPU generator (norm gain 1, else N(0, 0.02)).

  Parameters are visited in `named_parameters` order (a tied weight once), and each is drawn in
  float32 and then cast, so the values do not depend on the model's dtype or on how transformers
  initialised the module.
  """
  torch.manual_seed(seed)
  generator = torch.Generator().manual_seed(seed)
  norm_parameters = {id(p) for m in model.modules() if is_norm(m) for p in m.parameters(False)}
  for name, parameter in model.named_parameters():
    if id(parameter) in norm_parameters:
      parameter.fill_(1.0 if name.endswith("weight") else 0.0)
    else:
      values = torch.randn(parameter.shape, generator=generator, dtype=torch.float32) * INIT_STD
      parameter.copy_(values.to(parameter.dtype))


def fingerprint(model: torch.nn.Module) -> str:
  """CRC32 over every parameter's bytes (in float32), to compare checkpoints across machines."""
  crc = 0
  for _, parameter in model.named_parameters():
    crc = zlib.crc32(parameter.detach().float().numpy().tobytes(), crc)
  return f"{crc:08x}"


def write_checkpoint(name: str, model_class, config, out_dir: str, seed: int,
                     dtype: torch.dtype) -> dict:
  """Build, randomise and save one model; returns a summary (path, parameters, fingerprint)."""
  start = time.perf_counter()
  model = model_class(config).to(dtype)
  randomize(model, seed)
  if config.tie_word_embeddings:
    head, embedding = model.get_output_embeddings().weight, model.get_input_embeddings().weight
    assert head.data_ptr() == embedding.data_ptr(), f"{name}: output head is not tied"
  path = os.path.join(out_dir, name)
  os.makedirs(path, exist_ok=True)
  model.save_pretrained(path)
  summary = dict(name=name, path=path, architecture=model_class.__name__,
                 parameters=model.num_parameters(), dtype=str(dtype).removeprefix("torch."),
                 seed=seed, init_std=INIT_STD, fingerprint=fingerprint(model),
                 transformers_version=transformers.__version__, torch_version=torch.__version__)
  with open(os.path.join(path, "checkpoint_info.json"), "w") as f:
    json.dump(summary, f, indent=2)
  summary["seconds"] = round(time.perf_counter() - start, 1)
  return summary


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--out-dir", required=True, help="checkpoints go to <out-dir>/<name>/")
  parser.add_argument("--models", default=None,
                      help=f"comma-separated subset of {','.join(FULL_MODELS)} "
                           f"(with --smoke: {','.join(SMOKE_MODELS)}); default all")
  parser.add_argument("--smoke", action="store_true",
                      help="write tiny GPT-2 and Llama checkpoints (2 layers, hidden 64) instead")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
  args = parser.parse_args()
  catalogue = SMOKE_MODELS if args.smoke else FULL_MODELS
  names = args.models.split(",") if args.models else list(catalogue)
  unknown = [n for n in names if n not in catalogue]
  if unknown:
    parser.error(f"unknown model(s) {unknown}; known: {', '.join(catalogue)}")
  dtype = getattr(torch, args.dtype)
  for name in names:
    model_class, make_config = catalogue[name]
    summary = write_checkpoint(name, model_class, make_config(), args.out_dir, args.seed, dtype)
    print(f"{name:14s} {summary['parameters'] / 1e6:8.1f} M parameters  {summary['dtype']}  "
          f"fingerprint {summary['fingerprint']}  {summary['seconds']:.1f} s  -> {summary['path']}",
          flush=True)


if __name__ == "__main__":
  main()
