"""`SamplingParams`: how one request decodes, validated once where it is built.

One value travels from the caller (`Engine.generate`/`stream`/`submit`/`validate`, the CLI, the
server) to the scheduler. Its rules:
  * Every check that does not depend on the model runs in `__post_init__` (types, ranges, NaN,
    the stop strings' count), and normalises: `stop` is a tuple of strings, `eos_token_id` a
    tuple of ids or None (the model's).
  * The checks that need the model (EOS ids below the vocabulary size, stop strings need a
    tokenizer, log-probabilities up to the vocabulary size) run in `settings`, once per call,
    which also issues the `IgnoredSamplingWarning` of a greedy request with sampling options.
  * A bad value raises `ParamError` (a ValueError; `ParamTypeError`, also a TypeError, for a
    value of the wrong type) carrying `.param` (the field) and `.value`; its message names the
    parameter, the value and the allowed range, and `message(name)` says it under another name
    (a CLI flag, an OpenAI field) with no text rewriting.
"""

from __future__ import annotations

import dataclasses
import math
import os
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from cg_jax.core.sampling import TOP_LOGPROBS
from cg_jax.validation import (IgnoredSamplingWarning, SamplingSettings, caller_stacklevel, is_int,
                               is_real, reject_unknown)

__all__ = ["MAX_EOS_IDS", "MAX_STOP_STRINGS", "ParamError", "ParamTypeError", "SamplingParams"]

MAX_EOS_IDS = 8
MAX_STOP_STRINGS = 8


class ParamError(ValueError):
  """A sampling parameter's bad value.

  Args:
    param: the `SamplingParams` field.
    value: the value given (or the part of it that is wrong).
    template: the message, with `{name}` where the parameter is named and `{value}` (or
      `{value!r}`) where its value is shown.
  """

  def __init__(self, param: str, value: Any, template: str):
    self.param, self.value, self.template = param, value, template
    super().__init__(self.message())

  def __reduce__(self):
    return type(self), (self.param, self.value, self.template)

  def message(self, name: str | None = None) -> str:
    """The message, naming the parameter `name` (default: the field's own name)."""
    return self.template.format(name=self.param if name is None else name, value=self.value)


class ParamTypeError(ParamError, TypeError):
  """A sampling parameter's value of the wrong type."""


def _eos_count(ids: tuple[int, ...]) -> None:
  if len(ids) > MAX_EOS_IDS:
    raise ParamError("eos_token_id", ids, f"{{name}} has {len(ids)} ids; at most {MAX_EOS_IDS} "
                                          "are supported")


