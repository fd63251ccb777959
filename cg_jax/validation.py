"""Host-side request validation: every bad input is rejected before anything reaches the device.

JAX clamps out-of-range gathers and cache writes silently, so each check here names the
parameter, the value and the allowed range.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
import sys
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np

MAX_EOS_IDS = 8
MAX_STOP_STRINGS = 8
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


class IgnoredSamplingWarning(UserWarning):
  """Sampling options were given to a greedy decode (do_sample=False or temperature 0), where
  they have no effect."""


def caller_stacklevel() -> int:
  """The `warnings.warn` stacklevel, for a warning issued by the function that calls this, of
  the nearest frame outside the cg_jax package: the user's call, however deep inside cg_jax the
  warning is issued."""
  frame, level = sys._getframe(1), 1
  while frame.f_back is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
    frame, level = frame.f_back, level + 1
  return level

# Names users bring from Hugging Face transformers (or the OpenAI API), and what to use instead.
FOREIGN_NAMES = {
    "max_length": "use max_new_tokens (tokens to generate per prompt, the prompt not counted)",
    "max_tokens": "use max_new_tokens",
    "min_new_tokens": "not supported; eos_token_id=[] runs for max_new_tokens",
    "min_length": "not supported; eos_token_id=[] runs for max_new_tokens",
    "stop_strings": "use stop",
    "stop_sequences": "use stop",
    "num_beams": "beam search is not supported: greedy or sampling only",
    "num_return_sequences": "not supported; repeat the prompt with do_sample=True and a seed",
    "repetition_penalty": "repetition penalties are not supported",
    "pad_token_id": "not needed: prompts of any lengths are padded internally",
    "attention_mask": "not needed: pass the prompts as ragged token-id lists",
    "input_ids": "use inputs (the first argument)",
    "prompt": "use inputs (the first argument)",
    "generation_config": "use the sampling keywords (do_sample, temperature, top_k, top_p, seed)",
    "use_cache": "not needed: the KV cache is always used",
    "torch_dtype": "use dtype",
    "device_map": "use tensor_parallel (devices to split the model over)",
    "max_batch_size": "use batch_buckets",
    "max_model_len": "use max_seq_len",
    "device_loop": "removed: it was slower than the pipelined host loop (each decode step is "
                   "one CUDA graph launched ahead; benchmarks/results/device_loop_h200.md)",
    "decode_loop_steps": "removed with the device loop (benchmarks/results/device_loop_h200.md)",
}


def reject_unknown(where: str, unknown: Mapping[str, Any]) -> None:
  """TypeError naming each unexpected keyword of `where`, with what to use instead."""
  if not unknown:
    return
  parts = []
  for name in sorted(unknown):
    hint = FOREIGN_NAMES.get(name)
    parts.append(f"{name!r}" + (f" ({hint})" if hint else ""))
  raise TypeError(f"{where} got unexpected keyword argument(s): {', '.join(parts)}")


@dataclasses.dataclass(frozen=True)
class SamplingSettings:
  """Validated sampling settings of one request."""

  greedy: bool
  temperature: float
  top_k: int
  top_p: float
  seed: int
  eos_ids: tuple[int, ...]


def _is_int_type(kind: type) -> bool:
  return issubclass(kind, numbers.Integral) and not issubclass(kind, (bool, np.bool_))


def _is_int(value) -> bool:
  return _is_int_type(type(value))


def _is_real(value) -> bool:
  return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


def prompts(input_ids, vocab_size: int) -> list[np.ndarray]:
  """Validate token-id prompts: a list of int lists (ragged) or a 2-D integer array.

  Returns:
    One int32 array per row.
  """
  if isinstance(input_ids, np.ndarray) or hasattr(input_ids, "__array__"):
    array = np.asarray(input_ids)
    if array.ndim != 2:
      raise ValueError(f"input_ids must have rank 2 [batch, length], got shape {array.shape}")
    if not np.issubdtype(array.dtype, np.integer):
      raise TypeError(f"input_ids must hold integers, got dtype {array.dtype}")
    rows = list(array)
  elif isinstance(input_ids, (list, tuple)):
    rows = list(input_ids)
  else:
    raise TypeError(f"input_ids must be a list of token-id lists or a 2-D int array, "
                    f"got {type(input_ids).__name__}")
  if not rows:
    raise ValueError("input_ids is empty: need at least one prompt")
  result = []
  for index, row in enumerate(rows):
    if _is_int(row):
      raise ValueError("input_ids must have rank 2 (a list of token-id lists); got a flat list "
                       "of ints: wrap a single prompt as [[...]]")
    if isinstance(row, np.ndarray):
      if row.ndim != 1:
        raise ValueError(f"input_ids[{index}] must be 1-D, got shape {row.shape}")
      values = row.tolist() if np.issubdtype(row.dtype, np.integer) else list(row)
    elif isinstance(row, (list, tuple)):
      values = list(row)
    else:
      raise TypeError(f"input_ids[{index}] must be a list of ints, got {type(row).__name__}")
    if not values:
      raise ValueError(f"input_ids[{index}] is empty: every prompt needs at least one token")
    # One test per element type, not per token; the token named only when one is wrong.
    if not all(_is_int_type(kind) for kind in set(map(type, values))):
      for position, token in enumerate(values):
        if not _is_int(token):
          raise TypeError(f"input_ids[{index}][{position}] must be an int token id, "
                          f"got {token!r} ({type(token).__name__})")
    try:
      ids = np.asarray(values, dtype=np.int64)
      bad = np.flatnonzero((ids < 0) | (ids >= vocab_size))
      position = int(bad[0]) if bad.size else None
    except OverflowError:  # beyond int64
      position = next(i for i, token in enumerate(values) if not -2**63 <= token < 2**63)
    if position is not None:
      raise ValueError(f"input_ids[{index}][{position}] = {int(values[position])} is out of "
                       f"range; token ids must be in [0, {vocab_size - 1}]")
    result.append(ids.astype(np.int32))
  return result


def lengths(rows: list[np.ndarray], *, max_prompt_len: int, max_seq_len: int,
            max_new_tokens) -> None:
  """Check max_new_tokens and that each prompt and its continuation fit."""
  if not _is_int(max_new_tokens):
    raise TypeError(f"max_new_tokens must be an int, got {max_new_tokens!r}")
  if max_new_tokens <= 0:
    raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
  for index, row in enumerate(rows):
    if len(row) > max_prompt_len:
      raise ValueError(f"prompt {index} has {len(row)} tokens; the largest prompt-length bucket "
                       f"is {max_prompt_len} (allowed 1..{max_prompt_len})")
    if len(row) + max_new_tokens > max_seq_len:
      raise ValueError(
          f"prompt {index} ({len(row)} tokens) + max_new_tokens ({max_new_tokens}) = "
          f"{len(row) + max_new_tokens} exceeds the context of {max_seq_len} tokens; allowed "
          f"max_new_tokens for this prompt: 1..{max_seq_len - len(row)}")


def sampling(*, do_sample, temperature, top_k, top_p, seed, eos_token_id, default_eos,
             vocab_size: int) -> SamplingSettings:
  """Validate sampling settings; temperature 0 (or do_sample=False) means greedy. A greedy
  request with sampling options set (a temperature other than 0 and 1 without do_sample, top_k,
  top_p, a seed) gets one `IgnoredSamplingWarning` naming them all, pointed at the user's
  call."""
  if not isinstance(do_sample, (bool, np.bool_)):
    raise TypeError(f"do_sample must be a bool, got {do_sample!r}")
  if not _is_real(temperature) or not math.isfinite(temperature) or temperature < 0:
    raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
  if not _is_int(top_k):
    raise TypeError(f"top_k must be an int >= 0 (0 disables it), got {top_k!r}")
  if top_k < 0:
    raise ValueError(f"top_k must be >= 0 (0 disables it), got {top_k}")
  if not _is_real(top_p) or not (0.0 < top_p <= 1.0):  # NaN fails the comparison too
    raise ValueError(f"top_p must be in (0, 1] (1 disables it), got {top_p!r}")
  if seed is not None and (not _is_int(seed) or not 0 <= seed < 2**32):
    raise ValueError(f"seed must be None or an int in [0, 2**32), got {seed!r}")
  if eos_token_id is None:
    eos = tuple(default_eos)
  elif _is_int(eos_token_id):
    eos = (int(eos_token_id),)
  elif isinstance(eos_token_id, (list, tuple)) and all(_is_int(e) for e in eos_token_id):
    eos = tuple(int(e) for e in eos_token_id)
  else:
    raise TypeError(f"eos_token_id must be None, an int or a list of ints, got {eos_token_id!r}")
  for e in eos:
    if not 0 <= e < vocab_size:
      raise ValueError(f"eos_token_id {e} is out of range; allowed [0, {vocab_size - 1}]")
  if len(eos) > MAX_EOS_IDS:
    raise ValueError(f"eos_token_id has {len(eos)} ids; at most {MAX_EOS_IDS} are supported")
  greedy = (not do_sample) or temperature == 0
  if greedy:
    # Off values: temperature 1 (the default) or 0 (greedy), top_k 0, top_p 1, seed None.
    ignored = [f"{name}={value!r}" for name, value, off in (
        ("temperature", temperature, do_sample or temperature in (0, 1)),
        ("top_k", top_k, top_k == 0), ("top_p", top_p, top_p == 1), ("seed", seed, seed is None))
        if not off]
    if ignored:
      warnings.warn(f"{', '.join(ignored)} {'has' if len(ignored) == 1 else 'have'} no effect "
                    f"with greedy decoding (do_sample={do_sample}, temperature={temperature}): "
                    "pass do_sample=True and temperature > 0 to sample", IgnoredSamplingWarning,
                    stacklevel=caller_stacklevel())
  if seed is None:
    seed = int(np.random.default_rng().integers(0, 2**32))
  return SamplingSettings(greedy=greedy, temperature=float(temperature), top_k=int(top_k),
                          top_p=float(top_p), seed=int(seed), eos_ids=eos)


def stop_strings(stop, has_tokenizer: bool) -> tuple[str, ...]:
  """Validate `stop`: None, a string or a list of strings (at most MAX_STOP_STRINGS, none
  empty), which need a tokenizer."""
  if stop is None:
    return ()
  values = [stop] if isinstance(stop, str) else stop
  if not isinstance(values, (list, tuple)) or not all(isinstance(s, str) for s in values):
    raise TypeError(f"stop must be None, a string or a list of strings, got {stop!r}")
  if any(not s for s in values):
    raise ValueError(f"stop strings must be non-empty, got {list(values)!r}")
  if len(values) > MAX_STOP_STRINGS:
    raise ValueError(f"stop has {len(values)} strings; at most {MAX_STOP_STRINGS} are supported")
  if values and not has_tokenizer:
    raise TypeError("stop strings need a tokenizer (tokenizer.json in the checkpoint directory); "
                    "use eos_token_id to stop on token ids")
  return tuple(values)


def logprobs(value, allowed: int) -> int | None:
  """None (off) or how many alternatives to return per token, in [0, allowed]."""
  if value is None:
    return None
  if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or \
      not 0 <= value <= allowed:
    raise ValueError(f"logprobs must be None or an int in [0, {allowed}], got {value!r}")
  return int(value)


@dataclasses.dataclass
class Request:
  """A validated request: its prompts, budget, sampling settings and stop strings."""

  rows: list[np.ndarray]
  max_new_tokens: int
  settings: SamplingSettings
  stop: tuple[str, ...] = ()
  stats: dict[str, Any] = dataclasses.field(default_factory=dict)
  logprobs: int | None = None  # top alternatives per new token (0: the chosen one's only)
