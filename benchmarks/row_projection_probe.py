"""The row projection kernel (`cg_jax.kernels.row_projection`) against XLA's projection, alone and
in the decode step.

  1. Kernel alone: llama-3.2-1b's four layer projections (QKV with its RMSNorm, output with the
     residual, gate/up with its RMSNorm and SiLU, down with the residual), 16 layers a call (as
     a step runs them), at M rows: XLA (`models.decoder.projection` on a static layer slice)
     against the kernel under a few block configs. Time per projection = the wall time of 20
     back-to-back calls / 20 / 16 (the device is the bottleneck); HBM rate = weight bytes / time.
  2. The step: the model's layers with the kernel for steps of <= ROWS_LIMIT tokens (each
     shape's best config from part 1), against main's, through `profile.time_decode` and B=1
     `generate` (512-token prompt, 128 new, greedy), one engine each, same process.

  PYTHONPATH=. python3 benchmarks/row_projection_probe.py MODEL_DIR OUT.json

Results: results/row_projection_*.
"""
from __future__ import annotations

import collections
import gc
import json
import os
import re
import statistics
import sys
import time

os.environ.setdefault("CG_JAX_COMPILATION_CACHE", "off")  # the patched model must compile

import jax
import jax.numpy as jnp
import numpy as np

import models.decoder as decoder
from cg_jax import Engine, profile
from cg_jax.kernels import row_projection as rp

LAYERS = 16
INTERPRET = jax.default_backend() != "gpu"  # (CPU smoke runs)
OPTIONS = json.loads(os.environ.get("ENGINE_OPTIONS", "{}"))
ROWS_LIMIT = int(os.environ.get("ROWS_LIMIT", "64"))
CONFIGS = [rp.RowProjectionConfig(**kw) for kw in (
    {}, {"block_k": 256, "num_stages": 3}, {"num_stages": 3}, {"min_programs": 132},
    {"block_k": 64}, {"min_programs": 0}, {"block_k": 64, "min_programs": 528},
    {"block_k": 256, "min_programs": 528, "num_stages": 2})]
# name: (inputs, outputs, norm, gated, residual)
SHAPES = {"qkv": (2048, 3072, True, False, False), "o": (2048, 2048, False, False, True),
          "gate_up": (2048, 16384, True, True, False), "down": (8192, 2048, False, False, True)}


def _per_call(fn, args, calls: int = 20, repeats: int = 5) -> float:
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    for _ in range(calls):
      out = fn(*args)
    jax.block_until_ready(out)
    times.append((time.perf_counter() - start) / calls)
  return statistics.median(times)


