"""The engine's decode step and device loop, with Pallas attention and fused Pallas projections,
lower for an (abstract) H200 with every kernel as a Triton call: a CPU check that the GPU run
will not fail at lowering."""

import re

import jax
import jax.numpy as jnp
import pytest

from cg_jax import Engine
from cg_jax.steps import LoopState
from tests.kernels.kernel_test_base import lower_for_h200


@pytest.mark.parametrize("preset", ["tiny-gpt2", "tiny-llama"])
def test_decode_step_lowers_for_h200_with_fused_kernels(preset, monkeypatch):
  engine = Engine.from_pretrained(preset, dtype="bfloat16", batch_buckets=(1, 4),
                                  prompt_buckets=(16,), max_seq_len=128, attention="pallas",
                                  linear="pallas", layer_loop="unroll")
  layers = engine.model_config.num_layers
  # Trace as on a GPU (no interpreter), lower for CUDA.
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  weights, cache = engine._specs()
  i32 = jax.ShapeDtypeStruct((4,), jnp.int32)
  decode = lower_for_h200(engine._steps.decode, weights, cache, i32, i32, None,
                          donate_argnums=(1, 2, 3))
  loop = lower_for_h200(engine._steps.decode_loop, weights, cache, LoopState.spec(4),
                        jax.ShapeDtypeStruct((8,), jnp.int32), None, donate_argnums=(1, 2))
  for text in (decode, loop):
    # The four projection kernels (one lowered function each, called once per layer with the
    # layer index as an operand: the weights are read in place from the stacked arrays) and the
    # decode-attention kernel, all Triton calls; nothing interpreted.
    calls = re.findall(r"call @(_fused_linear\w*|decode_attention\w*)\(", text)
    assert sum(c.startswith("_fused_linear") for c in calls) == 4 * layers, calls
    assert sum(c.startswith("decode_attention") for c in calls) == layers, calls
    assert text.count('name = "fused_linear"') == 4
    assert text.count("custom_call @__gpu$xla.gpu.triton") >= 5
  # The cache write is part of the attention kernel (aliased caches): no scatter in the step
  # (the device loop has its own, for its [B, K] token buffer).
  assert "stablehlo.scatter" not in decode


def test_decode_step_with_qkv_in_the_kernel_lowers_for_h200(monkeypatch):
  """decode_qkv="kernel" on tiny-llama: one decode-attention Triton call per layer, and RoPE's
  angles computed once per step (the kernel rotates; "xla" rotates q and k in every layer); with
  decode_combine="pallas" also one split-combine call per layer (the cache has 2 splits)."""
  engine = Engine.from_pretrained("tiny-llama", dtype="bfloat16", batch_buckets=(1, 4),
                                  prompt_buckets=(16,), max_seq_len=128, attention="pallas",
                                  layer_loop="unroll", decode_qkv="kernel")
  layers = engine.model_config.num_layers
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  i32 = jax.ShapeDtypeStruct((4,), jnp.int32)
  texts = {}
  for name, options in (("kernel", dict(decode_qkv="kernel")), ("xla", dict(decode_qkv="xla")),
                        ("combine", dict(decode_qkv="kernel", decode_combine="pallas"))):
    steps = engine.with_options(**options)._steps
    texts[name] = lower_for_h200(steps.decode, *engine._specs(), i32, i32, None,
                                 donate_argnums=(1, 2, 3))
  calls = re.findall(r"call @(decode_attention\w*)\(", texts["kernel"])
  assert len(calls) == layers, calls
  assert "custom_call @__gpu$xla.gpu.triton" in texts["kernel"]
  assert texts["kernel"].count("stablehlo.cosine") == 1
  assert texts["xla"].count("stablehlo.cosine") == 2 * layers
  combines = {name: re.findall(r"call @(split_combine\w*)\(", text)
              for name, text in texts.items()}
  assert not combines["kernel"] and len(combines["combine"]) == layers, combines
