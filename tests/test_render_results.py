"""The result renderers (benchmarks/render_results.py): the comparison's ratios, tokens/s and
achieved bandwidth, which cg_jax rows it takes, the tensor-parallel ratios against the same
commit's one-GPU row, and the decode-step attention table."""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))
import pytest  # noqa: E402
import render_results  # noqa: E402


def _write(path, rows):
  path.write_text(json.dumps(rows))
  return str(path)


def test_comparison_ratios_throughput_and_the_rows_it_takes(tmp_path):
  pytest.importorskip("matplotlib")  # the plot (the notebooks extra)
  base = dict(model="m", max_len=1024, batch=8, gpu="H200", position=512, commit="c",
              date="d", torch_version="2.x", transformers_version="5.x")
  baselines = [dict(base, system="torch_compile", step_us=400.0, ttft_ms=2.0),
               dict(base, system="torch_eager", step_us=1000.0, ttft_ms=3.0)]
  ours = dict(base, system="cg_jax", mode="full", layer_loop="unroll", attention="pallas",
              max_seq_len=1024, floor_us=100.0, ttft_ms=1.5, jax_version="0.11.2")
  graphs = [dict(ours, step_us=200.0),
            # not the default configuration: left out of the table
            dict(ours, step_us=50.0, cache_write="scatter"),
            dict(ours, step_us=60.0, gemm="cublas"),
            dict(ours, step_us=70.0, decode_splits="length"),
            dict(ours, step_us=80.0, decode_qkv="kernel"),
            dict(ours, step_us=90.0, decode_combine="pallas")]
  md, png = tmp_path / "c.md", tmp_path / "c.png"
  render_results.comparison(_write(tmp_path / "b.json", baselines),
                            [_write(tmp_path / "g.json", graphs)], str(md), str(png))
  text = md.read_text()
  assert "| m | 1024 | 8 | 100.0 | 200.0 | 400.0 | 1000.0 | 2.00x |" in text
  # 8 rows / 200 us; the floor's bytes (100 us at 4.2 TB/s) over 200 us
  assert "40000 tok/s, 2.10 TB/s (2.0x)" in text
  assert "20000 tok/s, 1.05 TB/s (4.0x)" in text
  assert "torch 2.x, transformers 5.x" in text
  assert png.stat().st_size > 0


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
