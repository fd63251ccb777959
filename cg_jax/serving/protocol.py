"""OpenAI's wire formats: the request models (with the checks pydantic does), the error
body, and the response and chunk bodies with their log-probabilities."""


from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Annotated, Any

from fastapi.responses import JSONResponse
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field
from tokenizers import decoders

from cg_jax import text
from cg_jax.handles import EngineClosed, QueueFull, RequestTimeout
from cg_jax.sampling_params import ParamError

# --------------------------------------------------------------------------------------------------
# Errors

# `SamplingParams` fields -> the OpenAI fields that set them (chat's logprobs: `top_logprobs`).
OPENAI_NAMES = {"max_new_tokens": "max_tokens"}


class ApiError(Exception):
  """An error answered in OpenAI's format: {"error": {"message", "type", "param", "code"}}."""

  def __init__(self, status: int, message: str, *, param: str | None = None,
               type: str = "invalid_request_error", code: str | None = None):
    super().__init__(message)
    self.status, self.message, self.param, self.type, self.code = status, message, param, type, code

  def body(self) -> dict[str, Any]:
    return {"error": {"message": self.message, "type": self.type, "param": self.param,
                      "code": self.code}}

  def response(self) -> JSONResponse:
    return JSONResponse(self.body(), status_code=self.status)


def bad_request(param: str | None, message: str, code: str | None = None) -> ApiError:
  return ApiError(400, message, param=param, code=code)


def param_error(error: ParamError, names: Mapping[str, str]) -> ApiError:
  """The 400 of a bad sampling value, naming its OpenAI field (`names`: `SamplingParams` field
  -> OpenAI name; a field not there has the same name in both)."""
  name = names.get(error.param, error.param)
  return bad_request(name, error.message(name))


def engine_error(error: BaseException) -> ApiError:
  """The API error of an engine exception (from `submit` or a running request)."""
  if isinstance(error, QueueFull):
    return ApiError(429, str(error), type="rate_limit_error", code="rate_limit_exceeded")
  if isinstance(error, EngineClosed):
    return ApiError(503, str(error), type="server_error", code="engine_closed")
  if isinstance(error, RequestTimeout):
    return ApiError(504, str(error), type="timeout_error", code="timeout")
  if isinstance(error, ParamError):
    return param_error(error, OPENAI_NAMES)
  if isinstance(error, (ValueError, TypeError)):
    return bad_request(None, str(error))
  return ApiError(500, f"{type(error).__name__}: {error}", type="server_error")


def validation_error(errors: Sequence[Mapping[str, Any]]) -> ApiError:
  """The first of pydantic's (or FastAPI's) validation errors as a 400 naming the parameter."""
  first = errors[0]
  # Field names and indices; not "body" nor union members' tags such as "list[int]".
  loc = [part for part in first.get("loc", ()) if part != "body"
         and not (isinstance(part, str) and ("[" in part or "-" in part))]
  param = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".") or None
  kind, message = first.get("type", ""), first.get("msg", "invalid value")
  if kind == "json_invalid":
    reason = first.get("ctx", {}).get("error", message)
    return bad_request(None, f"the request body is not valid JSON: {reason}")
  if kind == "missing":
    return bad_request(param, f"missing required parameter: {param!r}" if param
                else "the request needs a JSON body")
  if kind == "extra_forbidden":
    return bad_request(param, f"unrecognized request argument supplied: {param!r}")
  if param is None:
    return bad_request(None, "the request body must be a JSON object, sent with Content-Type: "
                      "application/json")
  if kind == "value_error":
    return bad_request(param, message.removeprefix("Value error, "))
  got = first.get("input")
  return bad_request(param, f"invalid value for {param!r}: {message[:1].lower()}{message[1:]}, got "
                     f"{json.dumps(got) if jsonable(got) else repr(got)}")


def jsonable(value) -> bool:
  try:
    json.dumps(value)
  except (TypeError, ValueError):
    return False
  return True


# --------------------------------------------------------------------------------------------------
# Request models (OpenAI's fields; the unsupported ones are checked in `_check_unsupported`)


def is_token(value) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


def prompt_shape(value):
  if isinstance(value, str):
    return value
  if isinstance(value, list) and value:
    # (one type test per element type, not a call per token: prompts run to thousands of ids)
    kinds = set(map(type, value))
    if kinds == {str} or kinds == {int}:
      return value
    if kinds == {list} and all(set(map(type, x)) <= {int} for x in value):
      return value
  if isinstance(value, list) and not value:
    raise ValueError("prompt is empty: give a string, a list of strings, a list of token ids or "
                     "a list of token-id lists")
  raise ValueError(f"prompt must be a string, a list of strings, a list of token ids or a list "
                   f"of token-id lists, got {short(value)}")


