"""Command line: `python -m cg_jax generate [--model PATH_OR_NAME] --prompt TEXT ...`."""

from __future__ import annotations

import argparse
import json
import sys

from cg_jax.buckets import DEFAULT_BATCH_BUCKETS
from cg_jax.hub import DEFAULT_MODEL


def _int_list(text: str) -> list[int]:
  try:
    return [int(x) for x in text.replace(",", " ").split()]
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected integers separated by commas, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="python -m cg_jax", description=__doc__)
  sub = parser.add_subparsers(dest="command", required=True)
  gen = sub.add_parser("generate", help="generate a continuation and print it with stats")
  gen.add_argument("--model", default=DEFAULT_MODEL,
                   help="checkpoint directory, bundled model (default: %(default)s, trained on "
                        "the King James Bible), preset name (random weights) or HF model name "
                        "in the local Hugging Face cache")
  prompt = gen.add_mutually_exclusive_group(required=True)
  prompt.add_argument("--prompt", action="append", help="prompt text (repeat for a batch)")
  prompt.add_argument("--prompt-ids", action="append", type=_int_list,
                      help="prompt token ids, comma separated (repeat for a batch)")
  gen.add_argument("--max-new-tokens", type=int, default=32)
  gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
  gen.add_argument("--top-k", type=int, default=0)
  gen.add_argument("--top-p", type=float, default=1.0)
  gen.add_argument("--seed", type=int, default=None)
  gen.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
  gen.add_argument("--batch-buckets", type=_int_list, default=list(DEFAULT_BATCH_BUCKETS))
  gen.add_argument("--max-seq-len", type=int, default=None)
  gen.add_argument("--tensor-parallel", type=int, default=1,
                   help="split the model over this many devices (cg_jax.sharding)")
  gen.add_argument("--device-loop", action="store_true",
                   help="generate several tokens per host call inside one executable")
  gen.add_argument("--json", action="store_true", help="print one JSON object")

  prof = sub.add_parser("profile", help="launch accounting of decode steps from a real profile")
  prof.add_argument("--model", required=True, help="checkpoint directory or preset name")
  prof.add_argument("--batch", type=int, default=1)
  prof.add_argument("--graphs", default="xla-default", help="off, xla-default or full")
  prof.add_argument("--layer-loop", default="unroll", choices=("scan", "unroll"))
  prof.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"))
  prof.add_argument("--max-seq-len", type=int, default=1024)
  prof.add_argument("--position", type=int, default=512)
  prof.add_argument("--steps", type=int, default=10)
  prof.add_argument("--tensor-parallel", type=int, default=1)
  prof.add_argument("--json", action="store_true", help="print one JSON object")
  return parser


def run_profile(args) -> int:
  from cg_jax import profile
  from cg_jax.engine import Engine

  engine = Engine.from_pretrained(args.model, dtype=args.dtype, batch_buckets=[args.batch],
                                  prompt_buckets=[16], max_seq_len=args.max_seq_len,
                                  graphs=args.graphs, layer_loop=args.layer_loop,
                                  tensor_parallel=args.tensor_parallel)
  timing = profile.time_decode(engine, args.batch, position=args.position)
  report, trace = profile.profile_decode(engine, args.batch, position=args.position,
                                         steps=args.steps)
  result = dict(report.as_dict(), **timing, trace=trace, graphs=args.graphs,
                layer_loop=args.layer_loop, device=str(engine.weights()["embed"].devices()))
  if args.json:
    print(json.dumps(result))
    return 0
  for key in ("step_us", "host_dispatch_wall_us", "pipelined_call_us", "kernels_per_step",
              "graph_launches_per_step",
              "kernel_launches_outside_graphs_per_step", "memcpy_per_step", "host_dispatch_us",
              "gpu_busy_us", "idle_gap_share"):
    print(f"{key:42s} {result[key]:10.2f}")
  print(f"trace: {trace}")
  return 0


def generate(args) -> int:
  from cg_jax.engine import Engine

  engine = Engine.from_pretrained(args.model, dtype=args.dtype, batch_buckets=args.batch_buckets,
                                  max_seq_len=args.max_seq_len,
                                  tensor_parallel=args.tensor_parallel)
  inputs = args.prompt if args.prompt is not None else args.prompt_ids
  # Validate before compiling anything, then compile only the buckets this request needs.
  engine.validate(inputs, args.max_new_tokens, do_sample=args.temperature > 0,
                  temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                  seed=args.seed, device_loop=args.device_loop)
  batch = engine.config.buckets.batch_bucket(min(len(inputs), engine.config.buckets.max_batch))
  compile_times = engine.warmup(batch_sizes=[batch], progress=not args.json)
  result = engine.generate(inputs, args.max_new_tokens, do_sample=args.temperature > 0,
                           temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                           seed=args.seed, device_loop=args.device_loop)
  stats = dict(result.stats, warmup_s=sum(compile_times.values()),
               executables=len(compile_times))
  if args.json:
    print(json.dumps({"tokens": list(result), "texts": result.texts, "stats": stats}))
    return 0
  for i, tokens in enumerate(result):
    shown = result.texts[i] if result.texts is not None else " ".join(map(str, tokens))
    prefix = inputs[i] if args.prompt is not None else ""
    print(f"[{i}] {prefix}{shown}")
  print(f"time to first token {stats['ttft_s'] * 1e3:.1f} ms | per token "
        f"{stats['per_token_s'] * 1e3:.2f} ms | {stats['tokens_per_s']:.1f} tokens/s | "
        f"warmup {stats['warmup_s']:.1f} s ({stats['executables']} executables)")
  return 0


def main(argv: list[str] | None = None) -> int:
  args = build_parser().parse_args(argv)
  try:
    if args.command == "generate":
      return generate(args)
    if args.command == "profile":
      return run_profile(args)
  except (ValueError, TypeError) as err:
    print(f"error: {err}", file=sys.stderr)
    return 2
  return 1
