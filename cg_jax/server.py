"""An OpenAI-compatible HTTP server over one `Engine` (FastAPI + uvicorn).

Endpoints: POST /v1/completions, POST /v1/chat/completions (server-sent events with
`stream: true`), GET /v1/models, GET /health, GET /metrics (Prometheus text).

Rules:
  * Every request is validated on the host before anything is queued; a bad one gets a 400 in
    OpenAI's error format naming the parameter, the value and the allowed range (FastAPI's 422
    validation errors included). An unknown model is a 404, a full queue (`QueueFull`) a 429, a
    closed engine a 503, a request past its `request_timeout` a 504.
  * The event loop never blocks on the engine: tokens arrive through the handles' `async for`.
  * A client that disconnects cancels its requests, which frees their slots.
  * `serve` binds its socket before anything compiles (a busy port fails at once,
    `ListenError`). The app's lifespan starts the engine's warm-up (`Warmup`: log-probabilities'
    executables included, so nothing compiles on the request path) in a thread while the server
    already answers: until it is done, /health is a 503 saying how far it got and the API a 503
    (code "warming_up"); its progress goes to the log. A failed warm-up keeps /health at 500 with
    the reason and stops `serve` (`WarmupFailed`). At shutdown the lifespan stops a warm-up
    still running (the compiles in flight finish) and closes the engine; uvicorn's graceful
    shutdown lets in-flight requests finish for `graceful_timeout` seconds, then cancels them.
  * `temperature` 0 is greedy; `top_k` (0 or -1 = off), `ignore_eos` and `return_token_ids`
    (token ids in each choice and chunk) are extensions. `n`, `best_of` are 1; `suffix`,
    penalties, `logit_bias` and tools are not supported (400).
  * Log-probabilities are the model's (before temperature and filtering), natural-log, in
    OpenAI's formats (`_Logprobs`): /v1/completions' `logprobs` (0 to `TOP_LOGPROBS`
    alternatives; OpenAI's legacy API allows up to 5), chat's `logprobs: true` with
    `top_logprobs` (0 to `TOP_LOGPROBS`; without `logprobs: true` a 400). They cover every
    generated token, the EOS token and the ones of a cut stop string included (as `token_ids`).
    A token's string is `tokenizer.decode([id], skip_special_tokens=False)` (`_TokenText`).
  * `echo: true` (/v1/completions) starts each choice's text with its prompt (the string as
    given, or the token ids decoded) and, with `logprobs`, its logprobs with the prompt's tokens
    (`engine.score`; the first token's are null). `max_tokens: 0` needs `echo` and generates
    nothing (finish_reason "length"): how evaluation harnesses score prompts; then the prompt
    may fill the context (max_seq_len tokens), scored or not. Streamed, the prompt comes first,
    in a chunk of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import json
import logging
import math
import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Annotated, Any, ClassVar

import fastapi
import uvicorn
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import generate_latest
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException
from tokenizers import decoders

from cg_jax import text
from cg_jax.chat_template import ChatTemplate, TemplateError
from cg_jax.engine import Engine
from cg_jax.executables import SERVING_PHASES
from cg_jax.hub import resolve_model
from cg_jax.sampling_params import ParamError, SamplingParams
from cg_jax.scheduler import Completion, Delta, EngineClosed, Handle, QueueFull, RequestTimeout
from models.config import PRESETS

MAX_TEMPERATURE = 2.0
DEFAULT_MAX_TOKENS = 16  # /v1/completions' default, as OpenAI's; chat's is the rest of the context
# `SamplingParams` fields -> the OpenAI fields that set them (chat's logprobs: `top_logprobs`).
OPENAI_NAMES = {"max_new_tokens": "max_tokens"}
NO_TOKENIZER = "send the prompt to /v1/completions as token ids"  # what to do without a tokenizer
# Seconds the first token and each next one may take: the histograms' buckets.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
DURATION_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
# The warm-up compiles these phases' executables: serving and log-probabilities (`echo` included).
WARMUP_PHASES = (*SERVING_PHASES, "logprobs")
PROGRESS_EVERY = 5.0  # seconds between the warm-up's progress lines in the log
# uvicorn's log (its format and level): the server's own lines go there too.
log = logging.getLogger("uvicorn.error")


# --------------------------------------------------------------------------------------------------
# Errors


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


def _bad(param: str | None, message: str, code: str | None = None) -> ApiError:
  return ApiError(400, message, param=param, code=code)


def _param_error(error: ParamError, names: Mapping[str, str]) -> ApiError:
  """The 400 of a bad sampling value, naming its OpenAI field (`names`: `SamplingParams` field
  -> OpenAI name; a field not there has the same name in both)."""
  name = names.get(error.param, error.param)
  return _bad(name, error.message(name))


def engine_error(error: BaseException) -> ApiError:
  """The API error of an engine exception (from `submit` or a running request)."""
  if isinstance(error, QueueFull):
    return ApiError(429, str(error), type="rate_limit_error", code="rate_limit_exceeded")
  if isinstance(error, EngineClosed):
    return ApiError(503, str(error), type="server_error", code="engine_closed")
  if isinstance(error, RequestTimeout):
    return ApiError(504, str(error), type="timeout_error", code="timeout")
  if isinstance(error, ParamError):
    return _param_error(error, OPENAI_NAMES)
  if isinstance(error, (ValueError, TypeError)):
    return _bad(None, str(error))
  return ApiError(500, f"{type(error).__name__}: {error}", type="server_error")


def _validation_error(error: RequestValidationError) -> ApiError:
  """FastAPI's first validation error as a 400 naming the parameter."""
  first = error.errors()[0]
  # Field names and indices; not "body" nor union members' tags such as "list[int]".
  loc = [part for part in first.get("loc", ()) if part != "body"
         and not (isinstance(part, str) and ("[" in part or "-" in part))]
  param = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".") or None
  kind, message = first.get("type", ""), first.get("msg", "invalid value")
  if kind == "json_invalid":
    reason = first.get("ctx", {}).get("error", message)
    return _bad(None, f"the request body is not valid JSON: {reason}")
  if kind == "missing":
    return _bad(param, f"missing required parameter: {param!r}" if param
                else "the request needs a JSON body")
  if kind == "extra_forbidden":
    return _bad(param, f"unrecognized request argument supplied: {param!r}")
  if param is None:
    return _bad(None, "the request body must be a JSON object, sent with Content-Type: "
                      "application/json")
  if kind == "value_error":
    return _bad(param, message.removeprefix("Value error, "))
  got = first.get("input")
  return _bad(param, f"invalid value for {param!r}: {message[:1].lower()}{message[1:]}, got "
                     f"{json.dumps(got) if _jsonable(got) else repr(got)}")