def stop_shape(value):
  if value is None or isinstance(value, str):
    return value
  if isinstance(value, list) and all(isinstance(s, str) for s in value):
    return value
  raise ValueError(f"stop must be a string or a list of strings, got {short(value)}")


def content_shape(value):
  if value is None or isinstance(value, str):
    return value
  if isinstance(value, list) and all(isinstance(p, Mapping) and isinstance(p.get("type"), str)
                                     for p in value):
    return value
  raise ValueError(f"content must be a string or a list of content parts ({{\"type\": \"text\", "
                   f"\"text\": ...}}), got {short(value)}")


def short(value) -> str:
  text = json.dumps(value) if jsonable(value) else repr(value)
  return text if len(text) <= 80 else text[:77] + "..."


# (left to right, token ids before strings: in pydantic's default "smart" mode a list of ids was
# first tried as list[str], one error object per element, 3x the parse of a 480-id prompt)
Prompt = Annotated[str | list[int] | list[str] | list[list[int]], Field(union_mode="left_to_right"),
                   BeforeValidator(prompt_shape)]
Stop = Annotated[str | list[str] | None, BeforeValidator(stop_shape)]
_STRICT = ConfigDict(strict=True, frozen=True, extra="forbid")


class StreamOptions(BaseModel):
  model_config = _STRICT
  include_usage: bool | None = None
  # vLLM's extension (guidellm sends it): every chunk also carries the usage so far.
  continuous_usage_stats: bool | None = None


class SamplingFields(BaseModel):
  """The fields both endpoints share."""

  model_config = _STRICT
  model: str
  temperature: float | None = None
  top_p: float | None = None
  top_k: int | None = None
  seed: int | None = None
  stop: Stop = None
  stream: bool | None = False
  stream_options: StreamOptions | None = None
  n: int | None = None
  presence_penalty: float | None = None
  frequency_penalty: float | None = None
  logit_bias: dict[str, float] | None = None
  user: str | None = None
  ignore_eos: bool = False
  return_token_ids: bool = False


class CompletionRequest(SamplingFields):
  """POST /v1/completions."""

  prompt: Prompt
  max_tokens: int | None = None  # None: DEFAULT_MAX_TOKENS
  best_of: int | None = None
  logprobs: int | None = None
  echo: bool | None = None
  suffix: str | None = None


class ContentPart(BaseModel):
  model_config = ConfigDict(strict=True, frozen=True, extra="allow")
  type: str
  text: str | None = None


class ChatMessage(BaseModel):
  """A message; fields beyond role, content and name reach the template as they are."""

  model_config = ConfigDict(strict=True, frozen=True, extra="allow")
  role: str
  content: Annotated[str | list[ContentPart] | None, BeforeValidator(content_shape)] = None
  name: str | None = None


class ChatCompletionRequest(SamplingFields):
  """POST /v1/chat/completions."""

  messages: list[ChatMessage] = Field(min_length=1)
  max_tokens: int | None = None
  max_completion_tokens: int | None = None
  logprobs: bool | None = None
  top_logprobs: int | None = None
  tools: list[dict[str, Any]] | None = None
  tool_choice: str | dict[str, Any] | None = None
  parallel_tool_calls: bool | None = None
  response_format: dict[str, Any] | None = None



# --------------------------------------------------------------------------------------------------
# Log-probabilities


def byte_alphabet() -> dict[str, int]:
  """Byte-level BPE's alphabet (GPT-2's `bytes_to_unicode`): {the character standing for a byte:
  the byte}; printable Latin-1 bytes stand for themselves, the others for 256, 257, ..."""
  kept = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
          *range(ord("\xae"), ord("\xff") + 1)]
  chars = {b: b for b in kept}
  for b in range(256):
    if b not in chars:
      chars[b] = 256 + len(chars) - len(kept)
  return {chr(c): b for b, c in chars.items()}


_BYTE_OF = byte_alphabet()


class TokenText:
  """How log-probabilities name tokens. A token's string is `tokenizer.decode([id],
  skip_special_tokens=False)`: its text, a special token (EOS) by its name, a piece of a UTF-8
  character as U+FFFD. Its bytes are the UTF-8 bytes it stands for: exact with a byte-level
  tokenizer (a piece of a character has its own bytes), else its string's UTF-8 bytes."""

  def __init__(self, tokenizer):
    self.tokenizer = tokenizer
    self.byte_level = isinstance(tokenizer.decoder, decoders.ByteLevel)
    self._names: dict[int, str] = {}
    self._bytes: dict[int, list[int]] = {}

  def name(self, token: int) -> str:
    if token not in self._names:
      self._names[token] = self.tokenizer.decode([token], skip_special_tokens=False)
    return self._names[token]

  def bytes(self, token: int) -> list[int]:
    if token not in self._bytes:
      piece = self.tokenizer.id_to_token(token) if self.byte_level else None
      if piece and all(c in _BYTE_OF for c in piece):
        self._bytes[token] = [_BYTE_OF[c] for c in piece]
      else:
        self._bytes[token] = list(self.name(token).encode("utf-8"))
    return self._bytes[token]


