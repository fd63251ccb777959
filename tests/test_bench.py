"""`python -m cg_jax bench`: each subcommand through `cli.main` on the tiny-llama preset with tiny
workloads; the rows it appends to --output (schema, workload, sane figures), the table it
prints, --compare's earlier rows beside this run's, and bad arguments (exit 2 naming the
flag)."""

import argparse
import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from cg_jax import cli
from cg_jax.engine import Engine
from cg_jax.bench import latency, options, rows
from models.config import PRESETS

MODEL = "tiny-llama"
ENGINE = ["--model", MODEL, "--max-seq-len", "32"]
TINY_START = [*ENGINE, "--batch-buckets", "1", "--prompt-buckets", "16"]  # one bucket each


def _bench(capsys, *argv) -> tuple[int, str, str]:
  code = cli.main(["bench", *argv])
  out, err = capsys.readouterr()
  return code, out, err


def _check_schema(row: rows.Row, kind: str) -> None:
  assert row.schema == rows.SCHEMA and row.system == "cg_jax" and row.model == MODEL
  assert row.workload["kind"] == kind
  assert row.device and row.jax and row.commit and row.date
  assert all(isinstance(v, float) for v in row.figures.values())


def _table_line(out: str, row: rows.Row) -> str:
  """The printed table's line of `row` (its workload as the table writes it: in key order)."""
  workload = ", ".join(f"{k}={v}" for k, v in sorted(row.workload.items()))
  lines = [line for line in out.splitlines()
           if line.startswith(f"| {row.system} | {row.model} | {workload} |")]
  assert len(lines) == 1, out
  return lines[0]


def test_latency_rows_and_table(capsys, tmp_path):
  output = tmp_path / "latency.jsonl"
  code, out, _ = _bench(capsys, "latency", *ENGINE, "--batch", "1,2", "--prompt-len", "12",
                        "--output-len", "8", "--repeats", "3", "--output", str(output))
  assert code == 0
  found = rows.read([str(output)])
  assert [r.workload["batch"] for r in found] == [1, 2]
  for row in found:
    _check_schema(row, "latency")
    batch = row.workload["batch"]
    assert row.workload == dict(kind="latency", batch=batch, prompt_len=12, output_len=8,
                                repeats=3, dtype="float32", max_seq_len=32)
    f = row.figures
    # The step at position 12 + 8 // 2 reads every float32 weight and 17 tokens of K and V a row.
    c = PRESETS[MODEL]
    kv_values = 2 * c.num_layers * batch * 17 * c.num_kv_heads * c.head_dim
    assert f["step_bytes"] == 4 * (c.num_parameters() + kv_values)
    for name in ("ttft_ms", "ttft_last_ms", "tpot_ms", "tokens_per_s"):
      assert 0 < f[f"{name}_p50"] <= f[f"{name}_p90"] <= f[f"{name}_p99"], (name, f)
    assert f["ttft_last_ms_p50"] >= f["ttft_ms_p50"] and f["step_us"] > 0
    _table_line(out, row)
  header = next(line for line in out.splitlines() if line.startswith("| system |"))
  assert "ttft_last_ms_p50" in header and "step_us" in header


def test_latency_figures_are_percentiles_of_each_figure_over_calls():
  # Three calls, each slow in another figure: every figure's median is its own calls' median
  # (not a figure derived from the other medians; the three need not agree).
  stats = [dict(ttft_s=0.010, ttft_s_last=0.012, per_token_s=0.001, tokens_per_s=900.0),
           dict(ttft_s=0.050, ttft_s_last=0.060, per_token_s=0.001, tokens_per_s=300.0),
           dict(ttft_s=0.011, ttft_s_last=0.013, per_token_s=0.009, tokens_per_s=200.0)]
  f = latency.figures(stats)
  assert f["ttft_ms_p50"] == pytest.approx(11.0) and f["ttft_last_ms_p50"] == pytest.approx(13.0)
  assert f["tpot_ms_p50"] == pytest.approx(1.0) and f["tokens_per_s_p50"] == 300.0
  assert f["ttft_ms_p90"] == pytest.approx(42.2) and f["tokens_per_s_p99"] == pytest.approx(888.0)
  assert latency.figures([]) == {}


