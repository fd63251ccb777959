"""`bench startup`: how long a fresh process takes to answer, cold (an empty compilation cache)
and warm (the cache the cold start filled).

Each start is a new Python process with the persistent compilation cache (and the serialized
executables stored beside it) in one temporary directory: empty for the cold start, the same
again for the warm one. Times are seconds from just before the process is spawned:
  engine (`python -m cg_jax.bench.startup --child ...`, this module): `import_s` when the
    child has imported cg_jax, `load_s` when `Engine.from_pretrained` returns, `warmup_s` when
    `warmup()` returns, `first_answer_s` when the first `generate` (a 4-token prompt, 4 new
    tokens) returns, `final_steps_s` when no step runs on a stand-in any more
    (`Engine.wait_for_final_steps`); also the number of `executables` warm-up made, the
    `slowest_compile_s` of them, and the loading's own phases as durations (`Engine.stats()`:
    `checkpoint_read_s` unless the model is a preset, `weights_place_s`);
  serve (`python -m cg_jax serve --port 0`): `listen_s` when it logs "Uvicorn running on
    http://HOST:PORT", `loaded_s` when its engine core logs that the model is loaded (its
    warm-up starts), `ready_s` when GET /health first answers 200 (polled every 20 ms),
    `first_answer_s` when the first POST /v1/completions (4 tokens) returns, `final_steps_s`
    when GET /metrics first shows no step on a stand-in (polled every 0.2 s); then SIGTERM, and
    the process must exit.
A start ends only once its decode steps run on their own executables (a GPU builds them behind
the first requests, `Engine.warmup`), so that they are stored: the warm start measures loading
everything, not building the steps again.
A start runs in a process group of its own, killed whenever the measurement ends another way
(an error, a timeout, SIGTERM or SIGINT to this process): nothing it started outlives it.
`--max-seq-len`, `--batch-buckets`, `--prompt-buckets`, `--max-num-batched-tokens` and
`--token-buckets` pass through to both.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable

from tqdm.auto import tqdm

from cg_jax.bench import options, rows
from cg_jax.engine import Engine

WHICH = ("engine", "serve")
STARTS = ("cold", "warm")
PROMPT = [1, 2, 3, 4]  # the first request's token ids
ANSWER_TOKENS = 4
_LISTENING = re.compile(r"Uvicorn running on http://(\S+):(\d+)")
_LOADED = "engine core: model loaded"  # (`cg_jax.core.process`: the weights are on the device)
# `/metrics`' gauge of `Engine.stats()["steps_on_stand_ins"]`
_ON_STAND_INS = re.compile(r"^cg_jax_steps_on_stand_ins (\S+)$", re.MULTILINE)


def add_arguments(parser: argparse.ArgumentParser) -> None:
  options.add_model_arguments(parser, dtype=False)
  parser.add_argument("--which", default="engine,serve",
                      help=f"what to start, comma separated: {', '.join(WHICH)}")
  parser.add_argument("--starts", default="cold,warm",
                      help="the starts, in order, comma separated: cold (an empty compilation "
                           "cache), warm (the one the cold start filled)")
  parser.add_argument("--timeout", type=float, default=600.0,
                      help="seconds one start may take")


def _names(flag: str, text: str, allowed: tuple[str, ...]) -> list[str]:
  names = text.replace(",", " ").split()
  bad = [n for n in names if n not in allowed]
  if not names or bad:
    raise ValueError(f"{flag} must name some of {', '.join(allowed)} (comma separated), got "
                     f"{text!r}")
  return names


def _pass_through(args) -> list[str]:
  """The engine flags given, as command-line arguments."""
  flags = []
  for flag, value in (("--max-seq-len", args.max_seq_len), ("--batch-buckets", args.batch_buckets),
                      ("--prompt-buckets", args.prompt_buckets),
                      ("--max-num-batched-tokens", args.max_num_batched_tokens),
                      ("--token-buckets", args.token_buckets)):
    if value is not None:
      flags += [flag, str(value)]
  return flags


def run(args) -> list[rows.Row]:
  which = _names("--which", args.which, WHICH)
  starts = _names("--starts", args.starts, STARTS)
  if args.timeout is None or not args.timeout > 0:
    raise ValueError(f"--timeout must be a number of seconds > 0, got {args.timeout!r}")
  options.integer("--max-seq-len", args.max_seq_len, 2, optional=True)
  options.int_list("--batch-buckets", args.batch_buckets)
  options.int_list("--prompt-buckets", args.prompt_buckets)
  options.integer("--max-num-batched-tokens", args.max_num_batched_tokens, optional=True)
  options.int_list("--token-buckets", args.token_buckets)
  workload = dict(max_seq_len=args.max_seq_len, batch_buckets=args.batch_buckets,
                  prompt_buckets=args.prompt_buckets)
  result = []
  with _exit_on_sigterm(), tqdm(total=len(which) * len(starts), desc="startup",
                                unit="start") as bar:
    for what in which:
      # One cache per kind of start: a warm serve start must not reuse the engine's entries.
      with tempfile.TemporaryDirectory(prefix=f"cg_jax_startup_{what}_") as cache:
        for start in starts:
          timed = (_engine if what == "engine" else _serve)(args, cache)
          result.append(options.row(args, dict(kind="startup", which=what, cache=start,
                                                **workload), timed))
          bar.update()
  return result


@contextlib.contextmanager
def _exit_on_sigterm():
  """SIGTERM raises SystemExit (as SIGINT raises KeyboardInterrupt), so that the `finally`
  clauses that stop the started processes run; the handler before is restored after."""
  if threading.current_thread() is not threading.main_thread():
    yield  # (signal handlers belong to the main thread)
    return

  def leave(signum, frame):
    raise SystemExit(128 + signum)

  before = signal.signal(signal.SIGTERM, leave)
  try:
    yield
  finally:
    signal.signal(signal.SIGTERM, before)


def _kill_group(process: subprocess.Popen) -> None:
  """Kill a start's process group (it leads one: `start_new_session`), its children too."""
  with contextlib.suppress(ProcessLookupError, PermissionError):
    os.killpg(process.pid, signal.SIGKILL)
  process.wait()


