"""`bench serve` (cg_jax.bench.serve) against this project's server, live on 127.0.0.1 with the
bundled model on the CPU: all requests at once and Poisson arrivals with a concurrency cap give
positive figures, every request's `ignore_eos` output counted in full (from the streamed token
ids and the usage chunk alike), TTFT <= end-to-end, no errors, the cap and the arrival times
kept, also from two client processes sharing the cap; the prompts are seeded; a wrong model name
fails every request, reported with the server's 404 and message; bad options name their flag;
`python -m cg_jax bench serve` writes and prints the row, or `error: ...`; the server stops with
no thread left."""

import argparse
import math
import socket
import threading
import time

import pytest
import tqdm

from cg_jax import Engine, cli
from cg_jax import serving as server
from cg_jax.bench import rows, serve
from tests import live_server

MODEL = "kjv-serve-bench"
NUM_REQUESTS, OUTPUT_LEN = 8, 12
WORKLOAD = ["--num-requests", str(NUM_REQUESTS), "--prompt-len", "8:24", "--output-len",
            str(OUTPUT_LEN), "--request-timeout", "60", "--clients", "1"]


def _args(port: int | None, *extra: str) -> argparse.Namespace:
  """`bench serve`'s options as the CLI parses them (its common options at their defaults)."""
  parser = argparse.ArgumentParser()
  serve.add_arguments(parser)
  parser.add_argument("--system", default="cg_jax")
  parser.add_argument("--output", default=None)
  parser.add_argument("--compare", nargs="*", default=None)
  url = [] if port is None else ["--base-url", f"http://127.0.0.1:{port}/v1"]
  return parser.parse_args([*url, "--model", MODEL, *WORKLOAD, *extra])


@pytest.fixture(scope="module")
def port():
  """A server in a thread, its engine warmed up beforehand for the serving executables only
  (batch buckets 2 and 8: a few compiles on a 2-core machine); its app closes the engine at
  shutdown. Teardown checks that it stopped and left no thread behind (tqdm's monitor thread
  is switched off: the progress bars would start it once per process)."""
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(tqdm.tqdm, "monitor_interval", 0)
    before = set(threading.enumerate())
    engine = Engine.from_pretrained("kjv-llama-6m", max_seq_len=128, batch_buckets=(2, 8),
                                    prompt_buckets=(32,))
    engine.warmup(progress=False)
    with live_server.serving(server.create_app(engine, MODEL, warmup=False)) as port:
      yield port
    deadline = time.monotonic() + 10
    while set(threading.enumerate()) - before and time.monotonic() < deadline:
      time.sleep(0.05)
    assert not set(threading.enumerate()) - before


def _check(args, measured):
  """The row of a clean run: positive figures, every token counted, TTFT <= e2e; its row."""
  records = measured.records
  assert len(records) == NUM_REQUESTS
  for record in records:
    assert record.error is None
    assert record.usage_tokens == OUTPUT_LEN  # the usage chunk
    assert sum(n for _, n in record.chunks) == OUTPUT_LEN  # the streamed token ids
    assert record.sent <= record.chunks[0][0] <= record.chunks[-1][0] <= record.finished
  row = serve.row(args, measured)
  figures = row.figures
  assert figures["errors"] == 0
  for name in ("tokens_per_s", "requests_per_s", "wall_s", "ttft_ms_p50", "ttft_ms_p90",
               "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_p90", "tpot_ms_p99", "itl_ms_p50",
               "itl_ms_p90", "itl_ms_p99", "e2e_ms_p50", "e2e_ms_p99"):
    assert figures[name] > 0 and math.isfinite(figures[name]), name
  assert figures["output_tokens"] == NUM_REQUESTS * OUTPUT_LEN
  assert figures["tokens_per_s"] * figures["wall_s"] == pytest.approx(NUM_REQUESTS * OUTPUT_LEN)
  assert figures["requests_per_s"] * figures["wall_s"] == pytest.approx(NUM_REQUESTS)
  assert figures["ttft_ms_p50"] <= figures["e2e_ms_p50"]
  assert figures["ttft_ms_p99"] <= figures["e2e_ms_p99"]
  assert figures["ttft_ms_p50"] <= figures["ttft_ms_p90"] <= figures["ttft_ms_p99"]
  # The server's own figures of the measured requests: its first token comes inside the
  # client's wait for it.
  assert 0 < figures["server_ttft_ms_mean"] <= figures["ttft_ms_mean"]
  assert 0 < figures["server_tpot_ms_mean"] < figures["e2e_ms_p99"]
  assert (row.system, row.model) == ("cg_jax", MODEL)
  assert row.jax and row.commit and row.date
  return row