def _jsonable(value) -> bool:
  try:
    json.dumps(value)
  except (TypeError, ValueError):
    return False
  return True


# --------------------------------------------------------------------------------------------------
# Request models (OpenAI's fields; the unsupported ones are checked in `_check_unsupported`)


def _is_token(value) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


def _prompt_shape(value):
  if isinstance(value, str):
    return value
  if isinstance(value, list) and value:
    if all(isinstance(x, str) for x in value) or all(_is_token(x) for x in value):
      return value
    if all(isinstance(x, list) and all(_is_token(t) for t in x) for x in value):
      return value
  if isinstance(value, list) and not value:
    raise ValueError("prompt is empty: give a string, a list of strings, a list of token ids or "
                     "a list of token-id lists")
  raise ValueError(f"prompt must be a string, a list of strings, a list of token ids or a list "
                   f"of token-id lists, got {_short(value)}")


def _stop_shape(value):
  if value is None or isinstance(value, str):
    return value
  if isinstance(value, list) and all(isinstance(s, str) for s in value):
    return value
  raise ValueError(f"stop must be a string or a list of strings, got {_short(value)}")


def _content_shape(value):
  if value is None or isinstance(value, str):
    return value
  if isinstance(value, list) and all(isinstance(p, Mapping) and isinstance(p.get("type"), str)
                                     for p in value):
    return value
  raise ValueError(f"content must be a string or a list of content parts ({{\"type\": \"text\", "
                   f"\"text\": ...}}), got {_short(value)}")


def _short(value) -> str:
  text = json.dumps(value) if _jsonable(value) else repr(value)
  return text if len(text) <= 80 else text[:77] + "..."


Prompt = Annotated[str | list[str] | list[int] | list[list[int]], BeforeValidator(_prompt_shape)]
Stop = Annotated[str | list[str] | None, BeforeValidator(_stop_shape)]
_STRICT = ConfigDict(strict=True, frozen=True, extra="forbid")


class StreamOptions(BaseModel):
  model_config = _STRICT
  include_usage: bool | None = None
  # vLLM's extension (guidellm sends it): every chunk also carries the usage so far.
  continuous_usage_stats: bool | None = None


class _Sampling(BaseModel):
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


class CompletionRequest(_Sampling):
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
  content: Annotated[str | list[ContentPart] | None, BeforeValidator(_content_shape)] = None
  name: str | None = None


class ChatCompletionRequest(_Sampling):
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
# Metrics


class _EngineGauges:
  """Gauges read from `engine.stats()` at each scrape: queue depth, running requests, slot
  occupancy, compiles since warm-up and every numeric `prefix_cache_*` entry."""

  GAUGES: ClassVar[dict[str, tuple[str, str]]] = {
      "waiting": ("cg_jax_requests_waiting", "requests in the engine's waiting queue"),
      "running": ("cg_jax_requests_running", "requests holding a KV-cache slot"),
      "slot_occupancy": ("cg_jax_slot_occupancy", "share of the KV-cache slots in use"),
      "compiles_since_warmup": ("cg_jax_compiles_since_warmup",
                                "XLA compilations after warm-up (0 when serving)")}

  def __init__(self, engine: Engine):
    self.engine = engine

  def collect(self):
    stats = self.engine.stats()
    for key, (name, help_text) in self.GAUGES.items():
      if _is_number(stats.get(key)):
        yield GaugeMetricFamily(name, help_text, value=stats[key])
    for key, value in stats.items():
      if key.startswith("prefix_cache_") and _is_number(value):
        yield GaugeMetricFamily(f"cg_jax_{key}", f"engine.stats()[{key!r}]", value=value)


def _is_number(value) -> bool:
  return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


class Metrics:
  """The app's Prometheus metrics, in a registry of its own."""

  def __init__(self, engine: Engine):
    self.registry = CollectorRegistry()
    r = self.registry
    self.requests = Counter("cg_jax_http_requests", "HTTP requests by endpoint and status",
                            ("endpoint", "status"), registry=r)
    self.prompt_tokens = Counter("cg_jax_prompt_tokens", "prompt tokens of accepted requests",
                                 registry=r)
    self.generated_tokens = Counter("cg_jax_generation_tokens", "tokens of the finished requests",
                                    registry=r)
    self.cancelled = Counter("cg_jax_requests_cancelled",
                             "requests cancelled because their client disconnected", registry=r)
    self.ttft = Histogram("cg_jax_time_to_first_token_seconds",
                          "submit to first token, per request", buckets=TTFT_BUCKETS, registry=r)
    self.tpot = Histogram("cg_jax_time_per_output_token_seconds",
                          "seconds per token after the first, per request", buckets=TPOT_BUCKETS,
                          registry=r)
    self.duration = Histogram("cg_jax_request_duration_seconds",
                              "submit to last token, per request", buckets=DURATION_BUCKETS,
                              registry=r)
    r.register(_EngineGauges(engine))

  def finished(self, completion: Completion) -> None:
    stats = completion.stats
    self.generated_tokens.inc(len(completion.tokens))
    if stats.get("ttft_s") is not None:
      self.ttft.observe(stats["ttft_s"])
    if stats.get("per_token_s") is not None and len(completion.tokens) > 1:
      self.tpot.observe(stats["per_token_s"])
    if stats.get("total_s") is not None:
      self.duration.observe(stats["total_s"])

  def text(self) -> bytes:
    return generate_latest(self.registry)


