"""The OpenAI-compatible server (cg_jax.serving) on the CPU with the bundled model: one live uvicorn
server on 127.0.0.1 driven by the official `openai` client. Completions and chat equal the
in-process `engine.generate` (text and token ids, streamed or not); log-probabilities (completions,
`echo`, chat, streamed or not) equal a float64 log-softmax of `engine.logits`; 32 concurrent
streams; a
client that disconnects frees its slot; each bad request gets its status and message in OpenAI's
format; /metrics, /health, /v1/models; chat templates rendered as transformers renders them;
SIGTERM drains and exits; start-up binds the port first (a busy one fails at once), answers 503
while warming up (SIGTERM then exits cleanly), and a failed warm-up stops the server; the warm-up
bar counts what compiles; echo with max_tokens 0 takes a full-context prompt; no thread is left
behind."""

import asyncio
import http.client
import itertools
import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cg_jax import Engine
from cg_jax import serving as server
from cg_jax.chat_template import ChatTemplate
from cg_jax.hub import BUNDLED_DIR, DEFAULT_MODEL
from cg_jax.serving.protocol import TokenText
from tests.live_server import get as _get
from tests.live_server import serving as _serving
from tests.live_server import start as _start
from tests.live_server import stop as _stop
from tests.live_server import wait_health as _wait_health

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = "kjv-test"
OPTIONS = dict(max_seq_len=256, batch_buckets=(1, 2, 4, 8), prompt_buckets=(32,))
TIMEOUT = 60  # seconds, for every client call
# trim_blocks / lstrip_blocks decide its whitespace; rendered by hand in `test_chat_*`.
TEMPLATE = """{{ bos_token }}
{%- for message in messages %}
  {% if message['role'] not in ['system', 'user', 'assistant'] %}
    {{ raise_exception('unknown role: ' + message['role']) }}
  {% endif %}
{{ message['role'] | capitalize }}: {{ message['content'] | trim }}
{% endfor %}
{% if add_generation_prompt %}
Assistant:
{%- endif %}"""
MESSAGES = [{"role": "system", "content": "Thou art a scribe."},
            {"role": "user", "content": "  Who made the heavens? "}]
RENDERED = "<|endoftext|>System: Thou art a scribe.\nUser: Who made the heavens?\nAssistant:"
PROMPTS = ["In the beginning", "And God said", "The LORD is my shepherd"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  """The bundled model's files, linked, with a tokenizer_config.json holding TEMPLATE."""
  path = tmp_path_factory.mktemp("kjv-chat")
  source = os.path.join(BUNDLED_DIR, DEFAULT_MODEL)
  for name in os.listdir(source):
    if name != "tokenizer_config.json":
      os.symlink(os.path.join(source, name), path / name)
  with open(os.path.join(source, "tokenizer_config.json")) as f:
    config = json.load(f)
  with open(path / "tokenizer_config.json", "w") as f:
    json.dump(dict(config, chat_template=TEMPLATE), f)
  return path


@pytest.fixture(scope="module")
def engine(checkpoint):
  engine = Engine.from_pretrained(checkpoint, **OPTIONS)
  engine.warmup(progress=False)
  return engine


def _engine_threads():
  return [t for t in threading.enumerate() if t.name == "cg_jax-engine"]


@pytest.fixture(scope="module")
def port(engine, checkpoint):
  """The module's server (its app closes the engine at shutdown); teardown checks the shutdown:
  server thread joined, engine thread gone, no thread left behind."""
  before = set(threading.enumerate())
  app = server.create_app(engine, MODEL, chat_template=server.load_chat_template(checkpoint))
  live, thread, port = _start(app)
  yield port
  _stop(live, thread)
  assert not set(_engine_threads()) - before
  with pytest.raises(Exception, match="closed"):
    engine.submit([1, 2], 2)
  deadline = time.monotonic() + 10
  while set(threading.enumerate()) - before and time.monotonic() < deadline:
    time.sleep(0.05)
  assert not set(threading.enumerate()) - before


@pytest.fixture(scope="module")
def client(port):
  client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0,
                         timeout=TIMEOUT)
  yield client
  client.close()


def _post(port, path, body: bytes | dict):
  """(status, body bytes) of a POST with a JSON body (or raw bytes)."""
  data = body if isinstance(body, bytes) else json.dumps(body).encode()
  conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT)
  try:
    conn.request("POST", path, data, {"Content-Type": "application/json"})
    response = conn.getresponse()
    return response.status, response.read()
  finally:
    conn.close()


def _raw_post(port, path, body: dict) -> socket.socket:
  data = json.dumps(body).encode()
  sock = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT)
  sock.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode() + data)
  return sock


def _read_until(sock, marker: bytes) -> bytes:
  data = b""
  while marker not in data:
    more = sock.recv(65536)
    assert more, f"the connection closed before {marker!r}: {data!r}"
    data += more
  return data


def _read_all(sock) -> bytes:
  data = b""
  while more := sock.recv(65536):
    data += more
  return data


def _events(raw: bytes) -> list:
  """The server-sent events' data in a raw (chunked) HTTP response."""
  return [e if e == b"[DONE]" else json.loads(e) for e in re.findall(rb"data: (.*?)\n\n", raw)]


def _metrics(port) -> dict:
  status, body = _get(port, "/metrics")
  assert status == 200
  return {(s.name, tuple(sorted(s.labels.items()))): s.value
          for family in text_string_to_metric_families(body.decode()) for s in family.samples}


def _wait_idle(engine, timeout=30):
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    stats = engine.stats()
    if stats["running"] == 0 and stats["waiting"] == 0:
      return stats
    time.sleep(0.01)
  raise AssertionError(f"the engine is still busy: {engine.stats()}")


# --------------------------------------------------------------------------------------------------


def test_models_and_health(client, port):
  assert [m.id for m in client.models.list().data] == [MODEL]
  card = client.models.retrieve(MODEL)
  assert card.id == MODEL and card.model_extra["max_model_len"] == OPTIONS["max_seq_len"]
  with pytest.raises(openai.NotFoundError) as error:
    client.models.retrieve("gpt-4")
  assert error.value.code == "model_not_found"
  assert _get(port, "/health") == (200, b'{"status":"ok"}')


def test_completions_equal_engine_generate(client, engine):
  """Greedy completions (text prompt, token-id prompt, several prompts) give the tokens and
  text of `engine.generate` with the same prompt and budget."""
  tokenizer = engine.tokenizer
  for prompt in PROMPTS:
    expected = engine.generate([prompt], max_new_tokens=24)
    reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                      extra_body={"return_token_ids": True})
    (choice,) = reply.choices
    assert choice.text == expected.texts[0] and choice.token_ids == expected[0]
    assert choice.finish_reason == ("stop" if expected[0][-1] == 0 else "length")
    ids = tokenizer.encode(prompt).ids
    assert choice.prompt_token_ids == ids and choice.logprobs is None
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens,
            reply.usage.total_tokens) == (len(ids), len(expected[0]), len(ids) + len(expected[0]))
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=24, temperature=0)
    assert by_ids.choices[0].text == expected.texts[0]
  several = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=10, temperature=0)
  expected = engine.generate(PROMPTS, max_new_tokens=10)
  assert [c.index for c in several.choices] == [0, 1, 2]
  assert [c.text for c in several.choices] == expected.texts
  default = client.completions.create(model=MODEL, prompt=PROMPTS[0], temperature=0)
  assert default.usage.completion_tokens == 16  # OpenAI's default max_tokens