def test_all_at_once(port):
  args = _args(port)
  row = _check(args, serve.measure(args))
  assert row.device == "remote"
  assert row.workload == {"kind": "serve", "num_requests": NUM_REQUESTS, "prompt_len": "8:24",
                          "output_len": OUTPUT_LEN, "rate": "inf", "max_concurrency": None,
                          "clients": 1, "base_url": "127.0.0.1"}
  assert row.to_json()  # JSON-serialisable, the rate included


def test_poisson_arrivals_with_a_concurrency_cap(port):
  args = _args(port, "--rate", "50", "--max-concurrency", "2", "--device", "cpu")
  measured = serve.measure(args)
  row = _check(args, measured)
  assert row.workload["rate"] == 50.0 and row.workload["max_concurrency"] == 2
  assert row.device == "cpu"
  work = serve.workload(NUM_REQUESTS, (8, 24), 50.0, 1000, 0)
  events = []
  for record, arrival in zip(measured.records, work.arrivals, strict=True):
    assert record.sent >= measured.start + arrival  # not before its arrival
    events += [(record.sent, 1), (record.finished, -1)]
  in_flight = 0
  for _, step in sorted(events, key=lambda e: (e[0], e[1])):  # (a finish before a send at a tie)
    in_flight += step
    assert in_flight <= 2


def test_client_processes_share_the_requests_and_the_cap(port):
  """Two client processes: every request is recorded once, none before its arrival; the cap of 3
  is split 2 + 1, so at most 3 are in flight; the row names its clients."""
  args = _args(port, "--clients", "2", "--rate", "40", "--max-concurrency", "3")
  measured = serve.measure(args)
  row = _check(args, measured)
  assert measured.clients == 2 and row.workload["clients"] == 2
  work = serve.workload(NUM_REQUESTS, (8, 24), 40.0, 1000, 0)
  events = []
  for record, arrival in zip(measured.records, work.arrivals, strict=True):
    assert record.sent >= measured.start + arrival
    events += [(record.sent, 1), (record.finished, -1)]
  in_flight = 0
  for _, step in sorted(events, key=lambda e: (e[0], e[1])):
    in_flight += step
    assert in_flight <= 3
  assert serve._caps(3, 2) == [2, 1] and serve._caps(None, 3) == [None] * 3
  # More clients than requests (or than the cap) run as many as there are.
  assert serve.measure(_args(port, "--clients", "4", "--num-requests", "2")).clients == 2


def test_run_returns_the_row(port):
  (row,) = serve.run(_args(port, "--num-requests", "2", "--output-len", "3"))
  assert row.figures["errors"] == 0 and row.figures["output_tokens"] == 6


def test_wrong_model_fails_every_request(port):
  args = _args(port)
  args.model = "no-such-model"
  with pytest.raises(serve.AllFailed, match=r"all 8 requests .* failed; the first: HTTP 404: "
                                            r"the model 'no-such-model' does not exist"):
    serve.run(args)


def test_server_histograms_add_up_label_sets_and_skip_the_rest():
  text = "\n".join([
      "# HELP vllm:time_to_first_token_seconds Histogram of time to first token",
      'vllm:time_to_first_token_seconds_bucket{le="0.1",model_name="m"} 3.0',
      'vllm:time_to_first_token_seconds_sum{model_name="m"} 0.25',
      'vllm:time_to_first_token_seconds_count{model_name="m"} 3.0',
      'vllm:time_to_first_token_seconds_sum{model_name="n"} 0.75',
      'vllm:time_to_first_token_seconds_count{model_name="n"} 1.0',
      "cg_jax_time_per_output_token_seconds_sum 0.5",
      "cg_jax_time_per_output_token_seconds_count 100.0",
      "cg_jax_request_duration_seconds_sum 9.0"])
  after = serve.histogram_totals(text)
  assert after == {"time_to_first_token_seconds": (1.0, 4.0),
                   "time_per_output_token_seconds": (0.5, 100.0)}
  before = {"time_to_first_token_seconds": (0.5, 2.0)}
  assert serve.server_figures(before, after) == {"server_ttft_ms_mean": 250.0}
  assert serve.server_histograms("http://127.0.0.1:9/v1") == {}  # nothing listens there


