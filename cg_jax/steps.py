"""The hot path: pure functions over a flat list of weight arrays and a donated KV cache.

The NNX model is split once (`nnx.split`, then `SplitModel.from_state`); each step re-hydrates it with `nnx.merge` inside the
trace, so a call passes ~15-20 weight arrays and costs no Python graph traversal. `StepFunctions`
holds the functions that are compiled ahead of time per bucket:

  prefill(weights, cache, tokens[B,S], lengths[B])                 -> (logits[B,V], cache)
  first_token(logits[B,V], positions[B], sampling)                 -> tokens[B]
  decode(weights, cache, tokens[B], positions[B], sampling)
                                              -> (emitted[B], tokens[B], positions[B], cache)
  decode_loop(weights, cache, LoopState, eos[E], sampling)          -> (LoopState, out[B,K], cache)

`sampling` is a `SamplingArrays` or None (the greedy-only executable).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from cg_jax.sampling import SamplingArrays, select_tokens
from models.decoder import Decoder, KVCache


@dataclasses.dataclass(frozen=True)
class SplitModel:
  """A model split once for the hot path: static structure plus a flat list of weight arrays."""

  graphdef: Any
  treedef: Any
  weights: list[jax.Array]

  @classmethod
  def from_state(cls, graphdef, state) -> "SplitModel":
    """Flatten a split decoder's state into the weight list a step takes (done once, at load)."""
    weights, treedef = jax.tree.flatten(state)
    return cls(graphdef, treedef, weights)

  def merge(self, weights) -> Decoder:
    return nnx.merge(self.graphdef, jax.tree.unflatten(self.treedef, weights))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoopState:
  """Per-row decode state carried between device-loop calls, each [B].

  tokens: last token of each row; positions: where that token goes in the cache;
  done: row finished (EOS, budget spent, or a padding row); budget: tokens the row may still emit.
  """

  tokens: jax.Array
  positions: jax.Array
  done: jax.Array
  budget: jax.Array

  @classmethod
  def spec(cls, batch: int) -> "LoopState":
    i32 = jax.ShapeDtypeStruct((batch,), jnp.int32)
    return cls(tokens=i32, positions=i32, done=jax.ShapeDtypeStruct((batch,), jnp.bool_),
               budget=i32)


@dataclasses.dataclass(frozen=True)
class StepFunctions:
  """The step functions of one split model (see module docstring).

  Args:
    split: the split model; its graphdef/treedef are baked into the traces.
    attention: attention backend name passed to the model.
    layer_loop: "scan" or "unroll" for the per-token steps (see `models.decoder`); prefill runs
      once per request and always scans (small program, fast compile).
    loop_steps: K, tokens generated per device-loop call.
    min_matmul_rows: decode steps run the layers' products on at least this many rows.
    linear: decode steps' projections, "xla" or "pallas" (fused kernels).
    mesh: the tensor-parallel mesh (`cg_jax.sharding`), or None on one device.
    cache_write: decode steps' cache write, "fused" into the Pallas attention or "scatter".
    decode_splits: the fused decode kernel's split of each row's keys, "fixed" or "length".
    decode_combine: what merges its split-K partials, "xla" or "pallas".
    decode_qkv: who slices the fused QKV output and applies RoPE in decode steps, "xla" or
      "kernel" (the fused decode attention kernel).
  """

  split: SplitModel
  attention: str
  layer_loop: str
  loop_steps: int
  min_matmul_rows: int = 8
  linear: str = "xla"
  mesh: Any = None
  cache_write: str = "fused"
  decode_splits: str = "fixed"
  decode_combine: str = "xla"
  decode_qkv: str = "xla"

  @property
  def _model_options(self):
    return {"attention": self.attention, "layer_loop": self.layer_loop,
            "min_matmul_rows": self.min_matmul_rows, "linear": self.linear, "mesh": self.mesh,
            "cache_write": self.cache_write, "decode_splits": self.decode_splits,
            "decode_combine": self.decode_combine, "decode_qkv": self.decode_qkv}

  def prefill(self, weights, cache: KVCache, tokens, lengths):
    model = self.split.merge(weights)
    return model.prefill(tokens, lengths, cache, attention=self.attention, layer_loop="scan",
                         mesh=self.mesh)

  @staticmethod
  def first_token(logits, positions, sampling: SamplingArrays | None):
    return select_tokens(logits, positions, sampling)

  def decode(self, weights, cache: KVCache, tokens, positions, sampling: SamplingArrays | None):
    model = self.split.merge(weights)
    logits, cache = model.decode(tokens, positions, cache, **self._model_options)
    next_positions = positions + 1
    next_tokens = select_tokens(logits, next_positions, sampling)
    # `emitted` is a copy for the host to read back asynchronously: `next_tokens` is donated
    # into the following step, which may start before the read-back finishes.
    return next_tokens, next_tokens, next_positions, cache

  def decode_loop(self, weights, cache: KVCache, state: LoopState, eos, sampling):
    """Up to K decode steps in one `lax.while_loop`, stopping early when every row is done.

    out[b, i] is the i-th token of this call for row b, or -1 once the row was done.
    A row becomes done after emitting an EOS id (from `eos`, int32 [E], -1 padded) or when its
    budget reaches 0.
    """
    model = self.split.merge(weights)
    batch = state.tokens.shape[0]
    out = jnp.full((batch, self.loop_steps), -1, jnp.int32)

    def cond(carry):
      step, state, _, _ = carry
      return (step < self.loop_steps) & ~jnp.all(state.done)

    def body(carry):
      step, state, out, cache = carry
      logits, cache = model.decode(state.tokens, state.positions, cache,
                                   **self._model_options)
      positions = jnp.where(state.done, state.positions, state.positions + 1)
      tokens = select_tokens(logits, positions, sampling)
      tokens = jnp.where(state.done, state.tokens, tokens)
      out = out.at[:, step].set(jnp.where(state.done, -1, tokens))
      budget = jnp.where(state.done, state.budget, state.budget - 1)
      hit_eos = jnp.any(tokens[:, None] == eos[None, :], axis=-1)
      done = state.done | hit_eos | (budget <= 0)
      return step + 1, LoopState(tokens, positions, done, budget), out, cache

    _, state, out, cache = jax.lax.while_loop(cond, body, (jnp.int32(0), state, out, cache))
    return state, out, cache
