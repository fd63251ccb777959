"""`python -m cg_jax serve` as users run it: an engine-core process and front ends
(`cg_jax.serving.launch`), driven by the official `openai` client on 127.0.0.1. Its answers
equal the in-process engine's; the faults of a process (the core killed, one of two front ends
killed, a client that hangs up, a client that stops reading) leave the rest served or fail fast
and loudly."""

from __future__ import annotations

import concurrent.futures
import json
import multiprocessing
import os
import signal
import socket
import threading
import time
import types

import openai
import pytest

from cg_jax import Engine
from cg_jax.core import process
from cg_jax.hub import BUNDLED_DIR, DEFAULT_MODEL
from cg_jax.serving import launch
from tests.live_server import ServeProcess, get

CHECKPOINT = os.path.join(BUNDLED_DIR, DEFAULT_MODEL)
SMALL = ("--max-seq-len", "128", "--batch-buckets", "1,2,4", "--prompt-buckets", "16")
PROMPTS = ["In the beginning", "And God said", "The LORD is my shepherd"]
TIMEOUT = 60


def _client(port: int) -> openai.OpenAI:
  return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0,
                       timeout=TIMEOUT)


def _stream_ids(client: openai.OpenAI, model: str, prompt, max_tokens: int) -> list[list[int]]:
  """The token ids of each chunk of a streamed, greedy completion."""
  chunks = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                     temperature=0, stream=True,
                                     extra_body={"return_token_ids": True, "ignore_eos": True})
  return [ids for chunk in chunks if (ids := chunk.choices[0].model_extra.get("token_ids"))]


@pytest.fixture(scope="module")
def engine():
  engine = Engine.from_pretrained(CHECKPOINT, max_seq_len=128, batch_buckets=(1, 2, 4),
                                  prompt_buckets=(16,))
  yield engine
  engine.close()


@pytest.fixture(scope="module")
def served():
  """The bundled model behind two front ends."""
  with ServeProcess("--model", CHECKPOINT, "--served-model-name", "kjv", "--api-servers", "2",
                    *SMALL) as serving:
    yield serving


def test_answers_equal_the_in_process_engine(served, engine):
  """Greedy, seeded sampling, stop strings and log-probabilities through the core process equal
  `Engine.generate` / `submit` in this process."""
  client = _client(served.port)
  for prompt in PROMPTS:
    want = engine.generate([prompt], 12)
    got = client.completions.create(model="kjv", prompt=prompt, max_tokens=12, temperature=0)
    assert got.choices[0].text == want.texts[0]
    sampled = engine.generate([prompt], 12, do_sample=True, temperature=0.8, top_k=20, seed=7)
    got = client.completions.create(model="kjv", prompt=prompt, max_tokens=12, temperature=0.8,
                                    seed=7, extra_body={"top_k": 20})
    assert got.choices[0].text == sampled.texts[0]
  stop = engine.submit(PROMPTS[0], 40, stop=["LORD"]).result()
  got = client.completions.create(model="kjv", prompt=PROMPTS[0], max_tokens=40, temperature=0,
                                  stop=["LORD"])
  assert (got.choices[0].text, got.choices[0].finish_reason) == (stop.text, "stop")
  scored = engine.submit(PROMPTS[1], 6, logprobs=2).result()
  got = client.completions.create(model="kjv", prompt=PROMPTS[1], max_tokens=6, temperature=0,
                                  logprobs=2)
  assert got.choices[0].logprobs.token_logprobs == pytest.approx(scored.logprobs, abs=1e-5)


def test_streams_and_many_at_once(served, engine):
  """A stream's chunks hold the engine's tokens; 24 streams at once over both front ends are
  all answered and each equals its prompt's tokens."""
  client = _client(served.port)
  want = engine.generate([[5, 6, 7]], 40, eos_token_id=[])[0]
  chunks = _stream_ids(client, "kjv", [5, 6, 7], 40)
  assert sum(chunks, []) == want
  with concurrent.futures.ThreadPoolExecutor(24) as pool:
    results = list(pool.map(lambda i: sum(_stream_ids(client, "kjv", [5, 6, 7 + i % 3], 20), []),
                            range(24)))
  for i, ids in enumerate(results):
    assert ids == engine.generate([[5, 6, 7 + i % 3]], 20, eos_token_id=[])[0]


