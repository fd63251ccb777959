"""The model with attention="pallas" (kernels interpreted on CPU) equals attention="xla"."""

import numpy as np
import pytest

from cg_jax import Engine
from models.attention import default_backend
from tests.helpers import RELATIVE_TOLERANCE, assert_close_relative


@pytest.mark.parametrize("model", ["tiny-gpt2", "tiny-llama"])
def test_pallas_and_xla_agree(model):
  xla = Engine.from_pretrained(model, attention="xla", batch_buckets=(2,), prompt_buckets=(16,),
                               max_seq_len=40)
  pallas = xla.with_options(attention="pallas")
  assert pallas.stats()["attention"] == "pallas"
  prompts = [[3, 14, 15, 92, 65, 35, 89, 79, 32], [38, 46]]
  expected = xla.generate(prompts, max_new_tokens=12, eos_token_id=[])
  assert pallas.generate(prompts, max_new_tokens=12, eos_token_id=[]) == expected
  # Unrolled layers pass the stacked cache and a static layer to the kernel (no slice copy).
  unrolled = xla.with_options(attention="pallas", layer_loop="unroll")
  assert unrolled.generate(prompts, max_new_tokens=12, eos_token_id=[]) == expected
  # ... whose new keys/values the kernel stores itself ("fused"), or XLA scatters first.
  assert unrolled.stats()["cache_write"] == "fused"
  scattered = unrolled.with_options(cache_write="scatter")
  assert scattered.generate(prompts, max_new_tokens=12, eos_token_id=[]) == expected
  tokens = np.random.default_rng(0).integers(0, 263, (2, 21)).tolist()
  assert_close_relative(pallas.logits(tokens), xla.logits(tokens), RELATIVE_TOLERANCE["float32"],
                        "pallas logits")


def test_cpu_default_is_xla():
  assert default_backend() == "xla"
  assert Engine.from_pretrained("tiny-gpt2").stats()["attention"] == "xla"
