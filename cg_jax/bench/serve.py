"""`python -m cg_jax bench serve`: a load generator against an OpenAI-compatible
`/v1/completions` endpoint (`python -m cg_jax serve`, vLLM, or any other such server), measuring
what a client sees.

How: `--num-requests` prompts of random token ids (drawn in [1, --vocab-size), their lengths
uniform in `--prompt-len`, all from `--seed`), sent as token-id prompts (in the request's extra
body: the client's own typed walk over a list prompt is not the server's time) through the
official `openai.AsyncOpenAI` client, one asyncio task per request, from `--clients` processes
(request i from client i mod N, each its own client and event loop): one Python client consumes
about ten thousand streamed chunks a second, fewer than one server step of 64 streams makes, so
one process would measure itself (`benchmarks/README.md`). Each client first sends one short
request, unmeasured (its connection and the client's first-call costs, as a long-running
client has paid them), then every client waits for the common start. Arrivals are a Poisson
process of `--rate` requests/s (inf: all at time 0), at most `--max-concurrency` in flight
(a semaphore per client, the cap split among them; a request's send time is when it gets past
it). Times are `time.perf_counter()`, one clock for every process on Linux (CLOCK_MONOTONIC).
Every request is streamed with `stream_options.include_usage`, `max_tokens = --output-len`,
`temperature 0` and the extensions `ignore_eos` (every request generates `--output-len` tokens)
and `return_token_ids`. Per request it records the send time, each content chunk's arrival time
and token count (`len(token_ids)` where the server gives them, else 1 per chunk with text), the
final usage chunk's `completion_tokens` (the request's token count when given), the finish time
and any error.
The options are checked in `run` (a ValueError naming the flag, as in the other subcommands).

Figures (over the requests that succeeded; times from `time.perf_counter` on the client):
  * `tokens_per_s`: output tokens / wall, `requests_per_s`: requests / wall, where wall
    (`wall_s`) runs from the first arrival to the last finish; `output_tokens` their sum.
  * `ttft_ms` p50/p90/p99: send -> first chunk with content.
  * `tpot_ms` p50/p90/p99: (last content chunk - first) / (tokens - 1), requests of 2+ tokens.
  * `itl_ms` p50/p90/p99: the gaps between consecutive content chunks of a request (a chunk
    carrying several tokens is one gap).
  * `e2e_ms` p50/p99: send -> the stream's end.
  * `ttft_ms_mean`, `tpot_ms_mean`, and where the server has them (`/metrics` beside the base
    URL: cg_jax's and vLLM's), `server_ttft_ms_mean` and `server_tpot_ms_mean`: the same
    request-level figures as the server measured them over the measured requests (the change
    of its histograms' sums and counts from the common start to the end), so a client's time
    splits into the server's and the way there and back.
  * `errors`: requests that failed (an HTTP error, a refused connection, an error event in the
    stream); the first 3 messages go to stderr. If every request fails, `run` raises
    `AllFailed` (a ValueError: `python -m cg_jax` prints `error: ...`) with the first message.

The row's `device` is "remote" unless `--device` names it (the server's accelerator is not
visible from the client); `jax`, `commit` and `date` are the client's (`rows.where`), which is
the server's when both run from one checkout. The workload records the base URL's host only.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import importlib
import math
import multiprocessing
import os
import queue
import re
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from cg_jax.bench import options, rows
from cg_jax.bench.rows import Row

SHOWN_ERRORS = 3  # failed requests whose message is printed
START_AHEAD_S = 0.05  # the common start, after every client is ready
DEFAULT_CLIENTS = min(8, os.cpu_count() or 1)  # (one per core, up to 8)
_SPAWN = multiprocessing.get_context("spawn")
# The server's own per-request histograms (Prometheus text at /metrics beside /v1; cg_jax's and
# vLLM's names end so): (figure, metric name suffix).
SERVER_HISTOGRAMS = (("server_ttft_ms_mean", "time_to_first_token_seconds"),
                     ("server_tpot_ms_mean", "time_per_output_token_seconds"))
_SAMPLE = re.compile(r"^(\S+?)_(sum|count)(?:\{[^}]*\})? (\S+)$")


def client_module():
  """The official `openai` client (the `bench` extra, and `test-core`; not a core dependency),
  imported when a benchmark sends: `python -m cg_jax` imports this module for every command,
  and the client's import, about a second, would delay `serve`'s start-up and the others'.
  A ValueError says how to install it."""
  try:
    return importlib.import_module("openai")
  except ImportError as missing:
    raise ValueError(f"bench serve needs the `openai` package ({missing}): "
                     "pip install 'cg_jax[bench]'") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
  """`bench serve`'s own options (the CLI adds --output, --system, --compare)."""
  parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1",
                      help="the OpenAI-compatible API's base URL (…/v1)")
  parser.add_argument("--model", required=True, help="the served model name")
  parser.add_argument("--api-key", default=None,
                      help="API key; None = $OPENAI_API_KEY, else a placeholder")
  parser.add_argument("--num-requests", type=int, default=64, help="requests to send")
  parser.add_argument("--prompt-len", default="64:480",
                      help="prompt tokens: N, or MIN:MAX (inclusive, drawn uniformly, seeded)")
  parser.add_argument("--output-len", type=int, default=128,
                      help="tokens generated per request (max_tokens, with ignore_eos)")
  parser.add_argument("--rate", default="inf",
                      help="Poisson arrival rate, requests/s; inf = all at once")
  parser.add_argument("--max-concurrency", type=int, default=None,
                      help="most requests in flight; None = unlimited")
  parser.add_argument("--vocab-size", type=int, default=1000,
                      help="prompt token ids are drawn in [1, VOCAB_SIZE)")
  parser.add_argument("--seed", type=int, default=0, help="seed of prompts and arrivals")
  parser.add_argument("--request-timeout", type=float, default=600.0,
                      help="seconds per request before it counts as failed")
  parser.add_argument("--clients", type=int, default=DEFAULT_CLIENTS,
                      help="client processes sending the requests (see the module docstring); "
                           "default: one per core, at most 8")
  parser.add_argument("--device", default=None,
                      help="the server's device, for the row; None = 'remote'")


