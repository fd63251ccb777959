"""What the endpoints do: an OpenAI request into validated jobs, the jobs into engine requests,
their tokens into a response or server-sent events."""


from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np

from cg_jax import text, validation
from cg_jax.chat_template import ChatTemplate, TemplateError
from cg_jax.core.executables import SERVING_PHASES
from cg_jax.engine import Engine
from cg_jax.handles import Completion, Delta, Handle
from cg_jax.sampling_params import ParamError, SamplingParams
from cg_jax.serving.metrics import Metrics
from cg_jax.serving.protocol import (OPENAI_NAMES, ApiError, ChatCompletionRequest, ChatMessage,
                                     Chunks, CompletionRequest, Logprobs, SamplingFields, TokenText,
                                     bad_request, engine_error, is_token, param_error, short)

MAX_TEMPERATURE = 2.0
DEFAULT_MAX_TOKENS = 16  # /v1/completions' default, as OpenAI's; chat's is the rest of the context
NO_TOKENIZER = "send the prompt to /v1/completions as token ids"  # what to do without a tokenizer
# The warm-up builds the serving executables before the server says it is ready (/health 200),
# then the log-probabilities' (`echo` included) behind it while requests are served: a request
# that needs one before it is built waits for that build (`ExecutableTable.get`).
WARMUP_PHASES = SERVING_PHASES
LATER_PHASES = ("logprobs",)
PROGRESS_EVERY = 5.0  # seconds between the warm-up's progress lines in the log
# uvicorn's log (its format and level): the server's own lines go there too.
log = logging.getLogger("uvicorn.error")
T = TypeVar("T")



# --------------------------------------------------------------------------------------------------
# Requests into engine work


@dataclasses.dataclass(frozen=True)
class Job:
  """One prompt of a request, validated: its token ids, its `SamplingParams` (None: nothing to
  generate, `echo` with `max_tokens: 0`), the text its choice starts with (`echo`, else None),
  its log-probabilities' alternatives per token (None: no logprobs) and the engine's request
  (None when nothing is generated)."""

  ids: list[int]
  params: SamplingParams | None
  echo: str | None = None
  top: int | None = None
  request: validation.Request | None = None

  @property
  def scored(self) -> bool:
    """Whether the choice reports its prompt's log-probabilities (`engine.score`)."""
    return self.echo is not None and self.top is not None


# The choice of a job that generates nothing.
_NOTHING = Completion(tokens=[], text="", finish_reason="length", stats={}, logprobs=[],
                      top_logprobs=[])


class ClientGone(Exception):
  """The client disconnected before its response was ready."""


def _event(data: Mapping[str, Any]) -> str:
  return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


