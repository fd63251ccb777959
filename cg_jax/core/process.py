"""The engine-core process: one engine (its scheduler, executables and KV cache) serving the
front ends' requests over Unix-domain sockets (`cg_jax.core.wire`). It runs no asyncio and no
HTTP.

Threads: the main thread accepts the front ends' connections and reads them (requests,
cancellations, status and score calls; a closed connection cancels its front end's requests); a
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
import selectors
import signal
import socket
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
from cg_jax import validation
from cg_jax.core import wire
from cg_jax.handles import Group

log = logging.getLogger("cg_jax.core")
POLL_MS = 100  # the main loop's longest wait for a message
PENDING_POLL_S = 0.002  # its wait while a front end's socket has bytes to take
RECEIVE_BYTES = 1 << 20  # the most one read of a connection takes
MAX_PENDING = 256 << 20  # bytes a front end may fall behind before it is dropped


class Peer:
  """A front end's connection in the core (or the launcher's, which only says `shutdown`):
  messages in through `reader`, and the bytes of messages out that the kernel's buffer has not
  taken yet (`pending`, sent first from then on)."""

  def __init__(self, sock: socket.socket):
    self.sock, self.reader, self.pending = sock, wire.Reader(), bytearray()
    self.name: str | None = None  # a front end's, from its hello
    self.gone = False  # set by the outbox when it falls MAX_PENDING behind


class Outbox:
  """What goes back to the front ends: each step's tokens, ends and failures, gathered per front
  end and sent as one message each by `flush`; and the replies to status and score calls.
  Thread-safe (one lock around the buffers and the sends). A send never blocks the engine
  thread: what a front end's socket does not take waits in its `pending` bytes, and a front end
  that falls MAX_PENDING bytes behind is dropped (`Peer.gone`: the main thread closes it)."""

  def __init__(self):
    self._lock = threading.Lock()
    self._tokens: dict[Peer, list[tuple[int, int]]] = collections.defaultdict(list)
    self._scores: dict[Peer, list[tuple[int, np.ndarray]]] = collections.defaultdict(list)
    self._ends: dict[Peer, list[list]] = collections.defaultdict(list)
    self._errors: dict[Peer, list[list]] = collections.defaultdict(list)

  def forget(self, peer: Peer) -> None:
    with self._lock:
      peer.gone = True
      peer.pending.clear()
      for buffer in (self._tokens, self._scores, self._ends, self._errors):
        buffer.pop(peer, None)

  def token(self, peer: Peer, rid: int, token: int, score: np.ndarray | None) -> None:
    with self._lock:
      self._tokens[peer].append((rid, token))
      if score is not None:
        self._scores[peer].append((rid, score))

  def end(self, peer: Peer, rid: int, reason: str) -> None:
    with self._lock:
      self._ends[peer].append([rid, reason])

  def error(self, peer: Peer, rid: int, error: BaseException) -> None:
    with self._lock:
      self._errors[peer].append([rid, type(error).__name__, str(error)])

  def flush(self) -> None:
    """One `step` message per front end with outputs."""
    with self._lock:
      peers = set(self._tokens) | set(self._ends) | set(self._errors)
      for peer in peers:
        tokens = self._tokens.pop(peer, [])
        scores = self._scores.pop(peer, [])
        ids = np.array([rid for rid, _ in tokens], np.int64)
        values = np.array([token for _, token in tokens], np.int32)
        scored = np.array([rid for rid, _ in scores], np.int64)
        width = len(scores[0][1]) if scores else 0
        rows = (np.stack([score for _, score in scores]).astype(np.float32) if scores
                else np.zeros((0,), np.float32))
        header = {"op": "step", "ends": self._ends.pop(peer, []),
                  "errors": self._errors.pop(peer, []), "width": width}
        self._send(peer, wire.encode(header, ids, values, scored, rows))

  def reply(self, peer: Peer, ticket: int, result: Any = None,
            error: BaseException | None = None) -> None:
    header = {"op": "reply", "ticket": ticket, "result": result,
              "error": None if error is None else [type(error).__name__, str(error)]}
    with self._lock:
      self._send(peer, wire.encode(header))

  def drain(self, peer: Peer) -> None:
    """Send what waits in `peer.pending` (as much as its socket takes now)."""
    with self._lock:
      self._send(peer, b"")

  def _send(self, peer: Peer, data: bytes) -> None:
    if peer.gone:
      return
    pending = peer.pending
    if pending:  # (bytes wait already: these go behind them)
      pending += data
      data = pending
    try:
      sent = peer.sock.send(data) if data else 0
    except BlockingIOError:
      sent = 0
    except OSError:  # the front end is gone; the main thread sees its connection close
      return
    if data is pending:
      del pending[:sent]  # (O(1): a bytearray drops its head in place)
    elif sent < len(data):
      pending += memoryview(data)[sent:]
    if len(pending) > MAX_PENDING:
      log.error("engine core: front end %s fell %d bytes behind; dropping it", peer.name,
                len(pending))
      peer.gone = True
      pending.clear()


class _CoreGroup(Group):
  """A front end's request inside the core: its tokens, end or failure go to the outbox."""

  def __init__(self, outbox: Outbox, peer: Peer, rid: int, prompt_tokens: list[int],
               on_cancel: Callable[[], None]):
    super().__init__(prompt_tokens, on_cancel)
    self._outbox, self.peer, self.rid = outbox, peer, rid

  def _emit(self, tokens: dict[int, int], scores: dict[int, np.ndarray]) -> None:
    self._outbox.token(self.peer, self.rid, tokens[0], scores.get(0))

  def _finish(self, row: int, reason: str) -> None:
    if not self.done:
      self._outbox.end(self.peer, self.rid, reason)
    super()._finish(row, reason)

  def _fail(self, error: BaseException) -> None:
    if not self.done:
      self._outbox.error(self.peer, self.rid, error)
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
    self.listener = wire.listen(wire.core_address(directory))
    self.listener.setblocking(False)
    self.selector = selectors.DefaultSelector()
    self.selector.register(self.listener, selectors.EVENT_READ)
    self.peers: set[Peer] = set()
    self.outbox = Outbox()
    self.engine = None
    self.state, self.error = "loading", None
    self.done = self.total = 0
    self._build, self._phases, self._later = build, tuple(phases), tuple(later)
    self._started = time.monotonic()
    self._ready_at: float | None = None
    self._requests: dict[tuple[Peer, int], _CoreGroup] = {}
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
              "pid": os.getpid()}
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
      # (a short wait while some front end has bytes its socket did not take yet)
      waiting = any(peer.pending for peer in self.peers)
      for key, _ in self.selector.select(PENDING_POLL_S if waiting else POLL_MS / 1e3):
        if key.data is None:
          self._accept()
        else:
          self._receive(key.data)
        if self._stop:
          break
      for peer in [peer for peer in self.peers if peer.gone or peer.pending]:
        if peer.gone:
          self._close(peer)
        else:
          self.outbox.drain(peer)
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
    for peer in list(self.peers):
      self._close(peer, quiet=True)
    self.selector.close()
    self.listener.close()

  def _accept(self) -> None:
    try:
      sock, _ = self.listener.accept()
    except BlockingIOError:
      return
    wire.configure(sock)
    sock.setblocking(False)
    peer = Peer(sock)
    self.peers.add(peer)
    self.selector.register(sock, selectors.EVENT_READ, peer)

  def _receive(self, peer: Peer) -> None:
    try:
      data = peer.sock.recv(RECEIVE_BYTES)
    except BlockingIOError:
      return
    except OSError:
      data = b""
    if not data:
      self._close(peer)
      return
    for header, buffers in peer.reader.feed(data):
      self.handle(peer, header, buffers)

  def _close(self, peer: Peer, quiet: bool = False) -> None:
    """A connection closed (or dropped): its front end's requests are cancelled."""
    self.peers.discard(peer)
    self.outbox.forget(peer)
    self.selector.unregister(peer.sock)
    peer.sock.close()
    groups = [self._requests.pop(key) for key in [k for k in self._requests if k[0] is peer]]
    cancelled = [group for group in groups if not group.done]
    for group in cancelled:
      group.cancel()
    # (a front end closing with nothing in flight is a normal stop: not logged, so that the
    # server's last line stays its reason to stop)
    if cancelled and not quiet:
      log.warning("engine core: front end %s is gone; its %d requests were cancelled", peer.name,
                  len(cancelled))

  def handle(self, peer: Peer, header: dict[str, Any], buffers: list) -> None:
    op = header["op"]
    if op == "hello":
      peer.name = header.get("client")
      self.outbox.reply(peer, -1, self.status())
    elif op == "status":
      self.outbox.reply(peer, header["ticket"], self.status())
    elif op == "add":
      self._add(peer, header, wire.array(buffers[0], np.int32))
    elif op == "cancel":
      for rid in header["ids"]:
        group = self._requests.pop((peer, rid), None)
        if group is not None:
          group.cancel()
    elif op == "score":
      prompt = wire.array(buffers[0], np.int32).tolist()
      self._scoring.submit(self._score, peer, header["ticket"], prompt, header["top"])
    elif op == "shutdown":
      self._stop = True

  def _add(self, peer: Peer, header: dict[str, Any], prompt: np.ndarray) -> None:
    rid = header["id"]
    if self.state != "ready":
      self.outbox.error(peer, rid, RuntimeError(f"the engine core is not ready ({self.state})"))
      self.outbox.flush()
      return
    request = validation.Request([prompt.copy()], header["max_new_tokens"],
                                 wire.settings_from_json(header["settings"]),
                                 logprobs=header["logprobs"])
    make = functools.partial(_CoreGroup, self.outbox, peer, rid)
    try:
      group = self.engine.enqueue(request, timeout=header["timeout"], group=make)
    except Exception as error:  # noqa: BLE001 - QueueFull, EngineClosed: the request fails
      self.outbox.error(peer, rid, error)
      self.outbox.flush()
      return
    self._requests[(peer, rid)] = group

  def _score(self, peer: Peer, ticket: int, prompt: list[int], top: int) -> None:
    try:
      result = self.engine.score(prompt, top=top)
    except Exception as error:  # noqa: BLE001 - the caller gets it
      self.outbox.reply(peer, ticket, error=error)
    else:
      self.outbox.reply(peer, ticket, [[float(lp), [[int(t), float(p)] for t, p in alts]]
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
