"""Pallas attention kernels on the GPU: correctness against the jnp reference, and speed against
the XLA path and PyTorch `scaled_dot_product_attention` on the same inputs.

Prefill flash attention (S in 512, 2048, causal; Llama-3.2-1B heads: 32 query / 8 KV heads,
bfloat16): TFLOP/s against the ~790 TFLOP/s bf16 matmul ceiling. Paged (`--parts paged`): the
ragged paged-attention kernel on a paged cache (random block tables) at the decode step's shapes
(every layer of each model's cache, cache 1024, position 512, per layer in-graph: achieved
bandwidth = valid K/V bytes / time, against the 4.2 TB/s copy bandwidth), the default launch
config against pinned splits and warp counts; and against the flash kernel and SDPA on fresh
prompts (its time includes writing the prompt's keys and values into pages). Medians over
repeats, compile time excluded. One process, rows to JSON, table last.

The slot-cache decode kernel's parts (`decode`, `decode-step`) were removed with the kernel;
their rows stay in benchmarks/results (attention_h200.json, attention_step_h200.json).

  PYTHONPATH=$PWD python3 benchmarks/attention_bench.py --out $OUT
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import itertools
import os
import statistics
import time

import jax
import jax.numpy as jnp
from bench_util import HBM_BYTES_PER_S, fastest, median_call_us, relative_error, write_rows

from cg_jax.bench.rows import git_commit
from cg_jax.core.graphs import compiler_options
from cg_jax.kernels.flash_attention import (FlashAttentionConfig, flash_attention,
                                            flash_attention_reference)
from cg_jax.kernels.mosaic_prefill_attention import MosaicPrefillConfig, mosaic_prefill_attention
from cg_jax.kernels.ragged_paged_attention import (RaggedPagedAttentionConfig,
                                                   ragged_paged_attention,
                                                   ragged_paged_attention_reference, split_qkv)
from models.config import PRESETS

BF16_FLOPS = 790e12
# Launch settings searched per shape (the best is reported with its config).
PREFILL_CONFIGS = tuple(
    FlashAttentionConfig(block_q=block_q, block_k=block_k, num_warps=warps, num_stages=stages)
    for block_q, block_k in ((64, 64), (128, 64), (64, 128), (128, 128)) for warps in (4, 8)
    for stages in (2, 3))
# The ragged paged kernel: the default, then pinned splits and warps (decode); tiles (prefill).
PAGED_DECODE_CONFIGS = (RaggedPagedAttentionConfig(),) + tuple(
    RaggedPagedAttentionConfig(split_size=split, min_programs=0, num_warps=warps,
                               num_stages=stages)
    for split, warps, stages in ((64, 4, 2), (128, 4, 2), (256, 4, 2), (512, 4, 2), (128, 2, 1),
                                 (256, 2, 1))) + tuple(
    RaggedPagedAttentionConfig(min_programs=programs) for programs in (64, 128, 1024))
PAGED_PREFILL_CONFIGS = tuple(
    RaggedPagedAttentionConfig(tile_rows=rows, block_k=block_k, num_warps=warps,
                               num_stages=stages)
    for rows, block_k, warps, stages in (
        (64, 64, 4, 2), (32, 64, 4, 2), (64, 32, 4, 2), (64, 64, 4, 3), (64, 64, 8, 2),
        (128, 32, 4, 2), (128, 64, 4, 2), (128, 64, 8, 2), (128, 64, 8, 3), (256, 64, 8, 2)))
# The Mosaic GPU prompt-chunk kernel: attending warpgroups, key/value blocks in flight, turns.
MOSAIC_PREFILL_CONFIGS = tuple(
    MosaicPrefillConfig(consumers=consumers, max_concurrent_steps=steps, pingpong=pingpong,
                        block_kv=block)
    for consumers, steps, pingpong, block in (
        (2, 2, True, 64), (2, 3, True, 64), (2, 4, True, 64), (2, 2, False, 64), (1, 2, False, 64),
        (1, 4, False, 64), (2, 2, True, 128), (2, 3, True, 128)))
INTERPRET = False  # --smoke: run the kernels in the Pallas interpreter (CPU check of the script)


def _median_us(fn, *args) -> float:
  if INTERPRET:
    return median_call_us(fn, *args, calls=1, rounds=2)
  return median_call_us(fn, *args)


def _torch_us(fn, calls: int = 20, rounds: int = 7) -> float | None:
  """The same measurement for a PyTorch callable (CUDA events around back-to-back calls)."""
  try:
    import torch
  except ImportError:
    return None
  if not torch.cuda.is_available():
    return None
  fn()
  torch.cuda.synchronize()
  times = []
  for _ in range(rounds):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
      fn()
    end.record()
    torch.cuda.synchronize()
    times.append(start.elapsed_time(end) * 1e3 / calls)
  return statistics.median(times)


def _to_torch(x):
  import torch
  return torch.from_dlpack(x)


def causal_sdpa_us(q, k, v):
  """PyTorch SDPA's time on the same q [B, S, N, H], k, v [B, S, K, H] (causal, GQA), or None
  without a CUDA torch."""
  def sdpa():
    import torch
    tq, tk, tv = (_to_torch(x).transpose(1, 2) for x in (q, k, v))
    return torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=True,
                                                            enable_gqa=True)
  return _torch_us(sdpa)


def _random_inputs(seed: int, q_shape, kv_shape, batch: int, length: int):
  """Random bfloat16 q, k, v (never zeros) and full-length rows."""
  keys = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(keys[0], q_shape, jnp.bfloat16)
  k = jax.random.normal(keys[1], kv_shape, jnp.bfloat16)
  v = jax.random.normal(keys[2], kv_shape, jnp.bfloat16)
  return q, k, v, jnp.full((batch,), length, jnp.int32)


def layers_us(attend, inputs, layers: int, calls: int = 10, rounds: int = 5,
              caches: tuple[int, int] = (3, 4)) -> float:
  """Per-layer time of `attend(*inputs, layer=l)` -> (out, k_cache, v_cache), where
  inputs[caches] are the caches (after the new tokens' arrays: q, k_new, v_new, or the paged
  kernel's fused qkv), over `layers` layers back to back in one executable (graph mode `full`,
  the caches donated and carried from call to call), as in the decode step: in-graph kernel
  time plus its launch gap."""
  k_at, v_at = caches

  def step(*args):
    args = list(args)
    total = jnp.zeros((), jnp.float32)
    for layer in range(layers):
      out, args[k_at], args[v_at] = attend(*args, layer=layer)
      total += out[0, 0, 0].astype(jnp.float32)  # keeps every layer's output alive
    return total, args[k_at], args[v_at]

  compiled = jax.jit(step, donate_argnums=caches).lower(*inputs).compile(
      compiler_options("full"))
  args = list(inputs)
  total, args[k_at], args[v_at] = compiled(*args)
  jax.block_until_ready(total)
  times = []
  for _ in range(1 if INTERPRET else rounds):
    start = time.perf_counter()
    for _ in range(1 if INTERPRET else calls):
      total, args[k_at], args[v_at] = compiled(*args)
    jax.block_until_ready(total)
    times.append((time.perf_counter() - start) / (1 if INTERPRET else calls))
  return statistics.median(times) * 1e6 / layers


def prefill_rows(seq_lens, batch=4, heads=32, kv_heads=8, head_dims=(64, 128)):
  rows = []
  for head_dim in head_dims:
    for seq in seq_lens:
      q, k, v, lengths = _random_inputs(seq + head_dim, (batch, seq, heads, head_dim),
                                        (batch, seq, kv_heads, head_dim), batch, seq)
      reference = jax.jit(flash_attention_reference)
      default_us = _median_us(jax.jit(functools.partial(flash_attention, interpret=INTERPRET)),
                              q, k, v, lengths)
      error = relative_error(flash_attention(q, k, v, lengths, interpret=INTERPRET),
                              reference(q, k, v, lengths))
      flops = 4 * batch * heads * seq * seq * head_dim / 2  # causal half
      us, config, _ = fastest(
          ((config, jax.jit(functools.partial(flash_attention, config=config,
                                              interpret=INTERPRET))) for config in PREFILL_CONFIGS),
          _median_us, q, k, v, lengths)
      row = dict(kernel="flash_attention", batch=batch, seq_len=seq, heads=heads,
                 kv_heads=kv_heads, head_dim=head_dim, rel_error_vs_xla=error,
                 pallas_us=us, pallas_config=dataclasses.asdict(config), default_us=default_us,
                 xla_us=_median_us(reference, q, k, v, lengths))

      row["torch_sdpa_us"] = causal_sdpa_us(q, k, v)
      row["pallas_tflops"] = flops / row["pallas_us"] / 1e6
      row["pallas_share_of_ceiling"] = row["pallas_tflops"] * 1e12 / BF16_FLOPS
      rows.append(row)
      print(f"prefill D={head_dim} S={seq:<5d} pallas {row['pallas_us']:8.1f} us "
            f"({row['pallas_tflops']:6.1f} TFLOP/s) xla {row['xla_us']:8.1f} "
            f"torch {row['torch_sdpa_us'] or float('nan'):8.1f} err {error:.1e}", flush=True)
  return rows


def _paged_inputs(seed: int, layers: int, q_lens, seq_lens, page_size: int, width: int, heads: int,
                  kv_heads: int, head_dim: int):
  """A function returning a flat batch (sequence r: q_lens[r] query tokens, seq_lens[r]
  positions after the call: their heads fused, qkv [A, N + 2K, H]) over a random bfloat16 paged
  cache [L, M, C, K, H], fresh on each call (each timing donates its own), with random block
  tables [R, W] (every page distinct, M = R W + 1)."""
  keys = jax.random.split(jax.random.key(seed), 4)
  tokens, sequences = sum(q_lens), len(q_lens)
  pages = sequences * width + 1
  cache_shape = (layers, pages, page_size, kv_heads, head_dim)
  qkv = jax.random.normal(keys[0], (tokens, heads + 2 * kv_heads, head_dim), jnp.bfloat16)
  tables = jax.random.permutation(keys[3], pages)[:sequences * width].reshape(sequences, width)
  index = (tables.astype(jnp.int32), jnp.asarray(seq_lens, jnp.int32),
           jnp.asarray([0, *itertools.accumulate(q_lens)], jnp.int32))

  def inputs():
    return (qkv, *(jax.random.normal(k, cache_shape, jnp.bfloat16) for k in keys[2:4]), *index)
  return inputs


# Where the paged inputs hold the caches.
PAGED_CACHES = (1, 2)


def _paged_attend(config, decode_only: bool = False):
  def attend(qkv, k_pages, v_pages, tables, lens, starts, *, layer):
    return ragged_paged_attention(qkv, k_pages, v_pages, jnp.int32(layer), tables, lens, starts,
                                  config=config, decode_only=decode_only, interpret=INTERPRET)
  return attend


def _mosaic_attend(config):
  def attend(qkv, k_pages, v_pages, tables, lens, starts, *, layer):
    return mosaic_prefill_attention(qkv, k_pages, v_pages, jnp.int32(layer), tables, lens,
                                    starts, config=config, interpret=INTERPRET)
  return attend


def _paged_error(inputs, config, decode_only: bool = False, reference=None) -> float:
  """Relative error of the kernel's attention (the Mosaic GPU kernel's for a
  MosaicPrefillConfig) against `reference` [A, N, H], by default the paged jnp reference (fresh
  caches each; memory A x W C x K x H)."""
  qkv, k_pages, v_pages, *index = inputs()
  if isinstance(config, MosaicPrefillConfig):
    out = _mosaic_attend(config)(qkv, k_pages, v_pages, *index, layer=0)[0]
  else:
    out = ragged_paged_attention(qkv, k_pages, v_pages, jnp.int32(0), *index, config=config,
                                 decode_only=decode_only, interpret=INTERPRET)[0]
  if reference is None:
    reference = ragged_paged_attention_reference(*inputs()[:3], 0, *index)[0]
  return relative_error(out, reference)


def paged_decode_rows(models, batches, cache_len: int, position: int, page_sizes):
  """Decode rows (one token each at `position`) of the ragged paged kernel at each model's
  heads over its layers."""
  rows = []
  for model in models:
    c = PRESETS[model]
    for batch in batches:
      floor = 2 * batch * (position + 1) * c.num_kv_heads * c.head_dim * 2 / HBM_BYTES_PER_S * 1e6
      for page_size in page_sizes:
        inputs = _paged_inputs(batch, c.num_layers, [1] * batch, [position + 1] * batch,
                               page_size, cache_len // page_size, c.num_heads, c.num_kv_heads,
                               c.head_dim)
        # The decode specialization (what the engine's decode steps run), then the general
        # kernel on the same rows at its default.
        timed = [(layers_us(_paged_attend(config, True), inputs(), c.num_layers,
                            caches=PAGED_CACHES), config)
                 for config in PAGED_DECODE_CONFIGS]
        general_us = layers_us(_paged_attend(PAGED_DECODE_CONFIGS[0]), inputs(), c.num_layers,
                               caches=PAGED_CACHES)
        default_us = timed[0][0]
        best_us, best = min(timed, key=lambda t: t[0])
        row = dict(kernel="ragged_paged_attention", phase="decode", model=model, batch=batch,
                   cache_len=cache_len, length=position + 1, page_size=page_size,
                   heads=c.num_heads, kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                   layers=c.num_layers, floor_us=floor,
                   decode_only=True, general_default_us=general_us,
                   default_us=default_us, pallas_us=best_us, pallas_config=dataclasses.asdict(best),
                   all_us={f"s{c.split_size}_m{c.min_programs}_w{c.num_warps}_st{c.num_stages}":
                           us for us, c in timed},
                   rel_error_vs_xla=_paged_error(inputs, best, True),
                   pallas_bandwidth_share=floor / best_us)
        rows.append(row)
        print(f"paged decode {model:13s} B={batch:<3d} C={page_size:<3d} default "
              f"{default_us:6.1f} best {best_us:6.1f} us/layer (general {general_us:6.1f}), "
              f"floor {floor:5.1f}, err {row['rel_error_vs_xla']:.1e}", flush=True)
  return rows


def paged_prefill_rows(seq_lens, page_size: int, batch=4, heads=32, kv_heads=8, head_dim=64):
  """Fresh prompts (`batch` sequences of S tokens, causal) through the ragged paged kernel,
  keys and values written into pages, against the flash kernel (best config) and SDPA."""
  rows = []
  for seq in seq_lens:
    inputs = _paged_inputs(seq, 1, [seq] * batch, [seq] * batch, page_size,
                           -(-seq // page_size), heads, kv_heads, head_dim)
    timed = [(layers_us(_paged_attend(config), inputs(), 1, caches=PAGED_CACHES), config)
             for config in PAGED_PREFILL_CONFIGS]
    best_us, best = min(timed, key=lambda t: t[0])
    mosaic = [(layers_us(_mosaic_attend(config), inputs(), 1, caches=PAGED_CACHES), config)
              for config in MOSAIC_PREFILL_CONFIGS]
    mosaic_us, mosaic_best = min(mosaic, key=lambda t: t[0])
    # The flash kernel on the same tokens, [B, S, N, H] / [B, S, K, H].
    q, k, v = (x.reshape(batch, seq, *x.shape[1:]) for x in split_qkv(inputs()[0], kv_heads))
    lengths = jnp.full((batch,), seq, jnp.int32)
    # Fresh prompts: the dense causal reference [B S, N, H] (the paged one would gather
    # A x W C x K x H: 68 GB at 4 x 4096)
    reference = flash_attention_reference(q, k, v, lengths).reshape(batch * seq, heads, head_dim)
    flash_us, flash_config, _ = fastest(
        ((config, jax.jit(functools.partial(flash_attention, config=config,
                                            interpret=INTERPRET)))
         for config in PREFILL_CONFIGS[::2]),
        _median_us, q, k, v, lengths)


    flops = 4 * batch * heads * seq * seq * head_dim / 2
    row = dict(kernel="ragged_paged_attention", phase="prefill", batch=batch, seq_len=seq,
               page_size=page_size, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
               pallas_us=best_us, pallas_config=dataclasses.asdict(best),
               all_us={f"t{c.tile_rows}_k{c.block_k}_w{c.num_warps}_s{c.num_stages}": us
                       for us, c in timed},
               flash_us=flash_us, flash_config=dataclasses.asdict(flash_config),
               torch_sdpa_us=causal_sdpa_us(q, k, v),
               rel_error_vs_xla=_paged_error(inputs, best, reference=reference),
               pallas_tflops=flops / best_us / 1e6,
               mosaic_us=mosaic_us, mosaic_config=dataclasses.asdict(mosaic_best),
               mosaic_all_us={f"c{c.consumers}_steps{c.max_concurrent_steps}_k{c.block_kv}"
                              f"{'_pingpong' if c.pingpong and c.consumers == 2 else ''}": us
                              for us, c in mosaic},
               mosaic_rel_error=_paged_error(inputs, mosaic_best, reference=reference),
               mosaic_tflops=flops / mosaic_us / 1e6)
    rows.append(row)
    print(f"paged prefill {batch}x{heads}/{kv_heads} S={seq:<5d} C={page_size}: {best_us:8.1f} us "
          f"({row['pallas_tflops']:5.1f}"
          f" TFLOP/s, {best.tile_rows} rows x {best.block_k} keys, {best.num_warps} warps), mosaic "
          f"{mosaic_us:8.1f} ({row['mosaic_tflops']:5.1f} TFLOP/s, "
          f"{mosaic_best.consumers} x {mosaic_best.max_concurrent_steps} steps, err "
          f"{row['mosaic_rel_error']:.1e}), flash "
          f"{flash_us:8.1f}, torch {row['torch_sdpa_us'] or float('nan'):8.1f}, err "
          f"{row['rel_error_vs_xla']:.1e}", flush=True)
  return rows


def mosaic_probe_rows(seq_lens, batch=4, heads=32, kv_heads=8, head_dims=(64, 128)):
  """The Mosaic GPU backend on the same prefill shapes: jax's bundled FlashAttention-3 kernel
  (jax.experimental.pallas.ops.gpu.attention_mgpu, bfloat16, causal, no padding lengths) over a
  block search, and its error on right-padded rows (valid queries only) against the reference."""
  try:
    from jax.experimental.pallas.ops.gpu import attention_mgpu
  except ImportError as err:
    return [dict(kernel="mosaic_gpu_fa3_probe", error=f"ImportError: {err}")]
  rows = []
  for head_dim in head_dims:
    for seq in seq_lens:
      q, k, v, lengths = _random_inputs(seq + head_dim, (batch, seq, heads, head_dim),
                                        (batch, seq, kv_heads, head_dim), batch, seq)
      row = dict(kernel="mosaic_gpu_fa3_probe", batch=batch, seq_len=seq, heads=heads,
                 kv_heads=kv_heads, head_dim=head_dim, dtype="bfloat16")
      best = None
      for block_q, block_kv, steps in itertools.product((64, 128), (64, 128, 256), (2, 4)):
        if seq % (2 * block_q) or seq % block_kv:
          continue
        try:
          config = attention_mgpu.TuningConfig(block_q=block_q, block_kv=block_kv,
                                               max_concurrent_steps=steps, causal=True)
          fn = jax.jit(functools.partial(attention_mgpu.attention, config=config))
          us = _median_us(fn, q, k, v)
        except Exception as err:  # shared-memory limits, unsupported shapes: record and go on
          row.setdefault("errors", []).append(f"{block_q}/{block_kv}/{steps}: "
                                              f"{type(err).__name__}: {str(err)[:160]}")
          continue
        if best is None or us < best[0]:
          best = (us, dict(block_q=block_q, block_kv=block_kv, max_concurrent_steps=steps), fn)
      if best is not None:
        reference = jax.jit(flash_attention_reference)
        # Right-padded rows: causal attention never lets a valid query see a padding key.
        padded = jnp.array([seq, seq - 1, seq // 2 + 3, 1][:batch], jnp.int32)
        want = reference(q, k, v, padded)
        got = best[2](q, k, v)
        valid = (jnp.arange(seq)[None, :] < padded[:, None])[:, :, None, None]
        padded_error = float(jnp.max(jnp.where(valid, jnp.abs(got.astype(jnp.float32)
                                                              - want.astype(jnp.float32)), 0))
                             / jnp.max(jnp.abs(want.astype(jnp.float32))))
        row.update(mosaic_us=best[0], mosaic_config=best[1],
                   rel_error_vs_xla=relative_error(got, reference(q, k, v, lengths)),
                   padded_rel_error=padded_error,
                   mosaic_tflops=4 * batch * heads * seq * seq * head_dim / 2 / best[0] / 1e6)
      rows.append(row)
      print(f"mosaic probe D={head_dim} S={seq}: {row.get('mosaic_us', float('nan')):8.1f} us "
            f"{row.get('mosaic_config')} {row.get('errors', '')}", flush=True)
  return rows


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
  parser.add_argument("--batches", default="1,8,32", help="paged: decode batch sizes")
  parser.add_argument("--cache-lens", default="1024",
                      help="paged: the decode rows' cache length (the first of the list)")
  parser.add_argument("--step-position", type=int, default=512,
                      help="paged: the decode rows' new token position (its length - 1)")
  parser.add_argument("--seq-lens", default="512,2048")
  parser.add_argument("--head-dims", default="64,128", help="prefill, mosaic-probe: D")
  parser.add_argument("--smoke", action="store_true", help="tiny shapes in the interpreter (CPU)")
  parser.add_argument("--parts", default="prefill",
                      help="comma list of prefill, paged (decode and prefill rows), paged-prefill, "
                           "mosaic-probe (GPU only)")
  parser.add_argument("--page-sizes", default="16,64", help="paged: decode page sizes C")
  parser.add_argument("--paged-seq-lens", default="512,2048,4096",
                      help="paged: prompt lengths (page size the last of --page-sizes)")
  parser.add_argument("--paged-prefill-shapes", default="4x32/8",
                      help="paged, paged-prefill: prompts x query heads / KV heads, comma list "
                           "(gpt2's: 1x12/12,4x12/12)")
  parser.add_argument("--step-models", default="gpt2,gpt2-large,llama-3.2-1b",
                      help="paged: the decode rows' model shapes (heads, layers)")
  args = parser.parse_args()
  if args.smoke:
    global INTERPRET
    INTERPRET = True
    global PREFILL_CONFIGS, PAGED_DECODE_CONFIGS, PAGED_PREFILL_CONFIGS, MOSAIC_PREFILL_CONFIGS
    PREFILL_CONFIGS = PREFILL_CONFIGS[:1]
    PAGED_DECODE_CONFIGS = PAGED_DECODE_CONFIGS[:2]
    PAGED_PREFILL_CONFIGS = PAGED_PREFILL_CONFIGS[:1]
    MOSAIC_PREFILL_CONFIGS = (MosaicPrefillConfig(consumers=1),)  # (two hang on 2 CPU cores)
    args.paged_prefill_shapes = "1x4/2"
    args.batches, args.cache_lens, args.seq_lens = "1", "256", "64"
    args.page_sizes, args.paged_seq_lens, args.step_position = "64", "48", 100
    args.step_models = "tiny-gpt2"
  commit = git_commit()
  meta = dict(gpu=jax.devices()[0].device_kind, jax_version=jax.__version__, commit=commit,
              date=datetime.date.today().isoformat(), dtype="bfloat16")
  parts = args.parts.split(",")
  head_dims = tuple(int(d) for d in args.head_dims.split(","))
  rows = []
  removed = sorted({"decode", "decode-step"} & set(parts))
  if removed:
    parser.error(f"--parts {','.join(removed)}: removed with the slot-cache decode kernel")
  if "prefill" in parts:
    rows += prefill_rows([int(s) for s in args.seq_lens.split(",")], head_dims=head_dims)
  page_sizes = [int(c) for c in args.page_sizes.split(",")]
  if "paged" in parts:
    cache_len = int(args.cache_lens.split(",")[0])
    rows += paged_decode_rows(args.step_models.split(","),
                              [int(b) for b in args.batches.split(",")], cache_len,
                              min(args.step_position, cache_len - 1), page_sizes)
  if "paged" in parts or "paged-prefill" in parts:
    for shape in args.paged_prefill_shapes.split(","):
      batch, heads = shape.split("x")
      query_heads, kv_heads = (int(h) for h in heads.split("/"))
      rows += paged_prefill_rows([int(s) for s in args.paged_seq_lens.split(",")],
                                 page_sizes[-1], batch=int(batch),
                                 heads=query_heads, kv_heads=kv_heads)
  if "mosaic-probe" in parts:
    rows += mosaic_probe_rows([int(s) for s in args.seq_lens.split(",")], head_dims=head_dims)
  rows = [dict(meta, **r) for r in rows]
  write_rows(args.out, "attention_rows.json", rows)
  print("\nkernel           shape                pallas_us   xla_us  torch_us  share_of_ceiling")
  for r in rows:
    if r["kernel"] == "ragged_paged_attention" and r["phase"] == "decode":
      print(f"paged decode     {r['model']} B={r['batch']} C={r['page_size']}  default "
            f"{r['default_us']:7.1f} best {r['pallas_us']:7.1f} us/layer  floor "
            f"{r['floor_us']:5.1f} {r['pallas_bandwidth_share']:6.2f}")
      continue
    if r["kernel"] == "ragged_paged_attention":
      print(f"paged prefill    {r['batch']}x{r['heads']}/{r['kv_heads']} S={r['seq_len']} "
            f"C={r['page_size']}  {r['pallas_us']:9.1f} us  "
            f"flash {r['flash_us']:9.1f}  torch {r['torch_sdpa_us'] or float('nan'):9.1f}  "
            f"{r['pallas_tflops']:6.1f} TFLOP/s")
      continue
    if r["kernel"] == "mosaic_gpu_fa3_probe":
      print(f"{r['kernel']:16s} D={r.get('head_dim')} S={r.get('seq_len')} "
            f"{r.get('mosaic_us', float('nan')):9.1f} us  {r.get('mosaic_config')} err "
            f"{r.get('rel_error_vs_xla', float('nan')):.1e} padded "
            f"{r.get('padded_rel_error', float('nan')):.1e}")
      continue
    shape = f"D={r['head_dim']} S={r['seq_len']}"
    print(f"{r['kernel']:16s} {shape:20s} {r['pallas_us']:9.1f} {r['xla_us']:8.1f} "
          f"{r['torch_sdpa_us'] or float('nan'):9.1f} {r['pallas_share_of_ceiling']:8.2f}")


if __name__ == "__main__":
  main()