async def _finish(handle: Handle) -> Completion:
  """The request's completion, awaited through its deltas."""
  async for _ in handle:
    pass
  return handle.result()


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
    self.names = None if engine.tokenizer is None else TokenText(engine.tokenizer)
    self.closing = False
    self.warmup: Warmup | None = None  # None: nothing to wait for
    self.created = int(time.time())

  # Validation --------------------------------------------------------------------------------

  def _check_model(self, name: str) -> None:
    if name != self.model_name:
      raise ApiError(404, f"the model {name!r} does not exist; this server serves "
                          f"{self.model_name!r}", param="model", code="model_not_found")

  @staticmethod
  def _check_unsupported(body: SamplingFields) -> None:
    if body.n not in (None, 1):
      raise bad_request("n", f"n={body.n} is not supported: allowed n=1 (one choice per prompt)")
    for name in ("presence_penalty", "frequency_penalty"):
      value = getattr(body, name)
      if value not in (None, 0):
        raise bad_request(name, f"{name}={value} is not supported: allowed 0 (no penalty)")
    if body.logit_bias:
      raise bad_request("logit_bias", "logit_bias is not supported: allowed null or {}")
    if body.stream_options is not None and not body.stream:
      raise bad_request("stream_options", "stream_options needs stream=true")
    if isinstance(body, CompletionRequest):
      if body.best_of not in (None, 1):
        raise bad_request("best_of", f"best_of={body.best_of} is not supported: allowed best_of=1")
      if body.suffix is not None:
        raise bad_request("suffix", "suffix is not supported: allowed null")
    else:
      if body.tools:
        raise bad_request("tools", "tools are not supported: allowed null or []")
      if body.tool_choice not in (None, "none", "auto"):
        raise bad_request("tool_choice", f"tool_choice={short(body.tool_choice)} is not supported: "
                                  "allowed null, \"none\" or \"auto\" (no tools)")
      kind = (body.response_format or {}).get("type", "text")
      if kind != "text":
        raise bad_request("response_format", f"response_format type {short(kind)} is not supported: "
                                      "allowed \"text\"")

  def _sampling(self, body: SamplingFields, logprobs: int | None,
                names: Mapping[str, str] = OPENAI_NAMES) -> SamplingParams:
    """The request's `SamplingParams` (max_new_tokens left at its default: each job sets its
    own; `_request` checks them against the model). Temperature 0 is greedy: OpenAI's other
    sampling fields then go to the engine as off (no engine warning). A bad value is a 400
    naming its OpenAI field (`names`: field -> OpenAI name; the others are named alike). The
    server's own limits: temperature up to MAX_TEMPERATURE, top_k -1 as off."""
    temperature = 1.0 if body.temperature is None else body.temperature
    if not math.isfinite(temperature) or not 0 <= temperature <= MAX_TEMPERATURE:
      raise bad_request("temperature", f"temperature={temperature} is out of range: allowed 0 to "
                                f"{MAX_TEMPERATURE:g} (0 = greedy)")
    top_k = 0 if body.top_k in (None, -1) else body.top_k
    if top_k < 0:
      raise bad_request("top_k", f"top_k={top_k} is out of range: allowed 0 or -1 (off) or a "
                          f"positive number of tokens")
    try:
      params = SamplingParams(do_sample=temperature > 0, temperature=temperature, top_k=top_k,
                              top_p=1.0 if body.top_p is None else body.top_p, seed=body.seed,
                              stop=body.stop, eos_token_id=[] if body.ignore_eos else None,
                              logprobs=logprobs)
    except ParamError as error:
      raise param_error(error, names) from None
    if temperature == 0:
      params = dataclasses.replace(params, top_k=0, top_p=1.0, seed=None)
    return params

  def _request(self, ids: list[int], params: SamplingParams,
               names: Mapping[str, str] = OPENAI_NAMES) -> validation.Request:
    """The engine's request of one prompt checked already (`_token_ids`, `_lengths`): its
    sampling checked against the model here, the one validation pass a request gets."""
    model = self.engine.model_config
    try:
      settings, stops, top = params.settings(vocab_size=model.vocab_size,
                                             default_eos=model.eos_token_id,
                                             has_tokenizer=self.engine.tokenizer is not None)
    except ParamError as error:
      raise param_error(error, names) from None
    return validation.Request([np.asarray(ids, np.int32)], params.max_new_tokens, settings, stops,
                              logprobs=top)

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
      raise bad_request(max_param, f"{max_param}=0 needs echo=true: it generates nothing, so the "
                            f"response would be empty (with echo=true it shows the prompt, and "
                            f"with logprobs scores it); allowed {max_param} {allowed}, or 0 with "
                            "echo=true")
    budgets = []
    for i, ids in enumerate(prompts):
      which = {"messages": "the rendered chat"}.get(param, "the prompt")
      if len(prompts) > 1:
        which = f"{param}[{i}]"
      if only_prompt and len(ids) > context:
        raise bad_request(param, f"{which} has {len(ids)} tokens; with echo=true and {max_param}=0 a "
                          f"prompt may have 1 to {context} tokens (the context)",
                   code="context_length_exceeded")
      if not only_prompt and len(ids) >= context:
        also = f", or {context} with echo=true and {max_param}=0" if completions else ""
        raise bad_request(param, f"{which} has {len(ids)} tokens; the context holds {context} tokens "
                          f"(prompt + completion), so a prompt may have 1 to {context - 1}"
                          f"{also}", code="context_length_exceeded")
      room = context - len(ids)
      if max_tokens is None:
        budgets.append(room)
      elif not (1 <= max_tokens <= room or only_prompt):
        zero = ", or 0 with echo=true" if completions else ""
        raise bad_request(max_param, f"{max_param}={max_tokens} is out of range: {which} has {len(ids)} "
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
      prompts = [prompt] if is_token(prompt[0]) else prompt
    limit = self.engine.config.max_waiting
    if len(prompts) > limit:
      raise bad_request("prompt", f"the request has {len(prompts)} prompts; allowed 1 to {limit}")
    for i, ids in enumerate(prompts):
      where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
      if not ids:
        raise bad_request("prompt", f"{where} is empty: it needs at least one token")
      if 0 <= min(ids) and max(ids) < vocab:
        continue
      for j, token in enumerate(ids):
        if not 0 <= token < vocab:
          raise bad_request("prompt", f"{where}[{j}] = {token} is not a token id of this model: allowed "
                               f"0 to {vocab - 1}")
    return prompts

  def _tokenizer(self, param: str, needs: str = NO_TOKENIZER):
    if self.engine.tokenizer is None:
      raise bad_request(param, f"the model {self.model_name!r} has no tokenizer (no tokenizer.json in "
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
    jobs = []
    for ids, budget, shown in zip(prompts, budgets, texts, strict=True):
      job_params = dataclasses.replace(params, max_new_tokens=budget) if budget else None
      jobs.append(Job(ids, job_params, shown, top,
                      None if job_params is None else self._request(ids, job_params)))
    return jobs

  def chat_jobs(self, body: ChatCompletionRequest) -> list[Job]:
    """The job of a chat request; `top_logprobs` needs `logprobs: true`."""
    self._check_model(body.model)
    self._check_unsupported(body)
    if body.top_logprobs is not None and not body.logprobs:
      raise bad_request("top_logprobs", f"top_logprobs={body.top_logprobs} needs logprobs=true")
    top = (0 if body.top_logprobs is None else body.top_logprobs) if body.logprobs else None
    max_tokens, name = body.max_tokens, "max_tokens"
    if body.max_completion_tokens is not None:
      max_tokens, name = body.max_completion_tokens, "max_completion_tokens"
    names = {"max_new_tokens": name, "logprobs": "top_logprobs"}
    params = self._sampling(body, top, names)
    if self.chat_template is None:
      raise bad_request("messages", f"the model {self.model_name!r} has no chat template (no "
                             "chat_template in its tokenizer_config.json): use /v1/completions",
                 code="no_chat_template")
    tokenizer = self._tokenizer("messages")
    rendered = self.render(body.messages)
    ids = tokenizer.encode(rendered, add_special_tokens=False).ids
    if not ids:
      raise bad_request("messages", "the rendered chat prompt is empty")
    budgets = self._lengths([ids], max_tokens, "messages", name)
    params = dataclasses.replace(params, max_new_tokens=budgets[0])
    return [Job(ids, params, None, top, self._request(ids, params, names))]

  def render(self, messages: Sequence[ChatMessage]) -> str:
    """The chat prompt of `messages` (text content parts joined)."""
    chat = []
    for i, message in enumerate(messages):
      data = message.model_dump()
      if isinstance(message.content, list):
        texts = []
        for j, part in enumerate(message.content):
          if part.type != "text" or part.text is None:
            raise bad_request(f"messages[{i}].content[{j}]", f"content part type {part.type!r} is not "
                                                      "supported: allowed \"text\" with a text")
          texts.append(part.text)
        data["content"] = "".join(texts)
      chat.append(data)
    try:
      return self.chat_template.render(chat, add_generation_prompt=True)
    except TemplateError as error:
      raise bad_request("messages", f"the chat template rejected the messages: {error}") from None

  # Running ---------------------------------------------------------------------------------

  def check_open(self) -> None:
    if self.closing:
      raise ApiError(503, "the server is shutting down", type="server_error",
                     code="engine_closed")

  @property
  def failure(self) -> str | None:
    """Why the engine can serve nothing any more (its core process died), or None."""
    return getattr(self.engine, "failure", None)

  def check_ready(self) -> None:
    """A 503 unless the server takes requests: open, warmed up, its engine alive."""
    if self.failure is not None:
      raise ApiError(503, self.failure, type="server_error", code="engine_died")
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
        handles.append(None if job.request is None else self.engine.submit_validated(
            job.request, timeout=self.request_timeout))
    except Exception as error:  # noqa: BLE001 - every failure cancels the jobs queued before it
      for handle in handles:
        if handle is not None:
          handle.cancel()
      raise engine_error(error) from None
    self.metrics.prompt_tokens.inc(sum(len(job.ids) for job in jobs))
    return handles

  async def complete(self, receive, handles: list[Handle | None]) -> list[Completion]:
    """Every request's completion (`_NOTHING` for a job that generates nothing); raises
    `ClientGone` (requests cancelled) if the client disconnects first (`receive`: the request's
    ASGI receive, its body read already)."""
    live = [h for h in handles if h is not None]
    try:
      completions = await unless_gone(receive, asyncio.gather(*(_finish(h) for h in live)))
    except ClientGone:
      self.metrics.cancelled.inc(len(live))
      raise
    except Exception as error:  # noqa: BLE001 - answered in OpenAI's format
      raise engine_error(error) from None
    finally:
      for handle in live:
        handle.cancel()
    for completion in completions:
      self.metrics.finished(completion)
    done = iter(completions)
    return [_NOTHING if h is None else next(done) for h in handles]

  def logprobs(self, job: Job, score: list | None, chat: bool) -> Logprobs | None:
    """A choice's log-probabilities, its echoed prompt's added (None when not asked)."""
    if job.top is None:
      return None
    choice = Logprobs(self.names, chat)
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
    chunk = Chunks(self.model_name, chat, include_usage, token_ids)
    generated = 0
    logs = [self.logprobs(job, score, chat) for job, score in zip(jobs, scores, strict=True)]

    def taken(index: int) -> dict[str, Any] | None:
      return None if logs[index] is None else logs[index].take()

    def deltas_event(index: int, deltas: list[Delta]) -> str | None:
      """One chunk of a choice's deltas since its last chunk (one delta a step while the stream
      keeps up; when it falls behind, fewer and larger chunks). A step's token goes out with its
      text, or held back with it; without a tokenizer (no text) every step is a chunk, its ids
      with return_token_ids."""
      nonlocal generated
      texts, ids = [], []
      for delta in deltas:
        if logs[index] is not None and delta.token >= 0:
          logs[index].add(delta.token, delta.logprob, delta.top_logprobs)
        generated += int(delta.token >= 0)
        if delta.text or (delta.token >= 0 and (token_ids or self.names is None)):
          texts.append(delta.text or "")
          if delta.token >= 0:
            ids.append(delta.token)
      if continuous_usage:
        chunk.running = usage_counts(jobs, generated)
      if not texts and not ids:
        return None
      return _event(chunk.choices([chunk.delta(index, "".join(texts), ids, taken(index))]))

    completions: list[Completion | None] = [None] * len(handles)
    live = {i: h for i, h in enumerate(handles) if h is not None}
    ready = asyncio.Event()  # set when any choice has news
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
      for handle in live.values():
        handle.watch(ready)
      while live:
        # Everything that arrived since the last wake-up, as one write.
        ready.clear()
        events = []
        for index, handle in list(live.items()):
          try:
            deltas, ended = handle.poll()
          except Exception as error:  # noqa: BLE001 - the stream reports it
            failed = True
            events.append(_event(engine_error(error).body()))
            break
          if deltas and (event := deltas_event(index, deltas)) is not None:
            events.append(event)
          if ended:
            del live[index]
            completions[index] = completion = handle.result()
            self.metrics.finished(completion)
            events.append(_event(chunk.choices([chunk.final(index, completion.finish_reason,
                                                            taken(index))])))
        if events:
          yield "".join(events)
        if failed:
          break
        if live and not events:
          await ready.wait()
      else:
        if include_usage:
          yield _event(chunk.usage(usage(jobs, completions)))
      yield "data: [DONE]\n\n"
    finally:
      if not failed and any(c is None for c in completions):  # the client went away
        self.metrics.cancelled.inc(sum(c is None for c in completions))
      for handle in handles:
        if handle is not None:
          handle.cancel()


async def unless_gone(receive, work: Awaitable[T]) -> T:
  """`work`'s result, unless the client disconnects first: then `work` is cancelled and this
  raises `ClientGone` (`receive`: the request's ASGI receive, its body read already)."""
  task = asyncio.ensure_future(work)
  gone = asyncio.ensure_future(_disconnected(receive))
  try:
    await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
    if not task.done():
      raise ClientGone()
    return task.result()
  finally:
    task.cancel()
    gone.cancel()


async def _disconnected(receive) -> None:
  while True:
    message = await receive()
    if message["type"] == "http.disconnect":
      return


def usage(jobs: Sequence[Job], completions: Sequence[Completion]) -> dict[str, int]:
  return usage_counts(jobs, sum(len(c.tokens) for c in completions))


def usage_counts(jobs: Sequence[Job], generated: int) -> dict[str, int]:
  """OpenAI's usage object of `jobs`' prompts and `generated` new tokens."""
  prompt = sum(len(job.ids) for job in jobs)
  return {"prompt_tokens": prompt, "completion_tokens": generated,
          "total_tokens": prompt + generated}


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
          "model": model, "choices": choices, "usage": usage(jobs, completions)}


class _Stop(Exception):
  """Raised in the warm-up thread by its progress callback: `Warmup.stop` was called."""


class Warmup:
  """The engine's warm-up (`engine.warmup` of `WARMUP_PHASES`), run in a thread of its own
  ("cg_jax-warmup") while the server already answers; once ready, the same thread builds the
  `later` phases' executables (an engine core builds its own: none here).

  `state` is "warming up", then "ready", "failed" (`error` says why; `on_failure`, if set, is
  called in the warm-up thread) or "stopped" (`stop` came first). `done` of `total` executables
  are ready (loaded or compiled). The start, the end and a failure are logged; `report` logs
  the progress every PROGRESS_EVERY seconds. A failure of the later phases is logged (a request
  that needs one of their executables builds it).
  """

  def __init__(self, engine: Engine, later: Sequence[str] = LATER_PHASES):
    self.engine, self.later = engine, tuple(later)
    self.total = 0  # known once the warm-up thread asked (an engine core may still be loading)
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
      if self.state == "warming up" and self.total:  # (0: the model is still loading)
        log.info("warming up: %d of %d executables ready, %.0f s", self.done, self.total,
                 self.elapsed())

  def _progress(self, done: int, total: int) -> None:
    self.done, self.total = done, total
    if self._stop.is_set():
      raise _Stop()

  def _run(self) -> None:
    try:
      self.total = len(self.engine.executable_keys(phases=WARMUP_PHASES))
    except Exception as error:  # noqa: BLE001 - an engine core that failed to load
      self._failed(error)
      return
    log.info("warming up: %d executables to load or compile; /health answers 503 until they "
             "are ready", self.total)
    try:
      self.engine.warmup(phases=WARMUP_PHASES, progress=False, on_progress=self._progress)
    except _Stop:
      self._end("stopped")
      log.info("warm-up stopped after %d of %d executables, %.1f s", self.done, self.total,
               self.elapsed())
    except Exception as error:  # noqa: BLE001 - reported by /health, the log and `serve`
      self._failed(error)
    else:
      self._end("ready")
      log.info("warmed up: %d executables in %.1f s; serving", self.total, self.elapsed())
      if self.later:
        self.engine.warmup_behind(self.later, stopping=self._stop.is_set)

  def _failed(self, error: BaseException) -> None:
    self.error = f"{type(error).__name__}: {error}"
    self._end("failed")
    log.error("warm-up failed after %d of %d executables, %.1f s: %s", self.done, self.total,
              self.elapsed(), self.error, exc_info=error)
    if self.on_failure is not None:
      self.on_failure()

  def _end(self, state: str) -> None:
    self._ended = time.monotonic()
    self.state = state
