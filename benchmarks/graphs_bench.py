"""CUDA-graph modes on the GPU: decode-step latency and launch accounting per mode x model x batch.

One process, one model's weights shared by every mode (Engine.with_options), bfloat16, KV cache
1024 long, decode at position 512. Per row: step latency pipelined (token fed back on device),
with the token read back every step, kernels / graph launches /
outside-graph launches / memcpys per step, host dispatch per step (from the profile and from the
call's return time) and the idle-gap share; greedy tokens are checked identical across modes.

  PYTHONPATH=$PWD python3 benchmarks/graphs_bench.py --out $OUT [--models gpt2,llama-3.2-1b]
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import os
import shutil
import time

import jax
from bench_util import HBM_BYTES_PER_S, failed_row, git_commit, write_rows

from cg_jax import Engine, profile
from cg_jax.core.graphs import GRAPH_MODES

# XLA options per GEMM backend: "xla" is XLA's own choice (Triton GEMM fusions, autotuned against
# cuBLAS one by one); "cublas" turns the Triton GEMMs off (cuBLAS with bias epilogues); "cublaslt"
# also routes them through cuBLASLt (bias and activation epilogues).
GEMMS = {"xla": {}, "cublas": {"xla_gpu_enable_triton_gemm": False},
         "cublaslt": {"xla_gpu_enable_triton_gemm": False, "xla_gpu_enable_cublaslt": True}}
# --cache-writes value for the engine's own choice: "fused" with Pallas attention and unrolled
# layers, else "scatter" (rows record the write that ran).
DEFAULT_CACHE_WRITE = "default"


def floor_us(engine: Engine, batch: int, position: int) -> float:
  """HBM floor: weight bytes + valid KV bytes read per step, over the copy bandwidth."""
  c = engine.model_config
  weight_bytes = c.num_parameters() * engine.dtype.itemsize
  kv_bytes = 2 * c.num_layers * batch * position * c.num_kv_heads * c.head_dim * engine.dtype.itemsize
  return (weight_bytes + kv_bytes) / HBM_BYTES_PER_S * 1e6


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--models", default="gpt2,gpt2-large,llama-3.2-1b")
  parser.add_argument("--batches", default="1,8")
  parser.add_argument("--modes", default=",".join(GRAPH_MODES))
  parser.add_argument("--layer-loops", default="scan,unroll")
  parser.add_argument("--position", type=int, default=512)
  parser.add_argument("--max-seq-len", type=int, default=1024)
  parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
  parser.add_argument("--traces", default="gpt2", help="models whose batch-1 traces are kept")
  parser.add_argument("--attention", default="xla", choices=("xla", "pallas"))
  parser.add_argument("--matmul-rows", default="8",
                      help="comma list of Engine(min_matmul_rows=...) values to compare")
  parser.add_argument("--ttft-len", type=int, default=512,
                      help="prompt length of the time-to-first-token rows (0: not measured)")
  parser.add_argument("--checkpoint-dir", default=None,
                      help="load <dir>/<model> (benchmarks/make_checkpoints.py: the files the "
                           "PyTorch baselines load) instead of the preset's random weights")
  parser.add_argument("--cache-writes", default=DEFAULT_CACHE_WRITE,
                      help="comma list of Engine(cache_write=...) values to compare "
                           f"('{DEFAULT_CACHE_WRITE}': the engine's choice for the layer loop)")
  parser.add_argument("--gemms", default="xla", help=f"comma list of GEMM backends: {list(GEMMS)}")
  args = parser.parse_args()
  for value in args.gemms.split(","):
    if value not in GEMMS:
      parser.error(f"--gemms: {value!r} is not one of {list(GEMMS)}")
  batches = [int(b) for b in args.batches.split(",")]
  os.makedirs(args.out, exist_ok=True)
  meta = dict(system="cg_jax", gpu=jax.devices()[0].device_kind, jax_version=jax.__version__,
              attention=args.attention,
              weights="checkpoint" if args.checkpoint_dir else "random (preset seed 0)",
              commit=git_commit(), date=datetime.date.today().isoformat(), dtype="bfloat16",
              position=args.position, max_seq_len=args.max_seq_len)
  rows = []
  prompt = [[11, 22, 33, 44, 55, 66, 77]]
  for model in args.models.split(","):
    prompt_buckets = (16, args.ttft_len) if args.ttft_len > 16 else (16,)
    source = os.path.join(args.checkpoint_dir, model) if args.checkpoint_dir else model
    base = Engine.from_pretrained(source, dtype="bfloat16", batch_buckets=batches,
                                  prompt_buckets=prompt_buckets, max_seq_len=args.max_seq_len,
                                  attention=args.attention, compilation_cache=False)
    reference_tokens = None
    for layer_loop, mode, matmul_rows, cache_write, gemm in itertools.product(
        args.layer_loops.split(","), args.modes.split(","),
        [int(r) for r in args.matmul_rows.split(",")], args.cache_writes.split(","),
        args.gemms.split(",")):
        try:
          engine = base.with_options(
              graphs=mode, layer_loop=layer_loop, compilation_cache=False,
              min_matmul_rows=matmul_rows, compiler_options=GEMMS[gemm],
              cache_write=None if cache_write == DEFAULT_CACHE_WRITE else cache_write)
          cache_write = engine.config.forward.cache_write
          name = f"{model}_{layer_loop}_{mode}_{cache_write}_{gemm}_rows{matmul_rows}"
          start = time.perf_counter()
          engine.warmup(batch_sizes=[1], phases=("prefill", "first", "decode"), progress=False)
          tokens = list(engine.generate(prompt, max_new_tokens=16, eos_token_id=[]))
          reference_tokens = reference_tokens or tokens
          for batch in batches:
            engine.warmup(batch_sizes=[batch], phases=("decode",), progress=False)
            compile_s = time.perf_counter() - start
            row = dict(meta, mode=mode, layer_loop=layer_loop, model=model,
                       batch=batch, min_matmul_rows=matmul_rows,
                       cache_write=cache_write, gemm=gemm,
                       compile_s=compile_s,
                       tokens_match_reference=tokens == reference_tokens)
            row.update(profile.time_decode(engine, batch, position=args.position))
            row["step_readback_us"] = profile.time_decode(engine, batch, position=args.position,
                                                          read_back=True)["step_us"]
            trace_dir = os.path.join("/tmp", f"trace_{name}_{batch}")
            report, trace_path = profile.profile_decode(engine, batch, position=args.position,
                                                        logdir=trace_dir)
            row.update(report.as_dict())
            # The headline dispatch number is the un-profiled wall time of one call.
            row["host_dispatch_profiled_us"] = row.pop("host_dispatch_us")
            row["host_dispatch_us"] = row.pop("host_dispatch_wall_us")
            row["top_kernels"] = [list(k) for k in report.top_kernels]
            row["floor_us"] = floor_us(engine, batch, args.position)
            if args.ttft_len:
              row["ttft_ms"] = profile.time_prefill(engine, batch, args.ttft_len)
              row["ttft_prompt_len"] = args.ttft_len
            if model in args.traces.split(",") and batch == 1:
              shutil.copy(trace_path, os.path.join(args.out, f"trace_{name}.json.gz"))
            rows.append(row)
            write_rows(args.out, "graphs_rows.json", rows)
            print(f"{model:13s} {layer_loop:6s} {mode:11s} {cache_write:7s} {gemm:6s} "
                  f"rows>={matmul_rows:<2d} "
                  f"B={batch:<2d} step {row['step_us']:8.1f} us "
                  f"readback {row['step_readback_us']:8.1f} "
                  f"kern {row['kernels_per_step']:6.1f} graphs {row['graph_launches_per_step']:5.1f} "
                  f"launch {row['kernel_launches_outside_graphs_per_step']:6.1f} "
                  f"disp {row['host_dispatch_us']:6.1f} call {row['pipelined_call_us']:6.1f} "
                  f"idle {row['idle_gap_share']:.2f} floor {row['floor_us']:.0f} "
                  f"match {row['tokens_match_reference']} compile {compile_s:.0f}s", flush=True)
        except Exception as error:  # noqa: BLE001 -- a failed configuration is a row
          rows.append(failed_row(
              meta, error, f"{model} {layer_loop} {mode} {cache_write} {gemm} "
              f"rows>={matmul_rows}", mode=mode, layer_loop=layer_loop, model=model, batch=None,
              min_matmul_rows=matmul_rows, cache_write=cache_write, gemm=gemm))
          write_rows(args.out, "graphs_rows.json", rows)
        engine = None
    del base

  print("\nmodel          loop   mode        write   gemm   rows B   step_us  readback  "
        "kern/step graphs/step outside disp_us idle  floor")
  for r in rows:
    if r.get("status") == "failed":
      print(f"{r['model']:14s} {r['layer_loop']:6s} {r['mode']:11s} "
            f"{r['cache_write']:7s} {r['gemm']:6s} "
            f"FAILED: {r['error'][:120]}")
      continue
    print(f"{r['model']:14s} {r['layer_loop']:6s} {r['mode']:11s} "
          f"{r['cache_write']:7s} {r['gemm']:6s} "
          f"{r['min_matmul_rows']:<4d} "
          f"{r['batch']:<3d} "
          f"{r['step_us']:8.1f} {r['step_readback_us']:9.1f} "
          f"{r['kernels_per_step']:9.1f} {r['graph_launches_per_step']:11.1f} "
          f"{r['kernel_launches_outside_graphs_per_step']:7.1f} {r['host_dispatch_us']:7.1f} "
          f"{r['idle_gap_share']:5.2f} {r['floor_us']:6.0f}")


if __name__ == "__main__":
  main()
