"""A few rows times a weight matrix on the Mosaic GPU backend (Hopper: TMA and wgmma), for decode
steps, whose products are bound by reading the weights (issue #34: XLA's GEMMs read them at
2.1-3.4 TB/s of the H200's 4.2 at one to eight rows, benchmarks/results/
decode_kernels_step_h200.json; this kernel against them: benchmarks/results/gemv_h100.md).

  out [B, O] = x [B, D] @ w [D, O],  B <= 64 rows (padded to P, a multiple of 8); or w [L, D, O]
  stacked over layers and `layer` (traced) picking one, read in place. (D: the product's inner
  width, the hidden size or F; O: its output columns.)

wgmma's M is 64, so the product runs transposed ("swap AB"): a program computes out^T for 64
output columns, out^T [64, P] = w^T [64, D] @ x^T [D, P], with w's tile as the A operand and the
rows as B (wgmma's N = P, as few as 8). The grid is (O / 64 column tiles, `splits` parts of D);
each program streams its [block_k, 64] weight tiles (and the rows' [P, block_k] slice) into a
ring of `max_concurrent_steps` SMEM slots with TMA and accumulates in registers; its float32
partial sum goes to a [splits, O, P] buffer that XLA adds up. The kernel runs under the Mosaic GPU
interpreter on the CPU (`interpret=True`: tests); the interpreter's wgmma starts from zeros, so
there each block's product is added to the sum instead of accumulated in place.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

BLOCK_N = 64  # output columns per program: wgmma's M
ROW_ALIGN = 8  # rows are padded to a multiple of wgmma's smallest N
MAX_ROWS = 64
_DTYPES = (jnp.bfloat16, jnp.float16)
# Whether this jax has the Mosaic GPU interpreter (jax >= 0.11).
INTERPRETER = hasattr(plgpu, "InterpretGPUParams")


@dataclasses.dataclass(frozen=True)
class MosaicGemvConfig:
  """Launch settings: `block_k` rows of w per step (64 or 128), `max_concurrent_steps` steps
  in flight per program, `splits` programs along D per column tile (a power of two)."""

  block_k: int = 128
  max_concurrent_steps: int = 4
  splits: int = 4

  def __post_init__(self):
    if self.block_k not in (64, 128):
      raise ValueError(f"block_k must be 64 or 128; got {self.block_k!r}")
    for name in ("max_concurrent_steps", "splits"):
      value = getattr(self, name)
      if not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1; got {value!r}")
    if self.splits & (self.splits - 1):
      raise ValueError(f"splits must be a power of two; got {self.splits!r}")


def mosaic_gemv_reference(x, w):
  """The same product in plain jnp (float32 accumulation), in x's dtype."""
  return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)