class _CountRequests:
  """ASGI middleware: counts each HTTP request by endpoint (unknown paths as "other") and the
  status it was answered with."""

  def __init__(self, app, metrics: Metrics, endpoints: frozenset[str]):
    self.app, self.metrics, self.endpoints = app, metrics, endpoints

  async def __call__(self, scope, receive, send):
    if scope["type"] != "http":
      await self.app(scope, receive, send)
      return
    status = [500]

    async def watch(message):
      if message["type"] == "http.response.start":
        status[0] = message["status"]
      await send(message)

    try:
      await self.app(scope, receive, watch)
    finally:
      path = scope.get("path", "")
      endpoint = path if path in self.endpoints else "other"
      self.metrics.requests.labels(endpoint, str(status[0])).inc()


# --------------------------------------------------------------------------------------------------
# Requests into engine work


@dataclasses.dataclass(frozen=True)
class Job:
  """One prompt of a request, validated: its token ids, its `SamplingParams` (None: nothing to
  generate, `echo` with `max_tokens: 0`), the text its choice starts with (`echo`, else None)
  and its log-probabilities' alternatives per token (None: no logprobs)."""

  ids: list[int]
  params: SamplingParams | None
  echo: str | None = None
  top: int | None = None

  @property
  def scored(self) -> bool:
    """Whether the choice reports its prompt's log-probabilities (`engine.score`)."""
    return self.echo is not None and self.top is not None


# The choice of a job that generates nothing.
_NOTHING = Completion(tokens=[], text="", finish_reason="length", stats={}, logprobs=[],
                      top_logprobs=[])


class _ClientGone(Exception):
  """The client disconnected before its response was ready."""


