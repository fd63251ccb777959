"""Shared pieces of the Pallas kernel tests: float64 NumPy references, dtype-keyed tolerances,
random inputs, and lowering for an abstract H200 (a CPU check that a kernel still compiles to
Triton for the GPU).

Kernels run with interpret=True on CPU, so their logic is covered in CI.
"""

from __future__ import annotations

import numpy as np
import jax
import jax.numpy as jnp

# Relative tolerance by dtype: max|out - ref| <= tol * max|ref|.
KERNEL_TOLERANCE = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1e-2}


def random_array(rng: np.random.Generator, shape, dtype: str) -> jax.Array:
  """Standard-normal values (never zeros: zeros hide unwritten outputs), cast to `dtype`."""
  return jnp.asarray(rng.standard_normal(shape, dtype=np.float32), dtype=dtype)


def attention_reference(q, k, v, mask, sm_scale: float) -> np.ndarray:
  """float64 softmax attention with GQA.

  Args:
    q: [B, T, Hq, D]; k, v: [B, S, Hkv, D]; mask: bool [B, T, S] (True = attend).
  Returns:
    float64 [B, T, Hq, D]; rows with no valid key are 0.
  """
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  group = q.shape[2] // k.shape[2]
  k = np.repeat(k, group, axis=2)
  v = np.repeat(v, group, axis=2)
  scores = np.einsum("bthd,bshd->bhts", q, k) * sm_scale
  mask = np.asarray(mask)[:, None]
  scores = np.where(mask, scores, -np.inf)
  row_max = np.max(scores, axis=-1, keepdims=True)
  row_max = np.where(np.isfinite(row_max), row_max, 0.0)
  weights = np.where(mask, np.exp(scores - row_max), 0.0)
  total = weights.sum(-1, keepdims=True)
  probs = weights / np.where(total == 0, 1.0, total)
  return np.einsum("bhts,bshd->bthd", probs, v)


def assert_kernel_close(out, reference, dtype: str, what: str = "kernel"):
  """Relative max-abs check keyed by dtype, NaN never passes, reporting the worst place."""
  out = np.asarray(out, np.float64)
  reference = np.asarray(reference, np.float64)
  assert out.shape == reference.shape, (out.shape, reference.shape)
  assert np.all(np.isfinite(out)), f"{what}: non-finite output"
  diff = np.abs(out - reference)
  bound = KERNEL_TOLERANCE[dtype] * max(np.max(np.abs(reference)), 1e-30)
  worst = np.unravel_index(np.argmax(diff), diff.shape)
  assert diff.max() <= bound, (f"{what} ({dtype}): max|diff| {diff.max():.3e} at {worst} > "
                               f"{bound:.3e} ({100 * diff.max() / bound:.0f}% of tolerance)")


def lower_for_h200(fn, *specs, donate_argnums=()) -> str:
  """Lower `fn` for CUDA against an abstract H200 (no GPU needed) and return the module text."""
  from jax.sharding import AbstractDevice, AbstractMesh

  mesh = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(
      device_kind="NVIDIA H200", num_cores=132, platform="gpu"))
  with jax.sharding.use_abstract_mesh(mesh):
    return jax.jit(fn, donate_argnums=donate_argnums).trace(*specs).lower(
        lowering_platforms=("cuda",)).as_text()
