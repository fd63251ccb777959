"""Decode-step latency of one source tree's engine, for before/after comparisons in one GPU run.

  python benchmarks/decode_step_ab.py --root DIR --label NAME --variants default,full \
      --out rows.json
  python benchmarks/decode_step_ab.py --table rows.json ...    (a Markdown table of the rows)

Imports cg_jax from DIR (another checkout, e.g. the commit before a refactor, or this one), builds
each model once per variant with random bf16 weights (batch buckets 1 and 8, cache 1024) and
times the greedy decode step at position 512 with `cg_jax.profile.time_decode` (medians), the
helper both trees share. Variants: default (the engine's defaults), full (graphs="full").
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import time


def table(paths: list[str]) -> str:
  """Markdown: step us per (model, batch) and (tree, variant), in the files' order."""
  rows = [row for path in paths for row in json.load(open(path))]
  columns = list(dict.fromkeys((r["tree"], r["variant"]) for r in rows))
  cells = {(r["model"], r["batch"], r["tree"], r["variant"]): r["step_us"] for r in rows}
  lines = ["| model | B | " + " | ".join(f"{t} {v}" for t, v in columns) + " |",
           "|---|---|" + "---|" * len(columns)]
  for model, batch in dict.fromkeys((r["model"], r["batch"]) for r in rows):
    values = [cells.get((model, batch, t, v)) for t, v in columns]
    lines.append(f"| {model} | {batch} | "
                 + " | ".join("" if x is None else f"{x:.1f}" for x in values) + " |")
  return "\n".join(lines)


def main():
  if sys.argv[1:2] == ["--table"]:
    print(table(sys.argv[2:]))
    return
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--root", required=True, help="source tree to import cg_jax from")
  parser.add_argument("--label", required=True)
  parser.add_argument("--models", default="gpt2,llama-3.2-1b")
  parser.add_argument("--batches", default="1,8")
  parser.add_argument("--variants", default="default")
  parser.add_argument("--out", required=True)
  args = parser.parse_args()
  sys.path.insert(0, args.root)

  import jax

  from cg_jax import profile
  from cg_jax.engine import Engine

  commit = subprocess.run(["git", "-C", args.root, "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True).stdout.strip() or args.label

  def options(variant: str) -> dict:
    if variant == "default":
      return {}
    if variant == "full":
      return {"graphs": "full"}
    raise SystemExit(f"unknown variant {variant!r}")

  batches = [int(b) for b in args.batches.split(",")]
  rows = []
  for model in args.models.split(","):
    for variant in args.variants.split(","):
      start = time.perf_counter()
      engine = Engine.from_pretrained(model, dtype="bfloat16", max_seq_len=1024,
                                      batch_buckets=tuple(batches), prompt_buckets=(16,),
                                      **options(variant))
      for batch in batches:
        timing = profile.time_decode(engine, batch, position=512, steps=64, repeats=7)
        rows.append(dict(
            tree=args.label, commit=commit, model=model, variant=variant, batch=batch,
            step_us=round(timing["step_us"], 1),
            host_dispatch_wall_us=round(timing["host_dispatch_wall_us"], 1),
            gpu=jax.devices()[0].device_kind, jax_version=jax.__version__,
            date=datetime.date.today().isoformat(),
            setup_and_compile_s=round(time.perf_counter() - start, 1)))
        print(json.dumps(rows[-1]), flush=True)
      del engine
  with open(args.out, "w") as f:
    json.dump(rows, f, indent=1)


if __name__ == "__main__":
  main()