def test_throughput_counts_every_token_and_compares(capsys, tmp_path):
  workload = dict(kind="throughput", num_requests=8, prompt_len="5:20", output_len=6,
                  rate=200.0, seed=0, dtype="float32", client="threads")
  peer = rows.Row(system="peer", model=MODEL, workload=workload,
                  figures={"tokens_per_s": 10.0}, device="cpu", jax="0", commit="x",
                  date="2026-01-01")
  earlier = tmp_path / "peer.jsonl"
  rows.write(str(earlier), [peer])
  output = tmp_path / "throughput.jsonl"
  code, out, _ = _bench(capsys, "throughput", *ENGINE, "--batch-buckets", "1,4",
                        "--prompt-buckets", "16", "--num-requests", "8", "--prompt-len", "5:20",
                        "--output-len", "6", "--rate", "200", "--output", str(output),
                        "--compare", str(earlier))
  assert code == 0
  [row] = rows.read([str(output)])
  _check_schema(row, "throughput")
  assert row.workload == workload
  f = row.figures
  assert f["output_tokens"] == 8 * 6
  assert f["tokens_per_s"] == pytest.approx(f["requests_per_s"] * 6)
  for name in ("ttft_ms", "tpot_ms"):
    assert 0 < f[f"{name}_p50"] <= f[f"{name}_p90"] <= f[f"{name}_p99"], (name, f)
  assert f["e2e_ms_p50"] >= f["ttft_ms_p50"] and f["e2e_ms_p99"] >= f["e2e_ms_p50"]
  # The peer's row first, then this run's beside it with its ratio to the peer's.
  lines = out.splitlines()
  peer_line, line = _table_line(out, peer), _table_line(out, row)
  assert lines.index(peer_line) + 1 == lines.index(line)
  assert f"{f['tokens_per_s']:.4g} ({f['tokens_per_s'] / 10.0:.2f}x)" in line


def test_throughput_offline_client_is_one_generate_call(capsys, tmp_path, monkeypatch):
  calls = []
  generate = Engine.generate

  def counted(self, prompts, *args, **kwargs):
    calls.append(len(prompts))
    return generate(self, prompts, *args, **kwargs)

  monkeypatch.setattr(Engine, "generate", counted)
  output = tmp_path / "offline.jsonl"
  code, _, _ = _bench(capsys, "throughput", *ENGINE, "--batch-buckets", "1,4",
                      "--prompt-buckets", "16", "--num-requests", "6", "--prompt-len", "5:20",
                      "--output-len", "5", "--client", "generate", "--output", str(output))
  assert code == 0
  assert calls == [6, 6]  # the unmeasured pass, then the measured one
  [row] = rows.read([str(output)])
  assert row.workload["client"] == "generate" and row.workload["rate"] == "inf"
  f = row.figures
  assert f["output_tokens"] == 6 * 5
  assert f["tokens_per_s"] == pytest.approx(f["requests_per_s"] * 5)
  assert 0 < f["ttft_ms_p50"] <= f["ttft_ms_p99"] and 0 < f["tpot_ms_p50"] <= f["tpot_ms_p99"]


def test_startup_engine_cold_then_warm(capsys, tmp_path):
  output = tmp_path / "startup.jsonl"
  code, out, _ = _bench(capsys, "startup", *TINY_START, "--which", "engine", "--starts",
                        "cold,warm", "--output", str(output))
  assert code == 0
  cold, warm = rows.read([str(output)])
  for row, cache in ((cold, "cold"), (warm, "warm")):
    _check_schema(row, "startup")
    assert row.workload == dict(kind="startup", which="engine", cache=cache, max_seq_len=32,
                                batch_buckets="1", prompt_buckets="16")
    _table_line(out, row)
    f = row.figures
    assert 0 < f["import_s"] < f["load_s"] <= f["warmup_s"] <= f["first_answer_s"] <= f[
        "final_steps_s"], f
    # The loading's phases fit in it (a preset: random weights, no checkpoint to read).
    assert "checkpoint_read_s" not in f and 0 < f["weights_place_s"] < f["load_s"] - f["import_s"]
    # cache, load, steps of 1 .. 32 tokens (one row's context; XLA attention on the CPU), draw
    assert f["executables"] == 9 and 0 <= f["slowest_compile_s"] < f["warmup_s"], f
  # The warm start loads the executables the cold one compiled.
  assert warm.figures["warmup_s"] - warm.figures["load_s"] < (cold.figures["warmup_s"]
                                                              - cold.figures["load_s"])


@pytest.mark.skipif(cli.server is None, reason="`serve` needs the serve extra")
def test_startup_serve(capsys, tmp_path):
  output = tmp_path / "startup.jsonl"
  code, out, _ = _bench(capsys, "startup", *TINY_START, "--which", "serve", "--starts", "cold",
                        "--output", str(output))
  assert code == 0
  [row] = rows.read([str(output)])
  _check_schema(row, "startup")
  assert row.workload == dict(kind="startup", which="serve", cache="cold", max_seq_len=32,
                              batch_buckets="1", prompt_buckets="16")
  _table_line(out, row)
  f = row.figures
  assert 0 < f["listen_s"] <= f["ready_s"] <= f["first_answer_s"] <= f["final_steps_s"], f
  assert 0 < f["loaded_s"] <= f["ready_s"], f  # (the core loads while the launcher starts)