def test_sampling_and_stop_strings_equal_engine_generate(client, engine):
  sampled = engine.generate([PROMPTS[1]], max_new_tokens=20, do_sample=True, temperature=0.8,
                            top_k=40, top_p=0.9, seed=7)
  reply = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=20,
                                    temperature=0.8, top_p=0.9, seed=7,
                                    extra_body={"top_k": 40, "return_token_ids": True})
  assert reply.choices[0].token_ids == sampled[0]
  assert reply.choices[0].text == sampled.texts[0]
  stopped = engine.generate([PROMPTS[0]], max_new_tokens=40, stop=[":", "\n"])
  reply = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=40, temperature=0,
                                    stop=[":", "\n"])
  assert reply.choices[0].text == stopped.texts[0] and "\n" not in reply.choices[0].text
  assert reply.choices[0].finish_reason == "stop"
  long = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=60, temperature=0,
                                   extra_body={"ignore_eos": True})
  assert long.usage.completion_tokens == 60 and long.choices[0].finish_reason == "length"


def test_streamed_completion_equals_engine_generate(client, engine, port):
  expected = engine.generate([PROMPTS[2]], max_new_tokens=30)
  chunks = list(client.completions.create(
      model=MODEL, prompt=PROMPTS[2], max_tokens=30, temperature=0, stream=True,
      stream_options={"include_usage": True}, extra_body={"return_token_ids": True}))
  assert len({c.id for c in chunks}) == 1 and all(c.object == "text_completion" for c in chunks)
  *choices, last = chunks
  assert last.choices == [] and last.usage.completion_tokens == len(expected[0])
  assert all(c.usage is None for c in choices)
  assert "".join(c.choices[0].text for c in choices) == expected.texts[0]
  assert [t for c in choices for t in c.choices[0].token_ids] == expected[0]
  assert [c.choices[0].finish_reason for c in choices][-1] in ("stop", "length")
  assert all(c.choices[0].finish_reason is None for c in choices[:-1])
  # vLLM's continuous usage (guidellm asks for it): every chunk counts the tokens so far.
  chunks = list(client.completions.create(
      model=MODEL, prompt=PROMPTS[2], max_tokens=30, temperature=0, stream=True,
      stream_options={"include_usage": True, "continuous_usage_stats": True},
      extra_body={"return_token_ids": True}))
  *choices, last = chunks
  seen = list(itertools.accumulate(len(c.choices[0].token_ids) for c in choices))
  assert [c.usage.completion_tokens for c in choices] == seen
  assert last.usage.completion_tokens == seen[-1] == len(expected[0])
  assert {c.usage.prompt_tokens for c in chunks} == {last.usage.prompt_tokens}
  # Several prompts: one choice each, interleaved.
  chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=8,
                                          temperature=0, stream=True))
  texts = ["".join(c.choices[0].text for c in chunks if c.choices[0].index == i)
           for i in range(3)]
  assert texts == engine.generate(PROMPTS, max_new_tokens=8).texts
  # The wire format: `data: {json}\n\n` events, the last `data: [DONE]\n\n`.
  sock = _raw_post(port, "/v1/completions", {"model": MODEL, "prompt": PROMPTS[0],
                                             "max_tokens": 5, "temperature": 0, "stream": True})
  with sock:
    raw = _read_all(sock)
  head, _, body = raw.partition(b"\r\n\r\n")
  assert b"200 OK" in head and b"text/event-stream" in head
  events = _events(body)
  assert events[-1] == b"[DONE]" and body.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")
  assert "".join(e["choices"][0]["text"] for e in events[:-1]) == \
      engine.generate([PROMPTS[0]], max_new_tokens=5).texts[0]


def test_chat_renders_the_template_and_equals_engine_generate(client, engine, checkpoint):
  template = server.load_chat_template(checkpoint)
  assert template.render(MESSAGES) == RENDERED
  ids = engine.tokenizer.encode(RENDERED, add_special_tokens=False).ids
  assert ids[0] == 0  # the bos_token text is the special token
  expected = engine.generate([ids], max_new_tokens=20)
  reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=20,
                                         temperature=0)
  assert reply.object == "chat.completion"
  assert reply.choices[0].message.role == "assistant"
  assert reply.choices[0].message.content == expected.texts[0]
  assert reply.usage.prompt_tokens == len(ids)
  assert reply.usage.completion_tokens == len(expected[0])
  parts = [{"role": "system", "content": [{"type": "text", "text": "Thou art "},
                                          {"type": "text", "text": "a scribe."}]}, MESSAGES[1]]
  by_parts = client.chat.completions.create(model=MODEL, messages=parts, max_completion_tokens=20,
                                            temperature=0)
  assert by_parts.choices[0].message.content == expected.texts[0]
  chunks = list(client.chat.completions.create(
      model=MODEL, messages=MESSAGES, max_tokens=20, temperature=0, stream=True,
      stream_options={"include_usage": True}))
  assert chunks[0].choices[0].delta.role == "assistant"
  assert all(c.object == "chat.completion.chunk" for c in chunks)
  assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == expected.texts[0]
  assert chunks[-2].choices[0].finish_reason in ("stop", "length")
  assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == len(ids)
  # The default budget is the rest of the context.
  whole = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0,
                                         extra_body={"ignore_eos": True})
  assert whole.usage.total_tokens == OPTIONS["max_seq_len"]


