"""`bench throughput`: continuous batching under a stream of requests through `Engine.submit`.

`--num-requests` prompts of seeded random token ids, their lengths fixed or drawn uniformly
from an inclusive `MIN:MAX` range, arrive at Poisson times of `--rate` requests per second
(`inf`: all at once) and each asks for `--output-len` tokens with no EOS
(`submit(ids, output_len, eos_token_id=[])`). The engine warms up on all its buckets and serves
the same shapes once, unmeasured, first (a first pass after warm-up is slower). One
thread per request iterates its handle and records when its first token and its last arrived;
every request must make exactly output_len tokens.

Figures: `tokens_per_s` and `requests_per_s` (all output tokens, all requests, over the wall
time from the first submit to the last finish), `output_tokens` (their count), and percentiles
over the requests of `ttft_ms` (submit to first token), `tpot_ms` ((finish - first token) /
(tokens - 1)) and `e2e_ms` (submit to finish).

`--client generate` (offline, `--rate inf` only) sends the prompts as one
`Engine.generate(prompts, output_len, eos_token_id=[])` call instead, as an offline user (and
HF's `generate_batch`, vLLM's `LLM.generate`) does: no consumer threads; `tokens_per_s`,
`requests_per_s` and `output_tokens` over the call's wall time, `ttft_ms` (call to each row's
first token) and `tpot_ms` from the call's per-row stats (no `e2e_ms`).
A thread per request costs host time in this process (every step wakes each request's thread,
which takes the interpreter lock from the engine loop): the two clients bound what a user of
`submit` and of `generate` gets.
"""

from __future__ import annotations

import argparse
import math
import threading
import time

import numpy as np
from tqdm.auto import tqdm

from cg_jax.bench import options, rows
from cg_jax.engine import Engine


CLIENTS = ("threads", "generate")


def add_arguments(parser: argparse.ArgumentParser) -> None:
  options.add_model_arguments(parser)
  parser.add_argument("--num-requests", type=int, default=64, help="requests to submit")
  parser.add_argument("--prompt-len", default="64:480",
                      help="prompt tokens: a length N or an inclusive range MIN:MAX (drawn "
                           "uniformly, seeded)")
  parser.add_argument("--output-len", type=int, default=128, help="output tokens per request")
  parser.add_argument("--rate", default="inf",
                      help="requests per second, Poisson arrivals; inf = all at once")
  parser.add_argument("--seed", type=int, default=0,
                      help="seed of the prompt lengths, tokens and arrival times")
  parser.add_argument("--client", choices=CLIENTS, default="threads",
                      help="threads: Engine.submit, one consumer thread per request, at the "
                           "arrival times; generate: one Engine.generate call over all prompts "
                           "(offline; --rate inf only)")


class _Request(threading.Thread):
  """Consumes one handle: counts its tokens and notes when the first and the last came."""

  def __init__(self, handle, submitted: float, done):
    super().__init__(daemon=True)
    self.handle, self.submitted, self.done = handle, submitted, done
    self.first = self.finished = None
    self.tokens = 0
    self.error: BaseException | None = None

  def run(self) -> None:
    try:
      for delta in self.handle:
        if delta.token < 0:  # text held back to the end, no token
          continue
        if self.tokens == 0:
          self.first = time.perf_counter()
        self.tokens += 1
      self.finished = time.perf_counter()
    except BaseException as error:  # noqa: BLE001 - re-raised by the submitting thread
      self.error = error
    finally:
      self.done()


def _send(engine: Engine, prompts: list[list[int]], arrivals: np.ndarray, output_len: int,
          desc: str) -> list["_Request"]:
  """Submit each prompt at its arrival time (seconds from the first) and wait for them all."""
  bar = tqdm(total=len(prompts), desc=desc, unit="req")
  lock = threading.Lock()

  def done():
    with lock:
      bar.update()

  requests = []
  start = time.perf_counter()
  try:
    for i, (prompt, at) in enumerate(zip(prompts, arrivals)):
      wait = start + at - time.perf_counter()
      if wait > 0:
        time.sleep(wait)
      submitted = time.perf_counter()
      requests.append(_Request(engine.submit(prompt, output_len, eos_token_id=[]), submitted,
                               done))
      # Requests due together are all submitted before their consumers start (thread starts
      # between the submits would stagger them).
      if i + 1 == len(prompts) or start + arrivals[i + 1] > time.perf_counter():
        for request in requests:
          if request.ident is None:  # not started yet
            request.start()
    for request in requests:
      request.join()
  finally:
    bar.close()
  return requests


def run(args) -> list[rows.Row]:
  count = options.integer("--num-requests", args.num_requests)
  low, high = options.length_range("--prompt-len", args.prompt_len)
  output_len = options.integer("--output-len", args.output_len)
  per_s = options.rate("--rate", args.rate)
  if args.client == "generate" and math.isfinite(per_s):
    raise ValueError(f"--client generate sends every prompt at once: it takes --rate inf, got "
                     f"--rate {args.rate}")
  if args.max_seq_len is not None:
    options.fits(high, output_len, args.max_seq_len)
  engine = Engine.from_pretrained(args.model, max_waiting=max(count, 1024),  # all may wait
                                  **options.engine_options(
                                      args, options.int_list("--batch-buckets", args.batch_buckets),
                                      options.int_list("--prompt-buckets", args.prompt_buckets)))
  try:
    return _measure(args, engine, count, (low, high), output_len, per_s)
  finally:
    engine.close()


