"""Fused decode-time linear layer: [norm ->] matmul [-> bias -> activation / gated unit]
[-> + residual] in one kernel, for the few rows of a decode step.

A decode step multiplies a handful of rows (the batch) by every weight matrix. XLA turns a
single-row product into a multiply-and-reduce pair of fusions and keeps the norms, biases,
activations and residual adds in kernels of their own. Here one program per block of
`block_n` output columns streams its [K, block_n] slab of the weight in `block_k` steps:
  1. (norm) a first pass over the row computes the RMS (two passes, mean then variance, for
     LayerNorm); the tiny input stays in cache, so the extra reads are cheap;
  2. each step normalises its [rows, block_k] slice of the input on the fly and accumulates
     the product in float32 (gated units keep two accumulators, gate and up columns);
  3. the epilogue adds the bias, applies the activation (or act(gate) * up) and the residual,
     and writes [rows, block_n].
Rows are handled as a power of two >= 16 (Triton dots need 16) through masked loads and stores:
the extra rows read as zeros and are never written, so no padding copy runs outside the kernel. The norm follows `models.decoder._norm` (float32 statistics; LayerNorm's
affine in float32, RMSNorm's scale applied after the cast back, as Llama does).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from cg_jax.kernels.blocks import MIN_DOT_DIM, is_power_of_two

NORMS = (None, "rms", "layer")
ACTIVATIONS = (None, "gelu_tanh", "gelu", "silu")


@dataclasses.dataclass(frozen=True)
class FusedLinearConfig:
  """Launch settings: output columns per program, reduction step, Triton warps and stages."""

  block_n: int = 64
  block_k: int = 128
  num_warps: int = 4
  num_stages: int = 3

  def __post_init__(self):
    for name in ("block_n", "block_k"):
      value = getattr(self, name)
      if not is_power_of_two(value) or value < MIN_DOT_DIM:
        raise ValueError(f"FusedLinearConfig.{name} must be a power of two >= {MIN_DOT_DIM}, "
                         f"got {value!r}")
    for name in ("num_warps", "num_stages"):
      value = getattr(self, name)
      if not isinstance(value, int) or value < 1:
        raise ValueError(f"FusedLinearConfig.{name} must be a positive int, got {value!r}")


# Weight bytes one program loads per reduction step (per pipeline stage): enough loads in
# flight per SM to cover HBM latency, few enough stages to fit shared memory.
_STEP_WEIGHT_BYTES = 32 * 1024


def default_config(hidden: int, width: int, gated: bool = False,
                   itemsize: int = 2) -> FusedLinearConfig:
  """A launch config for a [hidden -> width] projection: the widest column block (up to 64) that
  still gives ~100 programs, so narrow projections spread over the GPU's 132 SMs; then the
  longest reduction step (up to 512, dividing `hidden`) whose weight tile stays within 32 KB, so
  each program streams its slab in a few large loads rather than many latency-bound ones."""
  block_n = 64
  while block_n > MIN_DOT_DIM and width // block_n < 96:
    block_n //= 2
  tile_bytes_per_k = block_n * itemsize * (2 if gated else 1)
  block_k = 512
  while block_k > MIN_DOT_DIM and (hidden % block_k or block_k * tile_bytes_per_k
                                   > _STEP_WEIGHT_BYTES):
    block_k //= 2
  return FusedLinearConfig(block_n=block_n, block_k=block_k)


def _activate(x, activation: str | None):
  if activation is None:
    return x
  if activation == "gelu_tanh":
    return jax.nn.gelu(x, approximate=True)
  if activation == "gelu":
    return jax.nn.gelu(x, approximate=False)
  return jax.nn.silu(x)


def _kernel(*refs, norm, eps, activation, gated, has_bias, has_residual, stacked, hidden,
            block_k, padded_rows, out_dtype):
  """refs: (layer [1] when `stacked`), x [R, K], w [K, bn] (and w_up [K, bn] when gated), then
  the optional norm scale [K] / norm bias [K], bias [bn] (and bias_up), residual [R, bn];
  output [R, bn]. With `stacked` the weight refs carry a leading [L] axis, indexed by the layer
  operand. Rows are handled as `padded_rows` (a power of two >= 16) with masked loads and
  stores."""
  refs = list(refs)
  layer = refs.pop(0)[0] if stacked else None

  def weight(ref, *index):
    """ref[index] of this layer's weights."""
    return ref[(layer,) + index] if stacked else ref[index]

  x_ref, w_ref = refs.pop(0), refs.pop(0)
  w_up_ref = refs.pop(0) if gated else None
  scale_ref = refs.pop(0) if norm else None
  shift_ref = refs.pop(0) if norm == "layer" else None
  bias_ref = refs.pop(0) if has_bias else None
  bias_up_ref = refs.pop(0) if has_bias and gated else None
  residual_ref = refs.pop(0) if has_residual else None
  (o_ref,) = refs
  rows = padded_rows
  real_rows = (jnp.arange(padded_rows) < x_ref.shape[0])[:, None]

  def load_rows(ref, columns):
    """[padded_rows, columns] of a [R, ...] ref; rows past R read as zeros."""
    return pltriton.load(ref.at[pl.ds(0, padded_rows), columns], mask=real_rows, other=0)

  steps = hidden // block_k
  dtype = x_ref.dtype
  precision = jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None

  mean = jnp.zeros((rows, 1), jnp.float32)
  rstd = jnp.ones((rows, 1), jnp.float32)
  if norm:
    def row_sum(transform):
      """sum over K of transform(x chunk) per row, in float32: [R]."""
      def add_chunk(step, total):
        # [R, block_k]
        chunk = load_rows(x_ref, pl.ds(step * block_k, block_k)).astype(jnp.float32)
        return total + jnp.sum(transform(chunk), axis=1)
      return jax.lax.fori_loop(0, steps, add_chunk, jnp.zeros((rows,), jnp.float32))

    # Two passes for LayerNorm (mean, then the centred squares), as `models.decoder._norm`
    # computes it; the row is tiny and stays in cache, so re-reading it is cheap.
    if norm == "layer":
      mean = (row_sum(lambda chunk: chunk) / hidden)[:, None]
    variance = (row_sum(lambda chunk: jnp.square(chunk - mean)) / hidden)[:, None]
    rstd = jax.lax.rsqrt(variance + eps)

  def body(step, accumulators):
    columns = pl.ds(step * block_k, block_k)
    # [R, block_k]
    x = load_rows(x_ref, columns)
    if norm == "layer":
      normed = (x.astype(jnp.float32) - mean) * rstd
      x = (normed * weight(scale_ref, columns).astype(jnp.float32)[None, :]
           + weight(shift_ref, columns).astype(jnp.float32)[None, :]).astype(dtype)
    elif norm == "rms":
      x = weight(scale_ref, columns)[None, :] * (x.astype(jnp.float32) * rstd).astype(dtype)
    # [R, bn] each
    out = [acc + jnp.dot(x, weight(w, columns, slice(None)), precision=precision,
                         preferred_element_type=jnp.float32)
           for acc, w in zip(accumulators, (w_ref, w_up_ref) if gated else (w_ref,))]
    return tuple(out)

  block_n = o_ref.shape[1]
  init = tuple(jnp.zeros((rows, block_n), jnp.float32) for _ in range(2 if gated else 1))
  accumulators = jax.lax.fori_loop(0, steps, body, init)
  # The epilogue step by step as the unfused layer computes it: each op in float32 (Triton has
  # no bfloat16 division), its result rounded to the input dtype.
  def op(fn, *values):
    return fn(*(v.astype(jnp.float32) for v in values)).astype(dtype)

  y = accumulators[0].astype(dtype)
  if has_bias:
    y = op(jnp.add, y, weight(bias_ref, slice(None))[None, :])
  y = op(functools.partial(_activate, activation=activation), y) if activation else y
  if gated:
    up = accumulators[1].astype(dtype)
    if has_bias:
      up = op(jnp.add, up, weight(bias_up_ref, slice(None))[None, :])
    y = op(jnp.multiply, y, up)
  if has_residual:
    y = op(jnp.add, load_rows(residual_ref, slice(None)), y)
  pltriton.store(o_ref.at[pl.ds(0, padded_rows), :], y.astype(out_dtype), mask=real_rows)


