"""The serving front end's capacity, with no model and no device: `serve`'s processes with a
stand-in engine in the core process that gives every running request its next token each
`--step-ms` (as a decode step would; its prompt's ids in turn, so the detokenizer sees real
text), then `python -m cg_jax bench serve` against it. What it measures is what one front end
(HTTP, server-sent events, detokenizing, the core's messages) delivers on this machine's CPU:
with the front end keeping up, each stream's time per token is the step; past its capacity it
grows. The front end's and the core's CPU seconds are read from /proc.

Usage (the tokenizer is --model's; one tree first on the path for an A/B):
  PYTHONSAFEPATH=1 PYTHONPATH=<tree> python3 benchmarks/front_end_bench.py --model DIR \
    --streams 16,64 --step-ms 1.6 [--output-len 128] [--clients 2]
One line per stream count: tokens/s, the client's TPOT and the server's, the front end's CPU
microseconds per token. `--trace N` first sends N streamed requests one at a time over a raw
socket (one prompt of the --prompt-len upper bound) and prints the median time between the
stages of each one's first chunk (marks patched onto uvicorn's parser and sender, the service
and the core client), then the first chunk's median through the openai client, and the same
client's against a stand-in server that answers at once (the client's own floor). `--lone N`
sends N requests one at a time from `bench serve` in its own process (the client apart from the
front end's interpreter, as users run it); `--first-token-ms` makes the stand-in's first token
wait as a prefill would (the front end's work after the send then overlaps it, as with a model).
"""
import argparse
import asyncio
import cProfile
import json
import multiprocessing
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import statistics
import types
import urllib.request

import openai
from uvicorn.protocols.http import httptools_impl

from cg_jax.core import process
from cg_jax.serving import client, launch, service
from cg_jax.serving.service import WARMUP_PHASES


class StandIn:
  """The part of `Engine` the core process uses; a thread "steps" every `step_s`. With
  `first_token_s`, `enqueue` returns that much later (the core's main thread waits, as a request
  waits for its prefill; for lone requests only: it holds every other message meanwhile)."""

  def __init__(self, step_s: float, vocab_size: int, eos: tuple[int, ...],
               first_token_s: float = 0.0):
    self._first_token_s = first_token_s
    self.model_config = types.SimpleNamespace(vocab_size=vocab_size, eos_token_id=eos)
    self.config = types.SimpleNamespace(max_seq_len=1 << 16, max_waiting=1 << 16)
    self._step_s, self._lock, self._running = step_s, threading.Condition(), []
    self._delivered = lambda: None
    self._stop = threading.Event()
    threading.Thread(target=self._loop, daemon=True).start()

  def on_step(self, callback):
    self._delivered = callback or (lambda: None)

  def executable_keys(self, phases=()):
    return []

  def warmup(self, **_):
    pass

  def warmup_behind(self, phases, stopping):
    pass

  def stats(self):
    return {"running": len(self._running)}

  def close(self):
    self._stop.set()

  def enqueue(self, request, *, timeout=None, group):
    if self._first_token_s:
      time.sleep(self._first_token_s)
    prompt = request.rows[0].tolist()
    made = group([len(prompt)], lambda: None)
    with self._lock:
      self._running.append([made, prompt, 0, request.max_new_tokens])
      self._lock.notify()
    return made

  def _loop(self):
    next_at = time.perf_counter()
    while not self._stop.is_set():
      with self._lock:
        if not self._running:  # idle until a request comes (its first token is given at once)
          self._lock.wait(0.05)
          next_at = time.perf_counter()
      next_at += self._step_s
      with self._lock:
        running = self._running
        for entry in running:
          made, prompt, given, budget = entry
          if made.cancelled:
            continue
          made._emit({0: prompt[given % len(prompt)]}, {})
          entry[2] = given = given + 1
          if given == budget:
            made._finish(0, "length")
        self._running = [e for e in running if e[2] < e[3] and not e[0].cancelled]
      self._delivered()
      time.sleep(max(0.0, next_at - time.perf_counter()))


_MARKS: list[tuple[str, float]] = []  # (stage, time) of the traced request


def _mark_before(cls, name: str, stage: str) -> None:
  method = getattr(cls, name)

  def marked(*args, **kwargs):
    _MARKS.append((stage, time.perf_counter()))
    return method(*args, **kwargs)

  setattr(cls, name, marked)