def requests(count: int, lengths: tuple[int, int], per_s: float, seed: int, vocab_size: int) -> tuple[list[list[int]], np.ndarray, list[list[int]]]:
  """The workload's measured prompts (count x [n], n drawn from the inclusive `lengths`), their
  arrival times ([count] seconds from the first; all zero at an infinite rate) and the prompts
  of the unmeasured pass before them (the same lengths, other tokens), from `seed`."""
  low, high = lengths
  rng = np.random.default_rng(seed)
  sizes = rng.integers(low, high + 1, count)  # [count]
  prompts = [rng.integers(0, vocab_size, int(n)).tolist() for n in sizes]  # count x [n]
  gaps = rng.exponential(1 / per_s, count) if math.isfinite(per_s) else np.zeros(count)
  arrivals = np.concatenate([[0.0], np.cumsum(gaps[1:])])  # [count]
  unmeasured = [rng.integers(0, vocab_size, int(n)).tolist() for n in sizes]  # count x [n]
  return prompts, arrivals, unmeasured


def workload(count: int, lengths: tuple[int, int], output_len: int, per_s: float, seed: int,
             dtype: str, client: str = "threads") -> dict:
  """A throughput row's workload."""
  low, high = lengths
  return dict(kind="throughput", num_requests=count,
              prompt_len=str(low) if low == high else f"{low}:{high}", output_len=output_len,
              rate=per_s if math.isfinite(per_s) else "inf", seed=seed, dtype=dtype,
              client=client)


def figures(submitted: list[float], first: list[float], finished: list[float],
            tokens: list[int]) -> dict[str, float]:
  """The figures of requests from their submit, first-token and finish times (perf_counter
  seconds) and token counts: wall time from the first submit to the last finish."""
  wall = max(finished) - min(submitted)
  count = len(tokens)
  return {
      "tokens_per_s": sum(tokens) / wall, "requests_per_s": count / wall,
      "output_tokens": sum(tokens),
      **rows.percentiles("ttft_ms", [(f - s) * 1e3 for s, f in zip(submitted, first)]),
      **rows.percentiles("tpot_ms", [(e - f) / (n - 1) * 1e3
                                     for f, e, n in zip(first, finished, tokens) if n > 1]),
      **rows.percentiles("e2e_ms", [(e - s) * 1e3 for s, e in zip(submitted, finished)],
                         (50, 99)),
  }


def _measure(args, engine: Engine, count: int, lengths: tuple[int, int], output_len: int,
             per_s: float) -> list[rows.Row]:
  options.fits(lengths[1], output_len, engine.config.max_seq_len)
  prompts, arrivals, unmeasured = requests(count, lengths, per_s, args.seed,
                                           engine.model_config.vocab_size)
  engine.warmup()
  engine.wait_for_final_steps()  # (steady state: no step on a stand-in)
  row_workload = workload(count, lengths, output_len, per_s, args.seed, engine.dtype.name,
                          args.client)
  if args.client == "generate":
    return [options.row(args, row_workload, _generate(engine, prompts, unmeasured, output_len))]
  # An unmeasured pass of the same shapes first (other prompts, all at once): the first pass
  # after warm-up is slower (benchmarks/results/bench_h200.md), start-up, not steady state.
  _send(engine, unmeasured, np.zeros(count), output_len, "unmeasured pass")
  sent = _send(engine, prompts, arrivals, output_len, "throughput")
  for i, request in enumerate(sent):
    if request.error is not None:
      raise RuntimeError(f"request {i} failed: {request.error!r}") from request.error
    if request.tokens != output_len:
      raise RuntimeError(f"request {i} made {request.tokens} tokens, not --output-len "
                         f"{output_len}")
  values = figures([r.submitted for r in sent], [r.first for r in sent],
                   [r.finished for r in sent], [r.tokens for r in sent])
  return [options.row(args, row_workload, values)]


def _generate(engine: Engine, prompts: list[list[int]], unmeasured: list[list[int]],
              output_len: int) -> dict[str, float]:
  """The offline client's figures: one `generate` call over all prompts, after an unmeasured
  one over the other prompts of the same lengths; TTFT and TPOT per row from its stats."""
  engine.generate(unmeasured, output_len, eos_token_id=[])
  start = time.perf_counter()
  result = engine.generate(prompts, output_len, eos_token_id=[])
  wall = time.perf_counter() - start
  made = [len(tokens) for tokens in result]
  if made != [output_len] * len(prompts):
    raise RuntimeError(f"generate made {made} tokens, not --output-len {output_len} each")
  stats = result.stats
  return {"tokens_per_s": sum(made) / wall, "requests_per_s": len(prompts) / wall,
          "output_tokens": sum(made),
          **rows.percentiles("ttft_ms", [t * 1e3 for t in stats["ttft_s_rows"]]),
          **rows.percentiles("tpot_ms", [t * 1e3 for t in stats["per_token_s_rows"]])}
