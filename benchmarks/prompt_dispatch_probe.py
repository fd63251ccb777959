"""Where a prompt call's host time goes before its GPU work starts (issue #18), in one process.

For B prompts of --prompt-len tokens:
  ttft         `generate(max_new_tokens=1)` TTFT with the engine as it is and with the prefix
               lookup hashing every block first (the engine before the lazy lookup), ABAB order
  dispatch     the ("prompts", B, S) executable called directly: host time until it returns
               (dispatch) and until its first tokens are on the host (total), with NumPy inputs
               (as the scheduler calls it) and with inputs already on the device
Run it under `TF_CPP_VMODULE=command_buffer_thunk=3` (gpu_session.sh part `prompt-dispatch`)
to see whether the prompt graph is updated on every call ("Updated N commands in X us").

  PYTHONPATH=$PWD python3 benchmarks/prompt_dispatch_probe.py --checkpoint /tmp/ck/gpt2 --out OUT
"""

from __future__ import annotations

import json
import os
import time

import jax
import numpy as np
from bench_util import generate_ttft_ms, git_commit, prompt_call_ms, prompt_probe_parser

from cg_jax import Engine
from cg_jax.core import prefix_cache


def eager_lookup(index, prompt, multiple=1):
  """PrefixIndex.lookup as it was: every block of the prompt hashed before the first test."""
  list(prefix_cache.block_digests(prompt[:len(prompt) - 1], index.block))
  return LAZY(index, prompt, multiple)


LAZY = prefix_cache.PrefixIndex.lookup


def main():
  ap = prompt_probe_parser()
  args = ap.parse_args()
  length, batches = args.prompt_len, tuple(int(b) for b in args.batches.split(","))
  name = os.path.basename(args.checkpoint.rstrip("/"))
  engine = Engine.from_pretrained(args.checkpoint, dtype="bfloat16", max_seq_len=2 * length,
                                  batch_buckets=batches, prompt_buckets=(length,))
  engine.warmup(phases=("prompts", "prefix"), progress=False)
  rng = np.random.default_rng(0)
  result = {"model": name, "commit": git_commit(), "jax": jax.__version__,
            "device": jax.devices()[0].device_kind, "date": time.strftime("%Y-%m-%d"),
            "vlog": os.environ.get("TF_CPP_VMODULE", "")}
  for batch in batches:
    row = {"lazy_lookup_ttft_ms": [], "eager_lookup_ttft_ms": []}
    for _ in range(2):
      for label, lookup in (("lazy", LAZY), ("eager", eager_lookup)):
        prefix_cache.PrefixIndex.lookup = lookup
        row[f"{label}_lookup_ttft_ms"].append(generate_ttft_ms(engine, batch, length, rng, 15))
    prefix_cache.PrefixIndex.lookup = LAZY
    exe = engine.executables.get(("prompts", batch, length))
    for staged in (False, True):
      label = "staged" if staged else "numpy"
      row[f"{label}_dispatch_ms"], row[f"{label}_total_ms"] = prompt_call_ms(
          engine, exe, batch, length, rng, staged)
    result[f"b{batch}"] = row
    print(name, batch, json.dumps({k: [round(x, 3) for x in v] if isinstance(v, list)
                                   else round(v, 3) for k, v in row.items()}), flush=True)
  suffix = "_vlog" if result["vlog"] else ""
  with open(os.path.join(args.out, f"prompt_dispatch_{name}{suffix}.json"), "w") as f:
    json.dump(result, f, indent=1)


if __name__ == "__main__":
  main()