def test_chat_template_errors(client, engine):
  with pytest.raises(openai.BadRequestError) as error:
    client.chat.completions.create(model=MODEL, messages=[{"role": "tool", "content": "x"}])
  assert error.value.param == "messages" and "unknown role: tool" in error.value.message
  with pytest.raises(openai.BadRequestError) as error:
    client.chat.completions.create(model=MODEL, messages=[
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
  assert error.value.param == "messages[0].content[0]"
  # A model without a template: a 400 saying so.
  app = server.create_app(engine, "plain", warmup=False, close_engine=False)
  with _serving(app) as port:
    plain = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0,
                          timeout=TIMEOUT)
    with plain:
      with pytest.raises(openai.BadRequestError) as error:
        plain.chat.completions.create(model="plain", messages=MESSAGES)
      assert "has no chat template" in error.value.message
      assert plain.completions.create(model="plain", prompt="In", max_tokens=2).choices
  assert _engine_threads()  # close_engine=False left it running


COMPLEX_TEMPLATE = """{%- set ns = namespace(count=0) -%}
{%- for m in messages -%}
  {%- if m.role == 'system' -%}{%- continue -%}{%- endif -%}
  {%- set ns.count = ns.count + 1 -%}
  [{{ ns.count }}{{ '/last' if loop.last }}] {{ m.role }} {{ m | tojson }}
  {% if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}{{ eos_token }}
  {% endif %}
{% endfor -%}
{{ messages | length }}{{ bos_token }}{% if add_generation_prompt %}>{% endif %}"""


@pytest.mark.torch
def test_chat_templates_render_as_transformers(checkpoint, engine):
  """Our rendering and token ids equal transformers' apply_chat_template (the test template and
  one with namespaces, loop controls, tojson of non-ASCII text and a generation tag)."""
  transformers = pytest.importorskip("transformers")
  tokenizer = transformers.AutoTokenizer.from_pretrained(str(checkpoint))
  messages = MESSAGES + [{"role": "assistant", "content": "God, é \"quoted\""},
                         {"role": "user", "content": "And the earth?"}]
  ours = server.load_chat_template(checkpoint)
  for chat in (MESSAGES, messages):
    theirs = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert ours.render(chat) == theirs
    their_ids = tokenizer.apply_chat_template(chat, tokenize=True, add_generation_prompt=True)
    if not isinstance(their_ids, list):
      their_ids = their_ids["input_ids"]
    assert engine.tokenizer.encode(ours.render(chat), add_special_tokens=False).ids == their_ids
  complex_ = ChatTemplate(COMPLEX_TEMPLATE, ours.special_tokens)
  for generation_prompt in (True, False):
    theirs = tokenizer.apply_chat_template(messages, chat_template=COMPLEX_TEMPLATE,
                                           tokenize=False,
                                           add_generation_prompt=generation_prompt)
    assert complex_.render(messages, add_generation_prompt=generation_prompt) == theirs
  assert '"God, é \\"quoted\\""' in complex_.render(messages)


def test_bad_requests_get_their_status_and_message(client, port):
  ok = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=4)
  cases = [
      (dict(temperature=3), 400, "temperature", "allowed 0 to 2"),
      (dict(temperature=-0.5), 400, "temperature", "allowed 0 to 2"),
      (dict(top_p=0), 400, "top_p", "top_p must be in (0, 1] (1 disables it), got 0.0"),
      (dict(max_tokens=400), 400, "max_tokens", "allowed max_tokens 1 to 253"),
      (dict(max_tokens=0), 400, "max_tokens",
       "max_tokens=0 needs echo=true: it generates nothing, so the response would be empty (with "
       "echo=true it shows the prompt, and with logprobs scores it); allowed max_tokens 1 to 253, "
       "or 0 with echo=true"),
      (dict(max_tokens=-2), 400, "max_tokens", "allowed max_tokens 1 to 253, or 0 with echo"),
      (dict(prompt=list(range(1, 300))), 400, "prompt", "a prompt may have 1 to 255"),
      (dict(prompt=[5, 4096]), 400, "prompt", "allowed 0 to 4095"),
      (dict(prompt=[5, -1]), 400, "prompt", "prompt[1] = -1 is not a token id"),
      (dict(prompt=[[5], [6, 4096]]), 400, "prompt", "prompt[1][1] = 4096 is not a token id"),
      (dict(prompt=[5, True]), 400, "prompt", "prompt must be a string"),
      (dict(prompt=[5, 6.0]), 400, "prompt", "prompt must be a string"),
      (dict(prompt=[[5], [6, "a"]]), 400, "prompt", "prompt must be a string"),
      (dict(prompt=[[5], []]), 400, "prompt", "prompt[1] is empty"),
      (dict(prompt=""), 400, "prompt", "empty"),
      (dict(n=2), 400, "n", "allowed n=1"),
      (dict(model="gpt-4"), 404, "model", "does not exist"),
      (dict(max_tokens="many"), 400, "max_tokens", "valid integer"),
      (dict(temperature=True), 400, "temperature", "valid number"),
      (dict(prompt=3.5), 400, "prompt", "prompt must be a string"),
      (dict(stop=[""]), 400, "stop", "non-empty"),
      (dict(seed=-1), 400, "seed", "seed must be None or an int in [0, 2**32), got -1"),
      (dict(logprobs=21), 400, "logprobs", "logprobs must be None or an int in [0, 20], got 21"),
      (dict(logprobs=-1), 400, "logprobs", "logprobs must be None or an int in [0, 20], got -1"),
      (dict(prompt=[[5], list(range(1, 258))], echo=True, logprobs=0, max_tokens=0), 400,
       "prompt", "prompt[1] has 257 tokens; with echo=true and max_tokens=0 a prompt may have 1 "
       "to 256 tokens (the context)"),
      (dict(stream_options={"include_usage": True}), 400, "stream_options", "stream=true"),
      (dict(extra_body={"frobnicate": 1}), 400, "frobnicate", "unrecognized"),
  ]
  for change, status, param, words in cases:
    with pytest.raises(openai.APIStatusError) as error:
      client.completions.create(**{**ok, **change})
    assert (error.value.status_code, error.value.param) == (status, param), change
    assert words in error.value.message, (change, error.value.message)
    assert error.value.type == "invalid_request_error"
  for change, param, words in ((dict(top_logprobs=2), "top_logprobs", "needs logprobs=true"),
                               (dict(logprobs=False, top_logprobs=0), "top_logprobs",
                                "needs logprobs=true"),
                               (dict(logprobs=True, top_logprobs=21), "top_logprobs",
                                "top_logprobs must be None or an int in [0, 20], got 21")):
    with pytest.raises(openai.BadRequestError) as error:
      client.chat.completions.create(model=MODEL, messages=MESSAGES, **change)
    assert error.value.param == param and words in error.value.message, error.value.message
  with pytest.raises(openai.BadRequestError) as error:
    client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=500)
  assert error.value.param == "max_tokens" and "context holds 256" in error.value.message
  # Raw requests: a missing field, bad JSON, no body, an unknown path; never a 422.
  for path, body, param, words in (
      ("/v1/completions", dict(model=MODEL), "prompt", "missing required parameter"),
      ("/v1/completions", b'{"model": ', None, "not valid JSON"),
      ("/v1/completions", b"", None, "JSON"),
      ("/v1/completions", b"[1, 2]", None, "must be a JSON object"),
      ("/v1/chat/completions", dict(model=MODEL, messages=[]), "messages", "at least 1")):
    status, raw = _post(port, path, body)
    error = json.loads(raw)["error"]
    assert status == 400 and error["param"] == param and words in error["message"], raw
    assert set(error) == {"message", "type", "param", "code"}
  status, raw = _post(port, "/v1/nothing", {})
  assert status == 404 and "error" in json.loads(raw)


def test_32_concurrent_streams(engine, port):
  subjects = ["God", "the LORD", "Moses", "David", "the people", "Jesus", "the king", "Israel"]
  verbs = ["said", "went", "called", "saw"]
  prompts = [f"And {s} {v}" for s in subjects for v in verbs]
  expected = engine.generate(prompts, max_new_tokens=12)

  async def run():
    async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x",
                                  max_retries=0, timeout=TIMEOUT) as client:

      async def one(prompt):
        stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=12,
                                                 temperature=0, stream=True,
                                                 extra_body={"return_token_ids": True})
        text, ids = "", []
        async for chunk in stream:
          for choice in chunk.choices:
            text, ids = text + choice.text, ids + choice.token_ids
        return text, ids

      return await asyncio.wait_for(asyncio.gather(*(one(p) for p in prompts)), TIMEOUT)

  results = asyncio.run(run())
  assert [r[0] for r in results] == expected.texts
  assert [r[1] for r in results] == list(expected)
  _wait_idle(engine)