def _check(x, w, norm, norm_scale, norm_bias, bias, activation, gated, residual):
  if x.ndim != 2 or w.ndim != 2:
    raise ValueError(f"x must be [rows, K] and w [K, N]; got {x.shape} and {w.shape}")
  if x.shape[1] != w.shape[0]:
    raise ValueError(f"x has {x.shape[1]} columns but w has {w.shape[0]} rows")
  if x.dtype != w.dtype:
    raise TypeError(f"x and w dtypes differ: {x.dtype} vs {w.dtype}")
  if norm not in NORMS:
    raise ValueError(f"norm must be one of {NORMS}, got {norm!r}")
  if activation not in ACTIVATIONS:
    raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
  if (norm is None) != (norm_scale is None) or (norm == "layer") != (norm_bias is not None):
    raise ValueError(f"norm={norm!r} needs norm_scale (and norm_bias for 'layer' only)")
  if norm_scale is not None and norm_scale.shape != (x.shape[1],):
    raise ValueError(f"norm_scale must have shape ({x.shape[1]},), got {norm_scale.shape}")
  if norm_bias is not None and norm_bias.shape != (x.shape[1],):
    raise ValueError(f"norm_bias must have shape ({x.shape[1]},), got {norm_bias.shape}")
  if gated and (w.shape[1] % 2 or activation is None):
    raise ValueError(f"gated needs an even number of w columns ([gate | up]) and an activation; "
                     f"got {w.shape[1]} columns, activation={activation!r}")
  width = w.shape[1] // 2 if gated else w.shape[1]
  if bias is not None and bias.shape != (w.shape[1],):
    raise ValueError(f"bias must have shape ({w.shape[1]},), got {bias.shape}")
  if residual is not None and residual.shape != (x.shape[0], width):
    raise ValueError(f"residual must have shape ({x.shape[0]}, {width}), got {residual.shape}")
  return width


