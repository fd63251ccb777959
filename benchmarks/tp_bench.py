"""Tensor-parallel decoding on the GPUs of one host (Engine(tensor_parallel=N)): correctness
against one GPU and decode latency per model x devices x batch x graph mode.

One process, bfloat16, random weights shared by every engine of a model (Engine.with_options),
Pallas attention, unrolled layers, KV cache 1024 long, decode at position 512 (CPU smoke run:
XLA_FLAGS=--xla_force_host_platform_device_count=2 ... --models tiny-gpt2 --batches 1,2
--max-seq-len 64 --position 32 --steps 2: on a small CPU many back-to-back steps with
collectives can starve XLA's CPU all-reduce rendezvous). Graph modes:
`full`, and `full` with XLA's COLLECTIVES command type and NCCL all-reduces instead of XLA's
collective kernels (async or synchronous), to put the all-reduces inside the CUDA graph; XLA's
COLLECTIVES command has known problems, so it is measured rather than assumed.
Per row: step latency (pipelined), host dispatch, kernels and graph launches per step (summed
over the devices' traces), the per-device HBM floor, greedy tokens and full-forward logits
against the one-GPU engine. Rows to JSON, a table last.

  PYTHONPATH=$PWD python3 benchmarks/tp_bench.py --out $OUT      # on nvidia-h200-x2
"""

from __future__ import annotations

import argparse
import datetime
import os

import jax
import numpy as np
from bench_util import HBM_BYTES_PER_S, failed_row, relative_error, write_rows

from cg_jax import Engine, profile
from cg_jax.bench.rows import git_commit
from cg_jax.core.graphs import GRAPH_MODES

# The `full` command types plus COLLECTIVES, as an extra per-executable option. Measured on two
# H200s (results/tp_h200.md): alone it changes nothing (33 graphs per device per step), since
# jax 0.11.2 runs small NVLink all-reduces as XLA's own collective kernels
# (`xla_gpu_experimental_use_collective_kernels`), which a command buffer cannot record. Turning
# those off leaves NCCL all-reduces, which COLLECTIVES can capture (async start/done regions, or
# synchronous ones with `xla_gpu_disable_async_collectives`).
WITH_COLLECTIVES = {"xla_gpu_enable_command_buffer":
                    GRAPH_MODES["full"]["xla_gpu_enable_command_buffer"] + ",COLLECTIVES"}
NCCL_IN_GRAPH = dict(WITH_COLLECTIVES, xla_gpu_experimental_use_collective_kernels="",
                     xla_gpu_enable_collectives_command_buffer_filter="ALLREDUCE")
VARIANTS = {"full": {}, "full+collectives": WITH_COLLECTIVES, "full+nccl-graph": NCCL_IN_GRAPH,
            "full+nccl-graph-sync": dict(NCCL_IN_GRAPH,
                                         xla_gpu_disable_async_collectives="ALLREDUCE")}


def floor_us(engine: Engine, batch: int, position: int) -> float:
  """Per-device HBM floor: the one-GPU floor over the devices."""
  one_gpu = profile.decode_bytes(engine, batch, position) / HBM_BYTES_PER_S * 1e6
  return one_gpu / engine.config.tensor_parallel