def test_a_client_that_disconnects_frees_its_slot(client, engine, port):
  """A client gone mid-stream, or while waiting for a whole completion, cancels its request:
  the slot frees long before its 240 tokens, and the server keeps serving."""
  before = _metrics(port)[("cg_jax_requests_cancelled_total", ())]
  for stream in (True, False):
    generated = _wait_idle(engine)["generated_tokens"]
    sock = _raw_post(port, "/v1/completions", {
        "model": MODEL, "prompt": PROMPTS[0], "max_tokens": 240, "temperature": 0,
        "ignore_eos": True, "stream": stream})
    if stream:
      _read_until(sock, b"data: ")
    else:
      deadline = time.monotonic() + TIMEOUT
      while engine.stats()["running"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    sock.shutdown(socket.SHUT_RDWR)
    sock.close()
    stats = _wait_idle(engine)
    assert stats["generated_tokens"] - generated < 240, stream
  assert _metrics(port)[("cg_jax_requests_cancelled_total", ())] == before + 2
  assert _get(port, "/health")[0] == 200
  assert client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=3).choices


def test_metrics_count_requests_and_tokens(client, engine, port):
  before = _metrics(port)
  reply = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=7, temperature=0,
                                    extra_body={"ignore_eos": True})
  with pytest.raises(openai.BadRequestError):
    client.completions.create(model=MODEL, prompt=PROMPTS[1], temperature=9)
  after = _metrics(port)

  def delta(name, **labels):
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0) - before.get(key, 0)

  assert delta("cg_jax_http_requests_total", endpoint="/v1/completions", status="200") == 1
  assert delta("cg_jax_http_requests_total", endpoint="/v1/completions", status="400") == 1
  assert delta("cg_jax_prompt_tokens_total") == reply.usage.prompt_tokens
  assert delta("cg_jax_generation_tokens_total") == 7
  assert delta("cg_jax_time_to_first_token_seconds_count") == 1
  assert delta("cg_jax_time_per_output_token_seconds_count") == 1
  assert after[("cg_jax_requests_running", ())] == 0
  assert after[("cg_jax_requests_waiting", ())] == 0
  assert after[("cg_jax_compiles_since_warmup", ())] == 0  # nothing compiled on the request path
  assert after[("cg_jax_steps_on_stand_ins", ())] == 0  # (the CPU builds no stand-ins)
  if "prefix_cache_hits" in engine.stats():
    assert ("cg_jax_prefix_cache_hits", ()) in after
  assert after[("cg_jax_kv_blocks", ())] == engine.stats()["kv_blocks"] > 0


# --------------------------------------------------------------------------------------------------
# Log-probabilities. These come after test_metrics_count_requests_and_tokens: `engine.logits`
# compiles (once: `_reference` pads every sequence to the context).

ATOL = 2e-4  # float32 engine against the float64 reference


def _reference(engine, ids) -> np.ndarray:
  """[len(ids), V] float64 log-softmax of `engine.logits` (cache-free, float32): row i is the
  distribution of token i + 1. The sequence is padded to the context, which a causal model's
  earlier positions do not see."""
  padded = np.zeros((1, OPTIONS["max_seq_len"]), np.int64)
  padded[0, :len(ids)] = ids
  logits = engine.logits(padded)[0, :len(ids)].astype(np.float64)
  shifted = logits - logits.max(axis=-1, keepdims=True)
  return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def _close(a, b) -> bool:
  """Equal, but floats within ATOL (two runs may batch differently, which changes the float32
  rounding)."""
  if isinstance(a, float) and isinstance(b, float):
    return abs(a - b) < ATOL
  if isinstance(a, dict) and isinstance(b, dict):
    return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
  if isinstance(a, list) and isinstance(b, list):
    return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
  return a == b


def _name(engine, token) -> str:
  return engine.tokenizer.decode([token], skip_special_tokens=False)


def _check_top(engine, row, got: dict, k: int, chosen: int):
  """`got` ({token string: logprob}) holds the k most likely tokens of `row` and the chosen one,
  with the reference's values (ties at the k-th within ATOL may swap)."""
  order = np.argsort(-row, kind="stable")
  expected = {_name(engine, t) for t in order[:k]} | {_name(engine, chosen)}
  by_name = {}
  for t in order[:k + 8]:
    by_name.setdefault(_name(engine, t), row[t])
  by_name.setdefault(_name(engine, chosen), row[chosen])
  if set(got) != expected:  # only a near-tie may differ
    kth = row[order[k - 1]] if k else np.inf
    assert all(abs(by_name[n] - kth) < ATOL for n in set(got) ^ expected if n in by_name), \
        (got, expected)
    assert len(got) == len(expected)
  for token_name, logprob in got.items():
    assert abs(logprob - by_name[token_name]) < ATOL, (token_name, logprob, by_name[token_name])


def _check_completion_logprobs(engine, logprobs, prompt_ids, generated, k, text, start=0):
  """A choice's generated tokens' logprobs (after `start` entries) against the reference."""
  ref = _reference(engine, list(prompt_ids) + list(generated))
  tokens = logprobs.tokens[start:]
  assert len(tokens) == len(logprobs.token_logprobs[start:]) == len(generated)
  assert len(logprobs.top_logprobs) == len(logprobs.text_offset) == len(logprobs.tokens)
  for i, token in enumerate(generated):
    row = ref[len(prompt_ids) - 1 + i]
    assert tokens[i] == _name(engine, token)
    assert abs(logprobs.token_logprobs[start + i] - row[token]) < ATOL
    _check_top(engine, row, logprobs.top_logprobs[start + i], k, token)
    offset = logprobs.text_offset[start + i] - logprobs.text_offset[start]
    assert offset == len(engine.tokenizer.decode(list(generated[:i]), skip_special_tokens=True))
    if token != 0:  # the text shows every token but EOS
      assert text[logprobs.text_offset[start + i]:].startswith(tokens[i])


def test_completion_logprobs_equal_the_reference(client, engine):
  """Greedy and sampled completions' logprobs are the model's (before temperature and top-k),
  with the top alternatives and the chosen token, offsets into the text; logprobs=0 gives the
  chosen token alone."""
  ids = engine.tokenizer.encode(PROMPTS[0]).ids
  for k, sampling in ((5, dict(temperature=0)), (3, dict(temperature=1.5, seed=3, top_k=8)),
                      (0, dict(temperature=0))):
    reply = client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=24, logprobs=k, seed=sampling.get("seed"),
        temperature=sampling["temperature"],
        extra_body={"return_token_ids": True, "top_k": sampling.get("top_k", 0)})
    (choice,) = reply.choices
    _check_completion_logprobs(engine, choice.logprobs, ids, choice.token_ids, k, choice.text)
    if k == 0:
      assert [list(t) for t in choice.logprobs.top_logprobs] == [[t] for t in
                                                                  choice.logprobs.tokens]
    if k == 3:  # sampled at temperature 1.5: some token is not the most likely
      assert any(len(top) == 4 for top in choice.logprobs.top_logprobs)
  # Several prompts, one EOS-ended: each choice its own logprobs (EOS named as its text).
  reply = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=40, temperature=0,
                                    logprobs=1, extra_body={"return_token_ids": True})
  for prompt, choice in zip(PROMPTS, reply.choices, strict=True):
    _check_completion_logprobs(engine, choice.logprobs, engine.tokenizer.encode(prompt).ids,
                               choice.token_ids, 1, choice.text)
    if choice.finish_reason == "stop" and choice.token_ids[-1] == 0:
      assert choice.logprobs.tokens[-1] == "<|endoftext|>"
      assert choice.logprobs.text_offset[-1] == len(choice.text)