class _EventStream(StreamingResponse):
  """Server-sent events that cancel their requests however the response ends."""

  def __init__(self, content: AsyncIterator[str], handles: Sequence[Handle]):
    super().__init__(content, media_type="text/event-stream",
                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    self._handles = handles

  async def __call__(self, scope, receive, send):
    try:
      await super().__call__(scope, receive, send)
    finally:
      for handle in self._handles:
        handle.cancel()


def _event(data: Mapping[str, Any]) -> str:
  return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


async def _finish(handle: Handle) -> Completion:
  """The request's completion, awaited through its deltas."""
  async for _ in handle:
    pass
  return await asyncio.to_thread(handle.result)


class Service:
  """What the endpoints do, over one engine.

  Args:
    engine: the engine (its tokenizer encodes text prompts and decodes the output).
    model_name: the name requests must give as `model`.
    chat_template: the model's template for /v1/chat/completions, or None (then a 400).
    request_timeout: seconds a request may take (None: no limit).
  """

  def __init__(self, engine: Engine, model_name: str, chat_template: ChatTemplate | None,
               request_timeout: float | None):
    self.engine, self.model_name, self.chat_template = engine, model_name, chat_template
    self.request_timeout = request_timeout
    self.metrics = Metrics(engine)
    self.names = None if engine.tokenizer is None else _TokenText(engine.tokenizer)
    self.closing = False
    self.warmup: Warmup | None = None  # None: nothing to wait for
    self.created = int(time.time())

  # Validation --------------------------------------------------------------------------------

  def _check_model(self, name: str) -> None:
    if name != self.model_name:
      raise ApiError(404, f"the model {name!r} does not exist; this server serves "
                          f"{self.model_name!r}", param="model", code="model_not_found")

  @staticmethod
  def _check_unsupported(body: _Sampling) -> None:
    if body.n not in (None, 1):
      raise _bad("n", f"n={body.n} is not supported: allowed n=1 (one choice per prompt)")
    for name in ("presence_penalty", "frequency_penalty"):
      value = getattr(body, name)
      if value not in (None, 0):
        raise _bad(name, f"{name}={value} is not supported: allowed 0 (no penalty)")
    if body.logit_bias:
      raise _bad("logit_bias", "logit_bias is not supported: allowed null or {}")
    if body.stream_options is not None and not body.stream:
      raise _bad("stream_options", "stream_options needs stream=true")
    if isinstance(body, CompletionRequest):
      if body.best_of not in (None, 1):
        raise _bad("best_of", f"best_of={body.best_of} is not supported: allowed best_of=1")
      if body.suffix is not None:
        raise _bad("suffix", "suffix is not supported: allowed null")
    else:
      if body.tools:
        raise _bad("tools", "tools are not supported: allowed null or []")
      if body.tool_choice not in (None, "none", "auto"):
        raise _bad("tool_choice", f"tool_choice={_short(body.tool_choice)} is not supported: "
                                  "allowed null, \"none\" or \"auto\" (no tools)")
      kind = (body.response_format or {}).get("type", "text")
      if kind != "text":
        raise _bad("response_format", f"response_format type {_short(kind)} is not supported: "
                                      "allowed \"text\"")

  def _sampling(self, body: _Sampling, logprobs: int | None,
                names: Mapping[str, str] = OPENAI_NAMES) -> SamplingParams:
    """The request's `SamplingParams` (max_new_tokens left at its default: each job sets its
    own), checked against the model too. Temperature 0 is greedy: OpenAI's other sampling
    fields then go to the engine as off (no engine warning). A bad value is a 400 naming its
    OpenAI field (`names`: field -> OpenAI name; the others are named alike). The server's own
    limits: temperature up to MAX_TEMPERATURE, top_k -1 as off."""
    temperature = 1.0 if body.temperature is None else body.temperature
    if not math.isfinite(temperature) or not 0 <= temperature <= MAX_TEMPERATURE:
      raise _bad("temperature", f"temperature={temperature} is out of range: allowed 0 to "
                                f"{MAX_TEMPERATURE:g} (0 = greedy)")
    top_k = 0 if body.top_k in (None, -1) else body.top_k
    if top_k < 0:
      raise _bad("top_k", f"top_k={top_k} is out of range: allowed 0 or -1 (off) or a "
                          f"positive number of tokens")
    model = self.engine.model_config
    try:
      params = SamplingParams(do_sample=temperature > 0, temperature=temperature, top_k=top_k,
                              top_p=1.0 if body.top_p is None else body.top_p, seed=body.seed,
                              stop=body.stop, eos_token_id=[] if body.ignore_eos else None,
                              logprobs=logprobs)
      if temperature == 0:
        params = dataclasses.replace(params, top_k=0, top_p=1.0, seed=None)
      params.settings(vocab_size=model.vocab_size, default_eos=model.eos_token_id,
                      has_tokenizer=self.engine.tokenizer is not None)
    except ParamError as error:
      raise _param_error(error, names) from None
    return params

  def _lengths(self, prompts: list[list[int]], max_tokens: int | None, param: str,
               max_param: str, echo: bool = False) -> list[int]:
    """Each prompt's token budget: `max_tokens`, or (None) the rest of the context. A prompt may
    have 1 to max_seq_len - 1 tokens (room for one generated token); with `echo` and
    `max_tokens: 0` (nothing generated: the prompt is shown, or scored) up to max_seq_len.
    `max_tokens: 0` without `echo` is a 400 naming `echo`, not the context."""
    context = self.engine.config.max_seq_len
    completions = param == "prompt"  # (chat has no `echo`)
    only_prompt = echo and max_tokens == 0
    if max_tokens == 0 and completions and not echo:
      room = context - max(len(ids) for ids in prompts)
      allowed = f"1 to {room}" if room >= 1 else ">= 1"
      raise _bad(max_param, f"{max_param}=0 needs echo=true: it generates nothing, so the "
                            f"response would be empty (with echo=true it shows the prompt, and "
                            f"with logprobs scores it); allowed {max_param} {allowed}, or 0 with "
                            "echo=true")
    budgets = []
    for i, ids in enumerate(prompts):
      which = {"messages": "the rendered chat"}.get(param, "the prompt")
      if len(prompts) > 1:
        which = f"{param}[{i}]"
      if only_prompt and len(ids) > context:
        raise _bad(param, f"{which} has {len(ids)} tokens; with echo=true and {max_param}=0 a "
                          f"prompt may have 1 to {context} tokens (the context)",
                   code="context_length_exceeded")
      if not only_prompt and len(ids) >= context:
        also = f", or {context} with echo=true and {max_param}=0" if completions else ""
        raise _bad(param, f"{which} has {len(ids)} tokens; the context holds {context} tokens "
                          f"(prompt + completion), so a prompt may have 1 to {context - 1}"
                          f"{also}", code="context_length_exceeded")
      room = context - len(ids)
      if max_tokens is None:
        budgets.append(room)
      elif not (1 <= max_tokens <= room or only_prompt):
        zero = ", or 0 with echo=true" if completions else ""
        raise _bad(max_param, f"{max_param}={max_tokens} is out of range: {which} has {len(ids)} "
                              f"tokens and the context holds {context}; allowed {max_param} 1 "
                              f"to {room}{zero}",
                   code="context_length_exceeded" if max_tokens > room else None)
      else:
        budgets.append(max_tokens)
    return budgets

  def _token_ids(self, prompt) -> list[list[int]]:
    """The prompts of a completion request as token-id lists."""
    vocab = self.engine.model_config.vocab_size
    if isinstance(prompt, str) or isinstance(prompt[0], str):
      texts = [prompt] if isinstance(prompt, str) else prompt
      tokenizer = self._tokenizer("prompt")
      prompts = [tokenizer.encode(text).ids for text in texts]
    else:
      prompts = [prompt] if _is_token(prompt[0]) else prompt
    limit = self.engine.config.max_waiting
    if len(prompts) > limit:
      raise _bad("prompt", f"the request has {len(prompts)} prompts; allowed 1 to {limit}")
    for i, ids in enumerate(prompts):
      where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
      if not ids:
        raise _bad("prompt", f"{where} is empty: it needs at least one token")
      for j, token in enumerate(ids):
        if not 0 <= token < vocab:
          raise _bad("prompt", f"{where}[{j}] = {token} is not a token id of this model: allowed "
                               f"0 to {vocab - 1}")
    return prompts

  def _tokenizer(self, param: str, needs: str = NO_TOKENIZER):
    if self.engine.tokenizer is None:
      raise _bad(param, f"the model {self.model_name!r} has no tokenizer (no tokenizer.json in "
                        f"its checkpoint): {needs}")
    return self.engine.tokenizer

  def completion_jobs(self, body: CompletionRequest) -> list[Job]:
    """The jobs of a completion request."""
    self._check_model(body.model)
    self._check_unsupported(body)
    top = body.logprobs
    params = self._sampling(body, top)
    echo = bool(body.echo)
    if top is not None:
      self._tokenizer("logprobs", "logprobs need it to name the tokens")
    if echo:
      self._tokenizer("echo", "echo needs it to show the prompt")
    prompts = self._token_ids(body.prompt)
    max_tokens = DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
    budgets = self._lengths(prompts, max_tokens, "prompt", "max_tokens", echo=echo)
    texts: list[str | None] = [None] * len(prompts)
    if echo:
      if isinstance(body.prompt, str):
        texts = [body.prompt]
      elif isinstance(body.prompt[0], str):
        texts = list(body.prompt)
      else:
        texts = [text.decode(self.engine.tokenizer, ids) for ids in prompts]
    return [Job(ids, dataclasses.replace(params, max_new_tokens=budget) if budget else None,
                shown, top) for ids, budget, shown in zip(prompts, budgets, texts, strict=True)]

  def chat_jobs(self, body: ChatCompletionRequest) -> list[Job]:
    """The job of a chat request; `top_logprobs` needs `logprobs: true`."""
    self._check_model(body.model)
    self._check_unsupported(body)
    if body.top_logprobs is not None and not body.logprobs:
      raise _bad("top_logprobs", f"top_logprobs={body.top_logprobs} needs logprobs=true")
    top = (0 if body.top_logprobs is None else body.top_logprobs) if body.logprobs else None
    max_tokens, name = body.max_tokens, "max_tokens"
    if body.max_completion_tokens is not None:
      max_tokens, name = body.max_completion_tokens, "max_completion_tokens"
    params = self._sampling(body, top, {"max_new_tokens": name, "logprobs": "top_logprobs"})
    if self.chat_template is None:
      raise _bad("messages", f"the model {self.model_name!r} has no chat template (no "
                             "chat_template in its tokenizer_config.json): use /v1/completions",
                 code="no_chat_template")
    tokenizer = self._tokenizer("messages")
    rendered = self.render(body.messages)
    ids = tokenizer.encode(rendered, add_special_tokens=False).ids
    if not ids:
      raise _bad("messages", "the rendered chat prompt is empty")
    budgets = self._lengths([ids], max_tokens, "messages", name)
    return [Job(ids, dataclasses.replace(params, max_new_tokens=budgets[0]), None, top)]

  def render(self, messages: Sequence[ChatMessage]) -> str:
    """The chat prompt of `messages` (text content parts joined)."""
    chat = []
    for i, message in enumerate(messages):
      data = message.model_dump()
      if isinstance(message.content, list):
        texts = []
        for j, part in enumerate(message.content):
          if part.type != "text" or part.text is None:
            raise _bad(f"messages[{i}].content[{j}]", f"content part type {part.type!r} is not "
                                                      "supported: allowed \"text\" with a text")
          texts.append(part.text)
        data["content"] = "".join(texts)
      chat.append(data)
    try:
      return self.chat_template.render(chat, add_generation_prompt=True)
    except TemplateError as error:
      raise _bad("messages", f"the chat template rejected the messages: {error}") from None

  # Running ---------------------------------------------------------------------------------

  def check_open(self) -> None:
    if self.closing:
      raise ApiError(503, "the server is shutting down", type="server_error",
                     code="engine_closed")

  def check_ready(self) -> None:
    """A 503 unless the server takes requests: open, and warmed up."""
    warm = self.warmup
    if warm is not None and warm.state == "failed":
      raise ApiError(503, f"the server cannot serve: its warm-up failed ({warm.error})",
                     type="server_error", code="warmup_failed")
    self.check_open()
    if warm is not None and warm.state != "ready":
      raise ApiError(503, f"the server is warming up ({warm.done} of {warm.total} executables "
                          f"ready after {warm.elapsed():.0f} s): retry once GET /health answers "
                          "200", type="server_error", code="warming_up")

  async def scores(self, jobs: list[Job]) -> list[list | None]:
    """Per job, its prompt's `engine.score` (tokens 1..n-1) if it reports them, else None."""
    self.check_open()
    out = []
    for job in jobs:
      if not job.scored:
        out.append(None)
        continue
      try:
        out.append(await asyncio.to_thread(self.engine.score, job.ids, top=job.top))
      except Exception as error:  # noqa: BLE001 - answered in OpenAI's format
        raise engine_error(error) from None
    return out

  def submit(self, jobs: list[Job]) -> list[Handle | None]:
    """Queue every job that generates (None for the others), or none (a failed submit cancels
    the ones before it)."""
    self.check_open()
    handles = []
    try:
      for job in jobs:
        handles.append(None if job.params is None else self.engine.submit(
            job.ids, params=job.params, timeout=self.request_timeout))
    except Exception as error:  # noqa: BLE001 - every failure cancels the jobs queued before it
      for handle in handles:
        if handle is not None:
          handle.cancel()
      raise engine_error(error) from None
    self.metrics.prompt_tokens.inc(sum(len(job.ids) for job in jobs))
    return handles

  async def complete(self, request: fastapi.Request,
                     handles: list[Handle | None]) -> list[Completion]:
    """Every request's completion (`_NOTHING` for a job that generates nothing); raises
    `_ClientGone` (requests cancelled) if the client disconnects first."""
    live = [h for h in handles if h is not None]
    work = asyncio.ensure_future(asyncio.gather(*(_finish(h) for h in live)))
    gone = asyncio.ensure_future(_disconnected(request))
    try:
      await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
      if not work.done():
        self.metrics.cancelled.inc(len(live))
        raise _ClientGone()
      try:
        completions = work.result()
      except Exception as error:  # noqa: BLE001 - answered in OpenAI's format
        raise engine_error(error) from None
    finally:
      gone.cancel()
      work.cancel()
      for handle in live:
        handle.cancel()
    for completion in completions:
      self.metrics.finished(completion)
    done = iter(completions)
    return [_NOTHING if h is None else next(done) for h in handles]

  def logprobs(self, job: Job, score: list | None, chat: bool) -> _Logprobs | None:
    """A choice's log-probabilities, its echoed prompt's added (None when not asked)."""
    if job.top is None:
      return None
    choice = _Logprobs(self.names, chat)
    if job.scored:
      choice.echo(job.ids, score, len(job.echo))
    return choice

  def choice_logprobs(self, job: Job, score: list | None, completion: Completion,
                      chat: bool) -> dict[str, Any] | None:
    """The "logprobs" of a finished (not streamed) choice."""
    choice = self.logprobs(job, score, chat)
    if choice is None:
      return None
    for token, logprob, top in zip(completion.tokens, completion.logprobs or [],
                                   completion.top_logprobs or [], strict=True):
      choice.add(token, logprob, top)
    return choice.take()

  async def events(self, jobs: list[Job], handles: list[Handle | None], scores: list, *,
                   chat: bool, include_usage: bool, token_ids: bool,
                   continuous_usage: bool = False) -> AsyncIterator[str]:
    """The server-sent events of a streamed request: chunks as tokens arrive (a choice per
    prompt; with `echo`, a first chunk per choice with its prompt), a last chunk per choice with
    its finish_reason, the usage chunk if asked, then [DONE]. An error after the first event is
    sent as an error event before [DONE].

    With logprobs, each chunk carries those of the tokens since the previous chunk of its choice
    (tokens whose text is held back wait for the chunk that shows it, or the last one), with
    offsets into the whole choice's text: joined, they equal the non-streamed logprobs. Chat's
    first (role) chunk has none. With `continuous_usage` (and `include_usage`) every chunk
    carries the usage so far."""
    chunk = _Chunks(self.model_name, chat, include_usage, token_ids)
    generated = 0
    queue: asyncio.Queue = asyncio.Queue()
    logs = [self.logprobs(job, score, chat) for job, score in zip(jobs, scores, strict=True)]

    def taken(index: int) -> dict[str, Any] | None:
      return None if logs[index] is None else logs[index].take()

    async def pump(index: int, handle: Handle):
      try:
        async for delta in handle:
          queue.put_nowait((index, delta))
        queue.put_nowait((index, await asyncio.to_thread(handle.result)))
      except Exception as error:  # noqa: BLE001 - the stream reports it
        queue.put_nowait((index, error))

    tasks = []
    completions: list[Completion | None] = [None] * len(handles)
    failed = False
    try:
      if chat:
        yield _event(chunk.choices([chunk.role(i) for i in range(len(handles))]))
      for index, job in enumerate(jobs):
        if job.echo is not None:
          yield _event(chunk.choices([chunk.delta(index, job.echo, [], taken(index))]))
        if handles[index] is None:
          completions[index] = _NOTHING
          yield _event(chunk.choices([chunk.final(index, _NOTHING.finish_reason,
                                                  taken(index))]))
      tasks = [asyncio.create_task(pump(i, h)) for i, h in enumerate(handles) if h is not None]
      while any(c is None for c in completions):
        # Everything that arrived since the last wake-up: a choice's deltas in it go out as one
        # chunk (when the stream falls behind the engine, fewer and larger chunks).
        items = [await queue.get()]
        while not queue.empty():
          items.append(queue.get_nowait())
        pending: dict[int, tuple[list[str], list[int]]] = {}

        def flush(index: int) -> str | None:
          texts, ids = pending.pop(index, ((), ()))
          if not texts and not ids:
            return None
          return _event(chunk.choices([chunk.delta(index, "".join(texts), list(ids),
                                                   taken(index))]))

        for index, item in items:
          if isinstance(item, Delta):
            if logs[index] is not None and item.token >= 0:
              logs[index].add(item.token, item.logprob, item.top_logprobs)
            generated += int(item.token >= 0)
            if continuous_usage:
              chunk.running = _usage_counts(jobs, generated)
            # A step's token goes out with its text, or held back with it; without a tokenizer
            # (no text) every step is a chunk, its ids with return_token_ids.
            if item.text or (item.token >= 0 and (token_ids or self.names is None)):
              texts, ids = pending.setdefault(index, ([], []))
              texts.append(item.text or "")
              if item.token >= 0:
                ids.append(item.token)
            continue
          if (event := flush(index)) is not None:
            yield event
          if isinstance(item, Completion):
            completions[index] = item
            self.metrics.finished(item)
            yield _event(chunk.choices([chunk.final(index, item.finish_reason, taken(index))]))
          else:
            failed = True
            yield _event(engine_error(item).body())
            break
        if failed:
          break
        for index in list(pending):
          if (event := flush(index)) is not None:
            yield event
      else:
        if include_usage:
          yield _event(chunk.usage(_usage(jobs, completions)))
      yield "data: [DONE]\n\n"
    finally:
      if not failed and any(c is None for c in completions):  # the client went away
        self.metrics.cancelled.inc(sum(c is None for c in completions))
      for task in tasks:
        task.cancel()
      for handle in handles:
        if handle is not None:
          handle.cancel()


async def _disconnected(request: fastapi.Request) -> None:
  """Returns once the client has disconnected (the body was read already)."""
  while True:
    message = await request.receive()
    if message["type"] == "http.disconnect":
      return


def _usage(jobs: Sequence[Job], completions: Sequence[Completion]) -> dict[str, int]:
  return _usage_counts(jobs, sum(len(c.tokens) for c in completions))


def _usage_counts(jobs: Sequence[Job], generated: int) -> dict[str, int]:
  """OpenAI's usage object of `jobs`' prompts and `generated` new tokens."""
  prompt = sum(len(job.ids) for job in jobs)
  return {"prompt_tokens": prompt, "completion_tokens": generated,
          "total_tokens": prompt + generated}


# --------------------------------------------------------------------------------------------------
# Log-probabilities


def _byte_alphabet() -> dict[str, int]:
  """Byte-level BPE's alphabet (GPT-2's `bytes_to_unicode`): {the character standing for a byte:
  the byte}; printable Latin-1 bytes stand for themselves, the others for 256, 257, ..."""
  kept = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
          *range(ord("\xae"), ord("\xff") + 1)]
  chars = {b: b for b in kept}
  for b in range(256):
    if b not in chars:
      chars[b] = 256 + len(chars) - len(kept)
  return {chr(c): b for b, c in chars.items()}


