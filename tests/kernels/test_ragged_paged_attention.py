"""Ragged paged attention (interpret mode), its jnp reference and the engine's XLA path
(`cg_jax.core.attention.ragged_attention_xla`) against float64 NumPy attention over each sequence's
keys, on mixed batches: decode rows, prefill chunks after cached context,
fresh prompts, sequences with no query token and padding tokens; the pages' writes checked slot
by slot; validation; tiles; lowering for an H200."""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cg_jax.core.attention import ragged_attention_xla
from cg_jax.kernels.ragged_paged_attention import (RaggedPagedAttentionConfig,
                                                   ragged_paged_attention,
                                                   ragged_paged_attention_reference, tile_layout)
from tests.kernels.kernel_test_base import (assert_kernel_close, attention_reference,
                                            lower_for_h200, random_array)

# min_programs=0: the split sizes as given (several splits over the small block tables).
SPLITS = RaggedPagedAttentionConfig(block_k=16, split_size=32, min_programs=0)
ONE_SPLIT = RaggedPagedAttentionConfig(block_k=16, split_size=512, min_programs=0)


@dataclasses.dataclass(frozen=True)
class Case:
  dtype: str
  heads: int
  kv_heads: int
  q_lens: tuple[int, ...]  # query tokens per sequence this call
  context: tuple[int, ...]  # positions already in each sequence's pages
  padding: int = 3  # tokens past the last sequence's
  gaps: tuple[int, ...] = ()  # padding tokens after each sequence's query tokens (query_lens)
  config: RaggedPagedAttentionConfig = SPLITS
  head_dim: int = 16
  page_size: int = 16
  decode_only: bool = False  # the kernel's decode specialization (regions of one token)

  def __str__(self):
    return (f"{self.dtype}-N{self.heads}-K{self.kv_heads}-q{'_'.join(map(str, self.q_lens))}-"
            f"ctx{'_'.join(map(str, self.context))}-gaps{'_'.join(map(str, self.gaps))}-"
            f"split{self.config.split_size}{'-decode' if self.decode_only else ''}")


CASES = [
    # GQA 4: a decode row, a chunk after context, an empty sequence, a fresh prompt spanning
    # pages and tiles; several splits.
    Case("float32", 8, 2, (1, 5, 0, 20), (40, 11, 3, 0)),
    # the same in one split (normalised in the kernel)
    Case("float32", 8, 2, (1, 5, 0, 20), (40, 11, 3, 0), config=ONE_SPLIT),
    # MHA (16 tokens a tile), decode rows only, context on page boundaries
    Case("float32", 4, 4, (1, 1, 1), (15, 16, 47), padding=0),
    # a group of 3 (not a power of two), bf16, chunks straddling pages
    Case("bfloat16", 6, 2, (17, 2, 9), (31, 0, 16)),
    # MQA (group 8: 2 tokens a tile), bf16, head dim 32, one long prefill and a decode row
    Case("bfloat16", 8, 1, (33, 1), (0, 60), head_dim=32, config=ONE_SPLIT),
    # a grid of right-padded rows (regions of 8 tokens, query_lens): a chunk after context,
    # an idle row (no query token), a short fresh prompt; then decode rows with an idle one
    Case("float32", 8, 2, (5, 0, 3), (20, 7, 0), gaps=(3, 8, 5)),
    Case("bfloat16", 4, 4, (1, 0, 1), (30, 0, 16), gaps=(0, 1, 0), config=ONE_SPLIT),
    # The decode specialization (one token per sequence, token r is sequence r's): GQA over
    # several splits with an idle row and context on and off page boundaries; MHA in one
    # split; MQA with a sequence whose only key is its own.
    Case("float32", 8, 2, (1, 0, 1, 1), (40, 7, 16, 63), padding=0, gaps=(0, 1, 0, 0),
         decode_only=True),
    Case("bfloat16", 4, 4, (1, 1, 1), (15, 16, 47), padding=0, gaps=(0, 0, 0), config=ONE_SPLIT,
         decode_only=True),
    Case("bfloat16", 8, 1, (1, 1), (0, 60), padding=0, gaps=(0, 0), head_dim=32,
         decode_only=True),
]


