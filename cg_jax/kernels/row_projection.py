"""A projection of a few rows, with the norm before it and the epilogue after it fused (Pallas,
Triton): out = residual + act(norm(x) @ w + bias), or act(gate) * up for a gated w.

A decode step multiplies a handful of rows (x [M, I], M <= 64) by weights of tens of megabytes:
the product is a stream of w from HBM, and the norm before it and the bias, activation and
residual add after it are separate small kernels around XLA's GEMM. Here one kernel does all of
it, and reads a layer's weights in place from the stacked [L, I, O] array (`layer` picks one:
no slice of the weights is copied first).

  1. Programs. One Triton program per (column block, split): columns [j Bn, (j + 1) Bn) of the
     output (of the gate and of the up half, [gate | up], for a gated w) over the inputs
     [s I/S, (s + 1) I/S). The M rows are padded to P = max(16, M rounded up to a power of
     two) (the Triton dot's minimum) by masked loads; nothing is padded outside.
  2. Norm. RMSNorm is folded around the product: norm(x) @ w = (x * scale) @ w / rms(x) (the
     row's 1 / rms is a factor of the whole row), so the loop that streams w multiplies x by the
     scale and sums x's squares on the way, and the result is scaled at the end: no pass over x
     before the stream starts. LayerNorm (float32, with its bias) needs the row's mean inside
     the product: each program reads its rows whole for the statistics first.
  3. Splits. S > 1 when the column blocks alone would give fewer than `min_programs` programs:
     each program then writes float32 partials [S, M, O] and the epilogue runs in jnp over their
     sum (XLA fuses it into one small kernel); with S = 1 the program applies the epilogue and
     writes x's dtype.

Rounding follows `models.projections.projection` where it can: the product rounded to x's
dtype, then the bias, the activation and the residual each rounded to it as XLA's elementwise
ops are. The product's float32 sum runs in another order than XLA's GEMM, and RMSNorm's scaled
row (rounded to x's dtype) is not Llama's normalised one, so results agree within the dtype's
tolerance, not bit for bit; they depend on a row's own inputs only (no row's result depends on
M or on the other rows).

`row_projection_reference` is the same computation in plain jnp (tests).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from cg_jax.kernels.blocks import MIN_DOT_DIM, is_power_of_two

NORMS = (None, "rms", "layer")
# The activations of the epilogue (models.decoder's, computed in float32 here); the exact GELU's
# erfc has no Triton lowering.
ACTIVATIONS = {
    "gelu_tanh": lambda u: jax.nn.gelu(u, approximate=True),
    "silu": jax.nn.silu,
}
# The most rows a call takes: beyond them the product is a GEMM's (cuBLAS) ground.
MAX_ROWS = 64


@dataclasses.dataclass(frozen=True)
class RowProjectionConfig:
  """Block sizes and launch settings of the row projection.

  Attributes:
    block_n: output columns per program (a power of two >= 16).
    block_k: inputs per inner-loop step (a power of two >= 16).
    min_programs: the inputs are split in two (up to `max_splits`) while the column blocks x
      splits give fewer programs than this; 0 keeps one split.
    max_splits: the most splits (a power of two).
    num_warps, num_stages: Triton launch settings.
  """

  block_n: int = 64
  block_k: int = 128
  min_programs: int = 264
  max_splits: int = 8
  num_warps: int = 4
  num_stages: int = 4

  def __post_init__(self):
    kind = type(self).__name__
    for name in ("block_n", "block_k", "max_splits", "num_warps"):
      value = getattr(self, name)
      if not is_power_of_two(value):
        raise ValueError(f"{kind}.{name} must be a positive power of two, got {value!r}")
    for name in ("block_n", "block_k"):
      if getattr(self, name) < MIN_DOT_DIM:
        raise ValueError(f"{kind}.{name} must be >= {MIN_DOT_DIM} (Triton dot), got "
                         f"{getattr(self, name)}")
    for name, low in (("min_programs", 0), ("num_stages", 1)):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{kind}.{name} must be an int >= {low}, got {value!r}")


def padded_rows(rows: int) -> int:
  """P: the program's rows for M = `rows` (a power of two >= MIN_DOT_DIM)."""
  return max(MIN_DOT_DIM, 1 << max(rows - 1, 0).bit_length())


def num_splits(inputs: int, column_blocks: int, config: RowProjectionConfig) -> int:
  """S: halving the inputs per program while they stay whole blocks of block_k, up to
  max_splits, until column_blocks x S reaches min_programs."""
  splits = 1
  while (column_blocks * splits < config.min_programs and splits < config.max_splits
         and inputs % (2 * splits * config.block_k) == 0):
    splits *= 2
  return splits