_BYTE_OF = _byte_alphabet()


class _TokenText:
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


class _Offsets:
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


class _Logprobs:
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

  def __init__(self, names: _TokenText, chat: bool):
    self.names, self.chat = names, chat
    self.offsets = _Offsets(names.tokenizer)
    self.entries: list = []

  def echo(self, ids: Sequence[int], scores: list, length: int) -> None:
    """Add the prompt's tokens (`scores`: `engine.score` of tokens 1..n-1, whose text has
    `length` characters); the generated tokens' offsets start after it."""
    offsets = _Offsets(self.names.tokenizer)
    for i, token in enumerate(ids):
      logprob, top = (None, None) if i == 0 else scores[i - 1]
      self._add(token, logprob, top, offsets.next(token))
    self.offsets = _Offsets(self.names.tokenizer, length)

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


class _Chunks:
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


def completion_response(model: str, jobs: Sequence[Job], completions: Sequence[Completion],
                        logprobs: Sequence[dict[str, Any] | None], *, chat: bool,
                        token_ids: bool) -> dict[str, Any]:
  """The JSON body of a finished (not streamed) request: per choice its text (after the echoed
  prompt, if any) and its `logprobs` (null when not asked)."""
  choices = []
  for index, (job, completion, lp) in enumerate(zip(jobs, completions, logprobs, strict=True)):
    text = (job.echo or "") + (completion.text or "")
    if chat:
      choice = {"index": index, "message": {"role": "assistant", "content": text},
                "logprobs": lp, "finish_reason": completion.finish_reason}
    else:
      choice = {"index": index, "text": text, "logprobs": lp,
                "finish_reason": completion.finish_reason}
    if token_ids:
      choice["prompt_token_ids"] = list(job.ids)
      choice["token_ids"] = list(completion.tokens)
    choices.append(choice)
  return {"id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex,
          "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
          "model": model, "choices": choices, "usage": _usage(jobs, completions)}