def kernel_alone(rows_list, out: dict) -> dict:
  rng = np.random.default_rng(0)
  best = {}
  for name, (inputs, outputs, norm, gated, residual) in SHAPES.items():
    w = jnp.asarray(rng.standard_normal((LAYERS, inputs, outputs), np.float32) * 0.02,
                    jnp.bfloat16)
    scale = jnp.asarray(rng.standard_normal((LAYERS, inputs), np.float32), jnp.bfloat16)
    width = outputs // 2 if gated else outputs
    kw = dict(norm="rms" if norm else None, activation="silu" if gated else None, gated=gated)
    for rows in rows_list:
      x = jnp.asarray(rng.standard_normal((rows, inputs), np.float32), jnp.bfloat16)
      res = jnp.asarray(rng.standard_normal((rows, width), np.float32), jnp.bfloat16)

      def xla(x, w, scale, res):
        return [decoder.projection(x, w[l], norm_scale=scale[l] if norm else None,
                                   residual=res if residual else None, eps=1e-5, **kw)
                for l in range(LAYERS)]
      base = _per_call(jax.jit(xla), (x, w, scale, res)) / LAYERS
      reference = jax.jit(xla)(x, w, scale, res)
      row = {"shape": name, "rows": rows, "xla_us": base * 1e6,
             "xla_tb_s": w[0].nbytes / base / 1e12, "kernel": []}
      configs = CONFIGS if rows == rows_list[0] else [CONFIGS[0]] + ([best[name]] if name in best else [])
      for config in configs:
        def kern(x, w, scale, res, config=config):
          return [rp.row_projection(x, w, l, norm_scale=scale if norm else None,
                                    residual=res if residual else None, eps=1e-5, config=config,
                                    **kw) for l in range(LAYERS)]
        try:
          fn = jax.jit(kern)
          got = fn(x, w, scale, res)
          err = max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
                    for a, b in zip(got, reference))
          t = _per_call(fn, (x, w, scale, res)) / LAYERS
          row["kernel"].append({"config": str(config), "us": t * 1e6,
                                "tb_s": w[0].nbytes / t / 1e12, "max_err": err,
                                "splits": rp.num_splits(inputs, width // config.block_n, config)})
        except Exception as error:  # noqa: BLE001 (a config Triton rejects is a row, not a stop)
          row["kernel"].append({"config": str(config), "error": repr(error)[:300]})
      ok = [k for k in row["kernel"] if "us" in k]
      if rows == rows_list[0] and ok:
        best[name] = CONFIGS[[str(c) for c in CONFIGS].index(min(ok, key=lambda k: k["us"])["config"])]
      out.setdefault("alone", []).append(row)
      line = " ".join(f"{k['us']:.1f}" if "us" in k else "ERR" for k in row["kernel"])
      print(f"{name:8s} M={rows:3d} xla {row['xla_us']:7.1f} us ({row['xla_tb_s']:.2f} TB/s) | "
            f"kernel {line}", flush=True)
  return best


class LayerView(dict):
  """A layer's weight slices (as `_over_layers` hands them) plus the stacked weights and the
  layer's index, for the kernel's in-place reads."""


def patch_model(best: dict) -> None:
  original_over, original_layer = decoder._over_layers, decoder.Decoder._layer

  def over_layers(body, carry, weights, num_layers, layer_loop):
    if layer_loop != "unroll":
      return original_over(body, carry, weights, num_layers, layer_loop)
    for layer in range(num_layers):
      view = LayerView(jax.tree.map(lambda a: a[layer], weights))
      view.stacked, view.index = weights, layer
      carry = body(carry, view, layer)
    return carry

  def layer_fn(self, x, w, positions, kv, attend, shards):
    c = self.config
    batch, seq, hidden = x.shape
    rows = batch * seq
    if not isinstance(w, LayerView) or shards != 1 or rows > ROWS_LIMIT:
      return original_layer(self, x, w, positions, kv, attend, shards)
    kernel_for = os.environ.get("KERNEL_FOR", "qkv,o,gate_up,down").split(",")
    st, index = w.stacked, jnp.int32(w.index)
    norm = "layer" if c.uses_layernorm else "rms"

    def project(x, name, key, **kw):
      weight = st[name]
      config = best.get(key, rp.RowProjectionConfig())
      if key in kernel_for and rp.supports(x.shape[0], weight.shape[1], weight.shape[2], config, kw.get("gated", False),
                     kw.get("activation")):
        return rp.row_projection(x, weight, index, config=config, eps=c.norm_eps,
                                 interpret=INTERPRET, **kw)
      stacked_kw = {k: (v[w.index] if k in ("norm_scale", "norm_bias", "bias") and v is not None
                        else v) for k, v in kw.items()}
      return decoder.projection(x, weight[w.index], eps=c.norm_eps, **stacked_kw)

    flat = x.reshape(rows, hidden)
    qkv = project(flat, "qkv_kernel", "qkv", norm=norm, norm_scale=st["attn_norm_scale"],
                  norm_bias=st.get("attn_norm_bias"), bias=st.get("qkv_bias"))
    qkv = qkv.reshape(batch, seq, shards, -1, c.head_dim)
    if c.uses_rope:
      inv_freq = jnp.asarray(decoder.rope_inverse_frequencies(c))
      qkv = decoder._apply_rope(qkv, positions, inv_freq, c.num_heads + c.num_kv_heads)
    attn, kv = attend(qkv, kv)
    flat = project(attn.reshape(rows, c.num_heads * c.head_dim), "out_kernel", "o",
                   bias=st.get("out_bias"), residual=flat)
    mlp = project(flat, "mlp_in_kernel", "gate_up", norm=norm, norm_scale=st["mlp_norm_scale"],
                  norm_bias=st.get("mlp_norm_bias"), bias=st.get("mlp_in_bias"),
                  activation=c.activation, gated=c.gated_mlp)
    flat = project(mlp, "mlp_out_kernel", "down", bias=st.get("mlp_out_bias"), residual=flat)
    return flat.reshape(batch, seq, hidden), kv

  decoder._over_layers = over_layers
  decoder.Decoder._layer = layer_fn


def families(path, steps: int) -> dict:
  """Device time per step (us) by kernel family (names without their numeric suffix)."""
  events = profile._load_events(path)
  names = {e["pid"]: e.get("args", {}).get("name", "") for e in events
           if e.get("ph") == "M" and e.get("name") == "process_name"}
  device = {pid for pid, name in names.items() if "/device:" in name and "CPU" not in name}
  totals = collections.Counter()
  for e in events:
    if e.get("ph") == "X" and e["pid"] in device and not re.search("memset|memcpy",
                                                                      e.get("name", ""), re.I):
      totals[re.sub(r"[._]\d+$", "", e["name"])] += float(e.get("dur", 0)) / steps
  return {k: round(t, 1) for k, t in totals.most_common()}


def engine_rows(model: str, label: str, batches, out: dict) -> list:
  start = time.perf_counter()
  engine = Engine.from_pretrained(model, max_seq_len=1024, **OPTIONS)
  engine.warmup(progress=False)
  engine.wait_for_final_steps(600)
  ready = time.perf_counter() - start
  row = {"variant": label, "ready_s": ready}
  for b in batches:
    row[f"step_us_b{b}"] = profile.time_decode(engine, b, position=512, steps=32,
                                               repeats=5)["step_us"]
  _, trace = profile.profile_decode(engine, 1, position=512, steps=10)
  row["kernels_b1"] = families(trace, 10)
  prompt = np.random.default_rng(0).integers(0, engine.model_config.vocab_size, 512).tolist()
  results = [engine.generate([prompt], 128, eos_token_id=[]) for _ in range(7)][2:]
  stats = [r.stats for r in results]
  row["b1_per_token_us"] = statistics.median(s["per_token_s"] * 1e6 for s in stats)
  row["b1_ttft_ms"] = statistics.median(s["ttft_s"] * 1e3 for s in stats)
  row["b1_tokens"] = list(results[0][0])
  out.setdefault("engine", []).append(row)
  print("   B=1 kernels: " + ", ".join(f"{k[:40]} {t:.0f}" for k, t in
                                      list(row["kernels_b1"].items())[:12]), flush=True)
  print(f"[{label}] ready {ready:.1f} s " + " ".join(
      f"B={b} {row[f'step_us_b{b}']:.1f}" for b in batches)
      + f" | B=1 generate {row['b1_per_token_us']:.1f} us/token, TTFT {row['b1_ttft_ms']:.2f} ms",
      flush=True)
  engine.close()
  del engine
  gc.collect()
  return row


def main(model: str, path: str) -> None:
  out = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
         "commit": os.environ.get("CG_JAX_COMMIT", "")}
  rows = [int(r) for r in os.environ.get("ROWS", "8,16,32,64").split(",")]
  best = kernel_alone(rows, out) if os.environ.get("ALONE", "1") == "1" else {}
  out["best"] = {k: str(v) for k, v in best.items()}
  with open(path, "w") as f:
    json.dump(out, f, indent=1)
  batches = [int(b) for b in os.environ.get("BATCHES", "1,8,32,64").split(",")]
  if os.environ.get("ENGINE", "1") == "1":
    base = engine_rows(model, "xla", batches, out)
    patch_model(best)
    for kernel_for in os.environ.get("VARIANTS", "qkv,o,gate_up,down").split(";"):
      os.environ["KERNEL_FOR"] = kernel_for
      new = engine_rows(model, f"row_projection[{kernel_for}]", batches, out)
      new["same_tokens_b1_as_xla"] = base["b1_tokens"] == new["b1_tokens"]
    for r in out["engine"]:
      r.pop("b1_tokens", None)
  with open(path, "w") as f:
    json.dump(out, f, indent=1)


if __name__ == "__main__":
  main(*sys.argv[1:])
