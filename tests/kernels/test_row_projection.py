"""The row projection (interpret mode) and its jnp reference against a float64 NumPy projection,
for every fusion the decoder uses (RMSNorm / LayerNorm before, bias, activation, gated MLP,
residual after), in one split and in several, at row counts that pad to the dot's minimum and
past it; rows independent of the others; validation; lowering for an H200."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cg_jax.kernels.row_projection import (MAX_ROWS, RowProjectionConfig, num_splits,
                                           padded_rows, row_projection, row_projection_reference,
                                           supports)
from tests.kernels.kernel_test_base import assert_kernel_close, lower_for_h200, random_array

ONE_SPLIT = RowProjectionConfig(block_n=16, block_k=32, min_programs=0)
SPLITS = RowProjectionConfig(block_n=16, block_k=32, min_programs=64, max_splits=4)
LAYERS, LAYER = 3, 1


@dataclasses.dataclass(frozen=True)
class Case:
  dtype: str
  rows: int
  inputs: int = 128
  outputs: int = 64
  norm: str | None = None
  bias: bool = False
  residual: bool = False
  activation: str | None = None
  gated: bool = False
  config: RowProjectionConfig = ONE_SPLIT

  def __str__(self):
    parts = [self.dtype, f"M{self.rows}", f"{self.inputs}x{self.outputs}", str(self.norm)]
    parts += [name for name in ("bias", "residual", "gated") if getattr(self, name)]
    parts += [str(self.activation), "splits" if self.config is SPLITS else "one"]
    return "-".join(parts)


CASES = [
    # the plain product; rows below, at and past the dot's 16
    Case("float32", 1), Case("bfloat16", 16), Case("float32", 33, config=SPLITS),
    # Llama's attention input: RMSNorm then QKV
    Case("float32", 5, norm="rms"), Case("bfloat16", 8, norm="rms", config=SPLITS),
    # Llama's output and down projections: the residual after
    Case("float32", 3, residual=True), Case("bfloat16", 8, residual=True, config=SPLITS),
    # Llama's gate/up: RMSNorm, then SiLU(gate) * up
    Case("float32", 7, norm="rms", activation="silu", gated=True),
    Case("bfloat16", 16, norm="rms", activation="silu", gated=True, config=SPLITS),
    # GPT-2: LayerNorm with its bias, the projection's bias, GELU (tanh); bias + residual
    Case("float32", 4, norm="layer", bias=True, activation="gelu_tanh"),
    Case("bfloat16", 9, norm="layer", bias=True, activation="gelu_tanh", config=SPLITS),
    Case("float32", 6, bias=True, residual=True, config=SPLITS),
    Case("bfloat16", 2, norm="layer", bias=True, activation="gelu_tanh", gated=True),
]


def _inputs(case: Case, seed: int = 0):
  rng = np.random.default_rng(seed)
  width = case.outputs // 2 if case.gated else case.outputs
  arrays = {
      "x": random_array(rng, (case.rows, case.inputs), case.dtype),
      # scaled so the products stay O(1) and the activations see both signs
      "w": random_array(rng, (LAYERS, case.inputs, case.outputs), case.dtype)
      * (1 / math.sqrt(case.inputs)),
  }
  kwargs = dict(norm=case.norm, activation=case.activation, gated=case.gated, eps=1e-5)
  if case.norm:
    kwargs["norm_scale"] = random_array(rng, (LAYERS, case.inputs), case.dtype)
  if case.norm == "layer":
    kwargs["norm_bias"] = random_array(rng, (LAYERS, case.inputs), case.dtype)
  if case.bias:
    kwargs["bias"] = random_array(rng, (LAYERS, case.outputs), case.dtype)
  if case.residual:
    kwargs["residual"] = random_array(rng, (case.rows, width), case.dtype)
  return arrays, kwargs


def _float64(x, w, *, norm, norm_scale=None, norm_bias=None, eps, bias=None, residual=None,
             activation, gated):
  """The projection in float64 NumPy, no intermediate rounding."""
  x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)[LAYER]
  if norm is not None:
    mean = x.mean(-1, keepdims=True) if norm == "layer" else 0.0
    x = (x - mean) / np.sqrt(np.mean((x - mean) ** 2, -1, keepdims=True) + eps)
    x = x * np.asarray(norm_scale, np.float64)[LAYER]
    if norm == "layer":
      x = x + np.asarray(norm_bias, np.float64)[LAYER]
  y = x @ w
  if bias is not None:
    y = y + np.asarray(bias, np.float64)[LAYER]
  act = {"silu": lambda u: u / (1 + np.exp(-u)),
         "gelu_tanh": lambda u: 0.5 * u * (1 + np.tanh(math.sqrt(2 / math.pi)
                                                       * (u + 0.044715 * u ** 3))),
         None: lambda u: u}[activation]
  if gated:
    half = y.shape[-1] // 2
    y = act(y[:, :half]) * y[:, half:]
  else:
    y = act(y)
  return y if residual is None else y + np.asarray(residual, np.float64)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_against_float64(case):
  arrays, kwargs = _inputs(case)
  reference = _float64(arrays["x"], arrays["w"], **kwargs)
  out = row_projection(arrays["x"], arrays["w"], jnp.int32(LAYER), config=case.config,
                       interpret=True, **kwargs)
  assert out.dtype == jnp.dtype(case.dtype)
  assert_kernel_close(out, reference, case.dtype, f"row_projection {case}")
  jnp_out = row_projection_reference(arrays["x"], arrays["w"], LAYER, **kwargs)
  assert_kernel_close(jnp_out, reference, case.dtype, f"reference {case}")


def test_cases_cover_splits():
  """The split cases run several splits, the others one (so both paths are the tests')."""
  for case in CASES:
    width = case.outputs // 2 if case.gated else case.outputs
    splits = num_splits(case.inputs, width // case.config.block_n, case.config)
    assert (splits > 1) == (case.config is SPLITS), case


@pytest.mark.parametrize("config", [ONE_SPLIT, SPLITS], ids=["one", "splits"])
def test_rows_independent(config):
  """A row's result is the same bits whatever rows come with it (M 3 or 24, other values)."""
  case = Case("bfloat16", 24, norm="rms", residual=False, config=config)
  arrays, kwargs = _inputs(case)
  full = row_projection(arrays["x"], arrays["w"], LAYER, config=config, interpret=True, **kwargs)
  others = arrays["x"].at[3:].set(-arrays["x"][3:])
  few = row_projection(others[:3], arrays["w"], LAYER, config=config, interpret=True, **kwargs)
  np.testing.assert_array_equal(np.asarray(full[:3], np.float32), np.asarray(few, np.float32))


def test_layer_selects_weights():
  """Another layer index reads another layer's weights (a kernel reading layer 0 fails)."""
  case = Case("float32", 4, norm="rms")
  arrays, kwargs = _inputs(case)
  one = row_projection(arrays["x"], arrays["w"], 1, config=ONE_SPLIT, interpret=True, **kwargs)
  two = row_projection(arrays["x"], arrays["w"], 2, config=ONE_SPLIT, interpret=True, **kwargs)
  reference = row_projection_reference(arrays["x"], arrays["w"], 2, **kwargs)
  assert_kernel_close(two, reference, "float32")
  assert not np.allclose(np.asarray(one), np.asarray(two))


def test_helpers():
  assert [padded_rows(m) for m in (1, 8, 16, 17, 33, 64)] == [16, 16, 16, 32, 64, 64]
  config = RowProjectionConfig(block_n=64, block_k=128, min_programs=264, max_splits=8)
  # llama-3.2-1b: QKV 48 column blocks -> 8 splits; gate/up 128 -> 4; down 32 over 8192 -> 8
  assert num_splits(2048, 48, config) == 8
  assert num_splits(2048, 128, config) == 4
  assert num_splits(8192, 32, config) == 8
  assert num_splits(256, 32, config) == 2  # no split smaller than block_k
  assert supports(8, 2048, 3072, config) and supports(MAX_ROWS, 2048, 16384, config, gated=True)
  assert not supports(MAX_ROWS + 1, 2048, 3072, config)
  assert not supports(8, 2000, 3072, config) and not supports(8, 2048, 3000, config)
  assert supports(8, 2048, 3072, config, activation="gelu_tanh")
  assert not supports(8, 2048, 3072, config, activation="gelu")  # erfc: no Triton lowering


@pytest.mark.parametrize("kwargs, match", [
    (dict(block_n=48), "block_n must be a positive power of two"),
    (dict(block_k=8), "block_k must be >= 16"),
    (dict(max_splits=3), "max_splits must be a positive power of two"),
    (dict(min_programs=-1), "min_programs must be an int >= 0"),
    (dict(num_stages=0), "num_stages must be an int >= 1"),
])
def test_config_validation(kwargs, match):
  with pytest.raises(ValueError, match=match):
    RowProjectionConfig(**kwargs)


def test_validation():
  x = jnp.zeros((4, 64), jnp.float32)
  w = jnp.zeros((2, 64, 32), jnp.float32)
  call = dict(config=ONE_SPLIT, interpret=True)
  with pytest.raises(ValueError, match="stacked w"):
    row_projection(x, w[0], 0, **call)
  with pytest.raises(ValueError, match="1 to 64 rows"):
    row_projection(jnp.zeros((65, 64)), w, 0, **call)
  with pytest.raises(ValueError, match="share a dtype"):
    row_projection(x.astype(jnp.bfloat16), w, 0, **call)
  with pytest.raises(ValueError, match="norm='rms' takes norm_scale"):
    row_projection(x, w, 0, norm="rms", **call)
  with pytest.raises(ValueError, match="gated projection needs an activation"):
    row_projection(x, w, 0, gated=True, **call)
  with pytest.raises(ValueError, match="residual must be"):
    row_projection(x, w, 0, residual=jnp.zeros((4, 16)), **call)
  with pytest.raises(ValueError, match="multiple of block_n"):
    row_projection(x, jnp.zeros((2, 64, 24)), 0, **call)


def test_lowers_for_h200():
  """The Triton lowering of Llama's gate/up and down shapes at 8 rows (no GPU needed)."""
  bf16 = jnp.bfloat16
  for inputs, outputs, kwargs in ((2048, 16384, dict(gated=True, activation="silu")),
                                  (8192, 2048, {})):
    def call(x, w, scale, kwargs=kwargs):
      return row_projection(x, w, jnp.int32(3), norm="rms" if kwargs else None,
                            norm_scale=scale if kwargs else None, **kwargs)
    text = lower_for_h200(call, jax.ShapeDtypeStruct((8, inputs), bf16),
                          jax.ShapeDtypeStruct((16, inputs, outputs), bf16),
                          jax.ShapeDtypeStruct((16, inputs), bf16))
    assert "triton" in text and "row_projection" in text