# --------------------------------------------------------------------------------------------------
# Warm-up


class _Stop(Exception):
  """Raised in the warm-up thread by its progress callback: `Warmup.stop` was called."""


class Warmup:
  """The engine's warm-up (`engine.warmup` of `WARMUP_PHASES`), run in a thread of its own
  ("cg_jax-warmup") while the server already answers.

  `state` is "warming up", then "ready", "failed" (`error` says why; `on_failure`, if set, is
  called in the warm-up thread) or "stopped" (`stop` came first). `done` of `total` executables
  are ready (loaded or compiled). The start, the end and a failure are logged; `report` logs
  the progress every PROGRESS_EVERY seconds.
  """

  def __init__(self, engine: Engine):
    self.engine = engine
    self.total = len(engine.executable_keys(phases=WARMUP_PHASES))
    self.done = 0
    self.state = "warming up"
    self.error: str | None = None
    self.on_failure: Callable[[], None] | None = None
    self._started = self._ended = None
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None

  def start(self) -> None:
    self._started = time.monotonic()
    self._thread = threading.Thread(target=self._run, name="cg_jax-warmup")
    self._thread.start()

  def elapsed(self) -> float:
    """Seconds since the start, up to the end."""
    if self._started is None:
      return 0.0
    return (self._ended or time.monotonic()) - self._started

  def stop(self) -> None:
    """Stop warming up (executables not started are not compiled; those compiling finish) and
    wait for the thread to end."""
    self._stop.set()
    if self._thread is not None:
      self._thread.join()

  def status(self) -> dict[str, Any]:
    """/health's body while not ready."""
    if self.state == "failed":
      return {"status": "warm-up failed", "error": self.error}
    return {"status": self.state, "executables_done": self.done,
            "executables_total": self.total, "elapsed_s": round(self.elapsed(), 1)}

  async def report(self) -> None:
    """Log the progress every PROGRESS_EVERY seconds until the warm-up ends."""
    while self.state == "warming up":
      await asyncio.sleep(PROGRESS_EVERY)
      if self.state == "warming up":
        log.info("warming up: %d of %d executables ready, %.0f s", self.done, self.total,
                 self.elapsed())

  def _progress(self, done: int, total: int) -> None:
    self.done, self.total = done, total
    if self._stop.is_set():
      raise _Stop()

  def _run(self) -> None:
    log.info("warming up: %d executables to load or compile; /health answers 503 until they "
             "are ready", self.total)
    try:
      self.engine.warmup(phases=WARMUP_PHASES, progress=False, on_progress=self._progress)
    except _Stop:
      self._end("stopped")
      log.info("warm-up stopped after %d of %d executables, %.1f s", self.done, self.total,
               self.elapsed())
    except Exception as error:  # noqa: BLE001 - reported by /health, the log and `serve`
      self.error = f"{type(error).__name__}: {error}"
      self._end("failed")
      log.error("warm-up failed after %d of %d executables, %.1f s: %s", self.done, self.total,
                self.elapsed(), self.error, exc_info=error)
      if self.on_failure is not None:
        self.on_failure()
    else:
      self._end("ready")
      log.info("warmed up: %d executables in %.1f s; serving", self.total, self.elapsed())

  def _end(self, state: str) -> None:
    self._ended = time.monotonic()
    self.state = state


