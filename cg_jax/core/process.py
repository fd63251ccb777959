"""The engine-core process: one engine (its scheduler, executables and KV cache) serving the
front ends' requests over ZMQ (`cg_jax.core.wire`). It runs no asyncio and no HTTP.

Threads: the main thread reads the inbox (requests, cancellations, status and score calls); a
loader thread builds the engine and warms it up (the main thread answers status meanwhile); the
engine thread runs the steps and, after each, sends every front end its requests' new tokens in
one message (`Outbox.flush`, given to `Engine.on_step`). A request arrives validated by its
front end (token ids, `SamplingSettings`, a budget); stop strings and text stay in the front end,
which cancels a request once its text holds one.

The process ends on a `shutdown` message (the launcher's, after the front ends drained) or once
its parent is gone; SIGINT is left to the launcher, which coordinates the shutdown.
"""

from __future__ import annotations

import collections
import functools
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import zmq

from cg_jax import validation
from cg_jax.core import wire
from cg_jax.handles import Group

log = logging.getLogger("cg_jax.core")
POLL_MS = 100  # the main loop's longest wait for a message


class Outbox:
  """What goes back to the front ends: each step's tokens, ends and failures, gathered per front
  end and sent as one message each by `flush`; and the replies to status and score calls.
  Thread-safe (one lock around the buffers and the sockets); a front end that is gone or does
  not read drops its messages (a send never blocks the engine thread)."""

  def __init__(self, context: zmq.Context):
    self._context = context
    self._lock = threading.Lock()
    self._sockets: dict[str, zmq.Socket] = {}
    self._tokens: dict[str, list[tuple[int, int]]] = collections.defaultdict(list)
    self._scores: dict[str, list[tuple[int, np.ndarray]]] = collections.defaultdict(list)
    self._ends: dict[str, list[list]] = collections.defaultdict(list)
    self._errors: dict[str, list[list]] = collections.defaultdict(list)
    self.dropped = 0

  def connect(self, client: str) -> None:
    with self._lock:
      if client not in self._sockets:
        sock = self._context.socket(zmq.PUSH)
        sock.setsockopt(zmq.SNDHWM, 100_000)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(client)
        self._sockets[client] = sock

  def forget(self, client: str) -> None:
    with self._lock:
      sock = self._sockets.pop(client, None)
      for buffer in (self._tokens, self._scores, self._ends, self._errors):
        buffer.pop(client, None)
    if sock is not None:
      sock.close()

  def token(self, client: str, rid: int, token: int, score: np.ndarray | None) -> None:
    with self._lock:
      self._tokens[client].append((rid, token))
      if score is not None:
        self._scores[client].append((rid, score))

  def end(self, client: str, rid: int, reason: str) -> None:
    with self._lock:
      self._ends[client].append([rid, reason])

  def error(self, client: str, rid: int, error: BaseException) -> None:
    with self._lock:
      self._errors[client].append([rid, type(error).__name__, str(error)])

  def flush(self) -> None:
    """One `step` message per front end with outputs."""
    with self._lock:
      clients = set(self._tokens) | set(self._ends) | set(self._errors)
      for client in clients:
        tokens = self._tokens.pop(client, [])
        scores = self._scores.pop(client, [])
        ids = np.array([rid for rid, _ in tokens], np.int64)
        values = np.array([token for _, token in tokens], np.int32)
        scored = np.array([rid for rid, _ in scores], np.int64)
        width = len(scores[0][1]) if scores else 0
        rows = (np.stack([score for _, score in scores]).astype(np.float32) if scores
                else np.zeros((0,), np.float32))
        header = {"op": "step", "ends": self._ends.pop(client, []),
                  "errors": self._errors.pop(client, []), "width": width}
        self._send(client, wire.encode(header, ids, values, scored, rows))

  def reply(self, client: str, ticket: int, result: Any = None,
            error: BaseException | None = None) -> None:
    header = {"op": "reply", "ticket": ticket, "result": result,
              "error": None if error is None else [type(error).__name__, str(error)]}
    with self._lock:
      self._send(client, wire.encode(header))

  def _send(self, client: str, frames: list) -> None:
    sock = self._sockets.get(client)
    if sock is None:
      return
    try:
      sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
    except zmq.Again:
      self.dropped += 1

  def close(self) -> None:
    with self._lock:
      for sock in self._sockets.values():
        sock.close()
      self._sockets.clear()


