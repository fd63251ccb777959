"""A step's request arrays in one int32 buffer, the staged buffer: packed on the host (one
transfer), copied into it in place by the "load" executable, read by every step executable as
slices of it, and carried on by each step (it writes the next lengths into it).

The staged buffer is donated to "load", to each step and aliased to their outputs, so it keeps
one device address for the engine's life; with the carry and the cache donated too, no buffer a
step reads moves between calls, whether its inputs are new or the last decode step's. XLA
updates the commands of an executable's command buffer (CUDA graph) whose buffers moved, on the
host, before it launches it: a step whose index arrays were fresh transfers would pay that for
every layer's attention kernel.

Layout of a step of T tokens and R = rows(T) of U rows at most, W blocks per table (shape
letters: the README's table), from offset 0; the rest of the buffer is unused:

  seq_lens [U] | tokens [T] | feed [T] | tables [R, W] | query_starts [R + 1] | query_lens [R]

seq_lens first and always C long: the lengths of every step's rows sit at [0, R) whatever its
bucket (`draw` of R rows reads them there), rows past R zero.

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
    step_rows: U, the most rows of a step (a step of T tokens has min(T, U)).
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
    return self.step_rows + 2 * tokens + rows * self.width + 2 * rows + 1

  @property
  def size(self) -> int:
    """I: the staged buffer's length (the largest step's)."""
    return max(self.length(tokens) for tokens in self.token_buckets)

  def pack(self, tokens: np.ndarray, feed: np.ndarray, tables: np.ndarray,
           query_starts: np.ndarray, query_lens: np.ndarray,
           seq_lens: np.ndarray) -> np.ndarray:
    """int32 [I]: a step's arrays as the module docstring lays them out, zeros elsewhere."""
    size, rows = tokens.shape[0], self.rows(tokens.shape[0])
    arrays = (tokens, feed, tables, query_starts, query_lens, seq_lens)
    expected = ((size,), (size,), (rows, self.width), (rows + 1,), (rows,), (rows,))
    shapes = tuple(a.shape for a in arrays)
    if shapes != expected:
      raise ValueError(f"a step of {size} tokens takes arrays of shapes {expected}, got {shapes}")
    out = np.zeros((self.size,), np.int32)
    out[:rows] = seq_lens
    np.concatenate([a.reshape(-1) for a in arrays[:5]],
                   out=out[self.step_rows:self.length(size)], casting="same_kind")
    return out

  def split(self, staged, tokens: int) -> tuple:
    """(tokens [T], feed [T], tables [R, W], query_starts [R + 1], query_lens [R],
    seq_lens [R]) of a step of `tokens` tokens, from the staged buffer [I] (NumPy or JAX)."""
    rows = self.rows(tokens)
    sizes = (tokens, tokens, rows * self.width, rows + 1, rows)
    ends = self.step_rows + np.cumsum(sizes)
    parts = [staged[int(end) - n:int(end)] for n, end in zip(sizes, ends)]
    parts[2] = parts[2].reshape(rows, self.width)
    return (*parts, staged[:rows])
