"""The Mosaic GPU prompt kernel of this checkout against another tree's (same process, same inputs),
beside jax's FlashAttention-3 example (attention_mgpu: float16, causal, contiguous [B, S, N, H]),
the Triton flash kernel, the engine's Triton ragged kernel and PyTorch SDPA.

B fresh prompts of S tokens at llama-3.2-1b's heads (32 query / 8 KV, H=64), bfloat16, pages of C
positions (the paged kernels' times include writing the keys and values into the pages). Each
Mosaic tree: the best of 2 / 3 blocks in flight x key blocks of 64 / 128 (two consumers,
ping-pong). Per-call medians (attention_bench's timers), compile excluded; relative error against
the dense float32 causal reference. Rows to OUT/mosaic_prefill_ab.json, a table last.

  git archive REV cg_jax models | tar -x -C .probe/base     # (the other tree, untracked)
  PYTHONPATH=$PWD:$PWD/benchmarks python3 benchmarks/mosaic_prefill_ab.py --base-tree .probe/base --out $OUT
"""

from __future__ import annotations

import argparse
import datetime
import functools
import importlib.util
import json
import os
import sys

import jax
import jax.numpy as jnp
import attention_bench as ab
from bench_util import relative_error

from cg_jax.bench.rows import git_commit
from cg_jax.kernels import mosaic_prefill_attention as this_tree
from cg_jax.kernels.flash_attention import (FlashAttentionConfig, flash_attention,
                                            flash_attention_reference)
from cg_jax.kernels.ragged_paged_attention import RaggedPagedAttentionConfig, split_qkv

BLOCKS = ((2, 64), (3, 64), (2, 128), (3, 128))  # (blocks in flight, key block)
FLASH = (FlashAttentionConfig(block_q=64, block_k=128, num_warps=4, num_stages=2),
         FlashAttentionConfig(block_q=128, block_k=64, num_warps=8, num_stages=2))
RAGGED = (RaggedPagedAttentionConfig(),
          RaggedPagedAttentionConfig(tile_rows=128, block_k=64, num_warps=8, num_stages=2))


def kernel_module(tree: str):
  """The Mosaic kernel module of another source tree, loaded beside this one's."""
  path = os.path.join(tree, "cg_jax", "kernels", "mosaic_prefill_attention.py")
  spec = importlib.util.spec_from_file_location("base_mosaic_prefill_attention", path)
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module
  spec.loader.exec_module(module)
  return module


def mosaic_rows(module, inputs, reference):
  """{config: us} over BLOCKS, and the best config's relative error."""
  def attend_with(config):
    def attend(qkv, k_pages, v_pages, tables, lens, starts, *, layer):
      return module.mosaic_prefill_attention(qkv, k_pages, v_pages, jnp.int32(layer), tables,
                                             lens, starts, config=config)
    return attend
  configs = {f"s{steps}_k{block}": module.MosaicPrefillConfig(
      consumers=2, max_concurrent_steps=steps, pingpong=True, block_kv=block)
      for steps, block in BLOCKS}
  times = {name: ab.layers_us(attend_with(config), inputs(), 1, caches=ab.PAGED_CACHES)
           for name, config in configs.items()}
  best = min(times, key=times.get)
  out = attend_with(configs[best])(*inputs(), layer=0)[0]
  return times, float(relative_error(out, reference))


def peer_rows(q, k, v, lengths, inputs):
  """FA3 example, Triton flash and ragged kernels, SDPA: {name: {config: us}}."""
  from jax.experimental.pallas.ops.gpu import attention_mgpu
  q16, k16, v16 = (x.astype(jnp.float16) for x in (q, k, v))
  fa3 = {f"s{steps}_k{block}": ab._median_us(jax.jit(functools.partial(
      attention_mgpu.attention, config=attention_mgpu.TuningConfig(
          block_q=64, block_kv=block, max_concurrent_steps=steps, causal=True))), q16, k16, v16)
      for steps, block in ((2, 64), (2, 128), (3, 128))}
  flash = {f"q{c.block_q}_k{c.block_k}_w{c.num_warps}": ab._median_us(
      jax.jit(functools.partial(flash_attention, config=c)), q, k, v, lengths) for c in FLASH}
  ragged = {f"t{c.tile_rows}_k{c.block_k}_w{c.num_warps}": ab.layers_us(
      ab._paged_attend(c), inputs(), 1, caches=ab.PAGED_CACHES) for c in RAGGED}
  return dict(fa3_us=fa3, flash_us=flash, triton_ragged_us=ragged,
              sdpa_us=ab.causal_sdpa_us(q, k, v))


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--base-tree", required=True, help="the other tree's root (cg_jax/ inside)")
  parser.add_argument("--seq-lens", default="2048,4096,512")
  parser.add_argument("--page-size", type=int, default=64)
  parser.add_argument("--batch", type=int, default=4)
  parser.add_argument("--out", default=".")
  args = parser.parse_args()
  trees = {"base": kernel_module(args.base_tree), "this": this_tree}
  heads, kv_heads, head_dim, batch, page = 32, 8, 64, args.batch, args.page_size
  meta = dict(gpu=jax.devices()[0].device_kind, jax_version=jax.__version__,
              commit=git_commit(), base_tree=args.base_tree,
              date=datetime.date.today().isoformat())
  rows = []
  for seq in (int(s) for s in args.seq_lens.split(",")):
    inputs = ab._paged_inputs(seq, 1, [seq] * batch, [seq] * batch, page, -(-seq // page),
                              heads, kv_heads, head_dim)
    # [B, S, N, H] / [B, S, K, H]
    q, k, v = (x.reshape(batch, seq, *x.shape[1:]) for x in split_qkv(inputs()[0], kv_heads))
    lengths = jnp.full((batch,), seq, jnp.int32)
    # [B S, N, H]
    reference = flash_attention_reference(q, k, v, lengths).reshape(-1, heads, head_dim)
    row = dict(meta, seq_len=seq, page_size=page, batch=batch, heads=heads, kv_heads=kv_heads,
               head_dim=head_dim)
    for name, module in trees.items():
      row[f"{name}_us"], row[f"{name}_rel_error"] = mosaic_rows(module, inputs, reference)
      print(f"S={seq} {name}: {row[f'{name}_us']} err {row[f'{name}_rel_error']:.1e}", flush=True)
    row.update(peer_rows(q, k, v, lengths, inputs))
    rows.append(row)
    with open(os.path.join(args.out, "mosaic_prefill_ab.json"), "w") as f:
      json.dump(rows, f, indent=1)
  best = lambda times: min(times.values()) if times else float("nan")
  print("| S | base | this | FA3 example | Triton flash | Triton ragged | SDPA | this / SDPA |")
  print("|---|---|---|---|---|---|---|---|")
  for r in rows:
    sdpa = r["sdpa_us"] or float("nan")
    print(f"| {r['seq_len']} | {best(r['base_us']):.1f} | {best(r['this_us']):.1f} | "
          f"{best(r['fa3_us']):.1f} | {best(r['flash_us']):.1f} | "
          f"{best(r['triton_ragged_us']):.1f} | {sdpa:.1f} | {best(r['this_us']) / sdpa:.2f}x |")


if __name__ == "__main__":
  main()