def test_seeded_workload():
  work = serve.workload(16, (8, 24), 10.0, 50, 3)
  assert work == serve.workload(16, (8, 24), 10.0, 50, 3)
  assert work != serve.workload(16, (8, 24), 10.0, 50, 4)
  assert work.prompts == serve.workload(16, (8, 24), math.inf, 50, 3).prompts
  assert all(8 <= len(p) <= 24 and all(1 <= t < 50 for t in p) for p in work.prompts)
  assert work.arrivals[0] == 0 and work.arrivals == sorted(work.arrivals)
  assert serve.workload(4, (5, 5), math.inf, 50, 0).arrivals == [0.0] * 4
  assert {len(p) for p in serve.workload(4, (5, 5), math.inf, 50, 0).prompts} == {5}


@pytest.mark.parametrize("flag, value, match", [
    ("--prompt-len", "9:3", "--prompt-len"), ("--prompt-len", "a", "--prompt-len"),
    ("--rate", "0", "--rate"), ("--rate", "fast", "--rate"),
    ("--num-requests", "0", "--num-requests"), ("--output-len", "-1", "--output-len"),
    ("--max-concurrency", "0", "--max-concurrency"), ("--vocab-size", "1", "--vocab-size"),
    ("--clients", "0", "--clients")])
def test_bad_options_name_their_flag(flag, value, match):
  with pytest.raises(ValueError, match=match):
    serve.measure(_args(None, flag, value))


def test_cli_writes_and_prints_the_row(port, tmp_path, capsys):
  out = tmp_path / "rows.jsonl"
  argv = ["bench", "serve", "--base-url", f"http://127.0.0.1:{port}/v1", "--model", MODEL,
          "--num-requests", "2", "--prompt-len", "5", "--output-len", "4", "--max-concurrency",
          "1", "--system", "mine", "--output", str(out)]
  assert cli.main(argv) == 0
  (row,) = rows.read([str(out)])
  assert row.system == "mine" and row.figures["output_tokens"] == 8
  assert row.workload["prompt_len"] == "5" and row.workload["max_concurrency"] == 1
  table = capsys.readouterr().out
  assert "| mine | " + MODEL in table and "ttft_ms_p50" in table


def test_cli_reports_failed_requests(port, capsys):
  argv = ["bench", "serve", "--base-url", f"http://127.0.0.1:{port}/v1", "--model", "nope",
          "--num-requests", "3", "--prompt-len", "5", "--output-len", "4"]
  assert cli.main(argv) == 2
  err = capsys.readouterr().err
  assert "error: bench serve: all 3 requests" in err and "HTTP 404: the model 'nope'" in err


def test_a_refused_connection_is_an_error(capsys):
  with socket.socket() as sock:  # a port nothing listens on
    sock.bind(("127.0.0.1", 0))
    free = sock.getsockname()[1]
  with pytest.raises(serve.AllFailed, match="all 8 requests .* failed; the first: "
                                            "APIConnectionError"):
    serve.run(_args(free))


def test_some_failed_requests_are_counted_and_shown(capsys):
  ok = serve.Record(sent=1.0, chunks=[(1.5, 1), (1.75, 2)], finished=2.0, usage_tokens=3)
  failed = [serve.Record(sent=1.0, finished=1.1, error=f"HTTP 500: boom {i}") for i in range(4)]
  row = serve.row(_args(None), serve.Measurement((8, 24), math.inf, [ok, *failed], 1.0))
  assert row.figures["errors"] == 4 and row.figures["output_tokens"] == 3
  assert row.figures["wall_s"] == 1.0 and row.figures["tokens_per_s"] == 3.0
  assert row.figures["ttft_ms_p50"] == 500.0 and row.figures["tpot_ms_p50"] == 125.0
  assert row.figures["itl_ms_p50"] == 250.0 and row.figures["e2e_ms_p99"] == 1000.0
  err = capsys.readouterr().err
  assert "4 of 5 requests failed" in err and "boom 2" in err and "boom 3" not in err
  assert "1 requests got fewer than --output-len 12 tokens" in err
