"""Block-shape rules the Triton lowering of Pallas kernels imposes, shared by the kernels here:
block dimensions are powers of two, and every operand dimension of a dot is at least 16."""

from __future__ import annotations

MIN_DOT_DIM = 16


def is_power_of_two(value) -> bool:
  """True for a positive int that is a power of two."""
  return isinstance(value, int) and not isinstance(value, bool) and value > 0 \
      and value & (value - 1) == 0


def check_split_config(config, powers: tuple[str, ...], dots: tuple[str, ...]) -> None:
  """Validates a split-K kernel's launch config (a dataclass with block_k, split_size,
  min_programs and num_stages): `powers` are powers of two, `dots` also >= MIN_DOT_DIM,
  split_size a multiple of block_k, min_programs an int >= 0, num_stages a positive int.
  Raises ValueError naming the class, the field and the value."""
  kind = type(config).__name__
  for name in powers:
    value = getattr(config, name)
    if not is_power_of_two(value):
      raise ValueError(f"{kind}.{name} must be a positive power of two, got {value!r}")
  for name in dots:
    if getattr(config, name) < MIN_DOT_DIM:
      raise ValueError(f"{kind}.{name} must be >= {MIN_DOT_DIM} (Triton dot), got "
                       f"{getattr(config, name)}")
  if config.split_size % config.block_k:
    raise ValueError(f"{kind}.split_size ({config.split_size}) must be a multiple of block_k "
                     f"({config.block_k})")
  for name, low in (("min_programs", 0), ("num_stages", 1)):
    value = getattr(config, name)
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
      raise ValueError(f"{kind}.{name} must be an int >= {low}, got {value!r}")
