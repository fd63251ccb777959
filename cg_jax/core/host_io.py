"""Host <-> device transfers that do not block the step loop.

- Request inputs (token ids, lengths, sampling settings: kilobytes) go straight to the device
  in one asynchronous copy (`stage`); a hop through pinned host memory first costs a
  page-locked allocation per array, far more than the copy (benchmarks/results/serving_h200.md).
- Outputs the host reads are written to pinned host memory by the executables themselves
  (`cg_jax.core.executables`); `AsyncReader` holds a step's outputs (starting a copy for any still on
  the device) and reads them one or more steps later, so the host never waits for step N
  before launching step N+1.
- Whole pytrees (a KV cache) can be swapped out to pinned host memory and back (`to_host`,
  `to_device`), freeing device memory in between.
"""

from __future__ import annotations

import collections
from typing import Any

import jax
import numpy as np
from jax.sharding import Sharding, SingleDeviceSharding

PINNED_HOST = "pinned_host"
# Memory kinds the host reads without a transfer.
HOST_MEMORY_KINDS = (PINNED_HOST, "unpinned_host")


def _placement(where) -> Sharding:
  """A device (one-device placement) or a sharding (e.g. replicated over a tensor-parallel
  mesh) as a sharding."""
  return where if isinstance(where, Sharding) else SingleDeviceSharding(where)


def pinned_host(where) -> Sharding:
  """Page-locked host memory of a device or sharding (DMA-able: transfers are asynchronous)."""
  return _placement(where).with_memory_kind(PINNED_HOST)


def on_device(where) -> Sharding:
  return _placement(where).with_memory_kind("device")


def stage(tree: Any, where) -> Any:
  """Host arrays -> device buffers, asynchronously. `where`: a device, or a sharding."""
  return jax.device_put(tree, on_device(where))


def to_host(tree: Any, where) -> Any:
  """Copy a device pytree to pinned host memory (the caller drops the device copy)."""
  return jax.device_put(tree, pinned_host(where))


def to_device(tree: Any, where) -> Any:
  """Copy a pinned-host pytree back to device memory."""
  return jax.device_put(tree, on_device(where))


def needs_copy(array: jax.Array) -> bool:
  """Whether reading `array` on the host needs a device-to-host copy: False for an array in
  host memory (pinned or unpinned: the executables write the outputs the host reads there)
  or on CPU devices (host memory too).

  Such an array gets no `copy_to_host_async()`: the copy is useless, and nothing waits for it
  (on the CPU `np.asarray` reads the buffer once it is ready), so its completion callback,
  which takes the GIL on an XLA worker thread, can run after the interpreter has begun
  finalizing, and abort the process ("terminate called without an active exception").
  """
  return (array.sharding.memory_kind not in HOST_MEMORY_KINDS
          and any(d.platform != "cpu" for d in array.sharding.device_set))


class AsyncReader:
  """FIFO of device arrays (or pytrees of them) whose device-to-host copies start on `push` and
  finish on `pop`."""

  def __init__(self):
    self._pending: collections.deque = collections.deque()

  def __len__(self) -> int:
    return len(self._pending)

  def push(self, arrays: Any, tag: Any = None) -> None:
    for array in jax.tree.leaves(arrays):
      if needs_copy(array):
        array.copy_to_host_async()
    self._pending.append((arrays, tag))

  def pop(self) -> tuple[Any, Any]:
    """The oldest arrays as NumPy (waits only if their copy has not landed yet), and the tag."""
    arrays, tag = self._pending.popleft()
    return jax.tree.map(np.asarray, arrays), tag