def ttft_ms(engine: Engine, length: int, batches: list[int]) -> dict[str, float]:
  """Median `generate` time to first token for `batch` random prompts of `length` tokens."""
  if not length:
    return {}
  rng = np.random.default_rng(1)
  vocab = engine.model_config.vocab_size
  result = {}
  for batch in batches:
    times = [engine.generate(rng.integers(0, vocab, (batch, length)).tolist(), max_new_tokens=1,
                             eos_token_id=[]).stats["ttft_s"] * 1e3 for _ in range(6)]
    result[str(batch)] = float(np.median(times[1:]))
  return result


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
  parser.add_argument("--models", default="llama-3.2-1b,llama-3.2-3b")
  parser.add_argument("--devices", default="1,2")
  parser.add_argument("--batches", default="1,32")
  parser.add_argument("--variants", default="full,full+nccl-graph,full+nccl-graph-sync",
                      help=f"comma list of {sorted(VARIANTS)}")
  parser.add_argument("--position", type=int, default=512)
  parser.add_argument("--max-seq-len", type=int, default=1024)
  parser.add_argument("--steps", type=int, default=64, help="decode steps per timed run")
  parser.add_argument("--ttft-len", type=int, default=512,
                      help="prompt length of the TTFT rows (generate's ttft_s, B=1 and 8); 0: none")
  args = parser.parse_args()
  batches = [int(b) for b in args.batches.split(",")]
  meta = dict(system="cg_jax", gpu=jax.devices()[0].device_kind, gpus=len(jax.devices()),
              jax_version=jax.__version__, commit=git_commit(),
              date=datetime.date.today().isoformat(), dtype="bfloat16", attention="pallas",
              layer_loop="unroll", position=args.position, max_seq_len=args.max_seq_len)
  prompt = [[11, 22, 33, 44, 55, 66, 77]]
  rows = []
  references = {}  # model -> (one-GPU engine, its greedy tokens, its full-forward logits)
  ids = np.asarray([prompt[0] * 2])
  # Variants outermost: the COLLECTIVES rows come after every plain row, so a failure or hang in
  # that command type costs no other row.
  for variant in args.variants.split(","):
    for model in args.models.split(","):
      if model not in references:
        base = Engine.from_pretrained(model, dtype="bfloat16", batch_buckets=batches,
                                      prompt_buckets=sorted({16, args.ttft_len} - {0}),
                                      max_seq_len=args.max_seq_len,
                                      attention="pallas", layer_loop="unroll", graphs="full",
                                      kv_blocks=max(batches) * -(-args.max_seq_len // 64),
                                      compilation_cache=False)
        references[model] = (base, base.generate(prompt, max_new_tokens=16, eos_token_id=[]),
                             base.logits(ids))
      base, reference_tokens, reference_logits = references[model]
      for devices in [int(d) for d in args.devices.split(",")]:
        if devices == 1 and VARIANTS[variant]:
          continue  # no collectives on one device: the plain row is the same program
        try:
          engine = base if devices == 1 else base.with_options(
              tensor_parallel=devices, compiler_options=VARIANTS[variant], compilation_cache=False)
          tokens = engine.generate(prompt, max_new_tokens=16, eos_token_id=[])
          logits_error = relative_error(engine.logits(ids), reference_logits)
          ttft = ttft_ms(engine, args.ttft_len, [b for b in (1, 8) if b <= max(batches)])
          for batch in batches:
            engine.warmup(phases=("step",), progress=False)
            row = dict(meta, mode=variant, model=model, tensor_parallel=devices, batch=batch,
                       tokens_match_one_gpu=tokens == reference_tokens,
                       logits_rel_error_vs_one_gpu=logits_error,
                       floor_us=floor_us(engine, batch, args.position), ttft_ms=ttft)
            row.update(profile.time_decode(engine, batch, position=args.position,
                                           steps=args.steps))
            report, _ = profile.profile_decode(engine, batch, position=args.position,
                                               steps=min(10, args.steps),
                                               logdir=f"/tmp/tp_trace_{model}_{devices}_{batch}")
            row.update(report.as_dict())
            rows.append(row)
            write_rows(args.out, "tp_rows.json", rows)
            print(f"{model:13s} tp={devices} {variant:17s} B={batch:<3d} step "
                  f"{row['step_us']:8.1f} us dispatch {row['host_dispatch_wall_us']:7.1f} kernels "
                  f"{row['kernels_per_step']:6.0f} graphs {row['graph_launches_per_step']:5.2f} "
                  f"floor {row['floor_us']:6.0f} ttft {ttft} "
                  f"tokens_equal {row['tokens_match_one_gpu']} "
                  f"logits_err {logits_error:.1e}", flush=True)
        except Exception as error:  # noqa: BLE001 -- a failed configuration is a row
          rows.append(failed_row(meta, error, f"{model} tp={devices} {variant}", mode=variant,
                                 model=model, tensor_parallel=devices))
          write_rows(args.out, "tp_rows.json", rows)
  print(f"\n{'model':13s} {'tp':>2s} {'mode':17s} {'B':>3s} {'step_us':>9s} {'floor_us':>8s} "
        f"{'graphs':>6s} {'tokens_equal':>12s}")
  for r in rows:
    if r.get("status") == "failed":
      print(f"{r['model']:13s} {r['tensor_parallel']:2d} {r['mode']:17s} FAILED {r['error'][:100]}")
      continue
    print(f"{r['model']:13s} {r['tensor_parallel']:2d} {r['mode']:17s} {r['batch']:3d} "
          f"{r['step_us']:9.1f} {r['floor_us']:8.0f} {r['graph_launches_per_step']:6.2f} "
          f"{str(r['tokens_match_one_gpu']):>12s}")


if __name__ == "__main__":
  main()