@dataclasses.dataclass
class Record:
  """What one request saw; times are `time.perf_counter()` seconds."""

  sent: float = math.nan
  chunks: list[tuple[float, int]] = dataclasses.field(default_factory=list)  # (arrival, tokens)
  finished: float = math.nan
  usage_tokens: int | None = None  # the usage chunk's completion_tokens
  error: str | None = None

  @property
  def tokens(self) -> int:
    return self.usage_tokens if self.usage_tokens is not None else sum(n for _, n in self.chunks)


@dataclasses.dataclass(frozen=True)
class Workload:
  """The requests to send: token-id prompts and their arrival offsets (seconds from start)."""

  prompts: list[list[int]]
  arrivals: list[float]


def workload(num_requests: int, prompt_len: tuple[int, int], rate: float, vocab_size: int,
             seed: int) -> Workload:
  """The seeded prompts and Poisson arrivals (lengths, then ids, then gaps are drawn, so the
  prompts do not depend on the rate)."""
  rng = np.random.default_rng(seed)
  sizes = rng.integers(prompt_len[0], prompt_len[1] + 1, size=num_requests)
  prompts = [rng.integers(1, vocab_size, size=int(n)).tolist() for n in sizes]
  if math.isinf(rate):
    arrivals = [0.0] * num_requests
  else:
    gaps = rng.exponential(1.0 / rate, size=num_requests)
    arrivals = [0.0, *np.cumsum(gaps[:-1]).tolist()]
  return Workload(prompts, arrivals)


def message(error: BaseException) -> str:
  """A failed request's error in one line: the HTTP status and the server's message if any."""
  if isinstance(error, client_module().APIStatusError):
    body = error.body
    text = body.get("message") if isinstance(body, dict) else None
    return f"HTTP {error.status_code}: {text or error.message}"
  return f"{type(error).__name__}: {error}"


