"""Probe: does Pallas's Mosaic GPU backend run our decode attention on an H200, and how fast?

Measures, at jax's own version (0.11.2 on the GPU machine), whether a Mosaic GPU
(`jax.experimental.pallas.mosaic_gpu`) flash-decoding kernel with the semantics of
`cg_jax.kernels.decode_attention.decode_attention` (one new query token per row, keys
0..lengths[b]-1 attend, masked float32 online softmax, GQA, bf16, head_dim 64) lowers, compiles
and runs, and how its time compares with our Triton kernel and with the HBM floor (the KV bytes
read up to the length at 4.2e12 B/s).

The Mosaic kernel (`mosaic_decode_attention`):
  * grid (split, KV head, batch row), one warpgroup (128 threads) per program;
  * wgmma needs M = 64 rows, and a TMA copy into the 128-byte-swizzled SMEM tile must start on
    its 8-row boundary (kv_head * G, a multiple of 4 for Llama-3.2-1B, is not: layout inference
    rejects it). So each program TMA-copies all N query rows of its batch row (N <= 64, a
    multiple of 8; 4 KiB, mostly L2 hits) into rows 0..N-1 of a 64-row tile and keeps its group's
    rows kv_head * G .. + G - 1. The other rows (other groups' queries, and rows N..63 never
    written) give rows of scores and outputs that are never stored: wgmma rows and softmax rows
    are independent, so they cannot reach the stored ones. The tensor cores do 16x the needed
    work, which decode (memory-bound) can afford;
  * it walks the blocks of its split that hold keys below the length (a dynamic trip count;
    splits past the length read nothing) in blocks of `block_k` = 64 keys, `stages` blocks in
    flight: K and V blocks are TMA-copied [block_k, H] (strided, from the [B, T, K, H] cache) into
    128-byte-swizzled SMEM; scores [64, block_k] = wgmma(q_smem, k_smem^T); keys >= length are
    masked with an iota compare (the last block's keys past the length are read, then masked);
    online softmax in float32 (base 2, scale folded into log2 e); acc [64, H] += wgmma(p bf16
    registers, v_smem);
  * per-split partials (acc [G, H], max and denominator [G], float32) are staged in SMEM,
    bulk-copied to GMEM (the [G] rows are G * 4 bytes, which the copy needs to be a multiple of
    16: G = 4 is), and combined in jnp by our `combine_splits`, always (also for one split).

Limits of this prototype: bf16/f16, head_dim 64, N <= 64 and a multiple of 8, G a multiple of
4, T a multiple of the split; the last block's keys past the length are read (then masked). The
Mosaic GPU interpreter (plgpu.force_gpu_interpret_mode) has no wgmma rule on CPU, so the
numbers are checked only on the GPU.

Run:
  JAX_PLATFORMS=cpu PYTHONPATH=. python benchmarks/mosaic_decode_probe.py --lower-only
      (CPU: lowers each shape for an abstract H200; PTX is only compiled on a GPU)
  PYTHONPATH=. python benchmarks/mosaic_decode_probe.py      (H200: checks and times)
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import os
import statistics
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from cg_jax.kernels.decode_attention import (DecodeAttentionConfig, combine_splits,
                                             decode_attention, decode_attention_reference,
                                             split_layout)

HBM_BYTES_PER_S = 4.2e12  # the H200's measured device-to-device copy bandwidth
WGMMA_M = 64  # wgmma's row count: the query group is held as this many rows
LOG2E = math.log2(math.e)


def _mosaic_partials(q, k_cache, v_cache, lengths, *, block_k: int, split_size: int,
                     stages: int, sm_scale: float):
  """The Mosaic GPU kernel: per-split partials (acc [B, K, S, G, H], max and denom [B, K, S, G],
  float32, the max in natural-log units) for `combine_splits`."""
  batch, num_q_heads, head_dim = q.shape
  _, cache_len, num_kv_heads, _ = k_cache.shape
  group = num_q_heads // num_kv_heads
  num_splits = pl.cdiv(cache_len, split_size)
  blocks_per_split = split_size // block_k
  stages = max(1, min(stages, blocks_per_split))
  dtype = q.dtype
  # Scores in base 2: exp(s * scale - m) = exp2(s * scale * log2 e - m').
  score_scale = sm_scale * LOG2E

  def kernel(lengths_ref, q_ref, k_ref, v_ref, acc_out, max_out, denom_out, q_smem, k_smem,
             v_smem, acc_smem, max_smem, denom_smem, q_barrier, k_barriers, v_barriers):
    split = lax.axis_index("split")
    kv_head = lax.axis_index("kv_head")
    row = lax.axis_index("batch")
    length = lengths_ref[row]
    split_start = split * split_size
    # Blocks of this split holding at least one key below the length (0 past it).
    keys_left = jnp.maximum(length - split_start, 0)
    num_blocks = jnp.minimum((keys_left + block_k - 1) // block_k, blocks_per_split)

    # q [B, N, H]: all N query rows of this batch row into rows 0..N-1 of q_smem [64, H] (a TMA
    # slice must start on the SMEM tile's 8-row boundary, and kv_head * G need not); this
    # group's rows are first_row..first_row+G-1, the other rows are unused.
    first_row = kv_head * group
    plgpu.copy_gmem_to_smem(q_ref.at[row], q_smem.at[pl.ds(0, num_q_heads)], q_barrier)

    def issue(block, slot):
      # [block_k, H] of the [B, T, K, H] caches (strided rows).
      keys = (row, pl.ds(split_start + block * block_k, block_k), kv_head)
      plgpu.copy_gmem_to_smem(k_ref.at[keys], k_smem.at[slot], k_barriers.at[slot])
      plgpu.copy_gmem_to_smem(v_ref.at[keys], v_smem.at[slot], v_barriers.at[slot])

    for i in range(stages):
      pl.when(i < num_blocks)(functools.partial(issue, i, i))
    plgpu.barrier_wait(q_barrier)

    def attend_block(block, carry):
      acc, row_max, denom = carry
      slot = lax.rem(block, jnp.array(stages, block.dtype))
      plgpu.barrier_wait(k_barriers.at[slot])

      # [64, block_k] = q_smem [64, H] . k_smem[slot]^T [H, block_k]
      def compute_scores(scores_ref):
        plgpu.wgmma(scores_ref, q_smem, k_smem.at[slot].T)
        return scores_ref[...]

      scores = pl.run_scoped(compute_scores, plgpu.ACC((WGMMA_M, block_k), jnp.float32))
      # [64, block_k] key positions relative to this block; keys >= length are masked.
      key_ids = plgpu.broadcasted_iota(jnp.int32, (WGMMA_M, block_k), 1,
                                       layout=plgpu.Layout.WGMMA)
      valid_keys = length - (split_start + block * block_k)
      scores = jnp.where(key_ids < valid_keys, scores * score_scale, -jnp.inf)
      # [64]; each block in the loop has a valid key, so new_max is finite.
      new_max = jnp.maximum(row_max, scores.max(axis=1))
      rescale = jnp.exp2(row_max - new_max)
      # [64, block_k]
      probs = jnp.exp2(scores - lax.broadcast_in_dim(new_max, scores.shape, [0]))
      denom = denom * rescale + probs.sum(axis=1)
      acc = acc * lax.broadcast_in_dim(rescale, acc.shape, [0])
      plgpu.barrier_wait(v_barriers.at[slot])

      # [64, H] += probs [64, block_k] . v_smem[slot] [block_k, H]
      def compute_values(acc_ref):
        plgpu.wgmma(acc_ref, probs.astype(dtype), v_smem.at[slot])

      acc = pl.run_state(compute_values)(plgpu.ACC.init(acc))
      # Both wgmmas on this slot are done (their results were read): refill it.
      pl.when(block + stages < num_blocks)(lambda: issue(block + stages, slot))
      return acc, new_max, denom

    initial = (
        plgpu.layout_cast(jnp.zeros((WGMMA_M, head_dim), jnp.float32), plgpu.Layout.WGMMA),
        plgpu.layout_cast(jnp.full((WGMMA_M,), -jnp.inf, jnp.float32),
                          plgpu.Layout.WGMMA.reduce(1)),
        plgpu.layout_cast(jnp.zeros((WGMMA_M,), jnp.float32), plgpu.Layout.WGMMA.reduce(1)),
    )
    acc, row_max, denom = lax.fori_loop(0, num_blocks, attend_block, initial)
    acc_smem[...] = acc
    max_smem[...] = row_max
    denom_smem[...] = denom
    plgpu.commit_smem()
    # This group's rows only: [G, H] and [G].
    rows = pl.ds(first_row, group)
    plgpu.copy_smem_to_gmem(acc_smem.at[rows], acc_out.at[row, kv_head, split])
    plgpu.copy_smem_to_gmem(max_smem.at[rows], max_out.at[row, kv_head, split])
    plgpu.copy_smem_to_gmem(denom_smem.at[rows], denom_out.at[row, kv_head, split])
    plgpu.wait_smem_to_gmem(0)

  swizzled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
  out_type = (
      jax.ShapeDtypeStruct((batch, num_kv_heads, num_splits, group, head_dim), jnp.float32),
      jax.ShapeDtypeStruct((batch, num_kv_heads, num_splits, group), jnp.float32),
      jax.ShapeDtypeStruct((batch, num_kv_heads, num_splits, group), jnp.float32),
  )
  scratch = (
      plgpu.SMEM((WGMMA_M, head_dim), dtype, transforms=swizzled),
      plgpu.SMEM((stages, block_k, head_dim), dtype, transforms=swizzled),
      plgpu.SMEM((stages, block_k, head_dim), dtype, transforms=swizzled),
      plgpu.SMEM((WGMMA_M, head_dim), jnp.float32),
      plgpu.SMEM((WGMMA_M,), jnp.float32),
      plgpu.SMEM((WGMMA_M,), jnp.float32),
      plgpu.Barrier(num_barriers=1),
      plgpu.Barrier(num_barriers=stages),
      plgpu.Barrier(num_barriers=stages),
  )
  acc, row_max, denom = plgpu.kernel(
      kernel,
      out_type=out_type,
      scratch_types=scratch,
      grid=(num_splits, num_kv_heads, batch),
      grid_names=("split", "kv_head", "batch"),
      compiler_params=plgpu.CompilerParams(approx_math=True),
  )(lengths, q, k_cache, v_cache)
  # Base-2 maxima back to natural-log units (-inf stays -inf).
  return acc, row_max / LOG2E, denom


@functools.partial(jax.jit, static_argnames=("block_k", "split_size", "stages", "sm_scale"))
def mosaic_decode_attention(q, k_cache, v_cache, lengths, *, block_k: int = 64,
                            split_size: int | None = None, stages: int = 2,
                            sm_scale: float | None = None):
  """`decode_attention` (q [B, N, H], caches [B, T, K, H], lengths [B]) with a Mosaic GPU kernel.

  bf16 (or f16), head_dim a multiple of 64, N // K <= 64 and T a multiple of `split_size`.
  split_size None: `split_layout` with the Triton kernel's default config (same launch shape).
  Returns [B, N, H] in q's dtype.
  """
  batch, num_q_heads, head_dim = q.shape
  _, cache_len, num_kv_heads, _ = k_cache.shape
  group = num_q_heads // num_kv_heads
  if (q.dtype not in (jnp.bfloat16, jnp.float16) or head_dim != 64 or num_q_heads > WGMMA_M
      or num_q_heads % 8 or group % 4):
    raise ValueError(f"mosaic_decode_attention: bf16/f16, head_dim 64, N <= 64 and a multiple "
                     f"of 8, N // K a multiple of 4; got "
                     f"q {q.shape} {q.dtype}, k_cache {k_cache.shape}")
  if split_size is None:
    split_size, _ = split_layout(batch, num_kv_heads, cache_len,
                                 DecodeAttentionConfig(block_k=block_k))
  if split_size % block_k or cache_len % split_size:
    raise ValueError(f"split_size {split_size} must be a multiple of block_k {block_k} and "
                     f"divide T {cache_len}")
  if sm_scale is None:
    sm_scale = 1.0 / math.sqrt(head_dim)
  lengths = jnp.clip(lengths.astype(jnp.int32), 0, cache_len)
  partials = _mosaic_partials(q, k_cache, v_cache, lengths, block_k=block_k,
                              split_size=split_size, stages=stages, sm_scale=float(sm_scale))
  # [B, K, G, H] -> [B, N, H]
  out = combine_splits(*partials)
  return out.reshape(batch, num_q_heads, head_dim).astype(q.dtype)


# ---------------------------------------------------------------------------------------------
# The probe.

BATCHES = (1, 8, 32)
CACHE_LENS = (1024, 4096)
MOSAIC_OPTIONS = {}  # block_k / split_size / stages for mosaic_decode_attention (flags)
HEADS, KV_HEADS, HEAD_DIM = 32, 8, 64
CHAIN = 50  # kernel calls chained inside one jit per timed call


def _shapes():
  """(batch, cache_len, length) for every probed shape: half-full and full caches."""
  return [(b, t, length) for b in BATCHES for t in CACHE_LENS for length in (t // 2, t)]


def _specs(batch, cache_len):
  q = jax.ShapeDtypeStruct((batch, HEADS, HEAD_DIM), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((batch, cache_len, KV_HEADS, HEAD_DIM), jnp.bfloat16)
  return q, kv, kv, jax.ShapeDtypeStruct((batch,), jnp.int32)


def lower_for_h200(fn, *specs) -> str:
  """Lowers `fn` for an abstract NVIDIA H200 (works on a CPU-only machine): StableHLO text."""
  from jax.sharding import AbstractDevice, AbstractMesh
  mesh = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(
      device_kind="NVIDIA H200", num_cores=132, platform="gpu"))
  with jax.sharding.use_abstract_mesh(mesh):
    return jax.jit(fn).trace(*specs).lower(lowering_platforms=("cuda",)).as_text()


def _error_text(err: BaseException) -> str:
  return f"{type(err).__name__}: {err}"[:3000]


def lower_only() -> list[dict]:
  rows = []
  for batch, cache_len, length in _shapes():
    if length != cache_len:  # the length is data: one lowering per (B, T)
      continue
    row = dict(batch=batch, cache_len=cache_len)
    try:
      text = lower_for_h200(functools.partial(mosaic_decode_attention, **MOSAIC_OPTIONS),
                            *_specs(batch, cache_len))
      row.update(status="ok", mosaic_custom_call="mosaic_gpu" in text)
      print(f"B={batch:<3d} T={cache_len:<5d} OK (mosaic_gpu custom call: "
            f"{row['mosaic_custom_call']})", flush=True)
    except Exception as err:  # record and go on with the next shape
      row.update(status="failed", error=_error_text(err))
      print(f"B={batch:<3d} T={cache_len:<5d} FAILED {row['error']}", flush=True)
      traceback.print_exc()
    rows.append(row)
  return rows


def _chained(fn):
  """A jitted function that applies `fn` CHAIN times, each call's output the next call's query
  (same [B, N, H] shape), so one executable runs CHAIN kernels back to back."""
  def chain(q, k, v, lengths):
    for _ in range(CHAIN):
      q = fn(q, k, v, lengths)
    return q
  return jax.jit(chain)


def _per_call_us(chained, *args, rounds: int = 9) -> float:
  """Median over rounds of one chained call's wall time / CHAIN (after a warm-up call)."""
  jax.block_until_ready(chained(*args))
  times = []
  for _ in range(rounds):
    start = time.perf_counter()
    jax.block_until_ready(chained(*args))
    times.append((time.perf_counter() - start) / CHAIN)
  return statistics.median(times) * 1e6


