"""A real server for the tests: uvicorn serving an app on 127.0.0.1 (a free port) in a thread."""

from __future__ import annotations

import contextlib
import http.client
import json
import threading
import time

import uvicorn

TIMEOUT = 60  # seconds, for every request


def start(app, ready: bool = True):
  """uvicorn serving `app` on 127.0.0.1 in a thread, listening and (with `ready`) warmed up:
  /health answers 200; returns (server, thread, port)."""
  config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on")
  live = uvicorn.Server(config)
  thread = threading.Thread(target=live.run, name="test-uvicorn", daemon=True)
  thread.start()
  deadline = time.monotonic() + 120
  while not live.started:
    assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
    time.sleep(0.02)
  port = live.servers[0].sockets[0].getsockname()[1]
  if ready:
    wait_health(port, 200)
  return live, thread, port


def wait_health(port, status: int, timeout: float = 120) -> dict:
  """/health's body once it answers `status`."""
  deadline = time.monotonic() + timeout
  while True:
    got, body = get(port, "/health")
    if got == status:
      return json.loads(body)
    assert time.monotonic() < deadline, f"/health still answers {got}: {body!r}"
    time.sleep(0.05)


def stop(live, thread):
  live.should_exit = True
  thread.join(timeout=60)
  assert not thread.is_alive(), "the server thread did not stop"


@contextlib.contextmanager
def serving(app, ready: bool = True):
  live, thread, port = start(app, ready)
  try:
    yield port
  finally:
    stop(live, thread)


def get(port, path):
  conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT)
  try:
    conn.request("GET", path)
    response = conn.getresponse()
    return response.status, response.read()
  finally:
    conn.close()