def test_echo_scores_the_prompt(client, engine, port):
  """echo=true, max_tokens=0, logprobs=1 (how harnesses score text): the prompt's text and its
  tokens' logprobs, the first null; nothing compiles on the way (the app's warm-up has the
  "logprobs" phase: scoring and logprob decode steps). With a
  budget, the echoed prompt comes before the generated tokens' logprobs."""
  compiles = _metrics(port)[("cg_jax_compiles_since_warmup", ())]
  prompt = "And God said, Let there be light"
  ids = engine.tokenizer.encode(prompt).ids
  scored = client.completions.create(model=MODEL, prompt=prompt, echo=True, max_tokens=0,
                                     logprobs=1)
  by_ids = client.completions.create(model=MODEL, prompt=[ids, ids[:1]], echo=True, max_tokens=0,
                                     logprobs=1)
  echoed = client.completions.create(model=MODEL, prompt=prompt, echo=True, max_tokens=8,
                                     logprobs=2, temperature=0,
                                     extra_body={"return_token_ids": True})
  plain_echo = client.completions.create(model=MODEL, prompt=list(range(1, 60)), echo=True,
                                         max_tokens=2, temperature=0)  # no scoring: no limit
  assert _metrics(port)[("cg_jax_compiles_since_warmup", ())] == compiles
  (choice,) = scored.choices
  assert choice.text == prompt and choice.finish_reason == "length"
  assert scored.usage.completion_tokens == 0 and scored.usage.prompt_tokens == len(ids)
  lp = choice.logprobs
  assert lp.tokens == [_name(engine, t) for t in ids] and "".join(lp.tokens) == prompt
  assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
  assert lp.text_offset == [len(engine.tokenizer.decode(ids[:i])) for i in range(len(ids))]
  ref = _reference(engine, ids)
  for i in range(1, len(ids)):
    assert abs(lp.token_logprobs[i] - ref[i - 1, ids[i]]) < ATOL
    _check_top(engine, ref[i - 1], lp.top_logprobs[i], 1, ids[i])
  assert by_ids.choices[0].text == prompt
  assert _close(by_ids.choices[0].logprobs.model_dump(), lp.model_dump())
  assert by_ids.choices[1].logprobs.token_logprobs == [None]
  assert by_ids.choices[1].text == engine.tokenizer.decode(ids[:1])
  # With tokens to generate: the prompt's logprobs, then the generated ones.
  (choice,) = echoed.choices
  generated = choice.token_ids
  alone = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, logprobs=2,
                                    temperature=0).choices[0]
  assert choice.text == prompt + alone.text
  assert choice.logprobs.tokens[:len(ids)] == lp.tokens
  assert choice.logprobs.text_offset[:len(ids)] == lp.text_offset
  assert choice.logprobs.text_offset[len(ids):] == [len(prompt) + o
                                                    for o in alone.logprobs.text_offset]
  assert _close(choice.logprobs.token_logprobs[len(ids):], alone.logprobs.token_logprobs)
  _check_completion_logprobs(engine, choice.logprobs, ids, generated, 2, choice.text,
                             start=len(ids))
  for i in range(1, len(ids)):
    assert abs(choice.logprobs.token_logprobs[i] - ref[i - 1, ids[i]]) < ATOL
  assert plain_echo.choices[0].text.startswith(engine.tokenizer.decode(list(range(1, 60))))
  assert plain_echo.choices[0].logprobs is None


def test_chat_logprobs_equal_the_reference(client, engine):
  """Chat's logprobs: per token its string, logprob, UTF-8 bytes and top_logprobs (the k most
  likely); logprobs=true alone gives empty top_logprobs. Byte-level tokens' bytes are exact."""
  ids = engine.tokenizer.encode(RENDERED, add_special_tokens=False).ids
  reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12,
                                         temperature=0, logprobs=True, top_logprobs=3,
                                         extra_body={"return_token_ids": True})
  (choice,) = reply.choices
  generated = choice.model_extra["token_ids"]
  content = choice.logprobs.content
  assert len(content) == len(generated) == reply.usage.completion_tokens
  ref = _reference(engine, ids + generated)
  for i, (entry, token) in enumerate(zip(content, generated, strict=True)):
    row = ref[len(ids) - 1 + i]
    assert entry.token == _name(engine, token) and "\ufffd" not in entry.token  # ASCII text
    assert entry.bytes == list(entry.token.encode())
    assert abs(entry.logprob - row[token]) < ATOL
    assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].token == entry.token
    for alternative, t in zip(entry.top_logprobs, np.argsort(-row, kind="stable")[:3],
                              strict=True):
      assert abs(alternative.logprob - row[t]) < ATOL  # by rank: near-ties may swap tokens
      if "\ufffd" not in alternative.token:  # a whole character: its UTF-8 bytes
        assert alternative.bytes == list(alternative.token.encode())
    logprobs = [a.logprob for a in entry.top_logprobs]
    assert logprobs == sorted(logprobs, reverse=True)
  text = choice.message.content
  assert "".join(e.token for e in content if e.token != "<|endoftext|>") == text
  bare = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12,
                                        temperature=0, logprobs=True)
  assert [(e.token, e.top_logprobs) for e in bare.choices[0].logprobs.content] == \
      [(e.token, []) for e in content]
  assert _close([e.logprob for e in bare.choices[0].logprobs.content],
                [e.logprob for e in content])
  # "é" is two byte-level tokens, each one byte of its UTF-8 encoding, named U+FFFD.
  names = TokenText(engine.tokenizer)
  pieces = engine.tokenizer.encode("é", add_special_tokens=False).ids
  assert [names.bytes(t) for t in pieces] == [[0xC3], [0xA9]]
  assert [names.name(t) for t in pieces] == ["\ufffd", "\ufffd"]
  assert names.bytes(0) == list(b"<|endoftext|>") and names.name(0) == "<|endoftext|>"


def _joined(chunks, index=0):
  """The completions logprobs lists of a stream's chunks of one choice, joined."""
  lists = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
  for chunk in chunks:
    for choice in chunk.choices:
      if choice.index == index:
        for key, values in lists.items():
          values += getattr(choice.logprobs, key)
        assert len({len(getattr(choice.logprobs, key)) for key in lists}) == 1
  return lists


