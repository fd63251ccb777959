"""The generation endpoints, POST /v1/completions and /v1/chat/completions, as plain ASGI in
front of the FastAPI app that serves the rest (`create_app` installs it as the app's middleware,
inside the request counter).

A request's body is parsed and validated in one pydantic-core pass (`model_validate_json`), its
errors answered in OpenAI's format as the app's are, and its response goes straight to the
server's `send`: no dependency resolution, exception middleware or task group per request, which
a lone request's first chunk paid for (see benchmarks/README.md, "Serving"). A streamed
response's requests are cancelled however it ends (finished, failed, the client gone).
"""

from __future__ import annotations

import logging
from typing import Any

from pydantic import ValidationError
from starlette.responses import JSONResponse, Response

from cg_jax.serving.protocol import (ApiError, ChatCompletionRequest, CompletionRequest,
                                     SamplingFields, StreamOptions, bad_request, engine_error,
                                     validation_error)
from cg_jax.serving.service import ClientGone, Job, Service, completion_response, unless_gone

log = logging.getLogger("uvicorn.error")
ROUTES = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest}
EVENT_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"),
                 (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]
NOT_JSON = "the request body must be a JSON object, sent with Content-Type: application/json"


class GenerationRoutes:
  """ASGI middleware: answers ROUTES' paths itself and hands every other request to `app`."""

  def __init__(self, app, service: Service):
    self.app, self.service = app, service

  async def __call__(self, scope, receive, send) -> None:
    model = ROUTES.get(scope.get("path")) if scope["type"] == "http" else None
    if model is None:
      await self.app(scope, receive, send)
      return
    try:
      if scope["method"] != "POST":
        raise ApiError(405, f"{scope['method']} {scope['path']}: Method Not Allowed")
      body = _parse(model, scope, await _body(receive))
      service = self.service
      service.check_ready()
      chat = model is ChatCompletionRequest
      jobs = service.chat_jobs(body) if chat else service.completion_jobs(body)
      await self._answer(body, jobs, chat, scope, receive, send)
    except ClientGone:
      await Response(status_code=499)(scope, receive, send)
    except ApiError as error:
      await error.response()(scope, receive, send)
    except Exception as error:  # noqa: BLE001 - answered in OpenAI's format
      await engine_error(error).response()(scope, receive, send)

  async def _answer(self, body: SamplingFields, jobs: list[Job], chat: bool, scope, receive,
                    send) -> None:
    service = self.service
    scores = await service.scores(jobs)
    handles = service.submit(jobs)
    if not body.stream:
      completions = await service.complete(receive, handles)
      logprobs = [service.choice_logprobs(job, score, completion, chat)
                  for job, score, completion in zip(jobs, scores, completions, strict=True)]
      response = completion_response(service.model_name, jobs, completions, logprobs, chat=chat,
                                     token_ids=body.return_token_ids)
      await JSONResponse(response)(scope, receive, send)
      return
    options = body.stream_options or StreamOptions()
    events = service.events(jobs, handles, scores, chat=chat,
                            include_usage=bool(options.include_usage),
                            token_ids=body.return_token_ids,
                            continuous_usage=bool(options.continuous_usage_stats))

    async def write() -> None:
      await send({"type": "http.response.start", "status": 200, "headers": EVENT_HEADERS})
      async for event in events:
        await send({"type": "http.response.body", "body": event.encode(), "more_body": True})
      await send({"type": "http.response.body", "body": b"", "more_body": False})

    try:
      await unless_gone(receive, write())
    except ClientGone:
      pass
    except Exception as error:  # noqa: BLE001 - the response has started: nothing to answer
      log.warning("a streamed response ended early: %r", error)
    finally:
      for handle in handles:
        if handle is not None:
          handle.cancel()


async def _body(receive) -> bytes:
  """The request's body; `ClientGone` if the client leaves before sending all of it."""
  parts = []
  while True:
    message = await receive()
    if message["type"] == "http.disconnect":
      raise ClientGone()
    parts.append(message.get("body", b""))
    if not message.get("more_body"):
      return b"".join(parts)


def _parse(model: type[SamplingFields], scope: dict[str, Any], body: bytes) -> SamplingFields:
  """The validated request of a JSON body (as FastAPI reads one: JSON unless a Content-Type
  says otherwise); a 400 naming the parameter."""
  if not body:
    raise bad_request(None, "the request needs a JSON body")
  for name, value in scope["headers"]:
    if name == b"content-type":
      kind = value.split(b";", 1)[0].strip().lower()
      if not (kind == b"application/json" or
              (kind.startswith(b"application/") and kind.endswith(b"+json"))):
        raise bad_request(None, NOT_JSON)
  try:
    return model.model_validate_json(body)
  except ValidationError as error:
    raise validation_error(error.errors(include_url=False)) from None
