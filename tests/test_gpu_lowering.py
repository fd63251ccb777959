"""The engine's decode step and device loop with Pallas attention lower for an (abstract) H200
with every kernel as a Triton call: a CPU check that the GPU run will not fail at lowering."""

import re

import jax
import pytest

from cg_jax import Engine
from tests.kernels.kernel_test_base import lower_for_h200


@pytest.mark.parametrize("preset", ["tiny-gpt2", "tiny-llama"])
def test_decode_step_lowers_for_h200_with_fused_kernels(preset, monkeypatch):
  # Build and trace as on a GPU (kernels compiled, not interpreted), lower for CUDA.
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  engine = Engine.from_pretrained(preset, dtype="bfloat16", batch_buckets=(1, 4),
                                  prompt_buckets=(16,), max_seq_len=128, attention="pallas",
                                  layer_loop="unroll")
  layers = engine.model_config.num_layers
  fn, args, donate, _, _ = engine.executables.signature(("decode", 4, True))
  text = lower_for_h200(fn, *args, donate_argnums=donate)
  # One paged-attention kernel per layer (its decode specialization), a Triton call; nothing
  # interpreted.
  calls = re.findall(r"call @(ragged_paged_attention\w*)\(", text)
  assert len(calls) == layers, calls
  assert "custom_call @__gpu$xla.gpu.triton" in text
  # The cache write is part of the attention kernel (aliased caches): no scatter in the step.
  assert "stablehlo.scatter" not in text
