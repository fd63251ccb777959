"""`serve`'s processes: one engine-core process (`cg_jax.core.process`: the scheduler, the
executables and the KV cache) and N front ends (`CoreClient` + the FastAPI app on uvicorn),
all on one listening socket bound before anything starts. With one front end it runs in this
process; with more, each is a process of its own and this one supervises them. The core is the
process `python -m cg_jax serve` started before its imports (`cg_jax.core.prestart`: it imports
jax and the engine meanwhile), else one started here.

Faults: the core's death fails every request in flight (503), turns /health to 503 and stops
the server with exit status 1 and a log line saying why; a front end's death is logged, its
requests are cancelled in the core, and the others keep serving; SIGTERM (or SIGINT) lets the
front ends drain (`graceful_timeout`), then stops the core. Front ends never touch the
accelerator (their jax platform is the CPU): only the core does.
"""

from __future__ import annotations

import functools
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import tempfile
import threading
from typing import Any

import jax

from cg_jax import text
from cg_jax.core import prestart, process, wire
from cg_jax.engine import Engine
from cg_jax.hub import resolve_model
from cg_jax.serving.app import EngineDied, WarmupFailed, create_app, load_chat_template, serve
from cg_jax.serving.client import CoreClient
from cg_jax.serving.service import LATER_PHASES, WARMUP_PHASES
from models.config import PRESETS

log = logging.getLogger("uvicorn.error")
CORE_STOP_S = 30.0  # seconds the core may take to stop after the front ends
_SPAWN = multiprocessing.get_context("spawn")


def _signal_name(code: int | None) -> str:
  if code is not None and code < 0:
    try:
      return f"{code} ({signal.Signals(-code).name})"
    except ValueError:
      pass
  return str(code)


def _tokenizer(model: str):
  if model in PRESETS and not os.path.isdir(model):
    return None
  return text.load_tokenizer(resolve_model(model))


def _front_end(directory: str, index: int, core_pid: int, model: str, served: str,
               request_timeout: float | None, sock: socket.socket, graceful_timeout: float,
               log_level: str) -> int:
  """Serve one front end until it is stopped: 0, or 1 if the engine failed."""
  jax.config.update("jax_platforms", "cpu")  # (the core owns the accelerator)
  client = CoreClient(directory, index, core_pid, _tokenizer(model))
  app = create_app(client, served, chat_template=load_chat_template(model),
                   request_timeout=request_timeout, later_phases=())  # (the core builds them)
  try:
    serve(app, sock=sock, graceful_timeout=graceful_timeout, log_level=log_level)
  except (WarmupFailed, EngineDied) as error:
    log.error("%s", error)
    return 1
  finally:
    client.close()
  return 0


def _front_end_process(*args) -> None:
  """A front end's own process (the `multiprocessing` target)."""
  signal.signal(signal.SIGINT, signal.SIG_IGN)  # (the supervisor forwards SIGTERM)
  raise SystemExit(_front_end(*args))


def _stop_core(core, directory: str) -> None:
  if core.is_alive():
    try:
      with wire.connect(wire.core_address(directory)) as sock:
        sock.sendall(wire.encode({"op": "shutdown"}))
    except OSError:  # not listening (yet, or any more): it is stopped as below
      core.terminate()
    core.join(CORE_STOP_S)
  if core.is_alive():
    log.warning("the engine core did not stop within %.0f s: killing it", CORE_STOP_S)
    core.kill()
    core.join(5)


def serve_model(model: str, *, sock: socket.socket, engine_options: dict[str, Any],
                served_model_name: str | None = None, api_servers: int = 1,
                request_timeout: float | None = None, graceful_timeout: float = 30.0,
                log_level: str = "info") -> int:
  """Serve `model` (as `Engine.from_pretrained(model, **engine_options)` builds it) on `sock`
  with `api_servers` front ends until SIGTERM / SIGINT; returns the exit status (0, or 1 when the
  engine's start-up failed or its process died)."""
  if not (isinstance(api_servers, int) and api_servers >= 1):
    raise ValueError(f"api_servers must be an int >= 1, got {api_servers!r}")
  # (before uvicorn configures its loggers: the launcher's first lines in uvicorn's format)
  logging.basicConfig(format="%(levelname)s:     %(message)s", level=log_level.upper())
  directory = tempfile.mkdtemp(prefix="cg_jax-")
  # (the serving executables compile while the checkpoint is read)
  build = functools.partial(Engine.from_pretrained, model, **engine_options,
                            compile_while_loading=WARMUP_PHASES)
  core = prestart.take().run(process.run, directory, build, WARMUP_PHASES, LATER_PHASES,
                             log_level)
  log.info("engine core process started (pid %d); %d front end%s", core.pid, api_servers,
           "" if api_servers == 1 else "s")
  args = (directory, core.pid, model, served_model_name or model, request_timeout, sock,
          graceful_timeout, log_level)
  try:
    if api_servers == 1:
      status = _front_end(directory, 0, *args[1:])
    else:
      status = _supervise(core, directory, api_servers, args)
    if not core.is_alive() and core.exitcode not in (0, None):
      log.error("the engine core process (pid %d) exited with code %s", core.pid,
                _signal_name(core.exitcode))
      status = 1
    return status
  finally:
    _stop_core(core, directory)
    shutil.rmtree(directory, ignore_errors=True)


def _supervise(core, directory: str, count: int, args: tuple) -> int:
  """Run `count` front-end processes; see the module docstring."""
  _, core_pid, *rest = args
  fronts = {}
  for index in range(count):
    front = _SPAWN.Process(target=_front_end_process, args=(directory, index, core_pid, *rest),
                           name=f"cg_jax-front-{index}")
    front.start()
    fronts[index] = front
  stopping = threading.Event()

  def stop(signum, frame):
    stopping.set()
    for front in fronts.values():
      if front.is_alive():
        os.kill(front.pid, signal.SIGTERM)

  previous = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
  status = 0
  try:
    while fronts:
      waiting = {front.sentinel: index for index, front in fronts.items()}
      ready = multiprocessing.connection.wait([core.sentinel, *waiting], timeout=0.5)
      if core.sentinel in ready and not stopping.is_set():
        log.error("the engine core process (pid %d) exited with code %s: stopping the front "
                  "ends", core.pid, _signal_name(core.exitcode))
        status = 1
        for front in fronts.values():
          front.join(5)  # (they fail their requests and stop by themselves)
          if front.is_alive():
            front.terminate()
        break
      for sentinel in ready:
        if sentinel in waiting:
          index = waiting[sentinel]
          front = fronts.pop(index)
          front.join()
          if not stopping.is_set():
            # (the core cancels its requests when its connection closes)
            log.warning("front end %d (pid %d) exited with code %s; %d keep serving", index,
                        front.pid, _signal_name(front.exitcode), len(fronts))
            if front.exitcode:
              status = 1 if not fronts else status
  finally:
    for s, handler in previous.items():
      signal.signal(s, handler)
  return status
