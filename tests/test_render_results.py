"""The result renderers (benchmarks/render_results.py): the bench tables (best peer and HBM floor
of the decode step, ratios against cg_jax, serve rows beside the in-process rows of the same
requests) and the README blocks they rewrite, the tensor-parallel ratios against the same
commit's one-GPU row, and the decode-step attention table."""

import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))
import render_results  # noqa: E402

from cg_jax.bench import rows  # noqa: E402


def _write(path, rows):
  path.write_text(json.dumps(rows))
  return str(path)


def _row(system, workload, figures, **where):
  return rows.Row(system=system, model="/ck/m", workload=workload, figures=figures,
                  device="H200", jax="0.11.2", commit=where.get("commit", "c"), date="d",
                  software=where.get("software", {}))


def _bench_rows():
  lat = dict(kind="latency", prompt_len=512, output_len=128, repeats=5, dtype="bfloat16",
             max_seq_len=1024)
  torch_versions = {"torch": "2.x"}
  thr = dict(kind="throughput", num_requests=64, prompt_len="64:480", output_len=128,
             rate="inf", seed=0, dtype="bfloat16")
  return [
      _row("cg_jax", dict(lat, batch=8), dict(step_us=200.0, step_bytes=420e6, ttft_ms_p50=4.0,
                                              tpot_ms_p50=0.21, tokens_per_s_p50=30000.0)),
      _row("torch_compile", dict(lat, batch=8), dict(step_us=500.0, ttft_ms_p50=3.0,
                                                     tpot_ms_p50=0.5, tokens_per_s_p50=15000.0),
           software=torch_versions),
      _row("torch_gptfast", dict(lat, batch=8), dict(step_us=400.0, ttft_ms_p50=5.0,
                                                     tpot_ms_p50=0.4, tokens_per_s_p50=18000.0),
           software=torch_versions),
      _row("cg_jax", thr, dict(tokens_per_s=20000.0, ttft_ms_p50=100.0, ttft_ms_p99=200.0,
                               tpot_ms_p50=1.5, tpot_ms_p99=1.7)),
      _row("hf_continuous", thr, dict(tokens_per_s=800.0), software=torch_versions),
      _row("cg_jax", dict(kind="serve", num_requests=64, prompt_len="64:480", output_len=128,
                          rate="inf", seed=0, clients=8, max_concurrency=None, host="127.0.0.1"),
           dict(tokens_per_s=19000.0, ttft_ms_p50=120.0, tpot_ms_p50=1.6, errors=0.0)),
  ]


def test_bench_tables_ratios_floor_and_pairings():
  blocks = render_results.bench_blocks(_bench_rows())
  assert set(blocks) == {"decode", "latency", "throughput", "serve"}  # no startup rows
  # best peer torch_gptfast 400 / 200; floor 420 MB / 4.2 TB/s = 100 us, 200 us = 2x it
  assert "| m | 1024 | 8 | 200.0 | 400.0 (torch_gptfast) | 2.00x | 100.0 | 2.00x |" in (
      blocks["decode"])
  assert "| m | 1024 | 8 | torch_gptfast | 5.00 | 0.400 | 18000 | 0.60x |" in blocks["latency"]
  assert blocks["latency"].index("| cg_jax |") < blocks["latency"].index("| torch_compile |")
  assert "| hf_continuous | 800 | 0.04x |" in blocks["throughput"]
  # the serve row beside the in-process row of the same requests at its commit
  assert "| m | 64 | 8 | 19000 | 20000 | 0.95x | 120.0 / 100.0 | 1.600 / 1.500 | 0 |" in (
      blocks["serve"])
  serve = _bench_rows()[-1]
  later = dataclasses.replace(serve, commit="later")
  assert "| m | 64 | 8 | 19000 | - | - | 120.0 / - |" in render_results.bench_blocks(
      _bench_rows()[:-1] + [later])["serve"]
  assert blocks["decode"].startswith("H200; jax 0.11.2, torch 2.x; commit c; d.")


def test_bench_rewrites_only_the_marked_blocks(tmp_path):
  source = tmp_path / "rows.jsonl"
  rows.write(str(source), _bench_rows())
  readme = tmp_path / "README.md"
  readme.write_text("intro\n<!-- bench:decode -->\nold table\n<!-- /bench:decode -->\nmiddle\n"
                    "<!-- bench:nothing -->\nkept\n<!-- /bench:nothing -->\nend\n")
  render_results.bench([str(source)], readmes=[str(readme)])
  text = readme.read_text()
  assert "old table" not in text and "| m | 1024 | 8 | 200.0 |" in text
  assert text.startswith("intro\n<!-- bench:decode -->\nH200;") and "middle\n" in text
  assert "<!-- bench:nothing -->\nkept\n<!-- /bench:nothing -->\nend\n" in text
  rendered = (tmp_path / "rows.md").read_text()
  assert "## serve" in rendered and "## decode" in rendered


def test_tensor_parallel_ratio_uses_the_same_commits_one_gpu_row():
  base = dict(model="m", batch=1, mode="full", floor_us=1.0, host_dispatch_wall_us=1.0,
              kernels_per_step=1, graph_launches_per_step=1, idle_gap_share=0.0,
              tokens_match_one_gpu=True, logits_rel_error_vs_one_gpu=0.0, max_seq_len=1024,
              position=512, gpu="H200", date="d", jax_version="0.11.2")
  rows = [dict(base, commit="old", tensor_parallel=1, step_us=100.0),
          dict(base, commit="new", tensor_parallel=1, step_us=200.0),
          dict(base, commit="new", tensor_parallel=2, step_us=300.0)]
  lines = render_results.tensor_parallel(rows)
  assert any(line.startswith("| new | m | 2 | full | 1 | 300.0 |") and "| 1.50x |" in line
             for line in lines), lines


def test_decode_step_attention_rows_get_their_own_table():
  row = dict(kernel="decode_attention_with_write", model="gpt2", batch=32, cache_len=1024,
             length=513, default_us=24.5, default_split=512, default_splits=2, pallas_us=21.7,
             pallas_config=dict(split_size=256, num_warps=4, num_stages=2, length_splits=True),
             floor_us=12.0, pallas_bandwidth_share=0.553,
             all_us={"split256_w4_s2": 21.7, "split512_w4_s2": 25.2}, gpu="H200",
             commit="c", date="d", jax_version="0.11.2")
  text = "\n".join(render_results.attention([row]))
  assert ("| gpt2 | 32 | 1024 | 513 | 24.5 (512 x 2) | 21.7 | split 256 by length, 4 warps, "
          "2 stages | 12.0 | 55% |") in text
  assert "| kernel | shape |" not in text  # no kernel rows: no empty kernel table