def test_a_client_that_hangs_up_is_cancelled_in_the_core(served):
  client = _client(served.port)
  body = {"model": "kjv", "prompt": [1, 2, 3], "max_tokens": 120, "temperature": 0,
          "ignore_eos": True, "stream": True}
  data = json.dumps(body).encode()
  with socket.create_connection(("127.0.0.1", served.port), timeout=TIMEOUT) as sock:
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                 b"\r\nContent-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
    received = b""
    while b"data: " not in received:
      more = sock.recv(65536)
      assert more, received
      received += more
  deadline = time.monotonic() + 10
  while True:  # the core's stats, as each front end's /metrics shows them
    status, metrics = get(served.port, "/metrics")
    if status == 200 and b"\ncg_jax_requests_running 0.0\n" in metrics:
      break
    assert time.monotonic() < deadline, metrics.decode()
    time.sleep(0.1)
  assert client.completions.create(model="kjv", prompt=[1, 2], max_tokens=2).choices[0].text


def test_a_stalled_client_delays_no_other_stream(served, engine):
  """A client that stops reading (a 2 KB receive buffer, nothing read) while its stream of six
  choices with log-probabilities (over 192 KB) is produced: other streams are answered
  meanwhile, in full and equal to the engine's; read afterwards, the stalled stream lost
  nothing (every choice's tokens, its finish, [DONE]). (Four choices made about 196 KB, and
  194,834 bytes in one CI run, below the size check: the front end coalesces a lagging
  stream's chunks, so the framing varies.)"""
  body = {"model": "kjv", "prompt": [[5, 6, 7 + i] for i in range(6)], "max_tokens": 120,
          "temperature": 0, "ignore_eos": True, "stream": True, "logprobs": 5,
          "return_token_ids": True}
  data = json.dumps(body).encode()
  with socket.socket() as stalled:
    stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)  # (before connecting)
    stalled.settimeout(TIMEOUT)
    stalled.connect(("127.0.0.1", served.port))
    stalled.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                    b"application/json\r\nContent-Length: " + str(len(data)).encode()
                    + b"\r\n\r\n" + data)
    time.sleep(1.0)  # (its tokens are being made, and its front end's writes back up)
    client = _client(served.port)
    for i in range(4):  # other streams, over both front ends
      started = time.monotonic()
      assert sum(_stream_ids(client, "kjv", [9, 10, 11 + i], 20), []) == engine.generate(
          [[9, 10, 11 + i]], 20, eos_token_id=[])[0]
      assert time.monotonic() - started < 20
    received = b""
    while not received.endswith(b"\r\n0\r\n\r\n"):  # (the chunked body's end)
      more = stalled.recv(1 << 16)
      assert more, received[-500:]
      received += more
  # Far past what the stalled socket's buffers hold (2 KB here, the server's send buffer against
  # that window, and uvicorn's 64 KB before it pauses the stream).
  assert len(received) > 192 * 1024
  head, body = received.split(b"\r\n\r\n", 1)
  assert head.startswith(b"HTTP/1.1 200")
  stream = b""
  while body:  # chunked transfer encoding: size in hex, CRLF, data, CRLF
    size, body = body.split(b"\r\n", 1)
    stream, body = stream + body[:int(size, 16)], body[int(size, 16) + 2:]
  lines = stream.decode().split("\n")
  assert "data: [DONE]" in lines
  events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
  for i in range(6):
    choices = [c for e in events for c in e["choices"] if c["index"] == i]
    ids = sum((c.get("token_ids") or [] for c in choices), [])
    assert ids == engine.generate([[5, 6, 7 + i]], 120, eos_token_id=[])[0]
    assert choices[-1]["finish_reason"] == "length"