def test_streamed_logprobs_equal_the_non_streamed(client):
  """Each chunk carries its tokens' logprobs: joined, they equal the whole response's (with a
  stop string holding text back, with echo, with several prompts, and in chat)."""
  # Text ending " the" or "," waits for the next token (it may begin a stop string).
  for request in (dict(prompt=PROMPTS[1], max_tokens=30, logprobs=3, stop=[" theZ", ",Q", ":"]),
                  dict(prompt=PROMPTS[0], max_tokens=10, logprobs=2, echo=True),
                  dict(prompt=PROMPTS[2], max_tokens=0, logprobs=1, echo=True),
                  dict(prompt=PROMPTS, max_tokens=6, logprobs=0)):
    whole = client.completions.create(model=MODEL, temperature=0, **request)
    chunks = list(client.completions.create(model=MODEL, temperature=0, stream=True, **request))
    for choice in whole.choices:
      joined = _joined(chunks, choice.index)
      assert joined["tokens"] and joined["tokens"] == choice.logprobs.tokens
      assert joined["text_offset"] == choice.logprobs.text_offset
      assert _close(joined["token_logprobs"], choice.logprobs.token_logprobs)
      assert _close(joined["top_logprobs"], choice.logprobs.top_logprobs)
      assert "".join(c.choices[0].text for c in chunks if c.choices[0].index == choice.index) \
          == choice.text
    if request.get("echo"):
      assert chunks[0].choices[0].text == request["prompt"]
  whole = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=15,
                                         temperature=0, logprobs=True, top_logprobs=2)
  chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=15,
                                               temperature=0, logprobs=True, top_logprobs=2,
                                               stream=True))
  assert chunks[0].choices[0].logprobs is None  # the role chunk
  streamed = [e.model_dump() for c in chunks[1:] for e in c.choices[0].logprobs.content]
  assert streamed and _close(streamed, [e.model_dump() for e in whole.choices[0].logprobs.content])


def _end(process, reader) -> None:
  """Kill the server process if it still runs, and join the thread that reads its log."""
  if process.poll() is None:
    process.kill()
    process.wait()
  reader.join(timeout=30)


def test_sigterm_drains_and_exits():
  """`python -m cg_jax serve`: a stream in flight at SIGTERM completes, then the process exits 0
  (engine closed by the app's shutdown)."""
  command = [sys.executable, "-m", "cg_jax", "serve", "--model", "tiny-llama", "--max-seq-len",
             "64", "--batch-buckets", "1", "--prompt-buckets", "16", "--port", "0",
             "--graceful-timeout", "30"]
  env = dict(os.environ, JAX_PLATFORMS="cpu", CG_JAX_COMPILATION_CACHE="off")
  process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
  lines, ports = [], queue.Queue()

  def read():
    for line in process.stdout:
      lines.append(line)
      if found := re.search(r"running on http://127\.0\.0\.1:(\d+)", line):
        ports.put(int(found[1]))

  reader = threading.Thread(target=read)
  reader.start()
  try:
    port = ports.get(timeout=180)
    _wait_health(port, 200, timeout=300)
    status, metrics = _get(port, "/metrics")  # warmed up: the gauge exists, at 0
    assert status == 200 and b"\ncg_jax_compiles_since_warmup 0.0\n" in metrics
    sock = _raw_post(port, "/v1/completions", {
        "model": "tiny-llama", "prompt": [1, 2, 3], "max_tokens": 60, "temperature": 0,
        "ignore_eos": True, "stream": True, "return_token_ids": True})
    with sock:
      first = _read_until(sock, b"data: ")
      process.send_signal(signal.SIGTERM)
      events = _events((first + _read_all(sock)).partition(b"\r\n\r\n")[2])
    assert events[-1] == b"[DONE]"
    assert sum(len(e["choices"][0]["token_ids"]) for e in events[:-1]) == 60
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert process.wait(timeout=60) == 0, "".join(lines)
  finally:
    _end(process, reader)
  assert "Traceback" not in "".join(lines), "".join(lines)
  with pytest.raises(OSError):
    socket.create_connection(("127.0.0.1", port), timeout=5).close()


def test_the_runtime_and_cli_work_without_the_serve_extra():
  """Without fastapi: `import cg_jax` and the CLI import; `serve` says what to install."""
  code = ("import sys; sys.modules['fastapi'] = None\n"
          "from cg_jax import Engine, cli\n"
          "assert cli.server is None\n"
          "sys.exit(cli.main(['serve']))")
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=120, check=False)
  assert out.returncode == 2, out.stderr
  assert "pip install 'cg_jax[serve]'" in out.stderr


# --------------------------------------------------------------------------------------------------
# Start-up: the port first, warm-up while listening


def _warmup_threads():
  return [t for t in threading.enumerate() if t.name == "cg_jax-warmup"]


def test_listen_binds_first_and_names_a_busy_port(engine):
  """`listen` binds and listens (port 0: a free port); a busy port is a `ListenError` naming
  the port and the address, raised by `serve` before the app starts (its warm-up never runs)."""
  with server.listen("127.0.0.1", 0) as sock:
    port = sock.getsockname()[1]
    assert port > 0
    socket.create_connection(("127.0.0.1", port), timeout=5).close()  # listening already
    with pytest.raises(server.ListenError) as error:
      server.listen("127.0.0.1", port)
    assert error.value.param == "port"
    assert str(error.value).startswith(f"address 127.0.0.1:{port} is in use")
    app = server.create_app(engine, MODEL, close_engine=False)
    started = time.monotonic()
    with pytest.raises(server.ListenError, match=f"address 127.0.0.1:{port} is in use"):
      server.serve(app, port=port)
    assert time.monotonic() - started < 5
    assert app.state.service.warmup.state == "warming up" and not _warmup_threads()
  for port in (70000, -1, "8000"):
    with pytest.raises(server.ListenError) as error:
      server.listen("127.0.0.1", port)
    assert error.value.param == "port"
    assert str(error.value) == f"port must be 0 to 65535 (0: any free port), got {port!r}"
  with pytest.raises(server.ListenError, match="neither an address nor a known host") as error:
    server.listen("no-such-host.invalid", 0)
  assert error.value.param == "host"
  with server.listen("127.0.0.1", port=0) as sock:  # after the errors, listening still works
    assert sock.getsockname()[1] > 0


