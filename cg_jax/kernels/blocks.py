"""Block-shape rules the Triton lowering of Pallas kernels imposes, shared by the kernels here:
block dimensions are powers of two, and every operand dimension of a dot is at least 16."""

from __future__ import annotations

MIN_DOT_DIM = 16


def is_power_of_two(value) -> bool:
  """True for a positive int that is a power of two."""
  return isinstance(value, int) and not isinstance(value, bool) and value > 0 \
      and value & (value - 1) == 0