def test_a_model_without_a_tokenizer_streams_per_step():
  """A preset (random weights, no tokenizer): the stream's chunks come as the steps do, not as one
  at the end. The core is paused every few milliseconds (SIGSTOP / SIGCONT), as a larger model's
  steps would pace it, so that the stream keeps up instead of coalescing steps."""
  with ServeProcess("--model", "tiny-llama", "--max-seq-len", "512", "--batch-buckets", "1",
                    "--prompt-buckets", "16") as serving:
    core = serving.pids(r"engine core process started \(pid (\d+)\)")[0]
    serving.wait_log(r"more executables \(logprobs\) ready")  # (no compile beside the steps)
    done = threading.Event()

    def pace():
      while not done.is_set():
        os.kill(core, signal.SIGSTOP)
        time.sleep(0.02)
        os.kill(core, signal.SIGCONT)
        time.sleep(0.002)

    pacer = threading.Thread(target=pace)
    pacer.start()
    try:
      chunks = _stream_ids(_client(serving.port), "tiny-llama", [1, 2, 3], 200)
    finally:
      done.set()
      pacer.join()
      os.kill(core, signal.SIGCONT)
  assert sum(len(c) for c in chunks) == 200
  assert len(chunks) >= 10, [len(c) for c in chunks]


class _BusyEngine:
  """The part of `Engine` the core process uses, with a build in flight on a thread pool that
  outlives the engine (as the decode steps' own executables build behind a warm-up)."""

  def __init__(self, marker: str):
    self.model_config = types.SimpleNamespace(vocab_size=16, eos_token_id=(0,))
    self.config = types.SimpleNamespace(max_seq_len=16, max_waiting=4)
    self._pool = concurrent.futures.ThreadPoolExecutor(1)
    self._pool.submit(time.sleep, 300)
    open(marker, "w").close()

  def on_step(self, callback):
    pass

  def executable_keys(self, phases=()):
    return []

  def warmup(self, **_):
    pass

  def stats(self):
    return {}

  def close(self):
    pass


class _BusyBuild:
  def __init__(self, marker: str):
    self.marker = marker

  def __call__(self) -> _BusyEngine:
    return _BusyEngine(self.marker)


def test_the_core_process_ends_at_shutdown_with_a_build_in_flight(tmp_path):
  marker = str(tmp_path / "built")
  core = multiprocessing.get_context("spawn").Process(
      target=process.run, args=(str(tmp_path), _BusyBuild(marker), ("step",), (), "warning"))
  core.start()
  try:
    deadline = time.monotonic() + TIMEOUT
    while not os.path.exists(marker):
      assert core.is_alive() and time.monotonic() < deadline
      time.sleep(0.05)
    start = time.monotonic()
    launch._stop_core(core, str(tmp_path))  # (a shutdown message; it kills only a core that
    assert not core.is_alive() and core.exitcode == 0, core.exitcode  # does not listen)
    assert time.monotonic() - start < 20
  finally:
    if core.is_alive():
      core.kill()
      core.join(5)


def test_the_core_killed_fails_requests_fast_and_stops_serve():
  """SIGKILL on the engine-core process: the request in flight fails with a 5xx within 2 s,
  /health fails, and `serve` exits non-zero saying why."""
  with ServeProcess("--model", "tiny-llama", "--max-seq-len", "512", "--batch-buckets", "1",
                    "--prompt-buckets", "16") as serving:
    core = serving.pids(r"engine core process started \(pid (\d+)\)")[0]
    client = _client(serving.port)
    os.kill(core, signal.SIGSTOP)  # (so that the request is still in flight when the core dies)
    stream = client.completions.create(model="tiny-llama", prompt=[1, 2, 3], max_tokens=500,
                                       temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    time.sleep(0.3)
    killed = time.monotonic()
    os.kill(core, signal.SIGKILL)
    with pytest.raises(openai.APIError, match="died"):
      for _ in stream:
        pass
    assert time.monotonic() - killed < 2.0
    status, body = get(serving.port, "/health")
    assert status == 503 and b"died" in body
    assert serving.process.wait(timeout=30) == 1
  assert "exited with code -9 (SIGKILL)" in serving.log, serving.log


def test_one_front_end_killed_the_other_serves(served, engine):
  """Two front ends: one SIGKILLed, the other answers every request after it."""
  fronts = served.pids(r"Started server process \[(\d+)\]")
  assert len(fronts) == 2, served.log
  os.kill(fronts[0], signal.SIGKILL)
  deadline = time.monotonic() + 10
  while "front end" not in served.log:
    assert time.monotonic() < deadline, served.log
    time.sleep(0.05)
  client = _client(served.port)
  want = engine.generate([PROMPTS[2]], 8).texts[0]
  for _ in range(8):
    got = client.completions.create(model="kjv", prompt=PROMPTS[2], max_tokens=8, temperature=0)
    assert got.choices[0].text == want
  assert served.process.poll() is None