def _back_to_back_us(fn, *args, calls: int = 200) -> float:
  """Per-call wall time of `calls` back-to-back dispatches of a jitted function (queue full)."""
  jax.block_until_ready(fn(*args))
  start = time.perf_counter()
  for _ in range(calls):
    out = fn(*args)
  jax.block_until_ready(out)
  return (time.perf_counter() - start) / calls * 1e6


def gpu_rows() -> list[dict]:
  triton = jax.jit(functools.partial(decode_attention, config=DecodeAttentionConfig()))
  mosaic = jax.jit(functools.partial(mosaic_decode_attention, **MOSAIC_OPTIONS))
  reference = jax.jit(decode_attention_reference)
  rows = []
  for batch, cache_len, length in _shapes():
    row = dict(batch=batch, cache_len=cache_len, length=length, heads=HEADS, kv_heads=KV_HEADS,
               head_dim=HEAD_DIM,
               hbm_floor_us=2 * batch * length * KV_HEADS * HEAD_DIM * 2 / HBM_BYTES_PER_S * 1e6)
    keys = jax.random.split(jax.random.key(batch * cache_len + length), 3)
    q = jax.random.normal(keys[0], (batch, HEADS, HEAD_DIM), jnp.bfloat16)
    k = jax.random.normal(keys[1], (batch, cache_len, KV_HEADS, HEAD_DIM), jnp.bfloat16)
    v = jax.random.normal(keys[2], (batch, cache_len, KV_HEADS, HEAD_DIM), jnp.bfloat16)
    lengths = jnp.full((batch,), length, jnp.int32)
    args = (q, k, v, lengths)
    ref = np.asarray(reference(*args), np.float64)
    scale = max(float(np.max(np.abs(ref))), 1e-30)
    for name, fn in (("triton", triton), ("mosaic", mosaic)):
      try:
        out = np.asarray(fn(*args), np.float64)
        err = float(np.max(np.abs(out - ref)))
        row[f"{name}_max_err"] = err
        row[f"{name}_ok"] = err <= 1e-2 * scale
        row[f"{name}_us"] = _per_call_us(_chained(fn), *args)
        row[f"{name}_call_us"] = _back_to_back_us(fn, *args)
      except Exception as err:  # lowering, compile or runtime: record and go on
        row[f"{name}_error"] = _error_text(err)
        print(f"B={batch} T={cache_len} len={length} {name}: FAILED {row[f'{name}_error'][:400]}",
              flush=True)
    rows.append(row)
    print(f"B={batch:<3d} T={cache_len:<5d} len={length:<5d} "
          f"triton {row.get('triton_us', float('nan')):7.1f} us "
          f"mosaic {row.get('mosaic_us', float('nan')):7.1f} us "
          f"err {row.get('mosaic_max_err', float('nan')):.2e}", flush=True)
  return rows