def _inputs(case: Case, seed: int = 0, layers: int = 2, width: int = 4):
  rng = np.random.default_rng(seed)
  sequences = len(case.q_lens)
  gaps = case.gaps or (0,) * len(case.q_lens)
  starts = np.concatenate([[0], np.cumsum(np.add(case.q_lens, gaps))]).astype(np.int32)
  tokens = int(starts[-1]) + case.padding
  lens = np.asarray([q + c for q, c in zip(case.q_lens, case.context)], np.int32)
  num_pages = sequences * width + 3
  # Each sequence's blocks, shuffled over the pool (tables need not be ordered or contiguous).
  tables = rng.permutation(num_pages)[:sequences * width].reshape(sequences, width)
  shape = (layers, num_pages, case.page_size, case.kv_heads, case.head_dim)
  arrays = dict(
      q=random_array(rng, (tokens, case.heads, case.head_dim), case.dtype),
      k_new=random_array(rng, (tokens, case.kv_heads, case.head_dim), case.dtype),
      v_new=random_array(rng, (tokens, case.kv_heads, case.head_dim), case.dtype),
      k_pages=random_array(rng, shape, case.dtype), v_pages=random_array(rng, shape, case.dtype))
  index = dict(block_tables=jnp.asarray(tables, jnp.int32), seq_lens=jnp.asarray(lens),
               query_starts=jnp.asarray(starts))
  if case.gaps:
    index["query_lens"] = jnp.asarray(case.q_lens, jnp.int32)
  return arrays, index


def _fused(arrays):
  """The kernel's arguments: q, k_new and v_new as one array qkv [A, N + 2K, H], and the pages."""
  qkv = jnp.concatenate([arrays["q"], arrays["k_new"], arrays["v_new"]], axis=1)
  return dict(qkv=qkv, k_pages=arrays["k_pages"], v_pages=arrays["v_pages"])