def _install_marks() -> None:
  _mark_before(httptools_impl.HttpToolsProtocol, "on_message_complete", "1 request parsed")
  _mark_before(service.Service, "completion_jobs", "2 validation starts")
  _mark_before(client.CoreClient, "_send", "3 sent to the core")
  _mark_before(client.CoreClient, "_step", "4 token in the front end")
  send = httptools_impl.RequestResponseCycle.send

  async def marked_send(self, message):
    await send(self, message)
    if message["type"] == "http.response.body" and message.get("body", b"").startswith(b"data:"):
      _MARKS.append(("5 first chunk written", time.perf_counter()))

  httptools_impl.RequestResponseCycle.send = marked_send


def trace(port: int, count: int, prompt_len: int) -> None:
  """`count` requests one at a time: each stage's median share of the first chunk's time."""
  body = json.dumps({"model": "m", "prompt": list(range(1, prompt_len + 1)), "max_tokens": 2,
                     "stream": True, "temperature": 0, "ignore_eos": True}).encode()
  request = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
             b"application/json\r\nContent-Length: %d\r\n\r\n" % len(body)) + body
  spans: dict[str, list[float]] = {}
  for _ in range(count):
    with socket.create_connection(("127.0.0.1", port)) as conn:
      conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
      time.sleep(0.01)
      _MARKS.clear()
      start = time.perf_counter()
      conn.sendall(request)
      received = b""
      while b"data: {" not in received:
        received += conn.recv(65536)
      end = time.perf_counter()
      while b"[DONE]" not in received and (more := conn.recv(65536)):
        received += more
    first: dict[str, float] = {}
    for stage, at in _MARKS:
      first.setdefault(stage, at)
    last = start
    for stage in sorted(first):
      spans.setdefault(stage, []).append(first[stage] - last)
      last = first[stage]
    spans.setdefault("6 client has it", []).append(end - last)
    spans.setdefault("first chunk", []).append(end - start)
  spans["first chunk, openai client"] = asyncio.run(_openai_first_chunks(port, count, prompt_len))
  spawn = multiprocessing.get_context("spawn")
  ports = spawn.SimpleQueue()
  canned = spawn.Process(target=_canned, args=(ports,), daemon=True)
  canned.start()
  spans["openai client, canned answer"] = asyncio.run(
      _openai_first_chunks(ports.get(), count, prompt_len))
  canned.terminate()
  for stage, times in sorted(spans.items()):
    print(f"trace: {stage:29s} {statistics.median(times) * 1e3:7.3f} ms", flush=True)


async def _openai_first_chunks(port: int, count: int, prompt_len: int) -> list[float]:
  """The same lone requests through `openai.AsyncOpenAI` (as `bench serve` sends them)."""
  api = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-")
  times = []
  for _ in range(count + 3):  # (the first three warm the client)
    start = time.perf_counter()
    stream = await api.completions.create(
        model="m", prompt="", max_tokens=2, stream=True, temperature=0,
        extra_body={"prompt": list(range(1, prompt_len + 1)), "ignore_eos": True})
    first = None
    async for chunk in stream:
      if first is None and chunk.choices:
        first = time.perf_counter() - start
    times.append(first)
  return times[3:]


def _canned(ports) -> None:
  """A stand-in server answering every request at once with one chunk and [DONE]: the openai
  client's own first-chunk time (its floor with any server), put in `ports` its port."""
  chunk = json.dumps({"id": "cmpl-0", "object": "text_completion", "created": 0, "model": "m",
                      "choices": [{"index": 0, "text": "a", "logprobs": None,
                                   "finish_reason": None}]})
  events = [f"data: {chunk}\n\n".encode(), b"data: [DONE]\n\n"]
  answer = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
            b"transfer-encoding: chunked\r\n\r\n" +
            b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events) + b"0\r\n\r\n")

  async def answer_all(reader, writer):
    while head := await reader.readuntil(b"\r\n\r\n"):
      length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:"))
      await reader.readexactly(length)
      writer.write(answer)

  async def run():
    server = await asyncio.start_server(answer_all, "127.0.0.1", 0)
    ports.put(server.sockets[0].getsockname()[1])
    await server.serve_forever()

  asyncio.run(run())