# --------------------------------------------------------------------------------------------------
# The app


ENDPOINTS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/models", "/health",
                       "/metrics"})


def create_app(engine: Engine, model_name: str, *, chat_template: ChatTemplate | None = None,
               warmup: bool = True, close_engine: bool = True,
               request_timeout: float | None = None) -> fastapi.FastAPI:
  """The FastAPI app serving `engine` as `model_name`.

  Args:
    chat_template: the template of /v1/chat/completions (`load_chat_template`), or None.
    warmup: compile the serving executables at start-up (`Warmup`: in a thread, while the
      server answers 503 "warming up"); False: the engine is taken as warmed up.
    close_engine: close the engine when the app shuts down.
    request_timeout: seconds each request may take (None: no limit); past it, a 504.
  """
  if request_timeout is not None and not (_is_number(request_timeout) and request_timeout > 0):
    raise ValueError(f"request_timeout must be None or a number of seconds > 0, got "
                     f"{request_timeout!r}")
  service = Service(engine, model_name, chat_template, request_timeout)
  if warmup:
    service.warmup = Warmup(engine)

  @contextlib.asynccontextmanager
  async def lifespan(app):
    warm = service.warmup
    report = None
    if warm is not None:  # answering meanwhile: /health and the API say "warming up" (503)
      warm.start()
      report = asyncio.create_task(warm.report())
    yield
    service.closing = True
    if warm is not None:
      report.cancel()
      await asyncio.to_thread(warm.stop)
    if close_engine:
      await asyncio.to_thread(engine.close)

  app = fastapi.FastAPI(title="cg_jax", lifespan=lifespan, docs_url=None, redoc_url=None,
                        openapi_url=None)
  app.state.service = service
  app.add_middleware(_CountRequests, metrics=service.metrics, endpoints=ENDPOINTS)

  @app.exception_handler(ApiError)
  async def api_error(request, error: ApiError):
    return error.response()

  @app.exception_handler(RequestValidationError)
  async def invalid(request, error: RequestValidationError):
    return _validation_error(error).response()

  @app.exception_handler(StarletteHTTPException)
  async def http_error(request, error: StarletteHTTPException):
    kind = "invalid_request_error" if error.status_code < 500 else "server_error"
    return ApiError(error.status_code, f"{request.method} {request.url.path}: {error.detail}",
                    type=kind).response()

  @app.exception_handler(Exception)
  async def failed(request, error: Exception):
    return engine_error(error).response()

  async def run(request: fastapi.Request, body: _Sampling, jobs: list[Job], chat: bool):
    scores = await service.scores(jobs)
    handles = service.submit(jobs)
    if body.stream:
      options = body.stream_options or StreamOptions()
      events = service.events(jobs, handles, scores, chat=chat,
                              include_usage=bool(options.include_usage),
                              token_ids=body.return_token_ids,
                              continuous_usage=bool(options.continuous_usage_stats))
      return _EventStream(events, [h for h in handles if h is not None])
    try:
      completions = await service.complete(request, handles)
    except _ClientGone:
      return Response(status_code=499)
    logprobs = [service.choice_logprobs(job, score, completion, chat)
                for job, score, completion in zip(jobs, scores, completions, strict=True)]
    return JSONResponse(completion_response(model_name, jobs, completions, logprobs, chat=chat,
                                            token_ids=body.return_token_ids))

  @app.post("/v1/completions")
  async def completions(body: CompletionRequest, request: fastapi.Request):
    service.check_ready()
    return await run(request, body, service.completion_jobs(body), chat=False)

  @app.post("/v1/chat/completions")
  async def chat_completions(body: ChatCompletionRequest, request: fastapi.Request):
    service.check_ready()
    return await run(request, body, service.chat_jobs(body), chat=True)

  def model_card() -> dict[str, Any]:
    return {"id": model_name, "object": "model", "created": service.created, "owned_by": "cg_jax",
            "max_model_len": engine.config.max_seq_len}

  @app.get("/v1/models")
  async def models():
    return {"object": "list", "data": [model_card()]}

  @app.get("/v1/models/{name:path}")
  async def model(name: str):
    service._check_model(name)
    return model_card()

  @app.get("/health")
  async def health():
    warm = service.warmup
    if warm is not None and warm.state == "failed":
      return JSONResponse(warm.status(), status_code=500)
    if service.closing:
      return JSONResponse({"status": "shutting down"}, status_code=503)
    if warm is not None and warm.state != "ready":
      return JSONResponse(warm.status(), status_code=503)
    return {"status": "ok"}

  @app.get("/metrics")
  async def metrics():
    return Response(service.metrics.text(), media_type=CONTENT_TYPE_LATEST)

  return app


