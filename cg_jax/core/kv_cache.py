"""The KV cache's lifecycle: allocated once by its executable, donated into every step and
replaced by the step's output, swapped out to pinned host memory and back."""

from __future__ import annotations

from collections.abc import Callable

import jax

from cg_jax.core import host_io
from models.decoder import KVCache


class CacheHolder:
  """Holds the engine's one KV cache.

  Args:
    allocate: returns a fresh zeroed cache on the device (the ("cache",) executable).
    placement: where the cache lives (a device or a sharding), for swapping.
  """

  def __init__(self, allocate: Callable[[], KVCache], placement):
    self._allocate, self._placement = allocate, placement
    self._device: KVCache | None = None
    self._host: KVCache | None = None  # the cache while swapped out

  def get(self) -> KVCache:
    """The device cache, swapped in or allocated when needed."""
    if self._host is not None:
      self.swap_in()
    if self._device is None or self._device.k.is_deleted() or self._device.v.is_deleted():
      self._device = self._allocate()
    return self._device

  def set(self, cache: KVCache) -> None:
    """Keep a step's output cache (its input was donated)."""
    self._device = cache

  def release(self) -> None:
    """Free the cache's memory, device and host (a later `get` allocates a new one)."""
    if self._device is not None:
      for array in (self._device.k, self._device.v):
        array.delete()
    self._device = self._host = None

  def swap_out(self) -> None:
    """Move the cache to pinned host memory and free its device memory."""
    if self._device is None or self._host is not None:
      return
    self._host = host_io.to_host(self._device, self._placement)
    jax.block_until_ready(self._host)
    for array in (self._device.k, self._device.v):
      array.delete()
    self._device = None

  def swap_in(self) -> None:
    """Bring a swapped-out cache back to device memory."""
    if self._host is None:
      return
    self._device = host_io.to_device(self._host, self._placement)
    self._host = None

  @property
  def swapped_out(self) -> bool:
    return self._host is not None

  @property
  def on_device(self) -> bool:
    return self._device is not None

  @property
  def memory_kind(self) -> str | None:
    """"device", "pinned_host" (swapped out) or None (not allocated yet)."""
    cache = self._device if self._device is not None else self._host
    return None if cache is None else cache.k.sharding.memory_kind
