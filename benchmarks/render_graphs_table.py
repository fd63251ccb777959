"""Render graphs_bench.py rows (benchmarks/results/graphs_h200.json and its siblings) as the
Markdown table beside them.

  python benchmarks/render_graphs_table.py [results.json] > results.md
"""

import json
import sys


def fmt(value, digits=1):
  return "-" if value is None or value != value else f"{value:.{digits}f}"


def main():
  path = sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results/graphs_h200.json"
  rows = json.load(open(path))
  first = rows[0]
  commits = ", ".join(sorted({r["commit"] for r in rows}))
  print(f"# CUDA-graph modes, decode step ({first['gpu']}, jax {first['jax_version']}, "
        f"commit {commits}, {first['date']})\n")
  lengths = "/".join(str(n) for n in sorted({r["max_seq_len"] for r in rows}))
  print(f"bfloat16, random weights, KV cache {lengths} long (column T), decode at position "
        f"{first['position']}, layers `{first['layer_loop']}`, attention `{first['attention']}`; "
        "medians. rows = `min_matmul_rows` (the step's hidden state zero-padded to that many rows), "
        "write = the decode step's cache write (`fused`: the "
        "Pallas decode attention stores the new K/V in place; `scatter`: XLA scatters first); "
        "gemm = `xla` (XLA's Triton GEMM fusions) or `cublas` / `cublaslt` (Triton GEMMs off); "
        "memcpy = copies per step; step = pipelined (token fed "
        "back on device); readback = token read to the host every step; loop/token = device loop "
        "(K=16 tokens per call); dispatch = host time of one step call into an idle queue; call = "
        "host time of one call inside back-to-back steps (approaches the step when GPU-bound); "
        "kernels, graph "
        "launches, outside-graph launches and idle share from a jax.profiler trace of 10 steps; "
        "floor = (weights + valid KV bytes) / 4.2 TB/s; TTFT = prefill of a 512-token prompt per "
        "row and the first token, on the device; tokens equal = greedy tokens equal to the "
        "model's first configuration in the run.\n")
  print("| model | T | mode | rows | write | gemm | batch | step us | readback us | "
        "loop us/token | floor us "
        "| kernels/step | graph launches/step | launches outside graphs/step | "
        "loop graph launches/token | memcpy/step | dispatch us | call us | idle share | TTFT ms | "
        "tokens equal |")
  print("|---" * 21 + "|")
  for r in rows:
    if r.get("status") == "failed":
      print(f"| {r['model']} | {r['max_seq_len']} | {r['mode']} | failed: {r['error'][:200]} |")
      continue
    print(f"| {r['model']} | {r['max_seq_len']} | {r['mode']} | {r.get('min_matmul_rows', 1)} | "
          f"{r.get('cache_write', 'scatter')} | {r.get('gemm', 'xla')} | "
          f"{r['batch']} | {fmt(r['step_us'])} | "
          f"{fmt(r['step_readback_us'])} | {fmt(r.get('device_loop_token_us'))} | "
          f"{fmt(r['floor_us'], 0)} | {fmt(r['kernels_per_step'], 0)} | "
          f"{fmt(r['graph_launches_per_step'], 2)} | "
          f"{fmt(r['kernel_launches_outside_graphs_per_step'], 0)} | "
          f"{fmt(r.get('device_loop_graph_launches_per_token'), 4)} | "
          f"{fmt(r.get('memcpy_per_step'))} | "
          f"{fmt(r['host_dispatch_us'])} | {fmt(r.get('pipelined_call_us'))} | "
          f"{fmt(r['idle_gap_share'], 2)} | {fmt(r.get('ttft_ms'), 2)} | "
          f"{'yes' if r['tokens_match_reference'] else 'NO'} |")


if __name__ == "__main__":
  main()
