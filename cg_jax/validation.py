"""Host-side request validation: every bad input is rejected before anything reaches the device.
The sampling parameters' checks live in `cg_jax.sampling_params`; this module holds the
prompts' and lengths' checks and what the scheduler consumes (`SamplingSettings`, `Request`).

JAX clamps out-of-range gathers and cache writes silently, so each check here names the
parameter, the value and the allowed range.
"""

from __future__ import annotations

import dataclasses
import numbers
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

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
    "max_batch_size": "use max_num_seqs",
    "max_model_len": "use max_seq_len",
    "device_loop": "removed: it was slower than the pipelined host loop (each decode step is "
                   "one CUDA graph launched ahead; benchmarks/results/device_loop_h200.md)",
    "decode_loop_steps": "removed with the device loop (benchmarks/results/device_loop_h200.md)",
    "cache_write": "removed with the slot-cache decode kernel: the paged kernel writes the new "
                   "keys and values itself",
    "decode_attention": "removed with the slot-cache decode kernel (the paged kernel serves "
                        "decode steps)",
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


def is_int(value) -> bool:
  return _is_int_type(type(value))


def is_real(value) -> bool:
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
    if is_int(row):
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
        if not is_int(token):
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
            max_new_tokens: int) -> None:
  """Check that each prompt and its continuation (`max_new_tokens`, already checked to be an
  int >= 1 by `SamplingParams`) fit."""
  for index, row in enumerate(rows):
    if len(row) > max_prompt_len:
      raise ValueError(f"prompt {index} has {len(row)} tokens; the largest prompt-length bucket "
                       f"is {max_prompt_len} (allowed 1..{max_prompt_len})")
    if len(row) + max_new_tokens > max_seq_len:
      raise ValueError(
          f"prompt {index} ({len(row)} tokens) + max_new_tokens ({max_new_tokens}) = "
          f"{len(row) + max_new_tokens} exceeds the context of {max_seq_len} tokens; allowed "
          f"max_new_tokens for this prompt: 1..{max_seq_len - len(row)}")


@dataclasses.dataclass
class Request:
  """A validated request: its prompts, budget, sampling settings and stop strings."""

  rows: list[np.ndarray]
  max_new_tokens: int
  settings: SamplingSettings
  stop: tuple[str, ...] = ()
  stats: dict[str, Any] = dataclasses.field(default_factory=dict)
  logprobs: int | None = None  # top alternatives per new token (0: the chosen one's only)


def timeout(value) -> None:
  """A request's `timeout`: None or a number of seconds > 0."""
  if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)
                            or not value > 0):
    raise ValueError(f"timeout must be None or a number of seconds > 0, got {value!r}")


def request(inputs, params, *, vocab_size: int, max_seq_len: int, default_eos: Sequence[int],
            has_tokenizer: bool) -> Request:
  """Every check of one request on the host, in one place (`Engine.validate` and the serving
  front end's client of the engine core both use it): token-id prompts (`inputs`, as
  `prompts`), their lengths against the cache, and the `SamplingParams` `params` against the
  model (`params.settings`)."""
  rows = prompts(inputs, vocab_size)
  # Prompts are prefilled in chunks, up to the cache.
  lengths(rows, max_prompt_len=max_seq_len - 1, max_seq_len=max_seq_len,
          max_new_tokens=params.max_new_tokens)
  settings, stops, top = params.settings(vocab_size=vocab_size, default_eos=default_eos,
                                         has_tokenizer=has_tokenizer)
  return Request(rows, params.max_new_tokens, settings, stops, logprobs=top)
