"""The hot path: pure functions over a flat list of weight arrays and a donated KV cache, compiled
ahead of time per bucket (`cg_jax.core.executables`):

  prefill(weights, cache, tokens[B,S], lengths[B], tables[B,W])    -> (logits[B,V], cache)
  first_token(logits[B,V], positions[B], sampling)                 -> tokens[B]
  decode(weights, cache, tokens[B], positions[B], tables[B,W], sampling)
                                              -> (tokens[B], positions[B], cache, emitted[B])
  decode_scored(weights, cache, tokens[B], positions[B], tables[B,W], sampling)
                                   -> (tokens[B], positions[B], cache, emitted[B], scores[B,E])
  step(weights, cache, tokens[A], tables[R,W], query_starts[R+1], query_lens[R], seq_lens[R])
                                                                -> (tokens[R], logits[R,V], cache)
  token_logprobs(logits[B,V], tokens[B])                           -> scores[B,E]
  score(weights, tokens[1,S])                                      -> scores[S,E]

The cache is paged: a KVCache of [L, M, C, K, H] arrays (M blocks of C tokens), and row b of a
call reads and writes the blocks of its block table tables[b] (`cg_jax.core.block_pool` decides
them on the host; position p lives in slot p % C of block tables[b, p // C]). Rows share blocks
by naming them (a prefix-cache hit), so no step copies keys or values between rows or blocks.

`scores` are `cg_jax.core.sampling.token_scores` of the new tokens (E = 1 + 2 x top log-probabilities),
computed only for requests that ask for log-probabilities: by `decode_scored` instead of `decode`,
and by `token_logprobs` from the logits a step returns. A negative position marks
an idle row of a decode step (a cache slot not decoding): it writes
nothing, and stays negative.

A step is a flat batch of A tokens (a token bucket) in which R requests' prompt chunks lie end
to end, each at its own cache offset (`RaggedAttention`): the first chunks of new prompts and the
next chunks of started ones (a cached prefix, or longer than one step) run in one call, none
padded to a bucket of its own.

`sampling` is a `SamplingArrays` or None (the greedy-only executable). A step picks greedily and
returns its logits: a step with a sampling row draws its tokens from them with `first_token` (the
sampling path sorts the vocabulary, a cost that greedy prompts never pay).
Shape letters: the README's table.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from cg_jax.core.attention import PagedAttention, RaggedAttention, RealRows
from cg_jax.core.config import ForwardConfig
from cg_jax.core.sampling import SamplingArrays, select_tokens, token_scores
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
  """

  split: SplitModel
  forward: ForwardConfig
  attention: Any
  paged: PagedAttention
  shards: int = 1

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

  def _logits(self, model, tokens, positions, tables, cache: KVCache):
    """One decode step's logits [B, V] ([P, V] when batch-invariant). With fewer than
    `min_matmul_rows` rows, the layers run on the rows padded to that many (token 0 at position
    0): the padding rows never reach the cache or the attention (`RealRows`), and the real rows
    do not depend on them. Batch-invariant steps pad with idle rows instead (position -1), which
    the attention takes too, so that the cache's first P rows are the step's rows."""
    batch = tokens.shape[0]
    padded = max(batch, self.forward.min_matmul_rows)
    attention = self._paged(tables)
    if padded > batch and self.forward.batch_invariant:
      # [B] -> [P]: the padding rows are idle (position -1: they write and read nothing), so
      # the attention too runs on P rows in every bucket. [B, W] -> [P, W]
      tokens, positions = _pad_rows(tokens, padded), _pad_rows(positions, padded, -1)
      attention = self._paged(jnp.pad(tables, ((0, padded - batch), (0, 0))))
    elif padded > batch:
      # [B] -> [P]
      tokens, positions = (jnp.pad(x, (0, padded - batch)) for x in (tokens, positions))
      attention = RealRows(attention, batch)
    hidden, cache = model.decode_hidden(tokens, positions, cache, attention=attention,
                                        layer_loop=self.forward.layer_loop, shards=self.shards)
    if self.forward.batch_invariant:
      # [P, V]: the token choice runs on the padded rows too (the same shapes in every bucket).
      return model.unembed(hidden), cache
    return model.unembed(hidden[:batch]), cache

  def _next(self, weights, cache: KVCache, tokens, positions, tables, sampling, scored: bool):
    """(next tokens [B], their scores [B, E] or None, next positions [B], cache) of one decode
    step."""
    batch = tokens.shape[0]
    logits, cache = self._logits(self.split.merge(weights), tokens, positions, tables, cache)
    next_positions = jnp.where(positions < 0, positions, positions + 1)
    rows = logits.shape[0]
    # [B] -> [P] when the logits cover the padded rows (padding rows: greedy, position 0)
    picked = select_tokens(logits, _pad_rows(next_positions, rows),
                           _pad_sampling(sampling, rows))
    scores = token_scores(logits, picked)[:batch] if scored else None
    return picked[:batch], scores, next_positions, cache

  def decode(self, weights, cache: KVCache, tokens, positions, tables,
             sampling: SamplingArrays | None):
    next_tokens, _, next_positions, cache = self._next(weights, cache, tokens, positions, tables,
                                                       sampling, scored=False)
    # `emitted` is the copy the host reads (the executables write it to host memory):
    # `next_tokens` is donated into the following step. It comes after the donated state, so
    # that each donated input's buffer is reused by the output of its own kind.
    return next_tokens, next_positions, cache, next_tokens

  def decode_scored(self, weights, cache: KVCache, tokens, positions, tables,
                    sampling: SamplingArrays):
    """`decode`, with the new tokens' scores."""
    next_tokens, scores, next_positions, cache = self._next(weights, cache, tokens, positions,
                                                            tables, sampling, scored=True)
    return next_tokens, next_positions, cache, next_tokens, scores

  @staticmethod
  def token_logprobs(logits, tokens):
    return token_scores(logits, tokens)

  def step(self, weights, cache: KVCache, tokens, tables, query_starts, query_lens, seq_lens):
    """One engine step: request r's query_lens[r] tokens of tokens [A] start at query_starts[r]
    (int32 [R + 1], packed: query_starts[r + 1] = query_starts[r] + query_lens[r]) and go to the
    blocks tables[r] at positions seq_lens[r] - query_lens[r] .. seq_lens[r] - 1 (the keys
    before are in the cache already); tokens past query_starts[R] are padding, and a request
    with no token writes nothing. Returns each request's greedy token after its last query
    token [R] (meaningful when the step ends its prompt), the logits it was picked from and
    the cache."""
    model = self.split.merge(weights)
    size = tokens.shape[0]
    # [A]: each token's position (-1: padding)
    _, real, position = token_positions(query_starts, query_lens, seq_lens, size)
    positions = jnp.where(real, position, -1)
    attention = RaggedAttention(self._paged(tables), query_starts, query_lens, seq_lens)
    hidden, cache = model.extend_hidden(tokens[None], positions[None], None, cache,
                                        attention=attention, layer_loop=self.forward.layer_loop,
                                        shards=self.shards)
    # [R, D]: each request's last query token
    last = jnp.clip(query_starts[:-1] + query_lens - 1, 0, size - 1)
    logits = self._head(model, hidden[0, last])
    return select_tokens(logits, seq_lens, None), logits, cache

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
  """[B] -> [rows] (B <= rows), padded with `value`."""
  return x if x.shape[0] == rows else jnp.pad(x, (0, rows - x.shape[0]), constant_values=value)


def _pad_sampling(sampling: SamplingArrays | None, rows: int) -> SamplingArrays | None:
  """Sampling arrays for `rows` rows; the padding rows are greedy."""
  if sampling is None:
    return None
  return SamplingArrays(temperature=_pad_rows(sampling.temperature, rows),
                        top_k=_pad_rows(sampling.top_k, rows),
                        top_p=_pad_rows(sampling.top_p, rows, 1.0),
                        seed=_pad_rows(sampling.seed, rows), row=_pad_rows(sampling.row, rows))
