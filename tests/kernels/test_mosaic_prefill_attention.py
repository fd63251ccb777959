"""The Mosaic GPU prompt-chunk kernel in the Mosaic GPU interpreter against float64 NumPy attention
over each sequence's keys (cases like test_ragged_paged_attention's at the kernel's sizes: head
dim 64, pages of 64, 16-bit), its pages' writes slot by slot, its tiles, its validation, and its
lowering for an H200.

The interpreter runs a program's warpgroups as concurrent XLA computations, each blocking in its
barrier waits. On the 2-core CI machine a process that had run three two-consumer programs (two
consumers and the producer) hung in its next one, while each ran to the end in a fresh process:
below 4 cores every two-consumer case runs in a process of its own."""

from __future__ import annotations

import functools
import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cg_jax.kernels.mosaic_prefill_attention import (ALIGN, SUPPORTED, WG_ROWS,
                                                     MosaicPrefillConfig, aligned_tiles,
                                                     mosaic_prefill_attention)
from tests.kernels.kernel_test_base import lower_for_h200
from tests.kernels.test_ragged_paged_attention import (Case, _expected, _fused, _inputs,
                                                       check_result)

CASES = [
    # GQA 2: a chunk after context (its start not aligned), a fresh prompt over two tiles and
    # several key blocks, a sequence with no query token, a decode row after a cached page and
    # a bit; padding tokens past them all.
    Case("bfloat16", 4, 2, (5, 200, 0, 1), (70, 0, 3, 130), padding=3, head_dim=64,
         page_size=64),
    # MHA, a tile's worth past a cached page, then a fresh prompt starting at an odd token
    Case("bfloat16", 2, 2, (130, 67), (64, 0), padding=0, head_dim=64, page_size=64),
    # MQA (group 8), regions with padding after their query tokens (query_lens), a long fresh
    # prompt reaching past the array's end in its last key block
    Case("float16", 8, 1, (1, 9, 260), (10, 200, 0), gaps=(3, 6, 0), padding=5, head_dim=64,
         page_size=64),
    # the engine's default pages of 16 (four copies a key block), and pages of 32
    Case("bfloat16", 4, 2, (5, 200, 0, 1), (70, 0, 3, 130), padding=3, head_dim=64,
         page_size=16),
    Case("bfloat16", 4, 4, (70, 3), (33, 90), padding=0, head_dim=64, page_size=32),
]


# Below this many cores a two-consumer case runs in a fresh process (module docstring).
SHARED_PROCESS_CORES = 4
NEEDS_0_11 = pytest.mark.skipif(not SUPPORTED,
                                reason=f"the kernel needs jax >= 0.11 (jax {jax.__version__})")


@NEEDS_0_11
@pytest.mark.parametrize("consumers", [1, 2])
@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("block_kv", [64, 128])
def test_matches_float64_attention_and_writes_only_the_new_slots(case, consumers, block_kv):
  if consumers == 1 or (os.cpu_count() or 1) >= SHARED_PROCESS_CORES:
    check_case(case, consumers, block_kv)
    return
  root = pathlib.Path(__file__).resolve().parents[2]
  code = (f"import sys; sys.path.insert(0, {str(root)!r}); "
          f"from tests.kernels import test_mosaic_prefill_attention as t; "
          f"t.check_case(t.CASES[{CASES.index(case)}], {consumers}, {block_kv})")
  done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                        timeout=600, env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert done.returncode == 0, done.stderr[-3000:]