def _descendants(pid: int) -> set[int]:
  """The live processes below `pid` (Linux: /proc's parent links)."""
  parents = {}
  for entry in os.listdir("/proc"):
    with contextlib.suppress(OSError, ValueError, IndexError):
      with open(f"/proc/{entry}/stat") as stat:
        parents[int(entry)] = int(stat.read().rsplit(")", 1)[1].split()[1])
  found, frontier = set(), {pid}
  while frontier:
    frontier = {child for child, parent in parents.items() if parent in frontier} - found
    found |= frontier
  return found


@pytest.mark.skipif(cli.server is None or not os.path.isdir("/proc"),
                    reason="`serve` needs the serve extra; the process tree is read from /proc")
@pytest.mark.parametrize("which", ["engine", "serve"])
def test_startup_stopped_leaves_no_process(tmp_path, which):
  # SIGTERM to `bench startup` while its start runs: the start's processes go with it.
  bench = subprocess.Popen(
      [sys.executable, "-m", "cg_jax", "bench", "startup", *TINY_START, "--which", which,
       "--starts", "cold", "--output", str(tmp_path / "rows.jsonl")],
      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
  try:
    deadline, started = time.monotonic() + 60, set()
    while not started and time.monotonic() < deadline:
      time.sleep(0.2)
      started = _descendants(bench.pid)
    assert started, "the start never began"
    time.sleep(1.0)  # (inside the start: imports running)
    started = _descendants(bench.pid)
    bench.send_signal(signal.SIGTERM)
    assert bench.wait(timeout=60) != 0
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(os.path.exists(f"/proc/{pid}") for pid in started):
      time.sleep(0.1)
    left = [pid for pid in started if os.path.exists(f"/proc/{pid}")]
    assert not left, f"processes left after SIGTERM: {left}"
  finally:
    with contextlib.suppress(ProcessLookupError):
      os.killpg(bench.pid, signal.SIGKILL)
    bench.wait()


@pytest.mark.parametrize("argv, flag, allowed", [
    (["latency", "--batch", "0"], "--batch", ">= 1"),
    (["latency", "--batch", "1,x"], "--batch", "integers >= 1"),
    (["throughput", "--token-buckets", "4,x"], "--token-buckets", "integers >= 1"),
    (["latency", "--batch", "4", "--batch-buckets", "1,2"], "--batch 4", "1 to 2"),
    (["latency", "--prompt-len", "30", "--output-len", "8", "--max-seq-len", "32"],
     "--prompt-len 30 + --output-len 8", "at most the KV cache length, --max-seq-len 32"),
    (["latency", "--repeats", "0"], "--repeats", ">= 1"),
    (["throughput", "--prompt-len", "5:2"], "--prompt-len", "MIN <= MAX"),
    (["throughput", "--prompt-len", "0"], "--prompt-len", "N >= 1"),
    (["throughput", "--rate", "0"], "--rate", "> 0, or inf"),
    (["throughput", "--num-requests", "0"], "--num-requests", ">= 1"),
    (["throughput", "--client", "generate", "--rate", "8"], "--client generate", "--rate inf"),
    (["startup", "--which", "engine,gpu"], "--which", "engine, serve"),
])
def test_bad_arguments_exit_2_naming_the_flag(capsys, argv, flag, allowed):
  code, out, err = _bench(capsys, *argv)
  assert code == 2 and out == ""
  assert err.startswith("error: ") and flag in err and allowed in err, err


def test_missing_compare_file_or_output_directory_names_the_flag(capsys, tmp_path):
  code, _, err = _bench(capsys, "latency", "--compare", str(tmp_path / "none.jsonl"))
  assert code == 2 and "--compare" in err
  code, _, err = _bench(capsys, "latency", "--output", str(tmp_path / "none" / "rows.jsonl"))
  assert code == 2 and "--output" in err


def test_rows_round_trip(tmp_path):
  row = rows.Row(system="s", model="m", workload={"kind": "latency", "batch": 1},
                 figures={"ttft_ms_p50": 1.5}, **rows.where("cpu"))
  path = str(tmp_path / "rows.jsonl")
  rows.write(path, [row, dataclasses.replace(row, system="t")])
  assert [r.system for r in rows.read([path])] == ["s", "t"]
  assert json.loads(row.to_json())["schema"] == rows.SCHEMA


def test_a_given_step_budget_is_named_in_the_rows_workload():
  args = argparse.Namespace(system="cg_jax", model=MODEL, max_num_batched_tokens=64)
  given = options.row(args, {"kind": "latency"}, {"step_us": 1.0}, device="cpu")
  assert given.workload == {"kind": "latency", "max_num_batched_tokens": 64}
  args.max_num_batched_tokens = None  # the default: rows stay comparable with earlier ones
  assert options.row(args, {"kind": "latency"}, {}, device="cpu").workload == {"kind": "latency"}
