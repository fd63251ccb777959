"""Process-wide XLA compile counter (jax.monitoring events) and the persistent compilation cache."""

from __future__ import annotations

import os
import threading
import warnings

import jax

# Emitted once per executable built, whether XLA compiled it or the persistent cache supplied it.
_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
_lock = threading.Lock()
_counts = {"compiles": 0, "compile_seconds": 0.0, "cache_hits": 0, "unplanned": 0}
_cache_dir: list[str | None] = []  # the directory configured first in this process, if any


_thread = threading.local()  # the current thread's cache hits and whether it warms up


def _on_duration(event: str, duration_secs: float, **_):
  if event == _COMPILE_EVENT:  # (emitted by the compiling thread)
    with _lock:
      _counts["compiles"] += 1
      _counts["compile_seconds"] += duration_secs
      if not getattr(_thread, "warming", False):
        _counts["unplanned"] += 1


def _on_event(event: str, **_):
  if event == _CACHE_HIT_EVENT:
    with _lock:
      _counts["cache_hits"] += 1
    _thread.cache_hits = getattr(_thread, "cache_hits", 0) + 1


jax.monitoring.register_event_duration_secs_listener(_on_duration)
jax.monitoring.register_event_listener(_on_event)


def compile_count() -> int:
  """Executables built in this process so far: XLA compilations plus persistent-cache loads.

  Any increase on the request path means a shape or setting was not compiled at start-up.
  """
  return _counts["compiles"]


def warming_thread() -> None:
  """Mark the calling thread as a warm-up's (a compile pool's): its compiles are planned."""
  _thread.warming = True


def unplanned_count() -> int:
  """`compile_count` less the warm-up threads' builds: a warm-up running beside requests (a
  server's log-probability executables) does not count, a compile on the request path does."""
  return _counts["unplanned"]


def cache_hit_count() -> int:
  """Executables loaded from the persistent compilation cache instead of compiled."""
  return _counts["cache_hits"]


def thread_cache_hit_count() -> int:
  """`cache_hit_count` of the calling thread alone (tells whether its last compile was a hit)."""
  return getattr(_thread, "cache_hits", 0)


def compile_seconds() -> float:
  return _counts["compile_seconds"]


def default_cache_dir() -> str:
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(base, "cg_jax", "xla")


def configure_compilation_cache(cache_dir: str | None | bool = True) -> str | None:
  """Turn on JAX's persistent compilation cache (once per process).

  Args:
    cache_dir: a directory, True for the default user cache directory
      (`$XDG_CACHE_HOME/cg_jax/xla`, overridden by `$CG_JAX_COMPILATION_CACHE`, where "off"
      disables it), or False/None to leave it off.
  Returns:
    The directory in use, or None when the cache is off.
  """
  if cache_dir is True:
    cache_dir = os.environ.get("CG_JAX_COMPILATION_CACHE") or default_cache_dir()
    if cache_dir == "off":
      cache_dir = None
  cache_dir = cache_dir or None
  with _lock:
    if _cache_dir:
      if cache_dir != _cache_dir[0]:
        warnings.warn(f"the compilation cache is already set to {_cache_dir[0]!r} in this process; "
                      f"ignoring {cache_dir!r}", stacklevel=3)
      return _cache_dir[0]
    _cache_dir.append(cache_dir)
  if cache_dir is not None:
    os.makedirs(cache_dir, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
  return cache_dir
