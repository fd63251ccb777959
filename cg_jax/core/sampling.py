"""On-device token selection: greedy, temperature, top-k and top-p, seeded per row.

Per-request values are arrays (`SamplingArrays`), so one compiled step serves every setting.
A row's random key is fold_in(fold_in(key(seed), row), position): the same seed gives the same
tokens whatever the batch composition or bucket.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingArrays:
  """Per-row sampling settings, each [B]. temperature 0 means greedy; top_k 0 and top_p 1 are off."""

  temperature: jax.Array  # float32
  top_k: jax.Array  # int32
  top_p: jax.Array  # float32
  seed: jax.Array  # uint32
  row: jax.Array  # int32, the row's index in its request

  @classmethod
  def host(cls, batch: int, *, temperature: float, top_k: int, top_p: float, seed: int,
           rows: np.ndarray) -> "SamplingArrays":
    """NumPy arrays for one request padded to `batch` rows (padding rows are greedy)."""
    real = len(rows)
    def column(value, dtype, pad):
      out = np.full((batch,), pad, dtype)
      out[:real] = value
      return out
    return cls(
        temperature=column(temperature, np.float32, 0.0), top_k=column(top_k, np.int32, 0),
        top_p=column(top_p, np.float32, 1.0), seed=column(seed, np.uint32, 0),
        row=column(rows, np.int32, 0))

  @classmethod
  def spec(cls, batch: int) -> "SamplingArrays":
    """Abstract shapes for ahead-of-time compilation."""
    f32, i32 = jax.ShapeDtypeStruct((batch,), jnp.float32), jax.ShapeDtypeStruct((batch,), jnp.int32)
    return cls(temperature=f32, top_k=i32, top_p=f32,
               seed=jax.ShapeDtypeStruct((batch,), jnp.uint32), row=i32)


def filter_logits(logits, temperature, top_k, top_p):
  """Temperature-scaled logits with everything outside top-k and the top-p nucleus set to -inf.

  Args:
    logits: float32 [B, V]; temperature (> 0), top_k (0 = off), top_p (1 = off): [B].
  Returns:
    float32 [B, V].
  """
  vocab = logits.shape[-1]
  scaled = logits / temperature[:, None]
  # [B, V], descending
  sorted_logits = -jnp.sort(-scaled, axis=-1)
  k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
  ranks = jnp.arange(vocab)[None, :]
  in_top_k = ranks < k[:, None]
  probs = jax.nn.softmax(jnp.where(in_top_k, sorted_logits, -jnp.inf), axis=-1)
  # Probability mass strictly before each sorted token; the first token is always kept.
  mass_before = jnp.cumsum(probs, axis=-1) - probs
  keep = in_top_k & (mass_before < top_p[:, None])
  num_keep = jnp.maximum(jnp.sum(keep, axis=-1), 1)
  # [B, 1]: the smallest kept logit
  threshold = jnp.take_along_axis(sorted_logits, (num_keep - 1)[:, None], axis=-1)
  return jnp.where(scaled >= threshold, scaled, -jnp.inf)


# The most alternatives a request may ask log-probabilities for.
TOP_LOGPROBS = 20


def token_scores(logits, tokens):
  """float32 [B, 1 + 2 * K] from logits [B, V] and the chosen tokens [B] (K = min(TOP_LOGPROBS,
  V)): the chosen token's log-probability under the model's distribution (before temperature
  and filtering), then the K most likely tokens' ids (as float32: exact below 2**24) and their
  log-probabilities, most likely first."""
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  chosen = jnp.take_along_axis(logp, tokens[:, None], axis=-1)
  top, ids = jax.lax.top_k(logp, min(TOP_LOGPROBS, logits.shape[-1]))
  return jnp.concatenate([chosen, ids.astype(jnp.float32), top], axis=-1)


def unpack_scores(row: np.ndarray, top: int) -> tuple[float, tuple[tuple[int, float], ...]]:
  """One row of `token_scores`: (the chosen token's log-probability, its `top` most likely
  (token, log-probability) pairs)."""
  k = (len(row) - 1) // 2
  pairs = tuple((int(row[1 + i]), float(row[1 + k + i])) for i in range(min(top, k)))
  return float(row[0]), pairs


def select_tokens(logits, positions, sampling: SamplingArrays | None):
  """Next tokens [B] int32 from float32 logits [B, V].

  Args:
    positions: int32 [B], the sequence index the new token will take (keys the randomness).
    sampling: None compiles the greedy-only step; else rows with temperature 0 stay greedy.
  """
  greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
  if sampling is None:
    return greedy
  temperature = jnp.where(sampling.temperature > 0, sampling.temperature, 1.0)
  filtered = filter_logits(logits, temperature, sampling.top_k, sampling.top_p)

  def draw(seed, row, position, row_logits):
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), row), position)
    return jax.random.categorical(key, row_logits)

  sampled = jax.vmap(draw)(sampling.seed, sampling.row, positions, filtered).astype(jnp.int32)
  return jnp.where(sampling.temperature > 0, sampled, greedy)