def _table(rows) -> str:
  lines = [f"{'shape (B, T, len)':<20} {'triton us':>10} {'mosaic us':>10} {'ratio':>7} "
           f"{'max err':>9} {'floor us':>9}  note"]
  for row in rows:
    triton_us, mosaic_us = row.get("triton_us", math.nan), row.get("mosaic_us", math.nan)
    note = row.get("mosaic_error", "") or row.get("triton_error", "")
    if "mosaic_ok" in row and not row["mosaic_ok"]:
      note = "MOSAIC WRONG " + note
    lines.append(f"{str((row['batch'], row['cache_len'], row['length'])):<20} {triton_us:>10.1f} "
                 f"{mosaic_us:>10.1f} {mosaic_us / triton_us:>7.2f} "
                 f"{row.get('mosaic_max_err', math.nan):>9.2e} {row['hbm_floor_us']:>9.2f}  "
                 f"{note[:120]}")
  return "\n".join(lines)


def main():
  global BATCHES, CACHE_LENS
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--lower-only", action="store_true",
                      help="lower each shape for an abstract H200 (CPU is enough) and stop")
  parser.add_argument("--batches", default=",".join(map(str, BATCHES)))
  parser.add_argument("--cache-lens", default=",".join(map(str, CACHE_LENS)))
  parser.add_argument("--block-k", type=int, default=64, help="Mosaic keys per block (64, 128)")
  parser.add_argument("--split-size", type=int, default=None,
                      help="Mosaic keys per split (default: split_layout, as the Triton kernel)")
  parser.add_argument("--stages", type=int, default=2, help="Mosaic K/V blocks in flight")
  args = parser.parse_args()
  BATCHES = tuple(int(x) for x in args.batches.split(","))
  CACHE_LENS = tuple(int(x) for x in args.cache_lens.split(","))
  MOSAIC_OPTIONS.update(block_k=args.block_k, split_size=args.split_size, stages=args.stages)
  result = dict(jax_version=jax.__version__, date=datetime.datetime.now().isoformat(),
                mode="lower-only" if args.lower_only else "gpu", mosaic_options=MOSAIC_OPTIONS)
  if args.lower_only:
    result["rows"] = lower_only()
  else:
    result["gpu"] = jax.devices()[0].device_kind
    rows = gpu_rows()
    result["rows"] = rows
    print(_table(rows))
  if os.environ.get("OUT"):
    path = os.path.join(os.environ["OUT"], "mosaic_decode_probe.json")
    with open(path, "w") as f:
      json.dump(result, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
  main()
