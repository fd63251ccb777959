"""The app (`create_app`), its warm-up, and `serve`: uvicorn on a socket bound first."""


from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import signal
import socket
import threading
from collections.abc import Sequence
from typing import Any

import fastapi
import uvicorn
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from cg_jax.chat_template import ChatTemplate
from cg_jax.engine import Engine
from cg_jax.hub import resolve_model
from cg_jax.serving.metrics import CountRequests, is_number
from cg_jax.serving.protocol import ApiError, engine_error, validation_error
from cg_jax.serving.routes import GenerationRoutes
from cg_jax.serving.service import LATER_PHASES, Service, Warmup
from models.config import PRESETS

# uvicorn's log (its format and level): the server's own lines go there too.
log = logging.getLogger("uvicorn.error")
FAILED_GRACE_S = 1.0  # seconds between the engine's death and the server's shutdown



# --------------------------------------------------------------------------------------------------
# The app


ENDPOINTS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/models", "/health",
                       "/metrics"})


def create_app(engine: Engine, model_name: str, *, chat_template: ChatTemplate | None = None,
               warmup: bool = True, close_engine: bool = True,
               request_timeout: float | None = None,
               later_phases: Sequence[str] = LATER_PHASES) -> fastapi.FastAPI:
  """The FastAPI app serving `engine` as `model_name`.

  Args:
    chat_template: the template of /v1/chat/completions (`load_chat_template`), or None.
    warmup: compile the serving executables at start-up (`Warmup`: in a thread, while the
      server answers 503 "warming up"), then those of `later_phases` while it serves; False:
      the engine is taken as warmed up.
    close_engine: close the engine when the app shuts down.
    request_timeout: seconds each request may take (None: no limit); past it, a 504.
  """
  if request_timeout is not None and not (is_number(request_timeout) and request_timeout > 0):
    raise ValueError(f"request_timeout must be None or a number of seconds > 0, got "
                     f"{request_timeout!r}")
  service = Service(engine, model_name, chat_template, request_timeout)
  if warmup:
    service.warmup = Warmup(engine, later_phases)

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
  # (the last added is the outermost: every request is counted, the generation routes' too)
  app.add_middleware(GenerationRoutes, service=service)
  app.add_middleware(CountRequests, metrics=service.metrics, endpoints=ENDPOINTS)

  @app.exception_handler(ApiError)
  async def api_error(request, error: ApiError):
    return error.response()

  @app.exception_handler(RequestValidationError)
  async def invalid(request, error: RequestValidationError):
    return validation_error(error.errors()).response()

  @app.exception_handler(StarletteHTTPException)
  async def http_error(request, error: StarletteHTTPException):
    kind = "invalid_request_error" if error.status_code < 500 else "server_error"
    return ApiError(error.status_code, f"{request.method} {request.url.path}: {error.detail}",
                    type=kind).response()

  @app.exception_handler(Exception)
  async def failed(request, error: Exception):
    return engine_error(error).response()

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
    if service.failure is not None:
      return JSONResponse({"status": "engine died", "error": service.failure}, status_code=503)
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


class EngineDied(RuntimeError):
  """`serve` stopped because its engine (the engine-core process) died."""


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
  fails, the server shuts down and this raises `WarmupFailed`; if the engine's core process
  dies, the requests in flight fail (503), /health answers 503, and after FAILED_GRACE_S the
  server shuts down and this raises `EngineDied`. uvicorn handles signals in the
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
  engine = None if service is None else service.engine
  if hasattr(engine, "on_failure"):  # an engine in another process: its death stops serving
    # (after a moment, so that the failed requests' 5xx responses go out first)
    engine.on_failure.append(lambda: threading.Timer(
        FAILED_GRACE_S, lambda: setattr(live, "should_exit", True)).start())
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
  if service is not None and service.failure is not None:
    raise EngineDied(service.failure)
  if warm is not None and warm.state == "failed":
    raise WarmupFailed(f"the engine's warm-up failed: {warm.error}")
