"""The fused decode linear kernel (norm -> matmul -> bias -> activation / gated unit -> residual)
in interpret mode against a float64 NumPy reference."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cg_jax.kernels.fused_linear import (FusedLinearConfig, default_config, fused_linear,
                                         fused_linear_reference)
from tests.kernels.kernel_test_base import assert_kernel_close, lower_for_h200, random_array

SMALL = FusedLinearConfig(block_n=16, block_k=32)


@dataclasses.dataclass(frozen=True)
class Case:
  rows: int
  hidden: int
  width: int
  norm: str | None = None
  bias: bool = False
  activation: str | None = None
  gated: bool = False
  residual: bool = False
  dtype: str = "float32"

  def __str__(self):
    parts = [f"r{self.rows}", f"k{self.hidden}", f"n{self.width}", str(self.norm),
             str(self.activation), self.dtype]
    parts += [flag for flag in ("bias", "gated", "residual") if getattr(self, flag)]
    return "-".join(parts)


CASES = [
    Case(1, 64, 48),                                              # a plain product, one row
    Case(3, 96, 64, norm="layer", bias=True),                     # GPT-2 QKV: LayerNorm + bias
    Case(8, 64, 32, bias=True, residual=True),                    # out projection + residual
    Case(1, 64, 128, norm="layer", bias=True, activation="gelu_tanh"),   # GPT-2 MLP in
    Case(20, 128, 64, norm="rms"),                                # Llama QKV (rows padded to 32)
    Case(2, 64, 96, norm="rms", activation="silu", gated=True),   # Llama SwiGLU
    Case(5, 64, 64, norm="rms", bias=True, activation="gelu", gated=True, residual=True),
    Case(1, 64, 48, norm="layer", bias=True, dtype="bfloat16"),
    Case(4, 128, 64, norm="rms", activation="silu", gated=True, dtype="bfloat16"),
    Case(3, 64, 32, bias=True, residual=True, dtype="bfloat16"),
]


def _inputs(case: Case, seed: int = 0):
  rng = np.random.default_rng(seed)
  out_width = case.width // 2 if case.gated else case.width
  x = random_array(rng, (case.rows, case.hidden), case.dtype)
  # ~unit-variance outputs: weights scaled by 1/sqrt(K)
  w = (random_array(rng, (case.hidden, case.width), "float32") / math.sqrt(case.hidden))
  w = w.astype(case.dtype)
  options = dict(norm=case.norm, activation=case.activation, gated=case.gated)
  if case.norm:
    options["norm_scale"] = (1.0 + 0.2 * random_array(rng, (case.hidden,), "float32")).astype(
        case.dtype)
  if case.norm == "layer":
    options["norm_bias"] = 0.2 * random_array(rng, (case.hidden,), case.dtype)
  if case.bias:
    options["bias"] = 0.2 * random_array(rng, (case.width,), case.dtype)
  if case.residual:
    options["residual"] = random_array(rng, (case.rows, out_width), case.dtype)
  return x, w, options


def _gelu_tanh(x):
  return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))


def float64_reference(x, w, *, norm=None, norm_scale=None, norm_bias=None, eps=1e-5, bias=None,
                      activation=None, gated=False, residual=None):
  erf = np.vectorize(math.erf)
  f64 = lambda a: None if a is None else np.asarray(a, np.float64)  # noqa: E731
  x, w, norm_scale, norm_bias, bias, residual = map(f64, (x, w, norm_scale, norm_bias, bias,
                                                          residual))
  if norm == "layer":
    centred = x - x.mean(-1, keepdims=True)
    x = centred / np.sqrt((centred ** 2).mean(-1, keepdims=True) + eps) * norm_scale + norm_bias
  elif norm == "rms":
    x = x / np.sqrt((x ** 2).mean(-1, keepdims=True) + eps) * norm_scale
  y = x @ w
  if bias is not None:
    y = y + bias
  act = {None: lambda v: v, "gelu_tanh": _gelu_tanh,
         "gelu": lambda v: 0.5 * v * (1 + erf(v / np.sqrt(2))),
         "silu": lambda v: v / (1 + np.exp(-v))}[activation]
  if gated:
    gate, up = np.split(y, 2, axis=-1)
    y = act(gate) * up
  else:
    y = act(y)
  return y if residual is None else residual + y


@pytest.mark.parametrize("case", CASES, ids=str)
def test_kernel_matches_float64_reference(case):
  x, w, options = _inputs(case)
  out = fused_linear(x, w, config=SMALL, interpret=True, **options)
  assert out.dtype == jnp.dtype(case.dtype)
  reference = float64_reference(x, w, **options)
  assert_kernel_close(out, reference, case.dtype, what=f"fused_linear[{case}]")
  # The jnp fallback computes the same function.
  assert_kernel_close(fused_linear_reference(x, w, **options), reference, case.dtype,
                      what=f"fused_linear_reference[{case}]")


@pytest.mark.parametrize("offset", [30.0, 300.0, 3000.0])
def test_layer_norm_of_offset_rows_is_accurate(offset):
  """Rows with a large mean (|mean| >> std, as in GPT-2 residual streams): the kernel's error
  against float64 is no worse than the unfused XLA path's (which is what float32 inputs allow;
  a variance taken as E[x^2] - mean^2 would be far worse), and within 1e-5 at offset 30."""
  case = Case(2, 128, 32, norm="layer")
  x, w, options = _inputs(case, seed=5)
  x = x + offset
  reference = float64_reference(x, w, **options)
  scale = np.max(np.abs(reference))
  kernel_error = np.max(np.abs(np.asarray(
      fused_linear(x, w, config=SMALL, interpret=True, **options), np.float64) - reference))
  xla_error = np.max(np.abs(np.asarray(fused_linear_reference(x, w, **options), np.float64)
                            - reference))
  assert kernel_error <= 1.5 * xla_error + 1e-7 * scale, (kernel_error, xla_error)
  if offset <= 30:
    assert kernel_error <= 1e-5 * scale


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_stacked_weights_with_layer_read_that_layer_in_place(family):
  """w [L, K, N] and vectors [L, ...] with a static layer equal the call on that layer's slices."""
  rng = np.random.default_rng(5)
  layers, rows, hidden, width = 3, 2, 64, 96
  x = random_array(rng, (rows, hidden), "float32")
  w = random_array(rng, (layers, hidden, width), "float32") / 8
  options = (dict(norm="layer", activation="gelu_tanh") if family == "gpt2"
             else dict(norm="rms", activation="silu", gated=True))
  stacked = dict(norm_scale=random_array(rng, (layers, hidden), "float32"))
  if family == "gpt2":
    stacked["norm_bias"] = random_array(rng, (layers, hidden), "float32")
    stacked["bias"] = random_array(rng, (layers, width), "float32")
  for layer in range(layers):
    sliced = {name: value[layer] for name, value in stacked.items()}
    expected = fused_linear(x, w[layer], config=SMALL, interpret=True, **options, **sliced)
    got = fused_linear(x, w, layer=layer, config=SMALL, interpret=True, **options, **stacked)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))
  with pytest.raises(ValueError, match="layer must be in"):
    fused_linear(x, w, layer=3, interpret=True, **options, **stacked)
  with pytest.raises(ValueError, match="same L"):
    fused_linear(x, w[:2], layer=0, interpret=True, **options, **stacked)


