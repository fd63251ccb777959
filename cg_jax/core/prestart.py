"""The engine-core process, started before its launcher imports jax (`python -m cg_jax serve`).

Importing jax, flax and the engine takes seconds, and both the launcher (the command line, the
front end) and the core need them. Started first, the core imports them while the launcher
imports its own, instead of after it: `cg_jax.__main__` calls `start` for `serve` before it
imports the command line, and the launcher (`cg_jax.serving.launch`) takes that process
(`take`) and sends it the engine-core loop to run.

A `Prestarted` process imports `PRELOAD` at once, then waits for the one call its launcher sends
(`run`) and runs it. It is a daemon of its launcher: if the launcher ends without sending a call
(`serve --help`, a busy port, a bad flag), the process ends with it; before it has a call, it
also ends by itself once the launcher is gone (its pipe closes).

This module imports only the standard library: it runs before anything else is imported.
"""

from __future__ import annotations

import importlib
import multiprocessing
import signal
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection

# What the engine core imports before its call arrives: the process loop and the engine that
# its build function makes.
PRELOAD = ("cg_jax.core.process", "cg_jax.engine")
CORE_NAME = "cg_jax-core"
_SPAWN = multiprocessing.get_context("spawn")
_started: Prestarted | None = None


class Prestarted:
  """A spawned daemon process that imports `preload`, then runs the call `run` sends it."""

  def __init__(self, name: str = CORE_NAME, preload: Sequence[str] = PRELOAD):
    receive, self._send = _SPAWN.Pipe(duplex=False)
    self.process = _SPAWN.Process(target=_main, args=(receive, tuple(preload)), name=name,
                                  daemon=True)
    self.process.start()
    receive.close()  # (this process's copy: the child sees the pipe close with `_send`)

  def run(self, function: Callable[..., object], *args) -> multiprocessing.Process:
    """Send the process its call (`function(*args)`, pickled: the function by reference);
    returns the process (`multiprocessing.Process`), which ends when the call returns."""
    try:
      self._send.send((function, args))
    except BrokenPipeError as error:  # it failed while importing: its log says why
      self.process.join(5)
      raise RuntimeError(f"the {self.process.name} process (pid {self.process.pid}) exited "
                         f"with code {self.process.exitcode} before its call") from error
    finally:
      self._send.close()
    return self.process


def start(name: str = CORE_NAME) -> None:
  """Start this process's engine core now, for a later `take` (once)."""
  global _started
  if _started is None:
    _started = Prestarted(name)


def take(name: str = CORE_NAME) -> Prestarted:
  """The engine core `start` started (once; if it is still running), else a new one."""
  global _started
  started, _started = _started, None
  if started is not None and started.process.is_alive():
    return started
  return Prestarted(name)


def _main(receive: Connection, preload: tuple[str, ...]) -> None:
  """The process's entry: import, wait for the call, run it."""
  signal.signal(signal.SIGINT, signal.SIG_IGN)  # (Ctrl-C reaches the launcher, which stops it)
  for module in preload:
    importlib.import_module(module)
  try:
    function, args = receive.recv()
  except EOFError:  # the launcher is gone before sending a call
    return
  finally:
    receive.close()
  function(*args)