async def _request(client: Any, args: argparse.Namespace, prompt: list[int], max_tokens: int,
                   start: float, arrival: float, gate: Any, record: Record,
                   done: Callable[[], None]) -> None:
  openai = client_module()
  await asyncio.sleep(max(0.0, start + arrival - time.perf_counter()))
  async with gate:
    record.sent = time.perf_counter()
    try:
      # The token ids go in extra_body (the request on the wire is the same): the client walks a
      # typed list prompt element by element, about 15 us a token on the CPU machine before it
      # sends anything, a cost of the token-id stand-in for text that a text prompt does not pay.
      stream = await client.completions.create(
          model=args.model, prompt="", max_tokens=max_tokens, temperature=0,
          stream=True, stream_options={"include_usage": True},
          extra_body={"prompt": prompt, "ignore_eos": True, "return_token_ids": True})
      async for chunk in stream:
        now = time.perf_counter()
        if chunk.usage is not None:
          record.usage_tokens = chunk.usage.completion_tokens
        for choice in chunk.choices:
          ids = (choice.model_extra or {}).get("token_ids")
          count = len(ids) if ids is not None else int(bool(choice.text))
          if count:
            record.chunks.append((now, count))
    except openai.APIError as error:
      record.error = message(error)
    finally:
      record.finished = time.perf_counter()
      done()


async def _send(args: argparse.Namespace, work: Workload, share: Sequence[int], cap: int | None,
                ready: Callable[[], None], start: Callable[[], float],
                done: Callable[[], None]) -> tuple[list[Record], float]:
  """One client's requests (`share`: their indices in `work`) and the start time: the warm-up
  request, `ready()`, then `start()` gives the common start time; `done()` after each
  request."""
  records = [Record() for _ in share]
  gate = asyncio.Semaphore(cap) if cap else contextlib.nullcontext()
  api_key = args.api_key or os.environ.get("OPENAI_API_KEY") or "EMPTY"
  openai = client_module()
  client = openai.AsyncOpenAI(base_url=args.base_url, api_key=api_key, max_retries=0,
                              timeout=args.request_timeout)
  try:
    await _request(client, args, work.prompts[share[0]][:4], 2, 0.0, 0.0,
                   contextlib.nullcontext(), Record(), lambda: None)
    ready()
    start = start()
    await asyncio.gather(*[
        _request(client, args, work.prompts[i], args.output_len, start, work.arrivals[i], gate,
                 record, done) for i, record in zip(share, records, strict=True)])
  finally:
    await client.close()
  return records, start


