"""The engine's decode and prompt steps with Pallas attention lower for an (abstract) H200 with
every kernel as a Triton call and no loop outside the kernels: a CPU check that the GPU run will
not fail at lowering, nor run a loop of small kernels per step."""

import re

import jax
import pytest

from cg_jax import Engine
from tests.kernels.kernel_test_base import lower_for_h200


def _gpu_engine(preset, monkeypatch):
  # Build and trace as on a GPU (kernels compiled, not interpreted), lower for CUDA.
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  return Engine.from_pretrained(preset, dtype="bfloat16", batch_buckets=(1, 4),
                                prompt_buckets=(16,), max_seq_len=128, attention="pallas",
                                layer_loop="unroll")


def _lowered(engine, key) -> str:
  fn, args, donate, _, _ = engine.executables.signature(key)
  return lower_for_h200(fn, *args, donate_argnums=donate)


@pytest.mark.parametrize("preset", ["tiny-gpt2", "tiny-llama"])
def test_decode_step_lowers_for_h200_with_fused_kernels(preset, monkeypatch):
  engine = _gpu_engine(preset, monkeypatch)
  layers = engine.model_config.num_layers
  # The decode-sized step (8 tokens over 4 rows).
  text = _lowered(engine, ("step", 8))
  # One paged-attention kernel per layer, a Triton call; nothing interpreted.
  calls = re.findall(r"call @(ragged_paged_attention\w*)\(", text)
  assert len(calls) == layers, calls
  assert "custom_call @__gpu$xla.gpu.triton" in text
  # The cache write is part of the attention kernel (aliased caches): no scatter in the step.
  assert "stablehlo.scatter" not in text
  assert "stablehlo.while" not in text  # (no loop outside the kernels, as the prompt steps)


def test_prompt_steps_lower_without_loops(monkeypatch):
  """A step's token layout (each token's sequence, the kernel's tiles) is computed without a
  while loop (`jnp.searchsorted`'s default method is one: a loop of small kernels per step,
  results/unified_step_h200.md)."""
  engine = _gpu_engine("tiny-llama", monkeypatch)
  for key in (("step", 16), ("step", engine.config.token_buckets[-1])):
    text = _lowered(engine, key)
    assert "custom_call @__gpu$xla.gpu.triton" in text
    assert "stablehlo.while" not in text, key