def _env(cache: str) -> dict[str, str]:
  return dict(os.environ, CG_JAX_COMPILATION_CACHE=cache)


def _engine(args, cache: str) -> dict[str, float]:
  command = [sys.executable, "-m", "cg_jax.bench.startup", "--child", "--model", args.model,
             "--cache", cache, "--timeout", str(args.timeout), *_pass_through(args)]
  begin = time.time()
  process = subprocess.Popen(command, env=_env(cache), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, start_new_session=True)
  try:
    out, err = process.communicate(timeout=args.timeout)
  finally:
    _kill_group(process)
  if process.returncode != 0:
    raise RuntimeError(f"the engine start failed ({process.returncode}): {err[-4000:]}")
  at = json.loads(out.strip().splitlines()[-1])
  return {**{name: at[name] - begin for name in ("import_s", "load_s", "warmup_s",
                                                 "first_answer_s", "final_steps_s")},
          **{name: at[name] for name in ("executables", "slowest_compile_s", "checkpoint_read_s",
                                         "weights_place_s") if at[name] is not None}}


def _request(url: str, body: dict | None = None, timeout: float = 60.0) -> tuple[int, bytes]:
  data = None if body is None else json.dumps(body).encode()
  request = urllib.request.Request(url, data=data,
                                   headers={"Content-Type": "application/json"})
  try:
    with urllib.request.urlopen(request, timeout=timeout) as response:
      return response.status, response.read()
  except urllib.error.HTTPError as error:
    return error.code, error.read()