def test_padded_rows_do_not_change_real_rows():
  """Row r of a 3-row call equals the same row computed alone (rows are independent)."""
  case = Case(3, 64, 48, norm="rms", bias=True, residual=True)
  x, w, options = _inputs(case, seed=3)
  together = np.asarray(fused_linear(x, w, config=SMALL, interpret=True, **options))
  for row in range(3):
    alone_options = dict(options, residual=options["residual"][row:row + 1])
    alone = fused_linear(x[row:row + 1], w, config=SMALL, interpret=True, **alone_options)
    np.testing.assert_allclose(np.asarray(alone)[0], together[row], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_lowers_for_h200(dtype, family):
  """Each projection of a Llama-3.2-1B / GPT-2 layer lowers to Triton for an abstract H200."""
  spec = lambda *shape: jax.ShapeDtypeStruct(shape, dtype)  # noqa: E731
  if family == "llama":
    hidden, width, norm, bias, activation, gated = 2048, 16384, "rms", False, "silu", True
  else:
    hidden, width, norm, bias, activation, gated = 768, 3072, "layer", True, "gelu_tanh", False
  out_width = width // 2 if gated else width

  def mlp_in(x, w, scale, shift, b):
    return fused_linear(x, w, norm=norm, norm_scale=scale, norm_bias=shift if norm == "layer"
                        else None, bias=b if bias else None, activation=activation, gated=gated)

  def mlp_out(a, w, b, residual):
    return fused_linear(a, w, bias=b if bias else None, residual=residual)

  text = lower_for_h200(mlp_in, spec(1, hidden), spec(hidden, width), spec(hidden), spec(hidden),
                        spec(width))
  assert "triton" in text.lower()
  text = lower_for_h200(mlp_out, spec(8, out_width), spec(out_width, hidden), spec(hidden),
                        spec(8, hidden))
  assert "triton" in text.lower()


@pytest.mark.parametrize("change, error, match", [
    (dict(x=jnp.zeros((2, 3, 64))), ValueError, r"x must be \[rows, K\]"),
    (dict(w=jnp.zeros((32, 48))), ValueError, "x has 64 columns but w has 32 rows"),
    (dict(w=jnp.zeros((64, 48), jnp.bfloat16)), TypeError, "dtypes differ"),
    (dict(norm="batch"), ValueError, "norm must be one of"),
    (dict(norm="rms"), ValueError, "needs norm_scale"),
    (dict(activation="relu"), ValueError, "activation must be one of"),
    (dict(gated=True), ValueError, "gated needs"),
    (dict(bias=jnp.zeros((47,))), ValueError, r"bias must have shape \(48,\)"),
    (dict(residual=jnp.zeros((2, 47))), ValueError, r"residual must have shape \(2, 48\)"),
    (dict(w=jnp.zeros((64, 40))), ValueError, "multiples of 16"),
])
def test_bad_arguments(change, error, match):
  arguments = dict(x=jnp.zeros((2, 64)), w=jnp.zeros((64, 48)))
  arguments.update(change)
  x, w = arguments.pop("x"), arguments.pop("w")
  with pytest.raises(error, match=match):
    fused_linear(x, w, interpret=True, **arguments)


@pytest.mark.parametrize("hidden, width, gated, expected", [
    (768, 2304, False, (16, 256)),    # gpt2 QKV: 144 programs; K = 3 x 256
    (768, 768, False, (16, 256)),     # gpt2 out projection
    (3072, 768, False, (16, 512)),    # gpt2 MLP out: six 16 KB steps
    (2048, 8192, True, (64, 128)),    # llama-3.2-1b SwiGLU: gate + up tiles of 16 KB each
    (8192, 2048, False, (16, 512)),   # llama-3.2-1b MLP out
    (64, 48, False, (16, 64)),
])
def test_default_config_spreads_narrow_outputs(hidden, width, gated, expected):
  config = default_config(hidden, width, gated)
  assert (config.block_n, config.block_k) == expected


def test_config_validation():
  with pytest.raises(ValueError, match="block_n must be a power of two >= 16"):
    FusedLinearConfig(block_n=24)
  with pytest.raises(ValueError, match="num_warps must be a positive int"):
    FusedLinearConfig(num_warps=0)
