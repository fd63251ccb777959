"""Tensor-parallel decoding with jax.sharding (XLA SPMD + NCCL): over the GPUs of one host, or
of several processes (`initialize_processes`).

Megatron-style: each of N devices holds 1/N of the attention heads and of the MLP columns.
  - QKV and MLP-in projections are column-parallel (their output columns are split), so each
    device computes its own heads / MLP columns with no communication;
  - the output and MLP-out projections are row-parallel (their input rows are split); each
    device's partial product is summed by one all-reduce per projection, which XLA's SPMD
    partitioner inserts;
  - the KV cache [L, B, T, K, H] is split by KV head, so attention is local to each device;
  - embeddings, norms, biases added after an all-reduce and the LM head are replicated.

Column-parallel weights whose columns hold several parts ([q | k | v], and [gate | up] for a
gated MLP) are stored shard-major when N > 1: N contiguous column groups, each holding the parts
of one device's heads / columns, so an even split of the columns gives every device whole parts
(`to_shard_major`; the model reads that layout through its `shards` argument). With N = 1 the
layout is the canonical one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from models.config import DecoderConfig

AXIS = "tp"

# Stacked per-layer weights [L, ...] that are split; every other weight is replicated.
_WEIGHT_SPECS = {
    "qkv_kernel": P(None, None, AXIS),      # [L, D, (N + 2K) H], column-parallel
    "qkv_bias": P(None, AXIS),
    "out_kernel": P(None, AXIS, None),      # [L, N H, D], row-parallel
    "mlp_in_kernel": P(None, None, AXIS),   # [L, D, F or 2F], column-parallel
    "mlp_in_bias": P(None, AXIS),
    "mlp_out_kernel": P(None, AXIS, None),  # [L, F, D], row-parallel
}
# [L, B, T, K, H]: split by KV head.
CACHE_SPEC = P(None, None, None, AXIS, None)


def initialize_processes(coordinator_address: str, num_processes: int, process_id: int) -> None:
  """Join this process to a multi-process run (`jax.distributed`): afterwards `jax.devices()`
  lists every process's devices, and `Engine(tensor_parallel=jax.device_count())` spans them.
  Every process then builds the same engine and makes the same calls (`generate` with the same
  arguments, in the same order): each runs the same executables on its own devices (SPMD). On
  CPU devices the collectives go through gloo."""
  if hasattr(jax.config, "jax_cpu_collectives_implementation"):  # CPU devices' collectives
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=coordinator_address,
                             num_processes=num_processes, process_id=process_id)


def check_tensor_parallel(config: DecoderConfig, tensor_parallel,
                          count_devices: bool = True) -> None:
  """ValueError unless `tensor_parallel` is an int in [1, device count] (an int >= 1 without
  `count_devices`: nothing asks the device) that divides the heads, the KV heads and the MLP
  width."""
  is_int = isinstance(tensor_parallel, int) and not isinstance(tensor_parallel, bool)
  if count_devices:
    devices = len(jax.devices())
    if not is_int or not 1 <= tensor_parallel <= devices:
      raise ValueError(f"tensor_parallel must be an int in [1, {devices}] (the devices here), "
                       f"got {tensor_parallel!r}")
  elif not is_int or tensor_parallel < 1:
    raise ValueError(f"tensor_parallel must be an int >= 1 (at most the devices), got "
                     f"{tensor_parallel!r}")
  sizes = {"num_heads": config.num_heads, "num_kv_heads": config.num_kv_heads,
           "intermediate_size": config.intermediate_size}
  odd = {name: size for name, size in sizes.items() if size % tensor_parallel}
  if odd:
    raise ValueError(f"tensor_parallel={tensor_parallel} must divide {odd}")


def _column_parts(config: DecoderConfig, name: str) -> list[int] | None:
  """Widths of the parts along the last axis of a multi-part column-parallel weight."""
  c = config
  if name in ("qkv_kernel", "qkv_bias"):
    return [c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim]
  if name in ("mlp_in_kernel", "mlp_in_bias") and c.gated_mlp:
    return [c.intermediate_size, c.intermediate_size]
  return None


def _regroup(config: DecoderConfig, weights: Mapping, shards: int, regroup) -> dict:
  """{name: array} with regroup(array, part widths, array module) applied to the multi-part
  column-parallel weights (nothing to do on one shard)."""
  out = dict(weights)
  for name, array in weights.items():
    parts = _column_parts(config, name)
    if parts is not None and shards > 1:
      out[name] = regroup(array, parts, jnp if isinstance(array, jax.Array) else np)
  return out


def to_shard_major(config: DecoderConfig, weights: Mapping, shards: int) -> dict:
  """Canonical {name: array} -> the same with multi-part columns regrouped per shard:
  [q | k | v] -> [q_0 k_0 v_0 | q_1 k_1 v_1 | ...] (and [gate | up] likewise)."""
  def regroup(array, parts, xp):
    pieces = xp.split(array, np.cumsum(parts)[:-1].tolist(), axis=-1)
    # each part [..., width] -> [..., shards, width / shards], side by side per shard
    grouped = xp.concatenate([p.reshape(*p.shape[:-1], shards, -1) for p in pieces], axis=-1)
    return grouped.reshape(array.shape)
  return _regroup(config, weights, shards, regroup)


def from_shard_major(config: DecoderConfig, weights: Mapping, shards: int) -> dict:
  """The inverse of `to_shard_major`."""
  def regroup(array, parts, xp):
    # [..., shards, per-shard width] -> parts [..., shards, width / shards] -> [..., width]
    grouped = array.reshape(*array.shape[:-1], shards, -1)
    pieces = xp.split(grouped, np.cumsum([p // shards for p in parts])[:-1].tolist(), axis=-1)
    return xp.concatenate([p.reshape(*array.shape[:-1], -1) for p in pieces], axis=-1)
  return _regroup(config, weights, shards, regroup)


@dataclasses.dataclass(frozen=True)
class TensorParallel:
  """A 1-D device mesh over the first `size` devices and the placements on it."""

  mesh: Mesh

  @classmethod
  def over(cls, size: int) -> "TensorParallel":
    return cls(Mesh(np.asarray(jax.devices()[:size]), (AXIS,)))

  @property
  def size(self) -> int:
    return self.mesh.shape[AXIS]

  def replicated(self, memory_kind: str | None = None) -> NamedSharding:
    return NamedSharding(self.mesh, P(), memory_kind=memory_kind)

  def weight(self, name: str) -> NamedSharding:
    return NamedSharding(self.mesh, _WEIGHT_SPECS.get(name, P()))

  def cache(self, memory_kind: str | None = None) -> NamedSharding:
    return NamedSharding(self.mesh, CACHE_SPEC, memory_kind=memory_kind)
