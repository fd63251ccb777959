"""The fused decode projections (cg_jax.kernels.fused_linear) against the same math as XLA ops,
on the four projections of a layer of each model shape, per batch, bfloat16.

Per row: the fused kernel's best launch config (a small search), the XLA ops as the model runs
them (single rows and padded to 16 rows), the weight-bytes floor at 4.2 TB/s and the kernel's
share of it; error of the fused kernel against the XLA result. One process, rows to JSON, table
last.

  PYTHONPATH=$PWD python3 benchmarks/linear_bench.py --out $OUT [--smoke]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

from bench_util import fastest, git_commit, median_call_us, relative_error, write_rows
from cg_jax.kernels.fused_linear import FusedLinearConfig, fused_linear
from models.config import PRESETS
from models.decoder import xla_projection

HBM_BYTES_PER_S = 4.2e12
CONFIGS = tuple(FusedLinearConfig(block_n=block_n, block_k=block_k, num_warps=warps,
                                  num_stages=stages)
                for block_n in (16, 32, 64) for block_k in (64, 128, 256)
                for warps, stages in ((4, 3), (8, 3)))


def projections(name: str):
  """(label, K, N, options) of the four projections of one layer of a preset."""
  c = PRESETS[name]
  norm = "layer" if c.uses_layernorm else "rms"
  mlp_width = (2 if c.gated_mlp else 1) * c.intermediate_size
  bias = c.attention_bias
  return [
      ("norm+qkv", c.hidden_size, c.qkv_width, dict(norm=norm, bias=bias)),
      ("out+residual", c.num_heads * c.head_dim, c.hidden_size,
       dict(bias=bias, residual=c.hidden_size)),
      ("norm+mlp_in+act", c.hidden_size, mlp_width,
       dict(norm=norm, bias=c.mlp_bias, activation=c.activation, gated=c.gated_mlp)),
      ("mlp_out+residual", c.intermediate_size, c.hidden_size,
       dict(bias=c.mlp_bias, residual=c.hidden_size)),
  ]


def make_inputs(rows: int, hidden: int, width: int, spec: dict, dtype, seed: int):
  keys = iter(jax.random.split(jax.random.key(seed), 8))
  x = jax.random.normal(next(keys), (rows, hidden), dtype)
  w = (jax.random.normal(next(keys), (hidden, width), jnp.float32) / np.sqrt(hidden)).astype(dtype)
  options = dict(activation=spec.get("activation"), gated=spec.get("gated", False))
  if spec.get("norm"):
    options["norm"] = spec["norm"]
    options["norm_scale"] = jnp.ones((hidden,), dtype)
    if spec["norm"] == "layer":
      options["norm_bias"] = jnp.zeros((hidden,), dtype)
  if spec.get("bias"):
    options["bias"] = 0.1 * jax.random.normal(next(keys), (width,), dtype)
  if spec.get("residual"):
    options["residual"] = jax.random.normal(next(keys), (rows, spec["residual"]), dtype)
  return x, w, options


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
  parser.add_argument("--models", default="gpt2,llama-3.2-1b")
  parser.add_argument("--batches", default="1,8,32")
  parser.add_argument("--smoke", action="store_true", help="tiny shapes in the interpreter (CPU)")
  args = parser.parse_args()
  interpret = args.smoke
  configs = CONFIGS[:1] if args.smoke else CONFIGS
  models = "tiny-gpt2,tiny-llama" if args.smoke else args.models
  batches = [1] if args.smoke else [int(b) for b in args.batches.split(",")]
  meta = dict(system="cg_jax", gpu=jax.devices()[0].device_kind, jax_version=jax.__version__,
              commit=git_commit(), date=datetime.date.today().isoformat(), dtype="bfloat16")
  timing = (functools.partial(median_call_us, calls=1, rounds=2) if interpret
            else median_call_us)
  rows = []
  for model in models.split(","):
    for label, hidden, width, spec in projections(model):
      for batch in batches:
        x, w, options = make_inputs(batch, hidden, width, spec, jnp.bfloat16, seed=batch)
        xla = jax.jit(functools.partial(xla_projection, **options))
        xla_padded = jax.jit(functools.partial(xla_projection, min_rows=16, **options))
        us, config, fused = fastest(
            ((config, jax.jit(functools.partial(fused_linear, config=config,
                                                interpret=interpret, **options)))
             for config in configs), timing, x, w)
        floor = w.size * w.dtype.itemsize / HBM_BYTES_PER_S * 1e6
        row = dict(meta, model=model, projection=label, batch=batch, k=hidden, n=width,
                   fused_us=us, fused_config=dataclasses.asdict(config),
                   xla_us=timing(xla, x, w), xla_padded16_us=timing(xla_padded, x, w),
                   floor_us=floor, fused_share_of_floor=floor / us,
                   rel_error_vs_xla=relative_error(fused(x, w), xla(x, w)))
        rows.append(row)
        print(f"{model:13s} {label:17s} B={batch:<3d} fused {row['fused_us']:7.1f} us "
              f"xla {row['xla_us']:7.1f} padded {row['xla_padded16_us']:7.1f} floor "
              f"{floor:6.1f} err {row['rel_error_vs_xla']:.1e}", flush=True)
  write_rows(args.out, "linear_rows.json", rows)
  print(f"\n{'model':13s} {'projection':17s} {'B':>3s} {'fused':>8s} {'xla':>8s} {'xla16':>8s} "
        f"{'floor':>7s} {'share':>6s}")
  for r in rows:
    print(f"{r['model']:13s} {r['projection']:17s} {r['batch']:3d} {r['fused_us']:8.1f} "
          f"{r['xla_us']:8.1f} {r['xla_padded16_us']:8.1f} {r['floor_us']:7.1f} "
          f"{r['fused_share_of_floor']:6.2f}")


if __name__ == "__main__":
  main()
