"""The fused decode projections (cg_jax.kernels.fused_linear) against the same math as XLA ops,
on the four projections of a layer of each model shape, per batch, bfloat16.

Each timing is in-graph: one executable (graph mode "full") applies the projection to LAYERS
distinct stacked layers back to back, as a decode step does, and the median pipelined call time
is divided by LAYERS; so a row is one kernel's device time plus its in-graph launch gap, with
weights streamed from HBM (LAYERS x weights exceed the L2 cache). A single call per kernel would
measure host dispatch instead.

Per row: the fused kernel (its default launch config and neighbours), the XLA ops on the real
rows and on rows zero-padded to 16, the weight-bytes floor at 4.2 TB/s and the fused kernel's
share of it; error of the fused kernel against the XLA result. One process, rows to JSON, table
last.

  PYTHONPATH=$PWD python3 benchmarks/linear_bench.py --out $OUT [--smoke]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os

import jax
import jax.numpy as jnp
import numpy as np

from bench_util import (HBM_BYTES_PER_S, fastest, git_commit, median_call_us, relative_error,
                        write_rows)
from cg_jax.graphs import compiler_options
from cg_jax.kernels.fused_linear import FusedLinearConfig, default_config, fused_linear
from models.config import PRESETS
from models.decoder import xla_projection

LAYERS = 32


def candidate_configs(hidden: int, width: int, gated: bool) -> list[FusedLinearConfig]:
  """The default launch config and its neighbours (half / double block_k, double block_n)."""
  base = default_config(hidden, width, gated)
  configs = [base]
  for change in (dict(block_k=base.block_k // 2), dict(block_k=base.block_k * 2),
                 dict(block_n=base.block_n * 2), dict(num_warps=8)):
    try:
      config = dataclasses.replace(base, **change)
    except ValueError:
      continue
    if hidden % config.block_k == 0 and config not in configs:
      configs.append(config)
  return configs


def over_layers(project, layers: int):
  """A jitted fn(x, w [L, K, N], **stacked options) applying `project(x, w, layer)` to every
  layer, compiled in graph mode "full" on first call."""
  def run(x, w, options):
    return tuple(project(x, w, layer, options) for layer in range(layers))

  compiled = {}

  def call(x, w, options):
    if "fn" not in compiled:
      lowered = jax.jit(run).lower(x, w, options)
      compiled["fn"] = lowered.compile(compiler_options=compiler_options("full"))
    return compiled["fn"](x, w, options)
  return call


def fused_project(config, interpret):
  def project(x, w, layer, options):
    return fused_linear(x, w, layer=layer, config=config, interpret=interpret, **options)
  return project


def xla_project(x, w, layer, options):
  sliced = {name: (value if name == "residual" or not hasattr(value, "ndim") else value[layer])
            for name, value in options.items()}
  return xla_projection(x, w[layer], **sliced)


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


def make_inputs(rows: int, hidden: int, width: int, spec: dict, dtype, seed: int, layers: int):
  """x [rows, K], w [L, K, N] and the projection's options, weights stacked over L layers."""
  keys = iter(jax.random.split(jax.random.key(seed), 8))
  x = jax.random.normal(next(keys), (rows, hidden), dtype)
  w = (jax.random.normal(next(keys), (layers, hidden, width), jnp.float32)
       / np.sqrt(hidden)).astype(dtype)
  options = dict(activation=spec.get("activation"), gated=spec.get("gated", False))
  if spec.get("norm"):
    options["norm"] = spec["norm"]
    options["norm_scale"] = jnp.ones((layers, hidden), dtype)
    if spec["norm"] == "layer":
      options["norm_bias"] = jnp.zeros((layers, hidden), dtype)
  if spec.get("bias"):
    options["bias"] = 0.1 * jax.random.normal(next(keys), (layers, width), dtype)
  if spec.get("residual"):
    options["residual"] = jax.random.normal(next(keys), (rows, spec["residual"]), dtype)
  static = {name: options.pop(name) for name in ("activation", "gated", "norm") if name in options}
  return x, w, options, static


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
  parser.add_argument("--models", default="gpt2,llama-3.2-1b")
  parser.add_argument("--batches", default="1,8")
  parser.add_argument("--smoke", action="store_true", help="tiny shapes in the interpreter (CPU)")
  args = parser.parse_args()
  interpret = args.smoke
  layers = 2 if args.smoke else LAYERS
  models = "tiny-gpt2,tiny-llama" if args.smoke else args.models
  batches = [1] if args.smoke else [int(b) for b in args.batches.split(",")]
  meta = dict(system="cg_jax", gpu=jax.devices()[0].device_kind, jax_version=jax.__version__,
              commit=git_commit(), date=datetime.date.today().isoformat(), dtype="bfloat16",
              layers=layers, graphs="full")
  calls = dict(calls=1, rounds=2) if interpret else {}

  def per_layer_us(fn, *args):
    return median_call_us(fn, *args, **calls) / layers

  def candidate_us(fn, *args):
    """per_layer_us, or inf for a launch config the GPU cannot take (e.g. too much shared
    memory for its pipeline stages)."""
    try:
      return per_layer_us(fn, *args)
    except jax.errors.JaxRuntimeError as error:
      print(f"  config skipped: {str(error).splitlines()[0][:120]}")
      return float("inf")

  rows = []
  for model in models.split(","):
    for label, hidden, width, spec in projections(model):
      for batch in batches:
        x, w, options, static = make_inputs(batch, hidden, width, spec, jnp.bfloat16, batch,
                                            layers)

        def bind(project):
          return over_layers(lambda x, w, layer, o: project(x, w, layer, {**o, **static}),
                             layers)
        xla = bind(xla_project)
        configs = candidate_configs(hidden, width // 2 if static.get("gated") else width,
                                    static.get("gated", False))[:1 if args.smoke else None]
        us, config, fused = fastest(((config, bind(fused_project(config, interpret)))
                                     for config in configs), candidate_us, x, w, options)
        default_us = (us if config == configs[0]
                      else per_layer_us(bind(fused_project(configs[0], interpret)), x, w, options))
        x16 = jnp.pad(x, ((0, max(0, 16 - batch)), (0, 0)))
        options16 = dict(options)
        if "residual" in options16:
          options16["residual"] = jnp.pad(options["residual"], ((0, max(0, 16 - batch)), (0, 0)))
        floor = w[0].size * w.dtype.itemsize / HBM_BYTES_PER_S * 1e6
        row = dict(meta, model=model, projection=label, batch=batch, k=hidden, n=width,
                   fused_us=us, fused_config=dataclasses.asdict(config),
                   fused_default_us=default_us, xla_us=per_layer_us(xla, x, w, options),
                   xla_padded16_us=per_layer_us(bind(xla_project), x16, w, options16),
                   floor_us=floor, fused_share_of_floor=floor / us,
                   rel_error_vs_xla=relative_error(fused(x, w, options)[-1],
                                                   xla(x, w, options)[-1]))
        rows.append(row)
        print(f"{model:13s} {label:17s} B={batch:<3d} fused {row['fused_us']:7.1f} us "
              f"(default {default_us:6.1f}) xla {row['xla_us']:7.1f} padded "
              f"{row['xla_padded16_us']:7.1f} floor {floor:6.1f} err "
              f"{row['rel_error_vs_xla']:.1e} {dataclasses.asdict(config)}", flush=True)
  write_rows(args.out, "linear_rows.json", rows)
  print(f"\n{'model':13s} {'projection':17s} {'B':>3s} {'fused':>8s} {'default':>8s} "
        f"{'xla':>8s} {'xla16':>8s} {'floor':>7s} {'share':>6s}")
  for r in rows:
    print(f"{r['model']:13s} {r['projection']:17s} {r['batch']:3d} {r['fused_us']:8.1f} "
          f"{r['fused_default_us']:8.1f} {r['xla_us']:8.1f} {r['xla_padded16_us']:8.1f} "
          f"{r['floor_us']:7.1f} {r['fused_share_of_floor']:6.2f}")


if __name__ == "__main__":
  main()
