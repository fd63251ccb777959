"""A step's request arrays in one int32 buffer: packed on the host (one transfer), copied in place
into the engine's staged buffer by the "load" executable (`cg_jax.core.executables`), and read
by every step executable as slices of that buffer.

The staged buffer is donated to "load" and aliased to its output, so it keeps one device address
for the engine's life; with the carry, the lengths and the cache donated too, no buffer a step
reads moves between calls. XLA updates the commands of an executable's command buffer (CUDA
graph) whose buffers moved before it launches it, on the host: a step whose index arrays were
fresh transfers would pay that for every layer's attention kernel.

Layout of a step of T tokens and R = rows(T) rows, W blocks per table (shape letters: the
README's table), at offset 0 of the staged buffer; the rest of it is unused:

  tokens [T] | feed [T] | tables [R, W] | query_starts [R + 1] | query_lens [R]

This module imports no jax: `split` slices NumPy and JAX arrays alike.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class StepLayout:
  """Where a step's arrays lie in the staged buffer.

  Args:
    token_buckets: the step executables' token counts.
    step_rows: C, the most rows of a step (a step of T tokens has min(T, C)).
    width: W, blocks per block table.
  """

  token_buckets: tuple[int, ...]
  step_rows: int
  width: int

  def rows(self, tokens: int) -> int:
    return min(tokens, self.step_rows)

  def length(self, tokens: int) -> int:
    """int32 elements a step of `tokens` tokens uses."""
    rows = self.rows(tokens)
    return 2 * tokens + rows * self.width + 2 * rows + 1

  @property
  def size(self) -> int:
    """P: the staged buffer's length (the largest step's)."""
    return max(self.length(tokens) for tokens in self.token_buckets)

  def pack(self, tokens: np.ndarray, feed: np.ndarray, tables: np.ndarray,
           query_starts: np.ndarray, query_lens: np.ndarray) -> np.ndarray:
    """int32 [P]: a step's arrays (see the module docstring) end to end, zeros after them."""
    size, rows = tokens.shape[0], self.rows(tokens.shape[0])
    expected = ((size,), (size,), (rows, self.width), (rows + 1,), (rows,))
    arrays = (tokens, feed, tables, query_starts, query_lens)
    shapes = tuple(a.shape for a in arrays)
    if shapes != expected:
      raise ValueError(f"a step of {size} tokens takes arrays of shapes {expected}, got {shapes}")
    out = np.zeros((self.size,), np.int32)
    np.concatenate([a.reshape(-1) for a in arrays], out=out[:self.length(size)],
                   casting="same_kind")
    return out

  def split(self, staged, tokens: int) -> tuple:
    """(tokens [T], feed [T], tables [R, W], query_starts [R + 1], query_lens [R]) of a step
    of `tokens` tokens, from the staged buffer [P] (NumPy or JAX)."""
    rows = self.rows(tokens)
    sizes = (tokens, tokens, rows * self.width, rows + 1, rows)
    ends = np.cumsum(sizes)
    parts = [staged[int(end) - n:int(end)] for n, end in zip(sizes, ends)]
    parts[2] = parts[2].reshape(rows, self.width)
    return tuple(parts)