def check_case(case, consumers: int, block_kv: int) -> None:
  """The kernel in the interpreter against float64 attention and the pages' expected slots."""
  longest = max(q + c for q, c in zip(case.q_lens, case.context))
  arrays, index = _inputs(case, width=-(-longest // case.page_size))
  layer = 1
  expected = _expected(case, arrays, index, layer)  # (before the call donates the pages)
  got = mosaic_prefill_attention(**_fused(arrays), layer=jnp.int32(layer), **index,
                                 config=MosaicPrefillConfig(consumers=consumers,
                                                            max_concurrent_steps=2,
                                                            block_kv=block_kv),
                                 interpret=True)
  check_result(case, index, got, expected, "mosaic attention")


@pytest.mark.parametrize("consumers", [1, 2])
@pytest.mark.parametrize("q_lens,gaps,tokens", [((1, 5, 0, 20), (0, 0, 0, 0), 30),
                                                ((130, 1, 300), (2, 0, 0), 500),
                                                ((0, 0, 3), (0, 0, 0), 3), ((7,), (0,), 400)])
def test_tiles_start_aligned_and_store_every_token_once(q_lens, gaps, tokens, consumers):
  starts = np.concatenate([[0], np.cumsum(np.add(q_lens, gaps))]).astype(np.int32)
  sequences = len(q_lens)
  meta, tables = aligned_tiles(jnp.asarray(starts), jnp.asarray(q_lens, jnp.int32),
                               jnp.asarray(q_lens, jnp.int32) + 4,
                               jnp.arange(sequences, dtype=jnp.int32)[:, None], tokens,
                               consumers)
  first, q_begin, q_len, _, region_end, active = np.asarray(meta)
  assert np.all(first % ALIGN == 0)
  owner = np.full(tokens, -1)
  for t in range(meta.shape[1]):
    stored = np.arange(max(first[t], q_begin[t]),
                       min(first[t] + consumers * WG_ROWS, region_end[t]))
    assert np.all(owner[stored] == -1), t
    owner[stored] = t
    if active[t]:  # its sequence's block table and query tokens
      seq = int(np.searchsorted(starts[1:], q_begin[t], side="right"))
      assert tables[t, 0] == seq and q_len[t] == q_lens[seq]
  assert np.all(owner >= 0)  # every token's row stored, the padding's too


def test_bad_inputs_raise_naming_the_argument():
  case = CASES[0]
  arrays, index = _inputs(case, width=8)
  arrays = _fused(arrays)
  call = functools.partial(mosaic_prefill_attention, layer=jnp.int32(0), interpret=True)
  with pytest.raises(ValueError, match="bfloat16 or float16"):
    call(**{k: v.astype(jnp.float32) for k, v in arrays.items()}, **index)
  with pytest.raises(ValueError, match="head_dim must be a multiple of 64"):
    call(**{k: v[..., :32] for k, v in arrays.items()}, **index)
  for size in (8, 48):
    small = dict(arrays, k_pages=arrays["k_pages"][:, :, :size],
                 v_pages=arrays["v_pages"][:, :, :size])
    with pytest.raises(ValueError, match="page size C must be 16, 32 or a multiple of 64"):
      call(**small, **index)
  with pytest.raises(ValueError, match="max_concurrent_steps must be an int >= 1"):
    MosaicPrefillConfig(max_concurrent_steps=0)
  with pytest.raises(ValueError, match="consumers must be 1 or 2"):
    MosaicPrefillConfig(consumers=3)
  with pytest.raises(ValueError, match="block_kv must be 64 or 128"):
    MosaicPrefillConfig(block_kv=32)
  if not SUPPORTED:  # (the py311 lane's jax 0.10)
    with pytest.raises(NotImplementedError, match="needs jax >= 0.11"):
      call(**arrays, **index)


@NEEDS_0_11
@pytest.mark.parametrize("head_dim,page,block_kv", [(64, 64, 64), (128, 64, 64), (64, 16, 64),
                                                   (64, 64, 128)])
def test_lowers_to_mosaic_gpu_for_h200(head_dim, page, block_kv):
  heads, kv_heads, tokens, sequences = 32, 8, 4096, 4
  width = 2048 // page
  spec = jax.ShapeDtypeStruct
  pages = spec((2, sequences * width + 1, page, kv_heads, head_dim), jnp.bfloat16)
  text = lower_for_h200(
      lambda *args: mosaic_prefill_attention(*args, config=MosaicPrefillConfig(block_kv=block_kv)),
      spec((tokens, heads + 2 * kv_heads, head_dim), jnp.bfloat16), pages, pages,
      spec((), jnp.int32), spec((sequences, width), jnp.int32), spec((sequences,), jnp.int32),
      spec((sequences + 1,), jnp.int32), donate_argnums=(1, 2))
  assert len(re.findall(r"custom_call @mosaic_gpu\w*\(", text)) == 1
