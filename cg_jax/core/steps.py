"""The hot path: pure functions over a flat list of weight arrays and a donated KV cache, compiled
ahead of time per bucket (`cg_jax.core.executables`):

  load(staged[I], packed[I])                                  -> staged[I]
  step(weights, cache, carry[U], staged[I])
                                    -> (carry[U], tokens[U], logits[Y,V], cache, staged[I])
  draw(logits[Y,V], staged[I], sampling, carry[U])            -> (carry[U], tokens[U])
  token_logprobs(logits[Y,V], tokens[U])       -> scores[Y,E]
  prefill(weights, cache, tokens[B,S], lengths[B], tables[B,W])    -> (logits[B,V], cache)
  first_token(logits[B,V], positions[B], sampling)                 -> tokens[B]
  score(weights, tokens[1,S])                                      -> scores[S,E]

The cache is paged: a KVCache of [L, M, C, K, H] arrays (M blocks of C tokens), and row b of a
call reads and writes the blocks of its block table tables[b] (`cg_jax.core.block_pool` decides
them on the host; position p lives in slot p % C of block tables[b, p // C]). Rows share blocks
by naming them (a prefix-cache hit), so no step copies keys or values between rows or blocks.

A step is the engine's one call per iteration: a flat batch of A tokens (a token bucket) in
which R requests' tokens lie end to end, each at its own cache offset (`RaggedAttention`):
decode rows of one token (the request's last token, fed from the previous step's `carry` on the
device: the host never waits for it) and prompt chunks (the first chunks of new prompts, the
next chunks of started ones), none padded to a bucket of its own. Each row's token after its
last query token is picked greedily into the carry; a step with a sampling row draws them from
its logits with `draw` instead (the sampling path sorts the vocabulary, a cost that greedy steps
never pay), and `token_logprobs` scores them for the requests that ask (E = 1 + 2 x top
log-probabilities, `cg_jax.core.sampling.token_scores`). The host reads each step's tokens from
the second output (written to pinned host memory). A step's index arrays (tokens [A], feed [A],
tables [R,W], query_starts [R+1], query_lens [R], seq_lens [R]) are slices of the staged buffer
[I] that `load` overwrites in place (`cg_jax.core.step_inputs`) and each step carries on with
its next lengths; it and the carry are donated (`draw` overwrites the carry in place), as the
cache is, so no buffer a step reads moves between calls and the command buffer (CUDA graph)
each step records stays valid (XLA updates the commands whose buffers moved before it launches
a graph).

`prefill` and `first_token` are the static path's (whole prompts of a (batch, length) bucket:
benchmarks' baseline); `score` the log-probabilities of a prompt's own tokens (`echo`).
Shape letters: the README's table.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from cg_jax.core.attention import PagedAttention, RaggedAttention
from cg_jax.core.config import ForwardConfig
from cg_jax.core.sampling import SamplingArrays, select_tokens, token_scores
from cg_jax.core.step_inputs import StepLayout
from cg_jax.core.step_plan import logit_rows
from cg_jax.core.weights import SplitModel
from cg_jax.kernels.ragged_paged_attention import token_positions
from models.decoder import KVCache


@dataclasses.dataclass(frozen=True)
class StepFunctions:
  """The step functions of one split model (see the module docstring).

  Args:
    split: the split model; its graphdef/treedef are baked into the traces.
    forward: how the forward paths run.
    attention: the cache-free attention handed to the model (`score`, the logits).
    paged: the paged attention of the cache-using steps (`cg_jax.core.attention`; its tables
      are each call's own).
    shards: the weights' column groups (the tensor-parallel size).
    layout: where a step's index arrays lie in the staged buffer; its step_rows is U, the
      carry's rows.
  """

  split: SplitModel
  forward: ForwardConfig
  attention: Any
  paged: PagedAttention
  shards: int = 1
  layout: StepLayout = StepLayout((1,), 1, 1)

  @property
  def carry_rows(self) -> int:
    return self.layout.step_rows

  def _paged(self, tables) -> PagedAttention:
    return dataclasses.replace(self.paged, tables=tables)

  def prefill(self, weights, cache: KVCache, tokens, lengths, tables):
    model = self.split.merge(weights)
    hidden, cache = model.prefill_hidden(tokens, lengths, cache, attention=self._paged(tables),
                                         layer_loop=self.forward.layer_loop, shards=self.shards)
    return self._head(model, hidden), cache

  def _head(self, model, hidden):
    """A prefill call's vocabulary projection, hidden [B, D] -> float32 logits [B, V], on at
    least `min_matmul_rows` rows: with cuBLAS GEMMs a one-row product runs as a float32 GEMV
    over a float32 copy of the whole head (results/ttft_probe_h200.md)."""
    batch = hidden.shape[0]
    padded = max(batch, self.forward.min_matmul_rows)
    # [B, D] -> [P, D]
    return model.unembed(jnp.pad(hidden, ((0, padded - batch), (0, 0))))[:batch]

  @staticmethod
  def first_token(logits, positions, sampling: SamplingArrays | None):
    return select_tokens(logits, positions, sampling)

  def draw(self, logits, staged, sampling: SamplingArrays, carry):
    """The tokens of a step with a sampling row: drawn from its logits [Y, V], row r's at
    position seq_lens[r] - 1 (the lengths the step left in the staged buffer [I]: its next;
    greedy rows, padding rows among them, pick the greedy token), padded to the carry's rows
    like `step`'s. The step's carry [U] is donated and overwritten: the next step reads the
    same buffer."""
    del carry  # (its buffer holds the result)
    rows = logits.shape[0]
    tokens = select_tokens(logits, staged[:rows] - 1, sampling)
    tokens = _pad_rows(tokens, self.carry_rows)
    return tokens, tokens

  @staticmethod
  def token_logprobs(logits, tokens):
    """scores [R, E] of tokens[:R] (tokens [U] when they are a step's carry)."""
    return token_scores(logits, tokens[:logits.shape[0]])

  @staticmethod
  def load(staged, packed):
    """The staged buffer, overwritten with `packed` (both [I]; `staged` is donated)."""
    del staged  # (its buffer holds the result)
    return packed

  def step(self, size: int, weights, cache: KVCache, carry, staged):
    """One engine step of A = `size` tokens (a token bucket: static) over the index arrays that
    the staged buffer [I] holds for it (`StepLayout.split`). Request r's query_lens[r] tokens
    of tokens [A] start at query_starts[r] (int32 [R + 1], packed: query_starts[r + 1] =
    query_starts[r] + query_lens[r]) and go to the blocks tables[r] at positions
    seq_lens[r] - query_lens[r] .. seq_lens[r] - 1 (the keys before are in the cache already);
    tokens past query_starts[R] are padding, and a request with no token writes nothing.
    Token i is carry[feed[i]] where feed[i] >= 0 (a decode row's last token, picked by the
    step before: carry [U] is its output), else tokens[i].
    Returns (each request's greedy token after its last query token, padded to [U]: the next
    step's carry; the same tokens for the host; the logits they were picked from, padded with
    zero rows to [Y, V] (`step_plan.logit_rows`); the
    cache; the staged buffer with seq_lens one longer in each row that took a token: the next
    decode step's, when the same rows decode again)."""
    model = self.split.merge(weights)
    rows = self.layout.rows(size)
    tokens, feed, tables, query_starts, query_lens, seq_lens = self.layout.split(staged, size)
    # [A]: the fed tokens from the device, the others from the host
    tokens = jnp.where(feed >= 0, carry[jnp.clip(feed, 0, carry.shape[0] - 1)], tokens)
    # [A]: each token's position (-1: padding)
    _, real, position = token_positions(query_starts, query_lens, seq_lens, size)
    positions = jnp.where(real, position, -1)
    # Buckets of at most one token per row hold decode rows only: the kernel's small tiles;
    # larger buckets carry prompt chunks: its prefill tiles.
    paged = self._paged(tables)
    config = paged.config if size <= rows else paged.prefill_config
    attention = RaggedAttention(paged, query_starts, query_lens, seq_lens, config)
    hidden, cache = model.extend_hidden(tokens[None], positions[None], None, cache,
                                        attention=attention, layer_loop=self.forward.layer_loop,
                                        shards=self.shards)
    # [R, D]: each request's last query token
    last = jnp.clip(query_starts[:-1] + query_lens - 1, 0, size - 1)
    logits = self._head(model, hidden[0, last])
    picked = _pad_rows(select_tokens(logits, seq_lens, None), self.carry_rows)
    # [R, V] -> [Y, V]: the draw executable of Y rows reads them (padding rows: zeros)
    logits = _pad_rows(logits, logit_rows(rows, self.carry_rows))
    # [I]: the lengths after one more token per row that took one, then the rest as it was (the
    # output aliases the donated input)
    staged = jnp.concatenate([seq_lens + (query_lens > 0), staged[rows:]])
    return picked, picked, logits, cache, staged

  def score(self, weights, tokens):
    """Row i of the result scores token i + 1 of tokens [1, S] given the tokens before it (the
    last row scores nothing meaningful; padding after the prompt does not change earlier
    rows)."""
    model = self.split.merge(weights)
    logits = model.logits(tokens, attention=self.attention, layer_loop=self.forward.layer_loop,
                          shards=self.shards)
    # [1, S] -> [S]: each position's next token
    following = jnp.roll(tokens[0], -1)
    return token_scores(logits[0], following)


def _pad_rows(x, rows: int, value=0):
  """[B, ...] -> [rows, ...] (B <= rows), padded with `value`."""
  if x.shape[0] == rows:
    return x
  return jnp.pad(x, [(0, rows - x.shape[0])] + [(0, 0)] * (x.ndim - 1), constant_values=value)