def check_logprobs(value, allowed: int, param: str = "logprobs") -> int | None:
  """None (off) or how many alternatives to return per token, in [0, allowed]."""
  if value is None:
    return None
  if not is_int(value) or not 0 <= value <= allowed:
    raise ParamError(param, value, f"{{name}} must be None or an int in [0, {allowed}], got "
                                   "{value!r}")
  return int(value)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """How a request decodes: greedy by default.

  Attributes:
    max_new_tokens: tokens to generate per prompt (>= 1); a row also stops after an EOS id or a
      stop string.
    do_sample: False for greedy; True samples with temperature / top_k / top_p.
    temperature: >= 0, finite; 0 is greedy even with do_sample.
    top_k: keep the k most likely tokens (>= 0; 0 disables it).
    top_p: keep the smallest set of tokens whose probability reaches top_p, in (0, 1] (1
      disables it).
    seed: sampling seed in [0, 2**32), or None for a random one per call. The same seed gives
      the same tokens.
    eos_token_id: an id or a list of ids (at most MAX_EOS_IDS; stored as a tuple); None uses
      the model's; [] disables EOS.
    stop: a string or a list of strings (at most MAX_STOP_STRINGS, none empty; stored as a
      tuple; they need a tokenizer): a row ends once its text holds one; its text is cut before
      it, its tokens end with the one that completed it.
    logprobs: None, or each new token's log-probability under the model (before temperature and
      filtering) with its `logprobs` most likely alternatives (0 to `TOP_LOGPROBS`).
  Raises:
    ParamError (ParamTypeError for a wrong type) naming the parameter, on a bad value.
  """

  max_new_tokens: int = 32
  do_sample: bool = False
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  seed: int | None = None
  eos_token_id: int | Sequence[int] | None = None
  stop: str | Sequence[str] | None = None
  logprobs: int | None = None

  def __post_init__(self):
    set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 - frozen
    value = self.max_new_tokens
    if not is_int(value):
      raise ParamTypeError("max_new_tokens", value, "{name} must be an int, got {value!r}")
    if value <= 0:
      raise ParamError("max_new_tokens", value, "{name} must be >= 1, got {value}")
    set_("max_new_tokens", int(value))
    if not isinstance(self.do_sample, (bool, np.bool_)):
      raise ParamTypeError("do_sample", self.do_sample, "{name} must be a bool, got {value!r}")
    set_("do_sample", bool(self.do_sample))
    value = self.temperature
    if not is_real(value) or not math.isfinite(value) or value < 0:
      raise ParamError("temperature", value, "{name} must be a finite number >= 0, got {value!r}")
    value = self.top_k
    if not is_int(value):
      raise ParamTypeError("top_k", value, "{name} must be an int >= 0 (0 disables it), got "
                                           "{value!r}")
    if value < 0:
      raise ParamError("top_k", value, "{name} must be >= 0 (0 disables it), got {value}")
    set_("top_k", int(value))
    value = self.top_p
    if not is_real(value) or not 0.0 < value <= 1.0:  # NaN fails the comparison too
      raise ParamError("top_p", value, "{name} must be in (0, 1] (1 disables it), got {value!r}")
    value = self.seed
    if value is not None:
      if not is_int(value) or not 0 <= value < 2**32:
        raise ParamError("seed", value, "{name} must be None or an int in [0, 2**32), got "
                                        "{value!r}")
      set_("seed", int(value))
    set_("eos_token_id", self._eos(self.eos_token_id))
    set_("stop", self._stop(self.stop))
    set_("logprobs", check_logprobs(self.logprobs, TOP_LOGPROBS))

  @staticmethod
  def _eos(value) -> tuple[int, ...] | None:
    if value is None:
      return None
    if is_int(value):
      return (int(value),)
    if not isinstance(value, (list, tuple)) or not all(is_int(e) for e in value):
      raise ParamTypeError("eos_token_id", value, "{name} must be None, an int or a list of "
                                                  "ints, got {value!r}")
    ids = tuple(int(e) for e in value)
    _eos_count(ids)
    return ids

  @staticmethod
  def _stop(value) -> tuple[str, ...]:
    if value is None:
      return ()
    values = [value] if isinstance(value, str) else value
    if not isinstance(values, (list, tuple)) or not all(isinstance(s, str) for s in values):
      raise ParamTypeError("stop", value, "{name} must be None, a string or a list of strings, "
                                          "got {value!r}")
    if any(not s for s in values):
      raise ParamError("stop", list(values), "{name} strings must be non-empty, got {value!r}")
    if len(values) > MAX_STOP_STRINGS:
      raise ParamError("stop", list(values), f"{{name}} has {len(values)} strings; at most "
                                             f"{MAX_STOP_STRINGS} are supported")
    return tuple(values)

  @classmethod
  def of(cls, params: SamplingParams | None, keywords: Mapping[str, Any],
         where: str = "generate()", max_new_tokens: int | None = None) -> SamplingParams:
    """The params of a call that takes either `params` or the fields as keywords (`where` names
    the call in errors; a positional `max_new_tokens` counts as one of the keywords): unknown
    keywords are a TypeError saying what to use instead (`validation.FOREIGN_NAMES`), and so are
    both forms at once."""
    if max_new_tokens is not None:
      keywords = dict(keywords, max_new_tokens=max_new_tokens)
    names = {field.name for field in dataclasses.fields(cls)}
    reject_unknown(where, {k: v for k, v in keywords.items() if k not in names})
    if params is None:
      return cls(**keywords)
    if not isinstance(params, SamplingParams):
      raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
    if keywords:
      raise TypeError(f"{where} got both params and the sampling keyword(s) "
                      f"{', '.join(sorted(keywords))}: pass one or the other (e.g. "
                      f"dataclasses.replace(params, {sorted(keywords)[0]}=...))")
    return params

  def settings(self, *, vocab_size: int, default_eos: Sequence[int], has_tokenizer: bool
               ) -> tuple[SamplingSettings, tuple[str, ...], int | None]:
    """The model-dependent checks, and what the scheduler consumes: (`SamplingSettings`, the
    stop strings, log-probabilities' alternatives or None). A greedy request (do_sample=False
    or temperature 0) with sampling options set (a temperature other than 0 and 1 without
    do_sample, top_k, top_p, a seed) gets one `IgnoredSamplingWarning` naming them all, pointed
    at the user's call. A seed of None draws a random one here, per call."""
    eos = tuple(default_eos) if self.eos_token_id is None else self.eos_token_id
    for e in eos:
      if not 0 <= e < vocab_size:
        raise ParamError("eos_token_id", e, f"{{name}} {{value}} is out of range; allowed "
                                            f"[0, {vocab_size - 1}]")
    _eos_count(eos)
    if self.stop and not has_tokenizer:
      raise ParamTypeError("stop", self.stop, "{name} strings need a tokenizer (tokenizer.json "
                                              "in the checkpoint directory); use eos_token_id to "
                                              "stop on token ids")
    logprobs = check_logprobs(self.logprobs, min(TOP_LOGPROBS, vocab_size))
    temperature, do_sample = self.temperature, self.do_sample
    greedy = (not do_sample) or temperature == 0
    if greedy:
      # Off values: temperature 1 (the default) or 0 (greedy), top_k 0, top_p 1, seed None.
      ignored = [f"{name}={value!r}" for name, value, off in (
          ("temperature", temperature, do_sample or temperature in (0, 1)),
          ("top_k", self.top_k, self.top_k == 0), ("top_p", self.top_p, self.top_p == 1),
          ("seed", self.seed, self.seed is None)) if not off]
      if ignored:
        warnings.warn(f"{', '.join(ignored)} {'has' if len(ignored) == 1 else 'have'} no effect "
                      f"with greedy decoding (do_sample={do_sample}, temperature={temperature}): "
                      "pass do_sample=True and temperature > 0 to sample", IgnoredSamplingWarning,
                      stacklevel=caller_stacklevel())
    seed = self.seed
    if seed is None:
      seed = int.from_bytes(os.urandom(4), "little")  # (numpy's default_rng costs 10 us more)
    settings = SamplingSettings(greedy=greedy, temperature=float(temperature), top_k=self.top_k,
                                top_p=float(self.top_p), seed=seed, eos_ids=eos)
    return settings, self.stop, logprobs