def _caps(cap: int | None, clients: int) -> list[int | None]:
  """`--max-concurrency` split among the clients (the first ones take the remainder)."""
  if cap is None:
    return [None] * clients
  return [cap // clients + (c < cap % clients) for c in range(clients)]


def _client_process(args: argparse.Namespace, work: Workload, share: list[int], cap: int | None,
                    go: Any, start: Any, results: Any) -> None:
  """A client process (`multiprocessing` target): it puts "ready" on `results` after its
  warm-up, starts at `start` once `go` is set, puts None after each request and its records
  last."""

  def begin() -> float:
    go.wait()
    return start.value

  records, _ = asyncio.run(_send(args, work, share, cap, lambda: results.put("ready"), begin,
                                 lambda: results.put(None)))
  results.put((share, records))


def _next(results: Any, workers: list) -> Any:
  """The next message of the client processes; a RuntimeError once one of them has died."""
  while True:
    try:
      return results.get(timeout=1.0)
    except queue.Empty:
      for worker in workers:
        if worker.exitcode not in (None, 0):
          raise RuntimeError(f"bench serve: the client process {worker.name} exited with "
                             f"code {worker.exitcode}") from None


def _send_all(args: argparse.Namespace, work: Workload,
              clients: int) -> tuple[list[Record], float, dict[str, float]]:
  """Every request's record, the start time (the first arrival) and the server's figures of
  the measured requests (`server_figures`: its histograms scraped once every client is warm and
  again at the end)."""
  n = len(work.prompts)
  shares = [list(range(c, n, clients)) for c in range(clients)]
  caps = _caps(args.max_concurrency, clients)
  before: dict[str, tuple[float, float]] = {}

  def warm() -> None:
    before.update(server_histograms(args.base_url))

  with tqdm(total=n, desc="requests", unit="req", file=sys.stderr) as bar:
    if clients == 1:
      records, start = asyncio.run(_send(args, work, shares[0], caps[0], warm,
                                         time.perf_counter, lambda: bar.update(1)))
      return records, start, server_figures(before, server_histograms(args.base_url))
    go, start = _SPAWN.Event(), _SPAWN.Value("d", 0.0)
    results = _SPAWN.Queue()
    workers = [_SPAWN.Process(target=_client_process, name=f"cg_jax-bench-client-{c}",
                              args=(args, work, shares[c], caps[c], go, start, results))
               for c in range(clients)]
    for worker in workers:
      worker.start()
    try:
      records: list[Record | None] = [None] * n
      ready = finished = 0
      while finished < clients:
        item = _next(results, workers)
        if item == "ready":
          ready += 1
          if ready == clients:  # every client warmed up: the common start
            warm()
            start.value = time.perf_counter() + START_AHEAD_S
            go.set()
        elif item is None:
          bar.update(1)
        else:
          share, got = item
          for i, record in zip(share, got, strict=True):
            records[i] = record
          finished += 1
    finally:
      for worker in workers:
        worker.join(5)
        if worker.is_alive():
          worker.kill()
          worker.join()
  return records, start.value, server_figures(before, server_histograms(args.base_url))


def server_histograms(base_url: str) -> dict[str, tuple[float, float]]:
  """`histogram_totals` of the server's /metrics (beside the base URL's /v1); {} when it does
  not answer."""
  url = urllib.parse.urljoin(base_url.rstrip("/") + "/", "../metrics")
  try:
    with urllib.request.urlopen(url, timeout=5) as response:
      return histogram_totals(response.read().decode())
  except (OSError, ValueError):
    return {}


def histogram_totals(text: str) -> dict[str, tuple[float, float]]:
  """{metric name suffix: (sum, count)} of `SERVER_HISTOGRAMS` in Prometheus text, each
  metric's label sets added up."""
  totals: dict[str, list[float]] = {}
  for line in text.splitlines():
    match = _SAMPLE.match(line)
    if match is None:
      continue
    name, part, value = match.groups()
    for _, suffix in SERVER_HISTOGRAMS:
      if name.endswith(suffix):
        totals.setdefault(suffix, [0.0, 0.0])[part == "count"] += float(value)
  return {suffix: (total, count) for suffix, (total, count) in totals.items()}


def server_figures(before: dict[str, tuple[float, float]],
                   after: dict[str, tuple[float, float]]) -> dict[str, float]:
  """The mean of each server histogram over the requests between two scrapes, in ms."""
  out = {}
  for figure, suffix in SERVER_HISTOGRAMS:
    if suffix in before and suffix in after and after[suffix][1] > before[suffix][1]:
      out[figure] = ((after[suffix][0] - before[suffix][0])
                     / (after[suffix][1] - before[suffix][1]) * 1e3)
  return out


def figures(records: Sequence[Record], start: float) -> dict[str, float]:
  """The row's figures of the requests' records (see the module docstring)."""
  done = [r for r in records if r.error is None]
  errors = len(records) - len(done)
  wall = max(r.finished for r in records) - start
  output = sum(r.tokens for r in done)
  ttft, tpot, itl, e2e = [], [], [], []
  for r in done:
    e2e.append((r.finished - r.sent) * 1e3)
    if not r.chunks:
      continue
    times = [t for t, _ in r.chunks]
    ttft.append((times[0] - r.sent) * 1e3)
    if r.tokens > 1:
      tpot.append((times[-1] - times[0]) / (r.tokens - 1) * 1e3)
    itl += [(b - a) * 1e3 for a, b in zip(times, times[1:])]
  return {"tokens_per_s": output / wall, "requests_per_s": len(done) / wall, "wall_s": wall,
          "output_tokens": float(output), **rows.percentiles("ttft_ms", ttft),
          **rows.percentiles("tpot_ms", tpot), **rows.percentiles("itl_ms", itl),
          **rows.percentiles("e2e_ms", e2e, (50, 99)), "errors": float(errors),
          **({"ttft_ms_mean": float(np.mean(ttft))} if ttft else {}),
          **({"tpot_ms_mean": float(np.mean(tpot))} if tpot else {})}


class AllFailed(ValueError):
  """Every request failed (a ValueError: `python -m cg_jax` prints it as `error: ...`)."""


@dataclasses.dataclass(frozen=True)
class Measurement:
  """A run's checked settings and what each request saw."""

  prompt_len: tuple[int, int]
  rate: float
  records: list[Record]
  start: float  # perf_counter at the first arrival
  clients: int = 1
  server: dict[str, float] = dataclasses.field(default_factory=dict)  # `server_figures`


def measure(args: argparse.Namespace) -> Measurement:
  """Checks the options (a ValueError naming the flag), sends the workload and records it."""
  client_module()
  options.integer("--num-requests", args.num_requests)
  options.integer("--output-len", args.output_len)
  options.integer("--max-concurrency", args.max_concurrency, optional=True)
  options.integer("--vocab-size", args.vocab_size, 2)
  clients = options.integer("--clients", args.clients)
  if not args.request_timeout > 0:
    raise ValueError(f"--request-timeout must be > 0 seconds, got {args.request_timeout!r}")
  prompt_len = options.length_range("--prompt-len", args.prompt_len)
  rate = options.rate("--rate", args.rate)
  work = workload(args.num_requests, prompt_len, rate, args.vocab_size, args.seed)
  clients = min(clients, args.num_requests, args.max_concurrency or args.num_requests)
  records, start, server = _send_all(args, work, clients)
  return Measurement(prompt_len, rate, records, start, clients, server)


def row(args: argparse.Namespace, measured: Measurement) -> Row:
  """The row of a measurement; every request failed: `AllFailed` with the first message, some
  failed: the first `SHOWN_ERRORS` messages on stderr (and a note there if a request got fewer
  tokens than asked)."""
  records = measured.records
  failed = [r.error for r in records if r.error is not None]
  if len(failed) == len(records):
    raise AllFailed(f"bench serve: all {len(records)} requests to {args.base_url} failed; the "
                    f"first: {failed[0]}")
  if failed:
    print(f"bench serve: {len(failed)} of {len(records)} requests failed:", file=sys.stderr)
    for text in failed[:SHOWN_ERRORS]:
      print(f"  {text}", file=sys.stderr)
  short = sum(r.error is None and r.tokens < args.output_len for r in records)
  if short:
    print(f"bench serve: {short} requests got fewer than --output-len {args.output_len} tokens "
          f"(does the server honour ignore_eos?)", file=sys.stderr)
  host = urllib.parse.urlsplit(args.base_url).hostname or args.base_url
  load = {"kind": "serve", "num_requests": args.num_requests, "prompt_len": args.prompt_len,
          "output_len": args.output_len,
          "rate": "inf" if math.isinf(measured.rate) else measured.rate,
          "max_concurrency": args.max_concurrency, "clients": measured.clients,
          "base_url": host}
  return options.row(args, load, {**figures(records, measured.start), **measured.server},
                     device=args.device or "remote")


def run(args: argparse.Namespace) -> list[Row]:
  """Sends the workload and returns its one row (`measure`, then `row`)."""
  return [row(args, measure(args))]