def _expected(case: Case, arrays, index, layer: int):
  """float64: each sequence's keys (pages before its first query position, the new keys
  after), causal attention of its query tokens; and the pages with the new keys written."""
  a = {k: np.asarray(v, np.float64) for k, v in arrays.items()}
  tables, lens, starts = (np.asarray(index[k]) for k in ("block_tables", "seq_lens",
                                                           "query_starts"))
  out = np.zeros(a["q"].shape)
  pages = {"k": a["k_pages"].copy(), "v": a["v_pages"].copy()}
  for r, (begin, q_len) in enumerate(zip(starts[:-1], case.q_lens)):
    length, end = int(lens[r]), begin + q_len
    first = length - q_len
    positions = np.arange(length)
    where = (tables[r, positions // case.page_size], positions % case.page_size)
    keys = {name: a[f"{name}_pages"][layer][where] for name in ("k", "v")}  # [length, K, H]
    for name in keys:
      keys[name][first:] = a[f"{name}_new"][begin:end]
      pages[name][layer][where[0][first:], where[1][first:]] = a[f"{name}_new"][begin:end]
    if q_len:
      mask = positions[None, :] <= (first + np.arange(q_len))[:, None]
      out[begin:end] = attention_reference(a["q"][None, begin:end], keys["k"][None],
                                           keys["v"][None], mask[None], case.head_dim ** -0.5)[0]
  return out, pages["k"], pages["v"]


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("kernel", ["pallas", "reference", "xla"])
def test_matches_float64_attention_and_writes_only_the_new_slots(case, kernel):
  arrays, index = _inputs(case)
  layer = 1
  want, want_k, want_v = _expected(case, arrays, index, layer)
  if kernel == "pallas":
    got = ragged_paged_attention(**_fused(arrays), layer=jnp.int32(layer), **index,
                                 config=case.config, decode_only=case.decode_only, interpret=True)
  elif kernel == "reference":
    got = ragged_paged_attention_reference(**_fused(arrays), layer=layer, **index)
  else:  # the engine's XLA path (blocks of keys in a loop), query_lens always given
    lens = index.get("query_lens", jnp.diff(index["query_starts"]))
    got = jax.jit(ragged_attention_xla)(
        arrays["q"], arrays["k_new"], arrays["v_new"], arrays["k_pages"], arrays["v_pages"],
        jnp.int32(layer), index["block_tables"], index["seq_lens"], index["query_starts"], lens)
  check_result(case, index, got, (want, want_k, want_v), f"{kernel} attention")


def check_result(case: Case, index, got, expected, what: str) -> None:
  """A kernel's (out, k_pages, v_pages) against `_expected`'s: attention within the dtype's
  tolerance, zeros for padding tokens, the written slots holding the new keys exactly (cast to
  the pages' dtype) and every other slot, and the other layer, untouched."""
  out, k_pages, v_pages = (np.asarray(x, np.float64) for x in got)
  want, want_k, want_v = expected
  assert_kernel_close(out, want, case.dtype, what)
  query = np.zeros(len(out), bool)
  for begin, q_len in zip(index["query_starts"], case.q_lens):
    query[int(begin):int(begin) + q_len] = True
  assert np.all(out[~query] == 0)  # padding tokens
  np.testing.assert_array_equal(k_pages, want_k)
  np.testing.assert_array_equal(v_pages, want_v)


def test_several_splits_and_one_split_agree():
  case = CASES[0]
  outs = []
  for config in (SPLITS, ONE_SPLIT):
    arrays, index = _inputs(case, seed=3)  # fresh pages: the call donates them
    outs.append(np.asarray(ragged_paged_attention(**_fused(arrays), layer=jnp.int32(0), **index,
                                                  config=config, interpret=True)[0]))
  np.testing.assert_allclose(outs[0], outs[1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("q_lens,tokens,tile", [((1, 5, 0, 20), 30, 4), ((16, 16), 32, 16),
                                                 ((0, 0, 3), 3, 2), ((7,), 40, 1)])
def test_tiles_cover_every_token_once_and_never_two_sequences(q_lens, tokens, tile):
  starts = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
  tile_seq, tile_start = (np.asarray(x) for x in tile_layout(jnp.asarray(starts), tokens, tile))
  owner = np.full(tokens, -1)
  ends = np.append(starts[1:], tokens)  # padding: "sequence" R up to the end
  for seq, start in zip(tile_seq, tile_start):
    if seq > len(q_lens):  # past every token
      continue
    covered = np.arange(start, min(start + tile, ends[seq]))
    assert len(covered) and np.all(owner[covered] == -1), (seq, start)
    assert start >= starts[min(seq, len(q_lens))]
    owner[covered] = seq
  want = np.repeat(np.arange(len(q_lens) + 1), np.diff(np.append(starts, tokens)))
  np.testing.assert_array_equal(owner, want)


def _specs(case: Case):
  arrays, index = _inputs(case)
  return {k: jax.ShapeDtypeStruct(v.shape, v.dtype)
          for k, v in {**_fused(arrays), **index}.items()}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("decode_only", [False, True])
def test_lowers_to_triton_for_h200(dtype, decode_only):
  q_lens = (1, 1, 1) if decode_only else (1, 1, 64)
  case = Case(dtype, 32, 8, q_lens, (500, 1000, 0), head_dim=64,
              padding=0 if decode_only else 3, config=RaggedPagedAttentionConfig())
  s = _specs(case)
  order = ("qkv", "k_pages", "v_pages")
  text = lower_for_h200(
      lambda qkv, kp, vp, layer, bt, sl, qs: ragged_paged_attention(
          qkv, kp, vp, layer, bt, sl, qs, decode_only=decode_only),
      *(s[k] for k in order), jax.ShapeDtypeStruct((), jnp.int32),
      s["block_tables"], s["seq_lens"], s["query_starts"])
  assert "custom_call @__gpu$xla.gpu.triton" in text
  assert len(re.findall(r"call @(ragged_paged_attention\w*)\(", text)) == 1


def test_bad_inputs_raise_naming_the_argument():
  arrays, index = _inputs(CASES[0])
  arrays = _fused(arrays)
  call = functools.partial(ragged_paged_attention, layer=jnp.int32(0), interpret=True)
  with pytest.raises(ValueError, match=r"qkv must be \[A, N \+ 2K, H\]"):
    call(**dict(arrays, qkv=arrays["qkv"][0]), **index)
  with pytest.raises(ValueError, match=r"query_starts \[R \+ 1\]"):
    call(**arrays, **dict(index, query_starts=index["query_starts"][:-1]))
  with pytest.raises(ValueError, match="share a dtype"):
    call(**dict(arrays, qkv=arrays["qkv"].astype(jnp.bfloat16)), **index)
  with pytest.raises(ValueError, match="multiple of the pages' K KV heads"):
    call(**dict(arrays, qkv=arrays["qkv"][:, :7]), **index)
  small = dict(arrays, k_pages=arrays["k_pages"][:, :, :8], v_pages=arrays["v_pages"][:, :, :8])
  with pytest.raises(ValueError, match="page size C must be a power of two >= 16"):
    call(**small, **index)
  with pytest.raises(ValueError, match="tile_rows must be >= 16"):
    RaggedPagedAttentionConfig(tile_rows=8)
  with pytest.raises(ValueError, match="split_size .* multiple of block_k"):
    RaggedPagedAttentionConfig(block_k=64, split_size=32)