def _largest_dividing_block(size: int, limit: int) -> int | None:
  """The largest power of two <= limit dividing size, at least 16; None if there is none."""
  block = limit
  while block >= MIN_DOT_DIM:
    if size % block == 0:
      return block
    block //= 2
  return None


def _layer_views(layer, w, norm_scale, norm_bias, bias):
  """Shape-only views of one layer of stacked [L, ...] weights (checked, nothing sliced)."""
  stacked = [a for a in (w, norm_scale, norm_bias, bias) if a is not None]
  if w.ndim != 3 or any(a.shape[0] != w.shape[0] for a in stacked):
    raise ValueError(f"with layer, w must be [L, K, N] and the vectors [L, ...] with the same L; "
                     f"got {[tuple(a.shape) for a in stacked]}")
  return [None if a is None else jax.ShapeDtypeStruct(a.shape[1:], a.dtype)
          for a in (w, norm_scale, norm_bias, bias)]


def fused_linear(x, w, *, norm: str | None = None, norm_scale=None, norm_bias=None,
                 eps: float = 1e-5, bias=None, activation: str | None = None, gated: bool = False,
                 residual=None, layer: int | None = None, config: FusedLinearConfig | None = None,
                 interpret: bool = False):
  """y = residual + act(norm(x) @ w + bias), or with `gated`: act(gate) * up for w = [gate | up].

  Args:
    x: [R, K] (R: the decode rows, any count); w: [K, N] in x's dtype. K and N (or N/2 when
      gated) must be multiples of 16.
    norm: None, "rms" (norm_scale) or "layer" (norm_scale, norm_bias), over x's K columns.
    bias: [N]; activation: None, "gelu_tanh", "gelu" or "silu"; gated: split w's columns into
      gate and up halves (needs an activation); residual: [R, N or N/2] added last.
    layer: an index (a Python int, range-checked, or an int32 scalar, e.g. a scan's layer) into
      weights stacked over layers: w [L, K, N], norm_scale, norm_bias [L, K], bias [L, N]. The
      kernel reads that layer in place, so no per-layer slice is copied out before it runs (a
      custom call cannot fuse the slice as XLA's own ops do), and all layers share one kernel.
    config: launch settings (default: `default_config` of the shape); interpret: run in
      the Pallas interpreter (CPU tests).
  Returns:
    [R, N] (or [R, N/2] when gated) in x's dtype.
  """
  if isinstance(layer, int) and not isinstance(layer, bool) and w.ndim == 3 and not (
      0 <= layer < w.shape[0]):
    raise ValueError(f"layer must be in [0, {w.shape[0]}), got {layer}")
  return _fused_linear(x, w, norm=norm, norm_scale=norm_scale, norm_bias=norm_bias, eps=eps,
                       bias=bias, activation=activation, gated=gated, residual=residual,
                       layer=layer, config=config, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("norm", "eps", "activation", "gated", "config",
                                             "interpret"))
