# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Pallas attention kernels
#
# `flash_attention` (prefill) and `ragged_paged_attention` (here a decode step over a paged KV
# cache, split-K) against float64 references, then speed from the committed GPU results when
# they exist. On a CPU the kernels run in the Pallas interpreter (same kernel code, no Triton).

# %%
import glob
import json
import os

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np

from cg_jax.kernels.flash_attention import FlashAttentionConfig, flash_attention
from cg_jax.kernels.ragged_paged_attention import (RaggedPagedAttentionConfig,
                                                   ragged_paged_attention)

ROOT = next(p for p in (".", "..") if os.path.isdir(os.path.join(p, "benchmarks")))  # repo root
interpret = jax.default_backend() != "gpu"


def reference(q, k, v, mask):
  """float64 attention with GQA; q [B, T, Hq, D], k/v [B, S, Hkv, D], mask [B, T, S]."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  k, v = (np.repeat(x, q.shape[2] // x.shape[2], axis=2) for x in (k, v))
  scores = np.where(mask[:, None], np.einsum("bthd,bshd->bhts", q, k) / np.sqrt(q.shape[-1]),
                    -np.inf)
  probs = np.exp(scores - scores.max(-1, keepdims=True))
  return np.einsum("bhts,bshd->bthd", probs / probs.sum(-1, keepdims=True), v)


# %% [markdown]
# ## Errors against float64, by dtype

# %%
rng = np.random.default_rng(0)
errors = {}
for dtype in ("float32", "bfloat16"):
  q = jnp.asarray(rng.standard_normal((2, 48, 8, 64)), dtype)
  k = jnp.asarray(rng.standard_normal((2, 48, 2, 64)), dtype)
  v = jnp.asarray(rng.standard_normal((2, 48, 2, 64)), dtype)
  lengths = jnp.asarray([48, 48], jnp.int32)
  causal = np.tril(np.ones((48, 48), bool))[None].repeat(2, 0)
  out = flash_attention(q, k, v, lengths, config=FlashAttentionConfig(16, 16), interpret=interpret)
  ref = reference(q, k, v, causal)
  errors[("flash", dtype)] = np.abs(np.asarray(out, np.float64) - ref).max() / np.abs(ref).max()
  # A decode step: row b's keys at positions 0..lengths[b] - 1, the last one the new token's,
  # in pages of 16 positions (row 0 owns pages 0..6, row 1 pages 7..13).
  keys = jnp.asarray(rng.standard_normal((2, 112, 2, 64)), dtype)
  values = jnp.asarray(rng.standard_normal((2, 112, 2, 64)), dtype)
  lengths = jnp.asarray([100, 37], jnp.int32)
  rows, last = jnp.arange(2), lengths - 1
  k_pages, v_pages = (x.reshape(1, 14, 16, 2, 64) for x in (keys, values))
  # [B, 8 + 2 + 2, 64]: the query heads, the new key and value heads, fused as the QKV
  # projection leaves them
  qkv = jnp.concatenate([q[:, 0], keys[rows, last], values[rows, last]], axis=1)
  out, _, _ = ragged_paged_attention(
      qkv, k_pages, v_pages, jnp.int32(0),
      jnp.arange(14, dtype=jnp.int32).reshape(2, 7), lengths, jnp.arange(3, dtype=jnp.int32),
      jnp.ones(2, jnp.int32), config=RaggedPagedAttentionConfig(block_k=16, split_size=32),
      decode_only=True, interpret=interpret)
  mask = (np.arange(112)[None, :] < np.asarray(lengths)[:, None])[:, None, :]
  ref = reference(q[:, :1], keys, values, mask)[:, 0]
  errors[("decode", dtype)] = np.abs(np.asarray(out, np.float64) - ref).max() / np.abs(ref).max()
for key, value in errors.items():
  print(key, f"{value:.2e}")

# %%
fig, ax = plt.subplots(figsize=(5, 2.5))
ax.bar([f"{k}\n{d}" for k, d in errors], list(errors.values()))
ax.set_yscale("log")
ax.set_ylabel("max |error| / max |ref|")
plt.show()

# %% [markdown]
# ## Speed (committed GPU results)
# `benchmarks/attention_bench.py` writes `attention_rows.json`; once it is committed under
# `benchmarks/results/`, this cell plots the flash kernel (prefill) against XLA and torch SDPA.

# %%
found = sorted(glob.glob(os.path.join(ROOT, "benchmarks/results/attention*.json")))
rows = [r for path in found for r in json.load(open(path)) if r["kernel"] == "flash_attention"]
if not rows:
  print("no committed GPU attention results yet")
else:
  fig, ax = plt.subplots(figsize=(7, 3))
  labels = [f"B={r['batch']}\nS={r['seq_len']}" for r in rows]
  for offset, key in enumerate(("pallas_us", "xla_us", "torch_sdpa_us")):
    ax.bar([i + 0.27 * offset for i in range(len(rows))], [r[key] or 0 for r in rows], 0.27,
           label=key)
  ax.set_xticks(range(len(rows)), labels, fontsize=7)
  ax.set_yscale("log")
  ax.legend()
  plt.show()