def test_health_and_the_api_answer_503_while_warming_up(engine):
  """While the warm-up runs (held here), the server answers: /health 503 with the progress,
  completions and chat a 503 in OpenAI's format (code "warming_up"), /v1/models 200; once it is
  done, /health is 200 and completions equal `engine.generate`. No thread is left behind."""
  before = set(threading.enumerate())
  total = len(engine.executable_keys(phases=server.WARMUP_PHASES))
  gate, calls = threading.Event(), []

  def held(**options):
    calls.append(options)
    options["on_progress"](3, total)
    assert gate.wait(60), "the test did not release the warm-up"
    options["on_progress"](total, total)
    return {}

  app = server.create_app(engine, MODEL, close_engine=False)
  warm = app.state.service.warmup
  behind = []  # the later phases, built once ready
  warm.engine = type("Held", (), {
      "warmup": staticmethod(held), "executable_keys": staticmethod(_nine),
      "warmup_behind": staticmethod(lambda phases, stopping: behind.append(phases))})()
  client = None
  with _serving(app, ready=False) as port:
    try:
      deadline = time.monotonic() + 30
      while not calls:
        assert time.monotonic() < deadline, "the warm-up did not start"
        time.sleep(0.01)
      assert calls == [dict(phases=server.WARMUP_PHASES, progress=False,
                            on_progress=calls[0]["on_progress"])]
      status, body = _get(port, "/health")
      health = json.loads(body)
      assert status == 503 and health.pop("elapsed_s") >= 0
      assert health == {"status": "warming up", "executables_done": 3, "executables_total": total}
      client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0,
                             timeout=TIMEOUT)
      for call in (lambda: client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4),
                   lambda: client.chat.completions.create(model=MODEL, messages=MESSAGES)):
        with pytest.raises(openai.InternalServerError) as error:
          call()
        assert error.value.status_code == 503 and error.value.code == "warming_up"
        assert error.value.type == "server_error" and error.value.param is None
        assert f"warming up (3 of {total} executables ready after" in error.value.message
        assert "retry once GET /health answers 200" in error.value.message
      status, raw = _post(port, "/v1/completions", dict(model=MODEL, prompt=[1, 2], max_tokens=2))
      assert status == 503 and set(json.loads(raw)["error"]) == {"message", "type", "param", "code"}
      assert [m.id for m in client.models.list().data] == [MODEL]
      gate.set()
      assert _wait_health(port, 200, timeout=30) == {"status": "ok"}
      assert warm.state == "ready" and warm.done == total
      warm._thread.join(30)
      assert behind == [server.LATER_PHASES] == [("logprobs",)]
      reply = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8,
                                        temperature=0)
      assert reply.choices[0].text == engine.generate([PROMPTS[0]], max_new_tokens=8).texts[0]
    finally:
      gate.set()
      if client is not None:
        client.close()
  assert not _warmup_threads()
  before |= set(_engine_threads())  # the module's engine (open: the app does not close it)
  deadline = time.monotonic() + 10
  while set(threading.enumerate()) - before and time.monotonic() < deadline:
    time.sleep(0.05)
  assert not set(threading.enumerate()) - before


def _nine(*_, **__):
  return [None] * 9


def test_a_failed_warmup_keeps_health_failing_and_stops_serve(engine):
  """A warm-up that fails: /health stays 500 with the reason, the API answers 503
  ("warmup_failed"); `serve` stops by itself and raises `WarmupFailed`, and `python -m cg_jax
  serve` exits 1 with the reason in its log and its last line."""

  def failing(**options):
    options["on_progress"](2, 9)
    raise RuntimeError("out of device memory")

  app = server.create_app(engine, MODEL, close_engine=False)
  app.state.service.warmup.engine = type("Failing", (), {"warmup": staticmethod(failing),
                                                           "executable_keys": staticmethod(_nine)})()
  with _serving(app, ready=False) as port:
    failed = {"status": "warm-up failed", "error": "RuntimeError: out of device memory"}
    assert _wait_health(port, 500, timeout=30) == failed
    status, raw = _post(port, "/v1/completions", dict(model=MODEL, prompt=[1, 2], max_tokens=2))
    assert status == 503 and json.loads(raw)["error"] == {
        "message": "the server cannot serve: its warm-up failed (RuntimeError: out of device "
                   "memory)", "type": "server_error", "param": None, "code": "warmup_failed"}
    time.sleep(0.3)
    assert _get(port, "/health") == (500, json.dumps(failed, separators=(",", ":")).encode())
  assert not _warmup_threads()

  app = server.create_app(engine, MODEL, close_engine=False)
  app.state.service.warmup.engine = type("Failing", (), {"warmup": staticmethod(failing),
                                                           "executable_keys": staticmethod(_nine)})()
  outcome = []

  def run():
    try:
      server.serve(app, port=0, log_level="critical")
    except Exception as error:  # noqa: BLE001 - checked below
      outcome.append(error)

  thread = threading.Thread(target=run)
  thread.start()
  thread.join(timeout=60)
  assert not thread.is_alive(), "serve did not stop after the failed warm-up"
  assert len(outcome) == 1 and isinstance(outcome[0], server.WarmupFailed), outcome
  assert str(outcome[0]) == "the engine's warm-up failed: RuntimeError: out of device memory"
  assert not _warmup_threads()

  # `python -m cg_jax serve`: an engine core whose start-up fails (a model too large for the
  # memory: the engine's own check) stops the server; the exit status is 1.
  command = [sys.executable, "-m", "cg_jax", "serve", "--model", "llama-3.1-8b", "--port", "0",
             "--max-seq-len", "64", "--batch-buckets", "1", "--prompt-buckets", "16"]
  env = dict(os.environ, JAX_PLATFORMS="cpu", CG_JAX_COMPILATION_CACHE="off")
  done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert done.returncode == 1, done.stderr
  assert "warm-up failed after 0 of 0 executables" in done.stderr, done.stderr
  assert "of device memory" in done.stderr.splitlines()[-1], done.stderr
  assert not _warmup_threads()


# The CLI with a progress line in the log every 0.2 s (its warm-up in the engine-core process
# takes seconds on the CPU: SIGTERM comes while it runs).
HELD_WARMUP = """
import sys
from cg_jax import cli
from cg_jax.serving import service
service.PROGRESS_EVERY = 0.2
sys.exit(cli.main(sys.argv[1:]))
"""


def test_sigterm_during_the_warmup_exits_cleanly():
  """`python -m cg_jax serve` listens while it warms up: the log says where at once, then the
  warm-up's progress in plain lines (no progress bar); /health is 503 meanwhile. SIGTERM then
  stops the warm-up (the compiles in flight finish) and the process exits 0."""
  command = [sys.executable, "-c", HELD_WARMUP, "serve", "--model", "tiny-llama",
             "--max-seq-len", "128", "--batch-buckets", "1,2,4,8,16",
             "--prompt-buckets", "16,32,64", "--port", "0"]
  env = dict(os.environ, JAX_PLATFORMS="cpu", CG_JAX_COMPILATION_CACHE="off")
  process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
  lines, ports, progress = [], queue.Queue(), threading.Event()

  def read():
    for line in process.stdout:
      lines.append(line)
      if found := re.search(r"running on http://127\.0\.0\.1:(\d+)", line):
        ports.put(int(found[1]))
      if re.search(r"warming up: \d+ of \d+ executables ready, \d+ s$", line):
        progress.set()

  reader = threading.Thread(target=read)
  reader.start()
  try:
    port = ports.get(timeout=180)
    status, body = _get(port, "/health")
    assert status == 503 and json.loads(body)["status"] == "warming up", body
    assert progress.wait(30), "".join(lines)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=120) == 0, "".join(lines)
  finally:
    _end(process, reader)
  log = "".join(lines)
  total = int(re.search(r"warming up: (\d+) executables to load or compile", log)[1])
  assert total > 5 and f"of {total} executables ready" in log
  assert re.search(rf"warm-up stopped after \d+ of {total} executables", log), log
  assert "warmed up" not in log and "Traceback" not in log, log
  assert "compiling:" not in log and "\r" not in log, log
  with pytest.raises(OSError):
    socket.create_connection(("127.0.0.1", port), timeout=5).close()


