"""The Mosaic GPU row-times-weights kernel (`mosaic_gemv`) in the Mosaic GPU interpreter against a
float64 product: row counts that need padding, several column tiles, D split in parts, rings of
one to four slots, bfloat16 and float16; its validation; its lowering for an H200 at the model
projections' shapes."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cg_jax.kernels.mosaic_gemv import (INTERPRETER, MosaicGemvConfig, mosaic_gemv,
                                        mosaic_gemv_reference)
from tests.kernels.kernel_test_base import assert_kernel_close, lower_for_h200, random_array


@pytest.mark.skipif(not INTERPRETER, reason=f"no Mosaic GPU interpreter in jax {jax.__version__}")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("m,k,n,config", [
    (1, 256, 64, MosaicGemvConfig(block_k=64, max_concurrent_steps=2, splits=2)),
    (5, 512, 192, MosaicGemvConfig(block_k=64, max_concurrent_steps=2, splits=2)),
    (8, 1024, 128, MosaicGemvConfig()),  # (four steps in flight, four parts of K)
    (13, 512, 128, MosaicGemvConfig(block_k=128, max_concurrent_steps=3, splits=1)),
    (64, 128, 64, MosaicGemvConfig(block_k=64, max_concurrent_steps=1, splits=1)),
], ids=str)
def test_matches_the_float64_product(m, k, n, config, dtype):
  rng = np.random.default_rng(m + k + n)
  x, w = random_array(rng, (m, k), dtype), random_array(rng, (k, n), dtype)
  got = mosaic_gemv(x, w, config=config, interpret=True)
  assert got.shape == (m, n) and got.dtype == jnp.dtype(dtype)
  want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
  assert_kernel_close(got, want, dtype, "mosaic_gemv")
  assert_kernel_close(mosaic_gemv_reference(x, w), want, dtype, "reference")


@pytest.mark.skipif(not INTERPRETER, reason=f"no Mosaic GPU interpreter in jax {jax.__version__}")
def test_a_layer_of_stacked_weights_is_read_in_place():
  rng = np.random.default_rng(3)
  x, w = random_array(rng, (3, 256), "bfloat16"), random_array(rng, (3, 256, 128), "bfloat16")
  config = MosaicGemvConfig(block_k=64, max_concurrent_steps=2, splits=2)
  for layer in range(3):
    got = mosaic_gemv(x, w, jnp.int32(layer), config=config, interpret=True)
    want = np.asarray(x, np.float64) @ np.asarray(w[layer], np.float64)
    assert_kernel_close(got, want, "bfloat16", f"layer {layer}")


def test_bad_inputs_raise_naming_the_argument():
  x, w = jnp.ones((4, 512), jnp.bfloat16), jnp.ones((512, 128), jnp.bfloat16)
  call = functools.partial(mosaic_gemv, interpret=True)
  with pytest.raises(ValueError, match="agree on D"):
    call(x, w[:256])
  with pytest.raises(ValueError, match=r"\[L, D, O\] with one"):
    call(x, w[None])
  with pytest.raises(ValueError, match="bfloat16 or float16"):
    call(x.astype(jnp.float32), w.astype(jnp.float32))
  with pytest.raises(ValueError, match="1 to 64 rows"):
    call(jnp.ones((65, 512), jnp.bfloat16), w)
  with pytest.raises(ValueError, match="multiple of 64"):
    call(x, w[:, :100])
  with pytest.raises(ValueError, match="multiple of splits x block_k = 512"):
    call(x[:, :256], w[:256])
  with pytest.raises(ValueError, match="block_k must be 64 or 128"):
    MosaicGemvConfig(block_k=32)
  with pytest.raises(ValueError, match="splits must be a power of two"):
    MosaicGemvConfig(splits=3)


@pytest.mark.parametrize("m,k,n", [(1, 2048, 3072), (8, 8192, 2048), (8, 2048, 128256),
                                   (32, 768, 2304)], ids=str)
def test_lowers_to_mosaic_gpu_for_h200(m, k, n):
  config = MosaicGemvConfig(splits=2 if k < 1024 else 4)
  text = lower_for_h200(functools.partial(mosaic_gemv, config=config),
                        jax.ShapeDtypeStruct((m, k), jnp.bfloat16),
                        jax.ShapeDtypeStruct((k, n), jnp.bfloat16))
  assert "custom_call @mosaic_gpu" in text
