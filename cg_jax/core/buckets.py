"""Bucketed shapes: each request is padded to the smallest (batch, prompt length) bucket that fits."""

from __future__ import annotations

import bisect
import dataclasses

DEFAULT_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32)


def powers_of_two(lowest: int, highest: int) -> tuple[int, ...]:
  """lowest, 2*lowest, ... up to and including `highest` (added if not a power of two)."""
  sizes, size = [], lowest
  while size < highest:
    sizes.append(size)
    size *= 2
  sizes.append(highest)
  return tuple(sizes)


@dataclasses.dataclass(frozen=True)
class Buckets:
  """Batch-size and prompt-length buckets.

  Args:
    batch_sizes: ascending batch buckets; a larger request batch is split into runs.
    prompt_lengths: ascending prompt-length buckets; a longer prompt is an error.
  """

  batch_sizes: tuple[int, ...]
  prompt_lengths: tuple[int, ...]

  def __post_init__(self):
    for name in ("batch_sizes", "prompt_lengths"):
      sizes = tuple(getattr(self, name))
      if not sizes or any(not isinstance(s, int) or isinstance(s, bool) or s <= 0 for s in sizes):
        raise ValueError(f"{name} must be a non-empty sequence of positive ints, got {sizes!r}")
      if list(sizes) != sorted(set(sizes)):
        raise ValueError(f"{name} must be strictly ascending, got {sizes!r}")
      object.__setattr__(self, name, sizes)

  @classmethod
  def default(cls, max_prompt_len: int, *, batch_sizes=DEFAULT_BATCH_BUCKETS,
              min_prompt_len: int = 16) -> "Buckets":
    """Default batch buckets and power-of-two prompt buckets up to `max_prompt_len`."""
    return cls(tuple(batch_sizes), powers_of_two(min(min_prompt_len, max_prompt_len), max_prompt_len))

  @property
  def max_batch(self) -> int:
    return self.batch_sizes[-1]

  @property
  def max_prompt_len(self) -> int:
    return self.prompt_lengths[-1]

  def batch_bucket(self, batch: int) -> int:
    """Smallest batch bucket >= batch; ValueError beyond the largest (split with `split`)."""
    return _smallest_fitting(self.batch_sizes, batch, "batch size")

  def length_bucket(self, length: int) -> int:
    """Smallest prompt-length bucket >= length; ValueError beyond the largest."""
    return _smallest_fitting(self.prompt_lengths, length, "prompt length")

  def split(self, batch: int) -> list[tuple[int, int]]:
    """Runs (start, stop) covering `batch` rows, each at most the largest batch bucket."""
    step = self.max_batch
    return [(start, min(start + step, batch)) for start in range(0, batch, step)]


def _smallest_fitting(sizes: tuple[int, ...], value: int, what: str) -> int:
  index = bisect.bisect_left(sizes, value)
  if value < 1 or index == len(sizes):
    raise ValueError(f"{what} {value} fits no bucket; allowed range is 1..{sizes[-1]} "
                     f"(buckets {sizes})")
  return sizes[index]
