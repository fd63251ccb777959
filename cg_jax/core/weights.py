"""Weight placement: checked against the model's shapes, cast, put on the device (or split over a
tensor-parallel mesh), and the NNX model split once into the flat weight list the steps take."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from cg_jax.core.sharding import TensorParallel, from_shard_major, to_shard_major
from models.config import DecoderConfig
from models.decoder import Decoder


@dataclasses.dataclass(frozen=True)
class SplitModel:
  """A model split once for the hot path: static structure plus a flat list of weight arrays.

  Each step re-hydrates it with `nnx.merge` inside the trace, so a call passes the ~15-20
  stacked weight arrays and costs no Python graph traversal.
  """

  graphdef: Any
  treedef: Any
  weights: list[jax.Array]

  def merge(self, weights) -> Decoder:
    return nnx.merge(self.graphdef, jax.tree.unflatten(self.treedef, weights))

  def specs(self) -> list[jax.ShapeDtypeStruct]:
    return [jax.ShapeDtypeStruct(w.shape, w.dtype) for w in self.weights]


def random_weights(config: DecoderConfig, dtype, seed: int) -> dict[str, jax.Array]:
  """normal(0.02) weights as Hugging Face initialises them, {weight kind: array}."""
  def init():
    return nnx.to_pure_dict(nnx.state(Decoder(config, dtype=dtype, rngs=nnx.Rngs(seed))))
  return jax.jit(init)()


def _abstract_state(config: DecoderConfig, dtype):
  """(graphdef, state) of the model with shapes and dtypes for weights (nothing allocated)."""
  return nnx.split(nnx.eval_shape(lambda: Decoder(config, dtype=dtype, rngs=nnx.Rngs(0))))


def abstract_split(config: DecoderConfig, dtype,
                   parallel: TensorParallel | None) -> SplitModel:
  """The split model with `jax.ShapeDtypeStruct`s for weights (with their placements over
  `parallel`'s mesh): all that tracing, lowering and compiling the steps need, before any weight
  is read (`place` gives the same structure)."""
  graphdef, state = _abstract_state(config, dtype)
  specs = {n: jax.ShapeDtypeStruct(w.shape, w.dtype,
                                   sharding=None if parallel is None else parallel.weight(n))
           for n, w in nnx.to_pure_dict(state).items()}
  nnx.replace_by_pure_dict(state, specs)
  leaves, treedef = jax.tree.flatten(state)
  return SplitModel(graphdef, treedef, leaves)


def place(config: DecoderConfig, weights: Mapping[str, Any], dtype,
          parallel: TensorParallel | None) -> SplitModel:
  """Check {weight kind: array} against the model's shapes, cast to `dtype` and place it: on the
  first device, or split over `parallel`'s mesh in its shard-major layout."""
  graphdef, state = _abstract_state(config, dtype)
  expected = nnx.to_pure_dict(state)
  if set(expected) != set(weights):
    raise ValueError(f"weights have kinds {sorted(weights)}, expected {sorted(expected)}")
  for name, spec in expected.items():
    if tuple(weights[name].shape) != tuple(spec.shape):
      raise ValueError(f"weight {name!r} has shape {tuple(weights[name].shape)}, "
                       f"expected {tuple(spec.shape)}")
  if parallel is None:
    device = jax.devices()[0]  # also when `weights` come split from a tensor-parallel engine
    placed = {n: jax.device_put(jnp.asarray(w, dtype=dtype), device) for n, w in weights.items()}
  else:
    host = {n: np.asarray(w).astype(dtype) for n, w in weights.items()}
    placed = {n: jax.device_put(w, parallel.weight(n))
              for n, w in to_shard_major(config, host, parallel.size).items()}
  nnx.replace_by_pure_dict(state, placed)
  leaves, treedef = jax.tree.flatten(state)
  return SplitModel(graphdef, treedef, leaves)


def canonical(config: DecoderConfig, split: SplitModel,
              parallel: TensorParallel | None) -> dict[str, jax.Array]:
  """The placed weights as {weight kind: array} in the canonical column layout (shared, not
  copied, on one device)."""
  weights = nnx.to_pure_dict(jax.tree.unflatten(split.treedef, split.weights))
  if parallel is not None:
    weights = from_shard_major(config, weights, parallel.size)
  return weights