def _fused_linear(x, w, *, norm, norm_scale, norm_bias, eps, bias, activation, gated, residual,
                  layer, config, interpret):
  views = (w, norm_scale, norm_bias, bias)
  if layer is not None:
    views = _layer_views(layer, *views)
  width = _check(x, views[0], norm, views[1], views[2], views[3], activation, gated, residual)
  rows, hidden = x.shape
  config = (default_config(hidden, width, gated, x.dtype.itemsize) if config is None
            else config)
  block_k = _largest_dividing_block(hidden, config.block_k)
  block_n = _largest_dividing_block(width, config.block_n)
  if block_k is None or block_n is None:
    raise ValueError(f"fused_linear needs K ({hidden}) and output width ({width}) to be "
                     f"multiples of {MIN_DOT_DIM}")
  padded_rows = max(MIN_DOT_DIM, pl.next_power_of_2(rows))
  blocks = width // block_n

  # With `layer`, each weight's block spec spans the whole leading [L] axis; the kernel picks the
  # layer with the layer operand.
  if layer is None:
    def spec(shape, index_map):
      return pl.BlockSpec(shape, index_map)
  else:
    def spec(shape, index_map):
      return pl.BlockSpec((w.shape[0],) + shape, lambda n: (0,) + index_map(n))

  operands, specs = [], []
  if layer is not None:
    operands.append(jnp.asarray(layer, jnp.int32).reshape(1))
    specs.append(pl.BlockSpec((1,), lambda n: (0,)))
  operands += [x, w]
  specs += [pl.BlockSpec((rows, hidden), lambda n: (0, 0)),
           spec((hidden, block_n), lambda n: (0, n))]
  if gated:
    operands.append(w)
    specs.append(spec((hidden, block_n), lambda n: (0, n + blocks)))
  for vector in (norm_scale, norm_bias):
    if vector is not None:
      operands.append(vector)
      specs.append(spec((hidden,), lambda n: (0,)))
  if bias is not None:
    operands.append(bias)
    specs.append(spec((block_n,), lambda n: (n,)))
    if gated:
      operands.append(bias)
      specs.append(spec((block_n,), lambda n: (n + blocks,)))
  if residual is not None:
    operands.append(residual)
    specs.append(pl.BlockSpec((rows, block_n), lambda n: (0, n)))

  kernel = functools.partial(
      _kernel, norm=norm, eps=eps, activation=activation, gated=gated,
      has_bias=bias is not None, has_residual=residual is not None, stacked=layer is not None,
      hidden=hidden,
      block_k=block_k, padded_rows=padded_rows, out_dtype=x.dtype)
  return pl.pallas_call(
      kernel,
      grid=(blocks,),
      in_specs=specs,
      out_specs=pl.BlockSpec((rows, block_n), lambda n: (0, n)),
      out_shape=jax.ShapeDtypeStruct((rows, width), x.dtype),
      compiler_params=pltriton.CompilerParams(num_warps=config.num_warps,
                                              num_stages=config.num_stages),
      interpret=interpret,
      name="fused_linear",
  )(*operands)


def fused_linear_reference(x, w, *, norm: str | None = None, norm_scale=None, norm_bias=None,
                           eps: float = 1e-5, bias=None, activation: str | None = None,
                           gated: bool = False, residual=None):
  """The same function in plain jnp, step by step as `models.decoder` computes it."""
  _check(x, w, norm, norm_scale, norm_bias, bias, activation, gated, residual)
  dtype = x.dtype
  precision = jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None
  if norm:
    x32 = x.astype(jnp.float32)
    if norm == "layer":
      x32 = x32 - jnp.mean(x32, axis=-1, keepdims=True)
    normed = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)
    if norm == "layer":
      x = (normed * norm_scale.astype(jnp.float32) + norm_bias.astype(jnp.float32)).astype(dtype)
    else:
      x = norm_scale * normed.astype(dtype)
  y = jnp.matmul(x, w, precision=precision)
  if bias is not None:
    y = y + bias
  if gated:
    gate, up = jnp.split(y, 2, axis=-1)
    y = _activate(gate, activation) * up
  else:
    y = _activate(y, activation)
  if residual is not None:
    y = residual + y
  return y.astype(dtype)