def load_chat_template(model: str | os.PathLike) -> ChatTemplate | None:
  """The chat template of a checkpoint directory or bundled/cached model (None for presets and
  checkpoints without one)."""
  name = os.fspath(model)
  if name in PRESETS and not os.path.isdir(name):
    return None
  return ChatTemplate.from_directory(resolve_model(name))


class ListenError(OSError):
  """The server cannot listen where it was asked; `param` names the culprit, "host" or
  "port"."""

  def __init__(self, param: str, message: str):
    super().__init__(message)
    self.param = param

  def __str__(self) -> str:
    return self.args[0]


class WarmupFailed(RuntimeError):
  """`serve` stopped because the engine's warm-up failed (the message says why)."""


def listen(host: str = "127.0.0.1", port: int = 8000) -> socket.socket:
  """A TCP socket bound to (host, port) and listening, for `serve` (port 0: a free port, which
  `getsockname()` tells). Binding before anything compiles makes a busy port fail at once:
  raises `ListenError` naming the host or the port and why."""
  if not (isinstance(port, int) and not isinstance(port, bool) and 0 <= port <= 65535):
    raise ListenError("port", f"port must be 0 to 65535 (0: any free port), got {port!r}")
  where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
  sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
  try:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
    sock.bind((host, port))
    sock.listen(2048)
  except OSError as error:
    sock.close()
    if isinstance(error, socket.gaierror):
      raise ListenError("host", f"{host!r} is neither an address nor a known host name "
                                f"({error.strerror})") from error
    if error.errno == errno.EADDRINUSE:
      raise ListenError("port", f"address {where} is in use (another server listens there): "
                                "stop it or choose another port (0: any free one)") from error
    if error.errno == errno.EACCES:
      raise ListenError("port", f"permission denied to listen on {where}: ports below 1024 "
                                "need privileges; allowed 1024 to 65535, or 0 (any free "
                                "one)") from error
    if error.errno == errno.EADDRNOTAVAIL:
      raise ListenError("host", f"{host} is not an address of this machine: allowed one of "
                                "its interfaces' addresses, 127.0.0.1 (this machine only) or "
                                "0.0.0.0 (every interface)") from error
    raise ListenError("host", f"cannot listen on {where}: {error.strerror or error}") from error
  return sock


class _Server(uvicorn.Server):
  """uvicorn's server, which also logs where it listens when it is handed its socket."""

  async def startup(self, sockets=None) -> None:
    await super().startup(sockets=sockets)
    if self.started and sockets:
      host, port = self.config.host, sockets[0].getsockname()[1]
      log.info("Uvicorn running on http://%s:%d (Press CTRL+C to quit)",
               f"[{host}]" if ":" in host else host, port)


class _Stopped(Exception):
  """SIGTERM, raised once uvicorn has shut down."""


def _stopped(signum, frame):
  raise _Stopped(signum)


def serve(app: fastapi.FastAPI, *, host: str = "127.0.0.1", port: int = 8000,
          sock: socket.socket | None = None, graceful_timeout: float = 30.0,
          log_level: str = "info") -> None:
  """Run `app` with uvicorn on `sock` (from `listen`; None: `listen(host, port)` here, so a bad
  address raises `ListenError` before anything starts) until SIGINT / SIGTERM: in-flight
  requests get `graceful_timeout` seconds to finish, the rest are cancelled, then the app shuts
  down (stopping a warm-up still running, closing the engine) and this returns.

  The server answers while the app's engine warms up (/health 503 until ready); if the warm-up
  fails, the server shuts down and this raises `WarmupFailed`. uvicorn handles signals in the
  main thread only; from another thread, stop it through `uvicorn.Server.should_exit` instead
  (see tests/test_server.py)."""
  if sock is None:
    sock = listen(host, port)
  config = uvicorn.Config(app, host=host, port=sock.getsockname()[1], lifespan="on",
                          log_level=log_level, timeout_graceful_shutdown=graceful_timeout)
  live = _Server(config)
  service = getattr(app.state, "service", None)
  warm = None if service is None else service.warmup
  if warm is not None:
    warm.on_failure = lambda: setattr(live, "should_exit", True)
  main = threading.current_thread() is threading.main_thread()
  # uvicorn re-raises the signal it stopped on once it is done: end here instead.
  previous = signal.signal(signal.SIGTERM, _stopped) if main else None
  try:
    live.run(sockets=[sock])
  except (_Stopped, KeyboardInterrupt):
    pass
  finally:
    if main:
      signal.signal(signal.SIGTERM, previous)
    if warm is not None:
      warm.stop()  # (done by the app's shutdown, unless a forced exit skipped it)
    sock.close()
  if warm is not None and warm.state == "failed":
    raise WarmupFailed(f"the engine's warm-up failed: {warm.error}")