def supports(rows: int, inputs: int, outputs: int, config: RowProjectionConfig,
             gated: bool = False, activation: str | None = None) -> bool:
  """Whether the kernel takes x [rows, inputs] @ w [inputs, outputs] (whole blocks only) with
  this activation."""
  columns = outputs // 2 if gated else outputs
  return (1 <= rows <= MAX_ROWS and inputs % config.block_k == 0
          and (activation is None or activation in ACTIVATIONS)
          and columns % config.block_n == 0 and (not gated or outputs % 2 == 0))


def _row_stats(x_ref, rows_ok, block_k: int, eps: float):
  """LayerNorm's float32 (mean [P], rstd [P]) of each row of x [M, I], read in blocks of
  block_k; rows past M get harmless values."""
  inputs = x_ref.shape[1]
  row = jnp.arange(rows_ok.shape[0])

  def load(i):
    cols = i * block_k + jnp.arange(block_k)
    return pltriton.load(x_ref.at[row[:, None], cols[None, :]], mask=rows_ok[:, None],
                         other=0.0).astype(jnp.float32)

  count = inputs // block_k
  zeros = jnp.zeros(rows_ok.shape, jnp.float32)
  mean = lax.fori_loop(0, count, lambda i, s: s + jnp.sum(load(i), axis=1), zeros) / inputs

  def squares(i, s):
    centred = load(i) - mean[:, None]
    return s + jnp.sum(centred * centred, axis=1)

  variance = lax.fori_loop(0, count, squares, zeros) / inputs
  return mean, lax.rsqrt(variance + eps)


def _kernel(layer_ref, x_ref, w_ref, *refs, norm, has_bias: bool, has_residual: bool,
            activation, gated: bool, split: int, block_n: int, block_k: int, eps: float,
            precision):
  """One (column block, split) program; refs: [norm scale (, norm bias)], [bias], [residual],
  out (x's dtype [M, O'], or float32 partials [S, M, O'] with S > 1, and for RMSNorm the
  partial sums of squares [S, M])."""
  refs = list(refs)
  squares_ref = refs.pop() if norm == "rms" and split > 1 else None
  out_ref = refs.pop()
  scale_ref = refs.pop(0) if norm else None
  shift_ref = refs.pop(0) if norm == "layer" else None
  bias_ref = refs.pop(0) if has_bias else None
  residual_ref = refs.pop(0) if has_residual else None
  rows = out_ref.shape[-2]
  inputs = x_ref.shape[1]
  column_block, split_index = pl.program_id(0), pl.program_id(1)
  layer = layer_ref[0]
  dtype = x_ref.dtype
  padded = padded_rows(rows)
  row = jnp.arange(padded)
  rows_ok = row < rows
  width = w_ref.shape[2] // 2 if gated else w_ref.shape[2]
  cols = column_block * block_n + jnp.arange(block_n)
  if norm == "layer":
    mean, rstd = _row_stats(x_ref, rows_ok, block_k, eps)
  per_split = inputs // split
  first = split_index * per_split

  def load_x(start):
    """x's block at `start` as the product takes it, and the float32 block (for RMSNorm's
    sum of squares)."""
    at = start + jnp.arange(block_k)
    x = pltriton.load(x_ref.at[row[:, None], at[None, :]], mask=rows_ok[:, None], other=0.0)
    x32 = x.astype(jnp.float32)
    if norm == "rms":  # the scale here, the row's 1 / rms after the product
      scale = pltriton.load(scale_ref.at[layer, pl.ds(start, block_k)]).astype(jnp.float32)
      x = (x32 * scale[None, :]).astype(dtype)
    elif norm == "layer":
      scale = pltriton.load(scale_ref.at[layer, pl.ds(start, block_k)]).astype(jnp.float32)
      shift = pltriton.load(shift_ref.at[layer, pl.ds(start, block_k)]).astype(jnp.float32)
      x = (((x32 - mean[:, None]) * rstd[:, None]) * scale[None, :] + shift[None, :]).astype(dtype)
    return x, x32

  def product(x, start, offset):
    w = pltriton.load(w_ref.at[layer, pl.ds(start, block_k), pl.ds(offset, block_n)])
    # [P, Bn] = x [P, Bk] . w [Bk, Bn]
    return lax.dot_general(x, w, (((1,), (0,)), ((), ())), precision=precision,
                           preferred_element_type=jnp.float32)

  def body(i, carry):
    squares, *accs = carry
    start = first + i * block_k
    x, x32 = load_x(start)
    new = [accs[0] + product(x, start, column_block * block_n)]
    if gated:
      new.append(accs[1] + product(x, start, width + column_block * block_n))
    if norm == "rms":
      squares = squares + jnp.sum(x32 * x32, axis=1)
    return (squares, *new)

  zeros = jnp.zeros((padded, block_n), jnp.float32)
  squares, *accs = lax.fori_loop(0, per_split // block_k, body,
                                 (jnp.zeros((padded,), jnp.float32), zeros)
                                 + ((zeros,) if gated else ()))
  if split > 1:
    for part, acc in enumerate(accs):
      at = cols + part * width
      pltriton.store(out_ref.at[split_index, row[:, None], at[None, :]], acc,
                     mask=rows_ok[:, None])
    if squares_ref is not None:
      pltriton.store(squares_ref.at[split_index, row], squares,
                     mask=rows_ok & (column_block == 0))
    return
  if norm == "rms":
    accs = [acc * lax.rsqrt(squares / inputs + eps)[:, None] for acc in accs]
  halves = []
  for part, acc in enumerate(accs):
    y = acc.astype(dtype)
    if has_bias:
      y = y + pltriton.load(bias_ref.at[layer, pl.ds(part * width + column_block * block_n,
                                                      block_n)])[None, :]
    halves.append(y)
  y = _epilogue(halves, activation, gated)
  if has_residual:
    residual = pltriton.load(residual_ref.at[row[:, None], cols[None, :]],
                             mask=rows_ok[:, None], other=0.0)
    y = residual + y
  pltriton.store(out_ref.at[row[:, None], cols[None, :]], y.astype(out_ref.dtype),
                 mask=rows_ok[:, None])


