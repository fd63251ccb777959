"""The decode steps' projections at 1-32 rows: the Mosaic GPU kernel (`mosaic_gemv`, best of a
small launch search) against XLA's product (`jnp.dot`, as the model's layers run it), both over
weights stacked over layers and read a layer at a time (the engine's layout; enough layers that
they do not fit in L2), bfloat16. Bandwidth = weight bytes / time against HBM_BYTES_PER_S
(bench_util; 4.2 TB/s, the H200's). Medians of back-to-back calls, compile excluded. Issue #34.

  PYTHONPATH=$PWD:$PWD/benchmarks python3 benchmarks/gemv_bench.py --out $OUT [--rows 1,8]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import math

import jax
import jax.numpy as jnp
from bench_util import HBM_BYTES_PER_S, median_call_us, write_rows

from cg_jax.bench.rows import git_commit
from cg_jax.core.graphs import compiler_options
from cg_jax.kernels.mosaic_gemv import MosaicGemvConfig, mosaic_gemv

# (model, projection, K, N): llama-3.2-1b, gpt2, gpt2-large (gpt2's head: N not a multiple of 64)
SHAPES = (("llama-3.2-1b", "qkv", 2048, 3072), ("llama-3.2-1b", "o", 2048, 2048),
          ("llama-3.2-1b", "gate_up", 2048, 16384), ("llama-3.2-1b", "down", 8192, 2048),
          ("llama-3.2-1b", "head", 2048, 128256),
          ("gpt2", "qkv", 768, 2304), ("gpt2", "o", 768, 768), ("gpt2", "fc", 768, 3072),
          ("gpt2", "proj", 3072, 768),
          ("gpt2-large", "qkv", 1280, 3840), ("gpt2-large", "fc", 1280, 5120),
          ("gpt2-large", "proj", 5120, 1280))
CONFIGS = tuple(MosaicGemvConfig(block_k=128, max_concurrent_steps=steps, splits=splits)
                for steps in (3, 6) for splits in (1, 2, 4, 8))
L2_BYTES = 256 << 20  # the stacked weights' least size: well past L2
INTERPRET = False  # --smoke: tiny shapes in the Mosaic GPU interpreter (a CPU check of the script)


def layers_us(project, x, stacked) -> float:
  """Per-layer time of `project(x, stacked, layer)` over every layer, unrolled in one
  executable (CUDA graphs `full`), as in the decode step."""
  def run(x, stacked):
    total = jnp.zeros((), jnp.float32)
    for layer in range(stacked.shape[0]):
      total += project(x, stacked, layer)[0, 0].astype(jnp.float32)
    return total
  compiled = jax.jit(run).lower(x, stacked).compile(compiler_options("full"))
  return median_call_us(compiled, x, stacked) / stacked.shape[0]


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--rows", default="1,8")
  parser.add_argument("--out", default=".")
  parser.add_argument("--models", default="llama-3.2-1b,gpt2,gpt2-large")
  parser.add_argument("--smoke", action="store_true", help="tiny shapes, interpreted (CPU)")
  args = parser.parse_args()
  shapes, configs, least = SHAPES, CONFIGS, L2_BYTES
  if args.smoke:
    global INTERPRET
    INTERPRET = True
    shapes, configs, least = (("tiny", "qkv", 256, 128),), CONFIGS[:2], 1
    args.models, args.rows = "tiny", "1"
  meta = dict(gpu=jax.devices()[0].device_kind, jax_version=jax.__version__,
              commit=git_commit(), date=datetime.date.today().isoformat(), dtype="bfloat16")
  rows = []
  for model, name, k, n in shapes:
    if model not in args.models.split(","):
      continue
    weight_bytes = k * n * 2
    layers = max(2, min(32, math.ceil(least / weight_bytes)))
    stacked = jax.random.normal(jax.random.key(k + n), (layers, k, n), jnp.bfloat16)
    for m in (int(r) for r in args.rows.split(",")):
      x = jax.random.normal(jax.random.key(m), (m, k), jnp.bfloat16)
      xla = layers_us(lambda x, w, l: jnp.dot(x, w[l], preferred_element_type=jnp.float32)
                      .astype(x.dtype), x, stacked)
      timed = {}
      for config in configs:
        if k % (config.splits * config.block_k):
          continue
        timed[config] = layers_us(functools.partial(
            lambda x, w, l, config: mosaic_gemv(x, w, jnp.int32(l), config=config,
                                                interpret=INTERPRET),
            config=config), x, stacked)
      best = min(timed, key=timed.get)
      floor = weight_bytes / HBM_BYTES_PER_S * 1e6
      row = dict(meta, model=model, projection=name, rows=m, k=k, n=n, layers=layers,
                 floor_us=floor, xla_us=xla, kernel_us=timed[best],
                 kernel_config=dataclasses.asdict(best),
                 kernel_all_us={f"st{c.max_concurrent_steps}_s{c.splits}": us
                                for c, us in timed.items()},
                 xla_tb_s=weight_bytes / xla / 1e6, kernel_tb_s=weight_bytes / timed[best] / 1e6)
      rows.append(row)
      write_rows(args.out, "gemv_rows.json", rows)
      print(f"{model:12s} {name:7s} M={m:<3d} K={k:<5d} N={n:<6d} xla {xla:7.1f} us "
            f"({row['xla_tb_s']:.2f} TB/s)  kernel {timed[best]:7.1f} us "
            f"({row['kernel_tb_s']:.2f} TB/s, st{best.max_concurrent_steps} s{best.splits})  "
            f"floor {floor:6.1f}", flush=True)
  print("| model | projection | M | XLA us (TB/s) | kernel us (TB/s) | kernel / XLA | floor us |")
  print("|---|---|---|---|---|---|---|")
  for r in rows:
    print(f"| {r['model']} | {r['projection']} | {r['rows']} | {r['xla_us']:.1f} "
          f"({r['xla_tb_s']:.2f}) | {r['kernel_us']:.1f} ({r['kernel_tb_s']:.2f}) | "
          f"{r['kernel_us'] / r['xla_us']:.2f} | {r['floor_us']:.1f} |")


if __name__ == "__main__":
  main()
