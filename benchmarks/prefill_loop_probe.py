"""Where the device loop's and the prefill's time goes (issue #18, items 1 and 2).

For one model (bf16, cache 1024, graphs as configured): the pipelined decode step against the
device loop (K tokens per call), each with its top kernel families from a profile, and the
large buffers the optimized HLO of each executable writes (inside while bodies and outside);
the prefill of 512-token prompts at B=1 and 8 with its top kernels; prefill variants built here
from the same model (layers scanned or unrolled; attention by the Pallas flash kernel, cuDNN
through `jax.nn.dot_product_attention`, or XLA), timed the same way; attention alone against
torch SDPA at several lengths when torch has CUDA.

  PYTHONPATH=$PWD python3 benchmarks/prefill_loop_probe.py --checkpoint DIR --out OUT
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from bench_util import median_s

from cg_jax import Engine, profile
from cg_jax.core.attention import PallasAttention
from cg_jax.core.sampling import select_tokens
from cg_jax.kernels.flash_attention import FlashAttentionConfig, flash_attention
from models.attention import XlaAttention

_BYTES = {"bf16": 2, "f16": 2, "f32": 4, "s32": 4, "pred": 1, "u8": 1, "s8": 1, "u32": 4}
_INSTR = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (\w+)\[([\d,]*)\]\S* (\w[\w\-]*)\((.*)$")


def big_writes(hlo: str, min_mb: float = 4.0) -> dict[str, list]:
  """{computation: [(instruction, opcode, MB, callee)]} for instructions writing >= min_mb,
  in while bodies and the entry computation."""
  comps, name, lines = {}, None, []
  for line in hlo.splitlines():
    head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
    if head and not line.startswith(" "):
      name, lines = head.group(1) + (" (ENTRY)" if line.startswith("ENTRY") else ""), []
      comps[name] = lines
    elif name is not None:
      lines.append(line)
  bodies = set(re.findall(r"body=%?([\w.\-]+)", hlo))
  found = {}
  for comp, body in comps.items():
    if not (comp.split(" ")[0] in bodies or comp.endswith("(ENTRY)")):
      continue
    rows = []
    for line in body:
      m = _INSTR.match(line)
      if not m or m.group(2) not in _BYTES:
        continue
      dims = [int(d) for d in m.group(3).split(",") if d]
      mb = _BYTES[m.group(2)] * int(np.prod(dims or [1])) / 2**20
      if mb >= min_mb and m.group(4) not in ("parameter", "get-tuple-element", "bitcast",
                                             "tuple", "constant"):
        callee = re.search(r"calls=%?([\w.\-]+)", line)
        rows.append((m.group(1), m.group(4), round(mb, 1), callee.group(1) if callee else ""))
    found[comp] = rows
  return found


def timed(fn, repeats: int = 10) -> float:
  return median_s(fn, repeats) * 1e3


def trace_kernels(fn, calls: int) -> list:
  report = profile.profile_calls(fn, calls)
  return [list(k) for k in report.top_kernels[:12]] + [["kernels/call", report.kernels_per_step]]


@dataclasses.dataclass(frozen=True)
class CudnnAttention(PallasAttention):
  """Prefill attention through cuDNN's fused kernel (right padding needs only the causal mask:
  a real query never sees a key past its own position)."""

  implementation: str = "cudnn"

  def causal(self, q, k, v, lengths):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                        implementation=self.implementation)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--checkpoint", required=True)
  ap.add_argument("--out", required=True)
  ap.add_argument("--graphs", default=None)
  ap.add_argument("--skip-loop", action="store_true")
  ap.add_argument("--prompt-len", type=int, default=512)
  ap.add_argument("--max-len", type=int, default=1024)
  ap.add_argument("--dtype", default="bfloat16")
  args = ap.parse_args()
  os.makedirs(args.out, exist_ok=True)
  plen = args.prompt_len
  options = dict(dtype=args.dtype, max_seq_len=args.max_len, batch_buckets=(1, 8),
                 prompt_buckets=(plen,))
  if args.graphs:
    options["graphs"] = args.graphs
  engine = Engine.from_pretrained(args.checkpoint, **options)
  name = os.path.basename(args.checkpoint.rstrip("/"))
  result = {"model": name, "jax": jax.__version__, "device": jax.devices()[0].device_kind,
            "commit": os.environ.get("CG_JAX_COMMIT", "unknown"), "graphs": args.graphs}

  pos = min(512, args.max_len // 2)

  def section(key, fn):
    try:
      result[key] = fn()
    except Exception as error:  # a probe's failure must not lose the others
      result[key] = {"error": f"{type(error).__name__}: {error}"[:600]}
    print(key, json.dumps(result[key])[:1500], flush=True)

  section("step", lambda: profile.time_decode(engine, 1, position=pos))
  section("step_kernels", lambda: list(map(list, profile.profile_decode(engine, 1, position=pos)[0].top_kernels[:12])))
  section("step_hlo_big", lambda: big_writes(engine.executables.get(("decode", 1, True)).as_text()))
  if not args.skip_loop:
    section("loop_token_us", lambda: profile.time_device_loop(engine, 1, position=pos))
    section("loop_kernels", lambda: list(map(list, profile.profile_device_loop(engine, 1, position=pos)[0].top_kernels[:12])))

    def loop_hlo():
      text = engine.executables.get(("loop", 1, True)).as_text()
      with open(os.path.join(args.out, f"{name}_loop_hlo.txt"), "w") as f:
        f.write(text)
      return big_writes(text)
    section("loop_hlo_big", loop_hlo)
  section("prefill_hlo_big", lambda: big_writes(
      engine.executables.get(("prefill", 1, plen)).as_text()))

  steps, weights = engine.executables.steps, engine.executables.steps.split.weights
  cfg = engine.model_config
  rng = np.random.default_rng(0)

  def variant(attention, layer_loop, batch):
    def fn(weights, cache, tokens, lengths):
      model = steps.split.merge(weights)
      logits, cache = model.prefill(tokens, lengths, cache, attention=attention,
                                    layer_loop=layer_loop)
      return select_tokens(logits, lengths, None), cache
    compiled = jax.jit(fn, donate_argnums=1).lower(
        weights, engine.kv_cache.get(), jnp.zeros((batch, plen), jnp.int32),
        jnp.zeros((batch,), jnp.int32)).compile()
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (batch, plen)).astype(np.int32))
    lengths = jnp.full((batch,), plen, jnp.int32)

    def once():
      first, cache = compiled(weights, engine.kv_cache.get(), tokens, lengths)
      engine.kv_cache.set(cache)
      np.asarray(first)
      return first
    return once

  variants = {"pallas_scan": (steps.attention, "scan"),
              "pallas_unroll": (steps.attention, "unroll"),
              "cudnn_scan": (CudnnAttention(), "scan"),
              "cudnn_unroll": (CudnnAttention(), "unroll"),
              "xla_unroll": (XlaAttention(), "unroll")}
  firsts = {}
  for batch in (1, 8):
    section(f"engine_prefill_ms_b{batch}", lambda: profile.time_prefill(engine, batch, plen))
    for key, (attention, loop) in variants.items():
      def measure():
        once = variant(attention, loop, batch)
        firsts[(key, batch)] = np.asarray(once()).tolist()
        return {"ms": timed(once), "kernels": trace_kernels(once, 3) if batch == 1 else None}
      section(f"prefill_{key}_b{batch}", measure)
  result["first_tokens_equal"] = {
      str(b): len({tuple(v) for (k, bb), v in firsts.items() if bb == b}) == 1 for b in (1, 8)}

  def attention_only():
    rows = []
    n, kv, h = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    try:
      import torch
      has_torch = torch.cuda.is_available()
    except ImportError:
      has_torch = False
    for s in (512, 1024, 2048, 4096):
      q = jnp.asarray(rng.standard_normal((1, s, n, h)), jnp.bfloat16)
      k = jnp.asarray(rng.standard_normal((1, s, kv, h)), jnp.bfloat16)
      v = jnp.asarray(rng.standard_normal((1, s, kv, h)), jnp.bfloat16)
      lengths = jnp.full((1,), s, jnp.int32)
      pallas = jax.jit(lambda q, k, v: flash_attention(
          q, k, v, lengths, causal=True, config=FlashAttentionConfig()))
      cudnn = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
          q, k, v, is_causal=True, implementation="cudnn"))
      row = {"seq": s}
      for label, fn in (("pallas_us", pallas), ("cudnn_us", cudnn)):
        row[label] = timed(lambda: fn(q, k, v).block_until_ready(), 20) * 1e3
      row["max_abs_diff"] = float(jnp.max(jnp.abs(pallas(q, k, v).astype(jnp.float32)
                                                  - cudnn(q, k, v).astype(jnp.float32))))
      if has_torch:
        tq, tk, tv = (torch.from_numpy(np.asarray(x.astype(jnp.float32))).cuda()
                      .to(torch.bfloat16).transpose(1, 2) for x in (q, k, v))
        sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
            tq, tk, tv, is_causal=True, enable_gqa=True)
        sdpa()
        torch.cuda.synchronize()
        times = []
        for _ in range(20):
          start = time.perf_counter()
          sdpa()
          torch.cuda.synchronize()
          times.append(time.perf_counter() - start)
        row["torch_sdpa_us"] = statistics.median(times) * 1e6
      rows.append(row)
    return rows
  section("attention_only_b1", attention_only)

  with open(os.path.join(args.out, f"probe_{name}.json"), "w") as f:
    json.dump(result, f, indent=1)
  print(f"\n{name}: step {result.get('step')} loop/token {result.get('loop_token_us')}")
  for key in sorted(result):
    if key.startswith("prefill_") and isinstance(result[key], dict) and "ms" in result[key]:
      print(f"  {key:28s} {result[key]['ms']:8.2f} ms")


if __name__ == "__main__":
  main()