class _CoreGroup(Group):
  """A front end's request inside the core: its tokens, end or failure go to the outbox."""

  def __init__(self, outbox: Outbox, client: str, rid: int, prompt_tokens: list[int],
               on_cancel: Callable[[], None]):
    super().__init__(prompt_tokens, on_cancel)
    self._outbox, self.client, self.rid = outbox, client, rid

  def _emit(self, tokens: dict[int, int], scores: dict[int, np.ndarray]) -> None:
    self._outbox.token(self.client, self.rid, tokens[0], scores.get(0))

  def _finish(self, row: int, reason: str) -> None:
    if not self.done:
      self._outbox.end(self.client, self.rid, reason)
    super()._finish(row, reason)

  def _fail(self, error: BaseException) -> None:
    if not self.done:
      self._outbox.error(self.client, self.rid, error)
    super()._fail(error)


class Core:
  """The engine-core process's state (see the module docstring).

  Args:
    build: makes the engine (called in the loader thread; an `Engine`, used through its public
      methods only).
    phases: the executables' phases to warm up once it is built (then it is ready).
    later: the phases whose executables it builds next, while it serves.
  """

  def __init__(self, directory: str, build: Callable[[], Any], phases: Sequence[str],
               later: Sequence[str] = ()):
    self.context = zmq.Context()
    self.inbox = self.context.socket(zmq.PULL)
    self.inbox.setsockopt(zmq.LINGER, 0)
    self.inbox.bind(wire.core_address(directory))
    self.outbox = Outbox(self.context)
    self.engine = None
    self.state, self.error = "loading", None
    self.done = self.total = 0
    self._build, self._phases, self._later = build, tuple(phases), tuple(later)
    self._started = time.monotonic()
    self._ready_at: float | None = None
    self._requests: dict[tuple[str, int], _CoreGroup] = {}
    self._scoring = ThreadPoolExecutor(1, thread_name_prefix="cg_jax-score")
    self._stop = False

  # The loader thread ------------------------------------------------------------------------

  def load(self) -> None:
    try:
      self.engine = self._build()
      self.engine.on_step(self.outbox.flush)
      self.total = len(self.engine.executable_keys(phases=self._phases))
      self.state = "warming up"
      log.info("engine core: model loaded in %.1f s; warming up %d executables",
               time.monotonic() - self._started, self.total)
      self.engine.warmup(phases=self._phases, progress=False, on_progress=self._progress)
    except Exception as error:  # noqa: BLE001 - reported through `status`
      if self._stop:
        log.info("engine core: start-up stopped (shutting down)")
        return
      self.error = f"{type(error).__name__}: {error}"
      self.state = "failed"
      log.error("engine core: start-up failed: %s", self.error, exc_info=error)
      return
    self._ready_at = time.monotonic()
    self.state = "ready"
    log.info("engine core ready in %.1f s (pid %d)", self._ready_at - self._started, os.getpid())
    if self._later:
      self.engine.warmup_behind(self._later, stopping=lambda: self._stop)

  def _progress(self, done: int, total: int) -> None:
    self.done, self.total = done, total
    if self._stop:
      raise RuntimeError("the engine core is shutting down")

  # The main thread --------------------------------------------------------------------------

  def status(self) -> dict[str, Any]:
    status = {"state": self.state, "error": self.error, "done": self.done, "total": self.total,
              "elapsed_s": (self._ready_at or time.monotonic()) - self._started,
              "pid": os.getpid(), "dropped": self.outbox.dropped}
    if self.engine is not None:
      engine = self.engine
      status["model"] = {"vocab_size": engine.model_config.vocab_size,
                         "eos_token_id": list(engine.model_config.eos_token_id)}
      status["config"] = {"max_seq_len": engine.config.max_seq_len,
                          "max_waiting": engine.config.max_waiting}
      status["stats"] = {k: v for k, v in engine.stats().items()
                         if isinstance(v, (int, float, str, bool)) or v is None}
    return status

  def run(self) -> None:
    loader = threading.Thread(target=self.load, name="cg_jax-core-loader", daemon=True)
    loader.start()
    parent = os.getppid()
    last_prune = time.monotonic()
    while not self._stop:
      if self.inbox.poll(POLL_MS):
        while not self._stop:
          try:
            frames = self.inbox.recv_multipart(flags=zmq.NOBLOCK, copy=False)
          except zmq.Again:
            break
          self.handle(*wire.decode(frames))
      if os.getppid() != parent:
        log.error("engine core: the launcher (pid %d) is gone; exiting", parent)
        break
      if time.monotonic() - last_prune > 1.0:
        self._requests = {key: g for key, g in self._requests.items() if not g.done}
        last_prune = time.monotonic()
    self._stop = True
    if self.engine is not None:
      self.engine.close()
    loader.join(timeout=5)
    self._scoring.shutdown(wait=False, cancel_futures=True)
    self.outbox.close()
    self.inbox.close()
    self.context.term()

  def handle(self, header: dict[str, Any], buffers: list) -> None:
    op, client = header["op"], header.get("client")
    if op == "hello":
      self.outbox.connect(client)
      self.outbox.reply(client, header.get("ticket", -1), self.status())
    elif op == "status":
      self.outbox.reply(client, header["ticket"], self.status())
    elif op == "add":
      self._add(client, header, wire.array(buffers[0], np.int32))
    elif op == "cancel":
      for rid in header["ids"]:
        group = self._requests.pop((client, rid), None)
        if group is not None:
          group.cancel()
    elif op == "score":
      prompt = wire.array(buffers[0], np.int32).tolist()
      self._scoring.submit(self._score, client, header["ticket"], prompt, header["top"])
    elif op == "client_gone":
      for key in [key for key in self._requests if key[0] == client]:
        self._requests.pop(key).cancel()
      self.outbox.forget(client)
      log.warning("engine core: front end %s is gone; its requests were cancelled", client)
    elif op == "shutdown":
      self._stop = True

  def _add(self, client: str, header: dict[str, Any], prompt: np.ndarray) -> None:
    rid = header["id"]
    if self.state != "ready":
      self.outbox.error(client, rid, RuntimeError(f"the engine core is not ready ({self.state})"))
      self.outbox.flush()
      return
    request = validation.Request([prompt.copy()], header["max_new_tokens"],
                                 wire.settings_from_json(header["settings"]),
                                 logprobs=header["logprobs"])
    make = functools.partial(_CoreGroup, self.outbox, client, rid)
    try:
      group = self.engine.enqueue(request, timeout=header["timeout"], group=make)
    except Exception as error:  # noqa: BLE001 - QueueFull, EngineClosed: the request fails
      self.outbox.error(client, rid, error)
      self.outbox.flush()
      return
    self._requests[(client, rid)] = group

  def _score(self, client: str, ticket: int, prompt: list[int], top: int) -> None:
    try:
      result = self.engine.score(prompt, top=top)
    except Exception as error:  # noqa: BLE001 - the caller gets it
      self.outbox.reply(client, ticket, error=error)
    else:
      self.outbox.reply(client, ticket, [[float(lp), [[int(t), float(p)] for t, p in alts]]
                                         for lp, alts in result])


def run(directory: str, build: Callable[[], Any], phases: Sequence[str],
        later: Sequence[str] = (), log_level: str = "info") -> None:
  """The engine-core process's entry (`multiprocessing` target; see the module docstring)."""
  signal.signal(signal.SIGINT, signal.SIG_IGN)
  logging.basicConfig(level=log_level.upper(), format="%(levelname)s:     %(message)s")
  Core(directory, build, phases, later).run()
  # The engine is closed: end now. A compile still in flight behind it (the decode steps' own,
  # `Engine.warmup`) would otherwise hold the exit (Python joins thread pools at exit) for as
  # long as it takes, past the launcher's CORE_STOP_S.
  logging.shutdown()
  os._exit(0)