def _epilogue(halves, activation, gated: bool):
  """act(gate) * up for a gated product, act(y) otherwise (x's dtype in and out, the
  activation computed in float32)."""
  y = halves[0]
  if activation is not None:
    y = ACTIVATIONS[activation](y.astype(jnp.float32)).astype(y.dtype)
  return y * halves[1] if gated else y


def _check(x, w, layer, norm, norm_scale, norm_bias, bias, residual, activation, gated) -> None:
  shapes = f"x {tuple(x.shape)}, w {tuple(w.shape)}"
  if x.ndim != 2 or w.ndim != 3 or x.shape[1] != w.shape[1]:
    raise ValueError(f"row_projection takes x [M, I] and stacked w [L, I, O]; got {shapes}")
  if not 1 <= x.shape[0] <= MAX_ROWS:
    raise ValueError(f"row_projection takes 1 to {MAX_ROWS} rows; got {shapes}")
  if x.dtype != w.dtype:
    raise ValueError(f"x and w must share a dtype; got {x.dtype} and {w.dtype}")
  if norm not in NORMS:
    raise ValueError(f"norm must be one of {NORMS}, got {norm!r}")
  if (norm is None) != (norm_scale is None) or (norm == "layer") != (norm_bias is not None):
    raise ValueError(f"norm={norm!r} takes norm_scale{' and norm_bias' if norm == 'layer' else ''}"
                     f"; got norm_scale {norm_scale is not None}, norm_bias "
                     f"{norm_bias is not None}")
  if activation is not None and activation not in ACTIVATIONS:
    raise ValueError(f"activation must be one of {tuple(ACTIVATIONS)} or None, got "
                     f"{activation!r}")
  if gated and activation is None:
    raise ValueError("a gated projection needs an activation")
  if residual is not None and (gated or residual.shape != (x.shape[0], w.shape[2])):
    raise ValueError(f"residual must be [M, O] of an ungated projection; got residual "
                     f"{tuple(residual.shape)}, {shapes}, gated={gated}")
  if not jnp.issubdtype(jnp.asarray(layer).dtype, jnp.integer) or jnp.ndim(layer) != 0:
    raise ValueError(f"layer must be an integer scalar; got {layer!r}")
  del bias


@functools.partial(jax.jit, static_argnames=("norm", "eps", "activation", "gated", "config",
                                             "interpret"))
