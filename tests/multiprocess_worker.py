"""One process of tests/test_multiprocess.py: joins a 2-process jax.distributed run on CPU devices
(one per process), builds Engine(tensor_parallel=2) over both, and prints its greedy tokens and
its streamed tokens as JSON lines."""

import json
import sys

from cg_jax import Engine
from cg_jax.core.sharding import initialize_processes

OPTIONS = dict(max_seq_len=64, batch_buckets=(1, 2, 4), prompt_buckets=(16,),
               compilation_cache=False)
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], list(range(20, 41))]  # the last one: two chunks


def main():
  process_id, port = int(sys.argv[1]), int(sys.argv[2])
  initialize_processes(f"127.0.0.1:{port}", num_processes=2, process_id=process_id)
  engine = Engine.from_pretrained("tiny-llama", tensor_parallel=2, **OPTIONS)
  tokens = engine.generate(PROMPTS, max_new_tokens=8, eos_token_id=[])
  streamed = [[] for _ in PROMPTS]
  for chunk in engine.stream(PROMPTS, max_new_tokens=8, eos_token_id=[]):
    for row, token in chunk.tokens.items():
      streamed[row].append(token)
  print("RESULT " + json.dumps({"process": process_id, "devices": engine.stats()["tensor_parallel"],
                               "tokens": [list(map(int, r)) for r in tokens],
                               "streamed": streamed}), flush=True)
  engine.close()


if __name__ == "__main__":
  main()