class _Paced:
  """A handle in lock step with the engine thread: the engine delivers a step's tokens, then
  waits until the server has polled them (as a larger model's steps would give it time to),
  so that no step's delta coalesces with the next one however loaded the machine is."""

  def __init__(self, handle, polled: threading.Semaphore):
    self.handle, self.polled = handle, polled

  def __getattr__(self, name):
    return getattr(self.handle, name)

  def poll(self):
    deltas, ended = self.handle.poll()
    for _ in deltas:
      self.polled.release()
    return deltas, ended


def test_a_model_without_a_tokenizer_streams_every_step(monkeypatch):
  """No tokenizer, no text: the stream still sends a chunk per step (empty text; the ids
  with return_token_ids), not one chunk at the end."""
  engine = Engine.from_pretrained("tiny-llama", max_seq_len=64, batch_buckets=(1,),
                                  prompt_buckets=(16,))
  engine.warmup(progress=False)
  expected = engine.generate([[5, 6, 7]], max_new_tokens=24, eos_token_id=[])[0]
  polled = threading.Semaphore(0)
  submit, deliver = engine.submit_validated, engine._scheduler._deliver

  def deliver_then_wait(new):
    deliver(new)
    assert polled.acquire(timeout=TIMEOUT)  # (the engine thread fails the request otherwise)

  monkeypatch.setattr(engine._scheduler, "_deliver", deliver_then_wait)
  monkeypatch.setattr(engine, "submit_validated",
                      lambda *args, **kwargs: _Paced(submit(*args, **kwargs), polled))
  app = server.create_app(engine, "tiny-llama", warmup=False)
  with _serving(app) as port:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                           timeout=TIMEOUT)
    for token_ids in (False, True):
      chunks = list(client.completions.create(
          model="tiny-llama", prompt=[5, 6, 7], max_tokens=24, temperature=0, stream=True,
          extra_body={"return_token_ids": token_ids, "ignore_eos": True}))
      *steps, last = chunks
      assert last.choices[0].finish_reason == "length"
      assert len(steps) == 24 and all(c.choices[0].text == "" for c in chunks), chunks
      if token_ids:
        assert [t for c in steps for t in c.choices[0].token_ids] == expected


def test_warmup_shows_a_bar_only_for_what_it_compiles(capsys):
  """engine.warmup's bar counts the executables it compiles (none: no bar); `on_progress`
  counts every key, and an exception from it stops the warm-up."""
  engine = Engine.from_pretrained("tiny-llama", max_seq_len=32, batch_buckets=(1,),
                                  prompt_buckets=(16,))
  engine.warmup(phases=("first",), progress=True)
  err = capsys.readouterr().err
  assert "compiling: 100%" in err and "| 3/3 [" in err, err  # the cache and two first-token picks
  seen = []
  engine.warmup(phases=("first",), progress=True, on_progress=lambda *c: seen.append(c))
  assert capsys.readouterr().err == "" and seen == [(3, 3)]
  seen.clear()
  engine.warmup(phases=("first", "prefill"), progress=True, on_progress=lambda *c: seen.append(c))
  err = capsys.readouterr().err
  assert "| 1/1 [" in err and "compiling: 0exe" not in err, err  # (the empty bar's format)
  assert seen == [(3, 4), (4, 4)]

  class Enough(Exception):
    pass

  def stop_after_a_compile(done, total):
    if done > 4:
      raise Enough

  keys = engine.executable_keys(phases=server.WARMUP_PHASES)
  with pytest.raises(Enough):
    engine.warmup(phases=server.WARMUP_PHASES, progress=False, workers=1,
                  on_progress=stop_after_a_compile)
  assert 5 <= sum(key in engine.executables.compiled for key in keys) < len(keys)
  assert not [t for t in threading.enumerate() if t.name.startswith("cg_jax-compile")]
  engine.close()


# --------------------------------------------------------------------------------------------------
# Scoring edges (lm-eval's local-completions)


def test_echo_with_max_tokens_0_takes_a_prompt_of_the_whole_context(client, engine, port):
  """echo=true with max_tokens=0 generates nothing, so a prompt may fill the context
  (max_seq_len tokens), scored (logprobs) or not; max_tokens=0 without echo is a 400 naming
  max_tokens and echo."""
  context = OPTIONS["max_seq_len"]
  full = [(7 * i) % 4000 + 1 for i in range(context)]
  reply = client.completions.create(model=MODEL, prompt=full, echo=True, max_tokens=0)
  (choice,) = reply.choices
  assert choice.text == engine.tokenizer.decode(full) and choice.finish_reason == "length"
  assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (context, 0)
  cases = [
      (dict(prompt=full + [5], echo=True, max_tokens=0), "prompt", "context_length_exceeded",
       f"the prompt has {context + 1} tokens; with echo=true and max_tokens=0 a prompt may have 1 "
       f"to {context} tokens (the context)"),
      (dict(prompt=full, max_tokens=1), "prompt", "context_length_exceeded",
       f"the prompt has {context} tokens; the context holds {context} tokens (prompt + "
       f"completion), so a prompt may have 1 to {context - 1}, or {context} with echo=true and "
       "max_tokens=0"),
      (dict(prompt=[1, 2, 3], max_tokens=0), "max_tokens", None,
       f"max_tokens=0 needs echo=true: it generates nothing, so the response would be empty "
       f"(with echo=true it shows the prompt, and with logprobs scores it); allowed max_tokens 1 "
       f"to {context - 3}, or 0 with echo=true"),
      (dict(prompt=full, max_tokens=0, echo=False), "max_tokens", None,
       "max_tokens=0 needs echo=true: it generates nothing, so the response would be empty "
       "(with echo=true it shows the prompt, and with logprobs scores it); allowed max_tokens "
       ">= 1, or 0 with echo=true"),
  ]
  for change, param, code, message in cases:
    status, raw = _post(port, "/v1/completions", dict(model=MODEL, **change))
    assert status == 400, raw
    assert json.loads(raw) == {"error": {"message": message, "type": "invalid_request_error",
                                         "param": param, "code": code}}
  # After the errors, a full-context prompt is still echoed, and scored: each token's logprob
  # is the cacheless float32 forward's log-softmax at the position before it.
  again = client.completions.create(model=MODEL, prompt=full, echo=True, max_tokens=0)
  assert again.choices[0].text == choice.text
  scored = client.completions.create(model=MODEL, prompt=full, echo=True, max_tokens=0,
                                     logprobs=1)
  token_logprobs = scored.choices[0].logprobs.token_logprobs
  assert len(token_logprobs) == context and token_logprobs[0] is None
  # [S - 1, V]: the logits that predict tokens 1..S-1
  logits = np.asarray(engine.logits([full])[0], np.float64)[:-1]
  shifted = logits - logits.max(-1, keepdims=True)
  log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
  expected = log_probs[np.arange(context - 1), full[1:]]
  np.testing.assert_allclose(token_logprobs[1:], expected, rtol=0, atol=2e-4)