def _serve(args, cache: str) -> dict[str, float]:
  command = [sys.executable, "-m", "cg_jax", "serve", "--model", args.model, "--port", "0",
             *_pass_through(args)]
  begin = time.time()
  deadline = time.monotonic() + args.timeout
  process = subprocess.Popen(command, env=_env(cache), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True)
  lines, found, loaded = [], queue.Queue(), []

  def read():
    for line in process.stdout:
      lines.append(line)
      if match := _LISTENING.search(line):
        found.put((time.time(), match[1], int(match[2])))
      if not loaded and _LOADED in line:
        loaded.append(time.time())
    found.put(None)  # the output ended

  reader = threading.Thread(target=read, daemon=True)
  reader.start()
  listening = None
  try:
    with contextlib.suppress(queue.Empty):
      listening = found.get(timeout=args.timeout)
    if not listening:
      raise RuntimeError(f"`serve` did not start listening: {''.join(lines)[-4000:]}")
    listened, host, port = listening
    base = f"http://{host.strip('[]')}:{port}"

    def until(done: Callable[[], bool], every: float, failure: str) -> float:
      """Poll `done` every `every` s until it holds (its time) or the server ends or times out."""
      while not done():
        if process.poll() is not None or time.monotonic() > deadline:
          raise RuntimeError(f"`serve` {failure}: {''.join(lines)[-4000:]}")
        time.sleep(every)
      return time.time()

    def healthy() -> bool:
      with contextlib.suppress(OSError):
        return _request(base + "/health", timeout=5)[0] == 200
      return False

    def on_own_steps() -> bool:
      status, body = _request(base + "/metrics", timeout=5)
      match = _ON_STAND_INS.search(body.decode()) if status == 200 else None
      return match is not None and not float(match[1])

    ready = until(healthy, 0.02, "never answered /health 200")
    status, body = _request(base + "/v1/completions", dict(
        model=args.model, prompt=PROMPT, max_tokens=ANSWER_TOKENS, temperature=0,
        ignore_eos=True))
    answered = time.time()
    if status != 200:
      raise RuntimeError(f"/v1/completions answered {status}: {body[:1000]!r}")
    final = until(on_own_steps, 0.2, "kept decode steps on stand-ins")
    process.send_signal(signal.SIGTERM)
    code = process.wait(timeout=60)
    if code != 0:
      raise RuntimeError(f"`serve` exited {code} after SIGTERM: {''.join(lines)[-4000:]}")
  finally:
    _kill_group(process)
    reader.join(timeout=30)
  return {"listen_s": listened - begin, "ready_s": ready - begin,
          "first_answer_s": answered - begin, "final_steps_s": final - begin,
          **({"loaded_s": loaded[0] - begin} if loaded else {})}


def _child(argv: list[str]) -> None:
  """The engine start: prints {"import_s", "load_s", "warmup_s", "first_answer_s",
  "final_steps_s"} as epoch seconds, the executables warmed up, the slowest one's compile (or
  load) seconds and the loading's phases (durations)."""
  imported = time.time()  # (this module's imports, cg_jax's among them, are done)
  parser = argparse.ArgumentParser(prog="python -m cg_jax.bench.startup")
  parser.add_argument("--child", action="store_true", required=True)
  parser.add_argument("--cache", required=True)
  parser.add_argument("--timeout", type=float, required=True)
  options.add_model_arguments(parser, dtype=False)
  args = parser.parse_args(argv)
  engine = Engine.from_pretrained(args.model, compilation_cache=args.cache,
                                  **options.engine_options(
                                      args, options.int_list("--batch-buckets", args.batch_buckets),
                                      options.int_list("--prompt-buckets", args.prompt_buckets)))
  loaded = time.time()
  seconds = engine.warmup(progress=False)
  warm = time.time()
  engine.generate([PROMPT], ANSWER_TOKENS, eos_token_id=[])
  answered = time.time()
  if not engine.wait_for_final_steps(args.timeout):
    raise RuntimeError(f"the decode steps stayed on stand-ins for {args.timeout} s")
  final = time.time()
  stats = engine.stats()
  engine.close()
  print(json.dumps({"import_s": imported, "load_s": loaded, "warmup_s": warm,
                    "first_answer_s": answered, "final_steps_s": final,
                    "executables": len(seconds),
                    "slowest_compile_s": max(seconds.values()),
                    **{name: stats[name] for name in ("checkpoint_read_s", "weights_place_s")}}))


if __name__ == "__main__":
  _child(sys.argv[1:])
