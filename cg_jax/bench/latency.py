"""`bench latency`: one `Engine.generate` call's latency at given batch sizes and prompt and
output lengths.

The engine compiles the batch sizes asked for (`--batch-buckets` unless given) and one prompt
bucket, the prompt length rounded up to a power of two (`--prompt-buckets` unless given), and
warms up on those before anything is timed. Per batch size: one unmeasured call, then
`--repeats` calls of `generate(prompts, output_len, eos_token_id=[])` (greedy, no EOS: every row
makes exactly output_len tokens), each on fresh seeded random token-id prompts so the prefix
cache never serves them. Figures, as percentiles over the repeats, from each call's
`result.stats`: `ttft_ms` (the batch's first token), `ttft_last_ms` (the last row's first token),
`tpot_ms` (per output token after each row's own first token, the median over rows: other rows'
prompt chunks that share its steps count, the wait for its first token does not) and
`tokens_per_s` (all output tokens over the call's wall time). Unless `--no-step-time`,
`step_us` is the decode step's time at batch size, from `cg_jax.profile.time_decode`
(back-to-back steps at `step_position`, mid-output, after all the calls: it overwrites the KV
cache), and `step_bytes` the bytes that step must read at least (`cg_jax.profile.decode_bytes`:
its HBM floor is step_bytes / bandwidth).

`workload` and `figures` make the rows, so the PyTorch peers in benchmarks/ write the same ones.
"""

from __future__ import annotations

import argparse

import numpy as np
from tqdm.auto import tqdm

from cg_jax import profile
from cg_jax.bench import options, rows
from cg_jax.engine import Engine


def add_arguments(parser: argparse.ArgumentParser) -> None:
  options.add_model_arguments(parser)
  parser.add_argument("--batch", default="1,8",
                      help="batch sizes to measure, comma separated (one row each); "
                           "--batch-buckets defaults to these")
  parser.add_argument("--prompt-len", type=int, default=512,
                      help="prompt tokens per row; --prompt-buckets defaults to it rounded up "
                           "to a power of two")
  parser.add_argument("--output-len", type=int, default=128, help="output tokens per row")
  parser.add_argument("--repeats", type=int, default=5, help="measured calls per batch size")
  parser.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
  parser.add_argument("--no-step-time", dest="step_time", action="store_false",
                      help="skip timing the decode step alone (step_us, from "
                           "cg_jax.profile.time_decode)")


def _power_of_two(n: int) -> int:
  return 1 << max(n - 1, 0).bit_length()


def run(args) -> list[rows.Row]:
  batches = options.int_list("--batch", args.batch)
  prompt_len = options.integer("--prompt-len", args.prompt_len)
  output_len = options.integer("--output-len", args.output_len)
  repeats = options.integer("--repeats", args.repeats)
  batch_buckets = options.int_list("--batch-buckets", args.batch_buckets) or sorted(set(batches))
  if max(batches) > max(batch_buckets):
    raise ValueError(f"--batch {max(batches)} is above the largest --batch-buckets "
                     f"({max(batch_buckets)}); allowed batch sizes 1 to {max(batch_buckets)}")
  if args.max_seq_len is not None:
    options.fits(prompt_len, output_len, args.max_seq_len)
  prompt_buckets = options.int_list("--prompt-buckets", args.prompt_buckets)
  if prompt_buckets is None:  # one bucket; a prompt bucket is below the cache length
    prompt_buckets = [_power_of_two(prompt_len) if args.max_seq_len is None
                      else min(_power_of_two(prompt_len), args.max_seq_len - 1)]
  engine = Engine.from_pretrained(args.model, **options.engine_options(
      args, batch_buckets, prompt_buckets))
  try:
    return _measure(args, engine, batches, prompt_len, output_len, repeats)
  finally:
    engine.close()


def _measure(args, engine: Engine, batches: list[int], prompt_len: int, output_len: int,
             repeats: int) -> list[rows.Row]:
  max_seq_len = engine.config.max_seq_len
  options.fits(prompt_len, output_len, max_seq_len)
  engine.warmup(batch_sizes=sorted({engine.config.buckets.batch_bucket(b) for b in batches}),
                prompt_lengths=engine.config.buckets.prompt_lengths)
  engine.wait_for_final_steps()  # (steady state: no step on a stand-in)
  rng = np.random.default_rng(args.seed)
  vocab = engine.model_config.vocab_size

  def call(batch: int) -> dict:
    prompts = rng.integers(0, vocab, (batch, prompt_len)).tolist()  # [batch, prompt_len]
    result = engine.generate(prompts, output_len, eos_token_id=[])
    made = [len(tokens) for tokens in result]
    if made != [output_len] * batch:
      raise RuntimeError(f"generate made {made} tokens per row, not {output_len} each")
    return result.stats

  found = []
  with tqdm(total=len(batches) * (repeats + 1), desc="latency", unit="call") as bar:
    for batch in batches:
      call(batch)  # warm: first-use effects (allocations, caches) are not measured
      bar.update()
      stats = []
      for _ in range(repeats):
        stats.append(call(batch))
        bar.update()
      found.append(stats)
  position = step_position(prompt_len, output_len, max_seq_len)
  result = []
  for batch, stats in zip(batches, found):
    values = figures(stats)
    if args.step_time:
      timing = profile.time_decode(engine, batch, position=position, steps=16, repeats=3)
      values["step_us"] = timing["step_us"]
      values["step_bytes"] = profile.decode_bytes(engine, batch, position)
    result.append(options.row(args, workload(batch, prompt_len, output_len, repeats,
                                             engine.dtype.name, max_seq_len), values))
  return result


def step_position(prompt_len: int, output_len: int, max_seq_len: int) -> int:
  """Where `step_us` is timed: mid-output (the average step of a call), inside the cache."""
  return min(prompt_len + output_len // 2, max_seq_len - 2)


def workload(batch: int, prompt_len: int, output_len: int, repeats: int, dtype: str,
             max_seq_len: int) -> dict:
  """A latency row's workload."""
  return dict(kind="latency", batch=batch, prompt_len=prompt_len, output_len=output_len,
              repeats=repeats, dtype=dtype, max_seq_len=max_seq_len)


def figures(stats: list[dict]) -> dict[str, float]:
  """Percentiles over calls of their `result.stats` (ttft_s, ttft_s_last, per_token_s,
  tokens_per_s), in the figures' units."""
  return {
      **rows.percentiles("ttft_ms", [s["ttft_s"] * 1e3 for s in stats]),
      **rows.percentiles("ttft_last_ms", [s["ttft_s_last"] * 1e3 for s in stats]),
      **rows.percentiles("tpot_ms", [s["per_token_s"] * 1e3 for s in stats]),
      **rows.percentiles("tokens_per_s", [s["tokens_per_s"] for s in stats]),
  }
