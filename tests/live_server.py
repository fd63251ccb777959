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


class ServeProcess:
  """`python -m cg_jax serve ARGS --port 0` (the launcher, its engine-core process and front
  ends) with its log read in a thread; `port` once /health answers 200 (with `ready`)."""

  def __init__(self, *args: str, ready: bool = True, env: dict | None = None):
    import os
    import queue
    import re
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, JAX_PLATFORMS="cpu", CG_JAX_COMPILATION_CACHE="off", **(env or {}))
    self.process = subprocess.Popen([sys.executable, "-m", "cg_jax", "serve", *args, "--port",
                                     "0"], cwd=root, env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True)
    self.lines: list[str] = []
    ports: queue.Queue = queue.Queue()

    def read():
      for line in self.process.stdout:
        self.lines.append(line)
        if found := re.search(r"running on http://127\.0\.0\.1:(\d+)", line):
          ports.put(int(found[1]))

    self._reader = threading.Thread(target=read, name="test-serve-log", daemon=True)
    self._reader.start()
    try:
      self.port = ports.get(timeout=180)
      if ready:
        wait_health(self.port, 200, timeout=300)
    except BaseException:
      self.close()
      raise

  @property
  def log(self) -> str:
    return "".join(self.lines)

  def wait_log(self, pattern: str, timeout: float = 120) -> None:
    """Wait until a line of the log matches `pattern`."""
    import re
    deadline = time.monotonic() + timeout
    while not any(re.search(pattern, line) for line in list(self.lines)):
      assert time.monotonic() < deadline and self.process.poll() is None, (
          f"no log line matched {pattern!r}:\n{self.log[-3000:]}")
      time.sleep(0.05)

  def pids(self, pattern: str) -> list[int]:
    """The pids the log names in lines matching `pattern` with a `(\\d+)` group."""
    import re
    return [int(m[1]) for line in list(self.lines) if (m := re.search(pattern, line))]

  def close(self) -> None:
    """Kill the launcher if it still runs (its core and front ends follow it) and join the
    log reader."""
    if self.process.poll() is None:
      self.process.kill()
      self.process.wait()
    self._reader.join(timeout=30)

  def __enter__(self) -> "ServeProcess":
    return self

  def __exit__(self, *exc) -> None:
    self.close()
