"""A front end's client of the engine-core process (`cg_jax.core.process`): what `create_app`
serves when `serve` runs the engine in its own process.

It offers the part of `Engine` the app uses (`submit`, `score`, `stats`, `warmup`,
`executable_keys`, `tokenizer`, `model_config`, `config`) and does the front end's share of a
request: one validation pass (the engine's own checks), `Handle`s and their text, and stop
strings (a request whose text holds one ends here, and the core is told to cancel it). A
reader thread ("cg_jax-core-client") connects to the core (`cg_jax.core.wire`: one Unix-domain
socket both ways), takes each step's message and hands its tokens to the requests' groups (an
asyncio consumer is woken on its own loop); it asks the core for its status every STATUS_EVERY
seconds, and watches the core's process: once it is gone (or closes the connection) every
request in flight fails with `CoreDied` and `failure` says why.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import select
import socket
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np

from cg_jax import validation
from cg_jax.core import wire
from cg_jax.core.sampling import TOP_LOGPROBS
from cg_jax.generation import RowText
from cg_jax.handles import EngineClosed, Group, Handle, QueueFull, RequestTimeout
from cg_jax.sampling_params import SamplingParams, check_logprobs

log = logging.getLogger("uvicorn.error")
STATUS_EVERY = 0.25  # seconds between status calls
CONNECT_EVERY = 0.01  # seconds between tries to connect while the core starts
RECEIVE_BYTES = 1 << 20  # the most one read of the connection takes
ERRORS = {cls.__name__: cls for cls in (QueueFull, EngineClosed, RequestTimeout, ValueError,
                                        TypeError)}


class CoreDied(EngineClosed):
  """The engine-core process ended while this front end still served."""


@dataclasses.dataclass(frozen=True)
class ModelInfo:
  """What the front end knows of the core's model (`Engine.model_config`'s fields it uses)."""

  vocab_size: int
  eos_token_id: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class LimitsInfo:
  """The core's `EngineConfig` fields the front end checks requests against."""

  max_seq_len: int
  max_waiting: int