def _kernel(layer_ref, x_ref, w_ref, out_ref, x_smem, w_smem, arrived, *, part: int,
            steps: int, block_k: int, interpret: bool):
  """One (column tile, part of D) program: its partial out^T [64, P] into out_ref[split]."""
  column, split = lax.axis_index("column"), lax.axis_index("split")
  layer = layer_ref[0]
  blocks = part // block_k
  rows = x_smem.shape[1]

  def load(block, slot):
    k = split * part + block * block_k
    plgpu.copy_gmem_to_smem(w_ref.at[layer, pl.ds(k, block_k), pl.ds(column * BLOCK_N, BLOCK_N)],
                            w_smem.at[slot], arrived.at[slot])
    plgpu.copy_gmem_to_smem(x_ref.at[:, pl.ds(k, block_k)], x_smem.at[slot], arrived.at[slot])

  for block in range(min(steps, blocks)):
    load(block, block)

  def step(block, acc):
    slot = block % steps
    plgpu.barrier_wait(arrived.at[slot])

    def product(acc_ref):
      # [64, block_k] @ [block_k, P]: the weights' tile and the rows, both transposed views
      plgpu.wgmma(acc_ref, w_smem.at[slot].T, x_smem.at[slot].T)
    if interpret:  # (the interpreter's wgmma starts from zeros)
      def from_zeros(acc_ref):
        product(acc_ref)
        return acc_ref[...]
      acc = acc + pl.run_scoped(from_zeros, plgpu.ACC((BLOCK_N, rows), jnp.float32))
    else:
      acc = pl.run_state(product)(plgpu.ACC.init(acc))

    @pl.when(block + steps < blocks)
    def _refill():  # (the product above has read the slot)
      load(block + steps, slot)
    return acc

  acc = lax.fori_loop(0, blocks, step, plgpu.layout_cast(
      jnp.zeros((BLOCK_N, rows), jnp.float32), plgpu.Layout.WGMMA))
  out_ref[split, pl.ds(column * BLOCK_N, BLOCK_N), :] = acc


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def mosaic_gemv(x, w, layer=None, *, config: MosaicGemvConfig = MosaicGemvConfig(),
                interpret: bool = False):
  """x [B, D] @ w [D, O] (or w[layer] of w [L, D, O]) -> [B, O] in x's dtype (float32
  accumulation): bfloat16 or float16, B <= 64, O a multiple of 64, D a multiple of splits x
  block_k. `interpret`: run in the Mosaic GPU interpreter (CPU tests)."""
  if (layer is None) != (w.ndim == 2):
    raise ValueError(f"w must be [D, O] without a layer or [L, D, O] with one; got w "
                     f"{tuple(w.shape)}, layer {layer!r}")
  if w.ndim == 2:
    w, layer = w[None], 0
  if x.ndim != 2 or w.ndim != 3 or x.shape[1] != w.shape[1]:
    raise ValueError(f"x [B, D] and w [D, O] must agree on D; got x {tuple(x.shape)}, w "
                     f"{tuple(w.shape)}")
  if x.dtype != w.dtype or x.dtype not in _DTYPES:
    raise ValueError(f"x and w must both be bfloat16 or float16; got {x.dtype}, {w.dtype}")
  (m, k), n = x.shape, w.shape[2]
  if not 1 <= m <= MAX_ROWS:
    raise ValueError(f"x must have 1 to {MAX_ROWS} rows; got x {tuple(x.shape)}")
  if n % BLOCK_N:
    raise ValueError(f"w's O must be a multiple of {BLOCK_N}; got w {tuple(w.shape)}")
  block_k, splits = config.block_k, config.splits
  if k % (splits * block_k):
    raise ValueError(f"D must be a multiple of splits x block_k = {splits * block_k}; got w "
                     f"{tuple(w.shape)} with {config}")
  if interpret and not INTERPRETER:
    raise NotImplementedError(f"interpret=True needs the Mosaic GPU interpreter (jax >= 0.11); "
                              f"this is jax {jax.__version__}")
  rows = -(-m // ROW_ALIGN) * ROW_ALIGN
  steps = config.max_concurrent_steps
  swizzled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
  kernel = functools.partial(_kernel, part=k // splits, steps=steps, block_k=block_k,
                             interpret=interpret)
  # [splits, O, P] float32 partial sums, out^T
  partials = plgpu.kernel(
      kernel,
      out_type=jax.ShapeDtypeStruct((splits, n, rows), jnp.float32),
      scratch_types=[
          plgpu.SMEM((steps, rows, block_k), x.dtype, transforms=swizzled),
          plgpu.SMEM((steps, block_k, BLOCK_N), w.dtype, transforms=swizzled),
          plgpu.Barrier(num_arrivals=2, num_barriers=steps),
      ],
      grid=(n // BLOCK_N, splits),
      grid_names=("column", "split"),
      num_threads=1,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True),
      interpret=plgpu.InterpretGPUParams() if interpret else None,
  )(jnp.asarray(layer, jnp.int32).reshape(1), jnp.pad(x, ((0, rows - m), (0, 0))), w)
  return partials.sum(axis=0).T[:m].astype(x.dtype)
