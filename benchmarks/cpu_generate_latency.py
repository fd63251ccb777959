"""CPU benchmark (not a test): per-token latency of generate and stream on a tiny model, after warmup. Prints a table; medians over repeats.

  python benchmarks/cpu_generate_latency.py [--model tiny-llama] [--new-tokens 64] [--repeats 5]
"""

import argparse
import statistics
import time

from cg_jax import Engine


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--model", default="tiny-llama")
  parser.add_argument("--new-tokens", type=int, default=64)
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--batch", type=int, default=1)
  args = parser.parse_args()

  engine = Engine.from_pretrained(args.model, batch_buckets=(args.batch,), prompt_buckets=(16,),
                                  max_seq_len=16 + args.new_tokens + 1)
  start = time.perf_counter()
  engine.warmup(progress=False)
  warmup_s = time.perf_counter() - start
  prompts = [[1 + i, 2, 3, 4, 5] for i in range(args.batch)]
  common = dict(max_new_tokens=args.new_tokens, eos_token_id=[])

  def run_generate():
    return engine.generate(prompts, **common).stats["per_token_s"]

  def run_stream():
    chunks = engine.stream(prompts, **common)
    next(chunks)
    first = time.perf_counter()
    steps = sum(1 for _ in chunks)
    return (time.perf_counter() - first) / steps

  rows = {"generate": run_generate, "stream": run_stream}
  print(f"model {args.model}, batch {args.batch}, {args.new_tokens} new tokens, "
        f"warmup {warmup_s:.1f} s ({len(engine.executable_keys())} executables)")
  print(f"{'mode':32s} {'median per-token latency':>26s}")
  for name, fn in rows.items():
    fn()  # one untimed run
    samples = [fn() for _ in range(args.repeats)]
    print(f"{name:32s} {statistics.median(samples) * 1e6:22.1f} us")


if __name__ == "__main__":
  main()