class Offsets:
  """Where each next token starts in its choice's text (/v1/completions' `text_offset`): `start`
  (the echoed prompt's length) plus the length of the text decoded from the tokens before it
  (as the choice's text is decoded, an incomplete last character not counted). Tokens after a
  stop string, which the text leaves out, point at or past its end."""

  def __init__(self, tokenizer, start: int = 0):
    self.tokenizer, self.start = tokenizer, start
    self.ids: list[int] = []

  def next(self, token: int) -> int:
    before = text.decode(self.tokenizer, self.ids).rstrip("\ufffd") if self.ids else ""
    self.ids.append(token)
    return self.start + len(before)


class Logprobs:
  """One choice's log-probabilities in OpenAI's format, built token by token: `add` a token
  (with its log-probability and most likely alternatives), `take` the entries of the tokens
  added since the last `take`.

    /v1/completions: {"tokens": [str], "token_logprobs": [float], "top_logprobs": [{str: float}],
      "text_offset": [int]}; each top_logprobs dict holds the most likely tokens and the chosen
      one (so up to logprobs + 1 entries, as OpenAI's legacy API; the more likely one wins when
      two tokens have the same string). An echoed prompt's first token has null token_logprob
      and top_logprobs.
    chat: {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
      "bytes"}]}]}, top_logprobs the most likely tokens only.
  """

  def __init__(self, names: TokenText, chat: bool):
    self.names, self.chat = names, chat
    self.offsets = Offsets(names.tokenizer)
    self.entries: list = []

  def echo(self, ids: Sequence[int], scores: list, length: int) -> None:
    """Add the prompt's tokens (`scores`: `engine.score` of tokens 1..n-1, whose text has
    `length` characters); the generated tokens' offsets start after it."""
    offsets = Offsets(self.names.tokenizer)
    for i, token in enumerate(ids):
      logprob, top = (None, None) if i == 0 else scores[i - 1]
      self._add(token, logprob, top, offsets.next(token))
    self.offsets = Offsets(self.names.tokenizer, length)

  def add(self, token: int, logprob: float, top: Sequence[tuple[int, float]]) -> None:
    self._add(token, logprob, top, self.offsets.next(token))

  def _add(self, token: int, logprob: float | None, top, offset: int) -> None:
    names = self.names
    if self.chat:
      self.entries.append({"token": names.name(token), "logprob": logprob,
                           "bytes": names.bytes(token),
                           "top_logprobs": [{"token": names.name(t), "logprob": lp,
                                             "bytes": names.bytes(t)} for t, lp in top]})
      return
    alternatives = None
    if top is not None:
      alternatives = {}
      for t, lp in (*top, (token, logprob)):
        alternatives.setdefault(names.name(t), lp)
    self.entries.append((names.name(token), logprob, alternatives, offset))

  def take(self) -> dict[str, Any]:
    entries, self.entries = self.entries, []
    if self.chat:
      return {"content": entries}
    return {"tokens": [e[0] for e in entries], "token_logprobs": [e[1] for e in entries],
            "top_logprobs": [e[2] for e in entries], "text_offset": [e[3] for e in entries]}


class Chunks:
  """Stream chunks of one response (completion or chat), sharing its id and time."""

  def __init__(self, model: str, chat: bool, include_usage: bool, token_ids: bool):
    self.model, self.chat = model, chat
    self.include_usage, self.token_ids = include_usage, token_ids
    self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    self.created = int(time.time())
    self.running: dict[str, int] | None = None  # the usage so far (`continuous_usage_stats`)

  def choices(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
    data = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created, "model": self.model, "choices": choices}
    if self.include_usage:
      data["usage"] = self.running
    return data

  def usage(self, usage: dict[str, int]) -> dict[str, Any]:
    return dict(self.choices([]), usage=usage)

  def role(self, index: int) -> dict[str, Any]:
    return {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
            "finish_reason": None}

  def delta(self, index: int, text: str, ids: list[int],
            logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    if self.chat:
      choice = {"index": index, "delta": {"content": text}, "logprobs": logprobs,
                "finish_reason": None}
    else:
      choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": None}
    if self.token_ids:
      choice["token_ids"] = ids
    return choice

  def final(self, index: int, finish_reason: str,
            logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    if self.chat:
      return {"index": index, "delta": {}, "logprobs": logprobs, "finish_reason": finish_reason}
    choice = {"index": index, "text": "", "logprobs": logprobs, "finish_reason": finish_reason}
    if self.token_ids:
      choice["token_ids"] = []
    return choice