def _alive(pid: int) -> bool:
  """Whether process `pid` runs (not gone, not a zombie)."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      state = f.read().rsplit(")", 1)[1].split()[0]
  except OSError:
    try:
      os.kill(pid, 0)
    except ProcessLookupError:
      return False
    except PermissionError:
      return True
    return True
  return state not in ("Z", "X")


class CoreClient:
  """Args:
    directory: the directory the core listens in; index: this front end's number (its name in
      the core's log); core_pid: the core's process, watched; tokenizer: the model's, or None.
  """

  def __init__(self, directory: str, index: int, core_pid: int, tokenizer=None):
    self.tokenizer = tokenizer
    self.name = f"front-{index}"
    self._address = wire.core_address(directory)
    self._core_pid = core_pid
    self._sock: socket.socket | None = None  # once the reader thread connected
    self._send_lock = threading.Lock()
    self._lock = threading.Lock()  # the request and reply tables
    self._requests: dict[int, tuple[Group, RowText | None]] = {}
    self._replies: dict[int, Future] = {}
    self._ids = itertools.count()
    self._status: dict[str, Any] = {"state": "loading", "done": 0, "total": 0}
    self._status_changed = threading.Condition()
    self.failure: str | None = None  # why nothing can be served any more (the core died)
    self.on_failure: list[Callable[[], None]] = []
    self._closed = False
    self._thread = threading.Thread(target=self._read, name="cg_jax-core-client", daemon=True)
    self._thread.start()

  # What `create_app` uses -------------------------------------------------------------------

  @property
  def model_config(self) -> ModelInfo:
    model = self._ready_status()["model"]
    return ModelInfo(model["vocab_size"], tuple(model["eos_token_id"]))

  @property
  def config(self) -> LimitsInfo:
    return LimitsInfo(**self._ready_status()["config"])

  def stats(self) -> dict[str, Any]:
    """The core's latest `Engine.stats()` (its numbers and names), at most STATUS_EVERY old."""
    return dict(self._status.get("stats", {}))

  def executable_keys(self, phases: Sequence[str] = ()) -> list:
    """As many placeholders as the core warms up executables: waits until it has loaded the
    model (raises its start-up failure)."""
    status = self._wait(lambda status: status["state"] != "loading")
    return [None] * int(status.get("total", 0))

  def warmup(self, *, phases: Sequence[str] = (), progress: bool = False,
             on_progress: Callable[[int, int], None] | None = None, **_) -> None:
    """Wait for the core's own warm-up (it starts once the model is loaded), reporting its
    progress to `on_progress`; raises its failure."""
    # (on_progress is called at each status, so that an exception from it stops the wait)
    self._wait(lambda status: status["state"] == "ready", on_progress)

  def _wait(self, until: Callable[[dict], bool],
            on_progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """The core's first status for which `until` holds; raises its failure or its death."""
    while True:
      with self._status_changed:
        self._status_changed.wait(STATUS_EVERY)
        status = dict(self._status)
      if self.failure is not None:
        raise CoreDied(self.failure)
      if status["state"] == "failed":
        raise RuntimeError(f"the engine core's start-up failed: {status['error']}")
      if on_progress is not None and status["total"]:
        on_progress(status["done"], status["total"])
      if until(status):
        return status

  def submit(self, prompt, max_new_tokens: int | None = None, *,
             params: SamplingParams | None = None, timeout: float | None = None,
             **sampling) -> Handle:
    """Queue one request (token ids) in the core; as `Engine.submit`."""
    if self.failure is not None:
      raise CoreDied(self.failure)
    model, limits = self.model_config, self.config
    params = SamplingParams.of(params, sampling, "submit()", max_new_tokens)
    return self.submit_validated(validation.request(
        [list(prompt)], params, vocab_size=model.vocab_size, max_seq_len=limits.max_seq_len,
        default_eos=model.eos_token_id, has_tokenizer=self.tokenizer is not None),
        timeout=timeout)

  def submit_validated(self, request: validation.Request, *,
                       timeout: float | None = None) -> Handle:
    """Queue a one-prompt request validated already (as `Engine.submit_validated`)."""
    if self.failure is not None:
      raise CoreDied(self.failure)
    validation.timeout(timeout)
    stop, top = request.stop, request.logprobs
    rid = next(self._ids)
    group = Group([len(request.rows[0])], lambda: self._send({"op": "cancel", "ids": [rid]}))
    follow = RowText(self.tokenizer, stop) if stop else None
    with self._lock:
      self._requests[rid] = (group, follow)
    self._send({"op": "add", "id": rid, "max_new_tokens": request.max_new_tokens,
                "settings": wire.settings_json(request.settings), "logprobs": top,
                "timeout": timeout}, request.rows[0].astype(np.int32))
    return Handle(group, self.tokenizer, stop, top)

  def score(self, prompt, top: int = 0) -> list[tuple[float, tuple[tuple[int, float], ...]]]:
    """`Engine.score` of token ids, run by the core."""
    top = check_logprobs(top, min(TOP_LOGPROBS, self.model_config.vocab_size), "top")
    rows = validation.prompts([list(prompt)], self.model_config.vocab_size)
    result = self._call({"op": "score", "top": top}, rows[0].astype(np.int32))
    return [(lp, tuple((t, p) for t, p in alts)) for lp, alts in result]

  def close(self) -> None:
    """Stop reading (the core keeps running for the other front ends); requests in flight fail
    with EngineClosed."""
    if self._closed:
      return
    self._closed = True
    self._thread.join(timeout=5)
    self._fail_all(EngineClosed("the server closed before the request finished"))
    with self._send_lock:
      if self._sock is not None:
        self._sock.close()  # (the core cancels what this front end still had running)

  # Internals --------------------------------------------------------------------------------

  def _ready_status(self) -> dict[str, Any]:
    status = self._status
    if "model" not in status:
      raise EngineClosed(f"the engine core is not ready ({status['state']})")
    return status

  def _send(self, header: dict[str, Any], *arrays: np.ndarray) -> None:
    data = wire.encode(header, *arrays)
    with self._send_lock:
      if self._closed or self._sock is None:
        return
      try:
        self._sock.sendall(data)
      except OSError:  # the core is gone: the reader thread sees the connection close
        pass

  def _call(self, header: dict[str, Any], *arrays: np.ndarray, timeout: float = 600) -> Any:
    future: Future = Future()
    ticket = next(self._ids)
    with self._lock:
      self._replies[ticket] = future
    self._send({**header, "ticket": ticket}, *arrays)
    return future.result(timeout)

  def _connect(self) -> socket.socket | None:
    """The connection to the core, once it listens (None if it died first or we closed)."""
    while not self._closed:
      try:
        sock = wire.connect(self._address)
      except OSError:
        if not _alive(self._core_pid):
          self._died()
          return None
        time.sleep(CONNECT_EVERY)
        continue
      with self._send_lock:
        self._sock = sock
      self._send({"op": "hello", "client": self.name})
      return sock
    return None

  def _read(self) -> None:
    sock = self._connect()
    if sock is None:
      return
    reader, poller = wire.Reader(), select.poll()
    poller.register(sock, select.POLLIN)
    next_status = time.monotonic() + STATUS_EVERY
    while not self._closed:
      now = time.monotonic()
      if now >= next_status:
        next_status = now + STATUS_EVERY
        if not _alive(self._core_pid):
          self._died()
          return
        self._send({"op": "status", "ticket": -1})
      if not poller.poll(50):
        continue
      try:
        data = sock.recv(RECEIVE_BYTES)
      except OSError:
        data = b""
      if not data:  # the core closed the connection: it ended or dropped this front end
        if not self._closed:
          self._died()
        return
      for header, buffers in reader.feed(data):
        if header["op"] == "step":
          self._step(header, buffers)
        else:
          self._reply(header)

  def _reply(self, header: dict[str, Any]) -> None:
    if header["ticket"] == -1:  # a status
      with self._status_changed:
        self._status = header["result"]
        self._status_changed.notify_all()
      return
    with self._lock:
      future = self._replies.pop(header["ticket"], None)
    if future is None:
      return
    if header["error"] is not None:
      kind, message = header["error"]
      future.set_exception(ERRORS.get(kind, RuntimeError)(message))
    else:
      future.set_result(header["result"])

  def _step(self, header: dict[str, Any], buffers: list) -> None:
    ids = wire.array(buffers[0], np.int64)
    tokens = wire.array(buffers[1], np.int32)
    scored = wire.array(buffers[2], np.int64)
    scores = wire.array(buffers[3], np.float32, header["width"] or None)
    by_id = {int(rid): scores[i] for i, rid in enumerate(scored)} if len(scored) else {}
    with self._lock:
      requests = self._requests
      live = [(requests.get(int(rid)), int(rid), int(token)) for rid, token in zip(ids, tokens)]
    stopped = []
    for entry, rid, token in live:
      if entry is None or entry[0].done:
        continue
      group, follow = entry
      score = by_id.get(rid)
      group._emit({0: token}, {} if score is None else {0: score})
      if follow is not None:
        try:
          follow.push(token)
        except Exception as error:  # noqa: BLE001 - a tokenizer failure ends this request only
          self._forget(rid)._fail(error)
          stopped.append(rid)
          continue
        if follow.stopped:
          self._forget(rid)._finish(0, "stop")
          stopped.append(rid)
    if stopped:
      self._send({"op": "cancel", "ids": stopped})
    for rid, reason in header["ends"]:
      if (group := self._forget(rid)) is not None:
        group._finish(0, reason)
    for rid, kind, message in header["errors"]:
      if (group := self._forget(rid)) is not None:
        group._fail(ERRORS.get(kind, RuntimeError)(message))

  def _forget(self, rid: int) -> Group | None:
    with self._lock:
      entry = self._requests.pop(rid, None)
    return None if entry is None else entry[0]

  def _fail_all(self, error: BaseException) -> None:
    with self._lock:
      groups = [group for group, _ in self._requests.values()]
      self._requests.clear()
      futures = list(self._replies.values())
      self._replies.clear()
    for group in groups:
      group._fail(error)
    for future in futures:
      future.set_exception(error)

  def _died(self) -> None:
    deadline = time.monotonic() + 1.0  # (a core that ends closes its sockets before it is gone)
    while _alive(self._core_pid) and time.monotonic() < deadline:
      time.sleep(0.01)
    what = "died" if not _alive(self._core_pid) else "closed this front end's connection"
    self.failure = (f"the engine core process (pid {self._core_pid}) {what}; this server cannot "
                    "serve any more")
    log.error("%s", self.failure)
    self._fail_all(CoreDied(self.failure))
    with self._status_changed:
      self._status_changed.notify_all()
    for callback in self.on_failure:
      callback()