def cpu_s(pid: int) -> float:
  with open(f"/proc/{pid}/stat") as f:
    fields = f.read().rsplit(")", 1)[1].split()
  return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--model", required=True, help="its tokenizer is used")
  parser.add_argument("--streams", default="16,64")
  parser.add_argument("--step-ms", type=float, default=1.6)
  parser.add_argument("--output-len", type=int, default=128)
  parser.add_argument("--prompt-len", default="64:480")
  parser.add_argument("--clients", type=int, default=2)
  parser.add_argument("--vocab-size", type=int, default=1000)
  parser.add_argument("--trace", type=int, default=0,
                      help="first time this many lone requests stage by stage")
  parser.add_argument("--lone", type=int, default=0,
                      help="then send this many requests one at a time with `bench serve` (its "
                           "own process; --max-concurrency 1) and print their TTFT p50")
  parser.add_argument("--first-token-ms", type=float, default=0.0,
                      help="with --trace or --lone: the stand-in's first token comes this long "
                           "after the core has the request (a prefill's time: the front end's "
                           "work after the send is then off the first chunk's path, as with a "
                           "model)")
  parser.add_argument("--profile", default=None,
                      help="write a cProfile of the event loop's thread to this file")
  args = parser.parse_args()
  tokenizer = launch._tokenizer(args.model)
  vocab = tokenizer.get_vocab_size() if tokenizer is not None else args.vocab_size
  directory = tempfile.mkdtemp(prefix="cg_jax-bench-")
  core = multiprocessing.get_context("spawn").Process(
      target=process.run,
      args=(directory, _Build(args.step_ms / 1e3, vocab, args.first_token_ms / 1e3),
            WARMUP_PHASES, "warning"))
  core.start()
  sock = socket.socket()
  sock.bind(("127.0.0.1", 0))
  port = sock.getsockname()[1]
  if args.trace:
    _install_marks()
  profiler = cProfile.Profile() if args.profile else None
  front_args = (directory, 0, core.pid, args.model, "m", None, sock, 5, "warning")
  front = threading.Thread(target=profiler.runcall if profiler else launch._front_end,
                           args=(launch._front_end, *front_args) if profiler else front_args,
                           daemon=True)
  front.start()
  for _ in range(300):
    try:
      if urllib.request.urlopen(f"http://127.0.0.1:{port}/health").status == 200:
        break
    except OSError:
      time.sleep(0.1)
  if args.trace:
    trace(port, args.trace, int(args.prompt_len.split(":")[-1]))
  def bench_serve(requests: int, *options: str) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".jsonl") as rows:
      subprocess.run([sys.executable, "-m", "cg_jax", "bench", "serve", "--base-url",
                      f"http://127.0.0.1:{port}/v1", "--model", "m", "--num-requests",
                      str(requests), "--output-len", str(args.output_len), "--prompt-len",
                      args.prompt_len, "--vocab-size", str(min(vocab, args.vocab_size)),
                      "--output", rows.name, *options], check=True, capture_output=True)
      return json.loads(open(rows.name).readlines()[-1])["figures"]

  if args.lone:
    figures = bench_serve(args.lone, "--clients", "1", "--max-concurrency", "1")
    print(f"lone requests {args.lone}: TTFT p50 {figures['ttft_ms_p50']:.3f} ms, server mean "
          f"{figures.get('server_ttft_ms_mean', 0):.3f} ms", flush=True)
  for streams in (int(s) for s in args.streams.split(",") if s):
    before = cpu_s(os.getpid()), cpu_s(core.pid)
    figures = bench_serve(streams, "--clients", str(args.clients))
    front_s, core_s = cpu_s(os.getpid()) - before[0], cpu_s(core.pid) - before[1]
    tokens = streams * args.output_len
    print(f"streams {streams:4d} step {args.step_ms} ms: {figures['tokens_per_s']:8.0f} tok/s "
          f"(the steps allow {streams / args.step_ms * 1e3:8.0f}), TPOT mean "
          f"{figures['tpot_ms_mean']:.3f} ms, server {figures.get('server_tpot_ms_mean', 0):.3f};"
          f" TTFT mean {figures['ttft_ms_mean']:.2f} ms, server "
          f"{figures.get('server_ttft_ms_mean', 0):.2f}; front end {front_s / tokens * 1e6:.1f} "
          f"us CPU a token, core {core_s / tokens * 1e6:.1f}", flush=True)
  if profiler is not None:
    profiler.dump_stats(args.profile)  # (while it runs: what it has so far)
  os.kill(os.getpid(), 15)


class _Build:
  """The core process's `build` (picklable): a `StandIn`."""

  def __init__(self, step_s: float, vocab_size: int, first_token_s: float):
    self.step_s, self.vocab_size, self.first_token_s = step_s, vocab_size, first_token_s

  def __call__(self) -> StandIn:
    return StandIn(self.step_s, self.vocab_size, (), self.first_token_s)


if __name__ == "__main__":
  main()