def row_projection(x, w, layer, *, norm: str | None = None, norm_scale=None, norm_bias=None,
                   eps: float = 1e-5, bias=None, residual=None, activation: str | None = None,
                   gated: bool = False, config: RowProjectionConfig = RowProjectionConfig(),
                   interpret: bool = False):
  """residual + act(norm(x) @ w[layer] + bias[layer]) (act(gate) * up when gated: w's columns
  [gate | up]), x [M, I] with M <= MAX_ROWS.

  Args:
    x: [M, I]; w: [L, I, O] stacked over layers; layer: int32 scalar, the layer.
    norm: None, "rms" or "layer" over x's rows, with norm_scale (and for "layer" norm_bias)
      [L, I].
    bias: [L, O] or None; residual: [M, O] or None (ungated only).
    activation: an ACTIVATIONS name or None; gated: w's columns [gate | up] of F each, the
      result act(gate) * up [M, F].
    config: block sizes and launch settings; `supports` says which shapes it takes.
    interpret: run in the Pallas interpreter (CPU tests).
  Returns:
    [M, O] (or [M, F] when gated) in x's dtype.
  """
  _check(x, w, layer, norm, norm_scale, norm_bias, bias, residual, activation, gated)
  rows, inputs = x.shape
  outputs = w.shape[2]
  width = outputs // 2 if gated else outputs
  if not supports(rows, inputs, outputs, config, gated):
    raise ValueError(f"row_projection needs I a multiple of block_k ({config.block_k}) and "
                     f"{'F' if gated else 'O'} a multiple of block_n ({config.block_n}); got "
                     f"x {tuple(x.shape)}, w {tuple(w.shape)}")
  column_blocks = width // config.block_n
  split = num_splits(inputs, column_blocks, config)
  precision = lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
  kernel = functools.partial(
      _kernel, norm=norm, has_bias=bias is not None and split == 1,
      has_residual=residual is not None and split == 1, activation=activation, gated=gated,
      split=split, block_n=config.block_n, block_k=config.block_k, eps=float(eps),
      precision=precision)
  layer = jnp.asarray(layer, jnp.int32).reshape(1)
  operands = [layer, x, w] + [a for a in (norm_scale, norm_bias) if a is not None]
  if split == 1:
    operands += [a for a in (bias, residual) if a is not None]
    out_shape = [jax.ShapeDtypeStruct((rows, width), x.dtype)]
  else:
    out_shape = [jax.ShapeDtypeStruct((split, rows, outputs), jnp.float32)]
    if norm == "rms":
      out_shape.append(jax.ShapeDtypeStruct((split, rows), jnp.float32))

  def whole(shape):  # the whole array as every program's block (indexed in the kernel)
    return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))

  out = pl.pallas_call(
      kernel,
      grid=(column_blocks, split),
      in_specs=[whole(a.shape) for a in operands],
      out_specs=[whole(a.shape) for a in out_shape],
      out_shape=out_shape,
      compiler_params=pltriton.CompilerParams(num_warps=config.num_warps,
                                              num_stages=config.num_stages),
      interpret=interpret,
      name="row_projection",
  )(*operands)
  if split == 1:
    return out[0]
  # [M, O]: the partials summed (times each row's 1 / rms), then the epilogue as the one-split
  # program applies it
  y = jnp.sum(out[0], axis=0)
  if norm == "rms":
    y = y * lax.rsqrt(jnp.sum(out[1], axis=0) / inputs + eps)[:, None]
  y = y.astype(x.dtype)
  if bias is not None:
    y = y + bias[layer[0]]
  y = _epilogue([y[:, :width], y[:, width:]] if gated else [y], activation, gated)
  return y if residual is None else residual + y


def row_projection_reference(x, w, layer, *, norm=None, norm_scale=None, norm_bias=None,
                             eps: float = 1e-5, bias=None, residual=None, activation=None,
                             gated: bool = False):
  """`row_projection` in plain jnp (same arguments, any rows)."""
  dtype = x.dtype
  if norm is not None:
    x32 = x.astype(jnp.float32)
    if norm == "layer":
      x32 = x32 - jnp.mean(x32, axis=-1, keepdims=True)
    normed = x32 * lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)
    if norm == "layer":
      x = (normed * norm_scale[layer].astype(jnp.float32)
           + norm_bias[layer].astype(jnp.float32)).astype(dtype)
    else:
      x = norm_scale[layer] * normed.astype(dtype)
  precision = lax.Precision.HIGHEST if dtype == jnp.float32 else None
  y = jnp.matmul(x, w[layer], precision=precision, preferred_element_type=jnp.float32)
  y = y.astype(dtype)
  if bias is not None:
    y = y + bias[layer]
  width = y.shape[-1] // 2
  y = _epilogue([y[:, :width], y[:, width:]] if gated else [y], activation, gated)
  return y if residual is None else residual + y
