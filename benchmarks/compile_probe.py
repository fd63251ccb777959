"""One cold engine start (no persistent cache, nothing stored) and what its executables cost.

  python benchmarks/compile_probe.py LABEL MODEL_DIR OUT.jsonl ['{"token_buckets": [...], ...}']

The JSON holds `Engine.from_pretrained` options (max_seq_len 1024 unless given) and, for the
probe only: "workers" (warm-up threads), "only" (compile just these keys, e.g. "step/8", on
`workers` threads, default one, and stop), "prefill_options" ({prefill_gemm choice: XLA options
added to that choice's}, to compare option sets that are not an engine option). Appends two
rows to OUT.jsonl: "compile" (import, load and warm-up seconds, the process's CPU seconds during
the warm-up, each executable's seconds) and "timing" (`profile.time_decode` at 1, 8, 16 and 32
rows, at position 512 (or half the cache); `generate`'s TTFT and per-token time for one prompt
of that many tokens, the last row's TTFT of 32 such prompts, and tokens/s of 64 requests of
256 + 128 tokens; medians). Results: results/compile_time_h100.md.
"""

import json
import os
import resource
import statistics
import sys
import time

START = time.perf_counter()
os.environ["CG_JAX_COMPILATION_CACHE"] = "off"

import jax  # noqa: E402
import numpy as np  # noqa: E402

from cg_jax import Engine, profile  # noqa: E402
from cg_jax.core import config as engine_config  # noqa: E402


def cpu_seconds() -> float:
  usage = resource.getrusage(resource.RUSAGE_SELF)
  return usage.ru_utime + usage.ru_stime


def add_prefill_options(extra: dict) -> None:
  """`EngineConfig.prefill_xla_options` with `extra[prefill_gemm]` on top (probe only)."""
  original = engine_config.EngineConfig.prefill_xla_options.fget
  engine_config.EngineConfig.prefill_xla_options = property(
      lambda self: {**original(self), **extra.get(self.prefill_gemm, {})})


def timings(engine) -> dict:
  row = {}
  position = min(512, engine.config.max_seq_len // 2)
  for batch in (1, 8, 16, 32):
    row[f"step_us_b{batch}"] = round(profile.time_decode(
        engine, batch, position=position, steps=32, repeats=5)["step_us"], 1)
  rng = np.random.default_rng(0)
  vocab = engine.model_config.vocab_size

  def stats(n, length, new):
    prompts = [rng.integers(0, vocab, length).tolist() for _ in range(n)]
    return engine.generate(prompts, new, eos_token_id=[]).stats

  ones = [stats(1, position, 32) for _ in range(4)][1:]
  row["b1_ttft_ms"] = round(statistics.median(s["ttft_s"] for s in ones) * 1e3, 2)
  row["b1_per_token_us"] = round(statistics.median(s["per_token_s"] for s in ones) * 1e6, 1)
  batches = [stats(32, position, 1) for _ in range(3)][1:]
  row["b32x512_last_ttft_ms"] = round(
      statistics.median(s["ttft_s_last"] for s in batches) * 1e3, 2)
  row["r64_tok_s"] = round(stats(64, 256, 128)["tokens_per_s"])
  return row


def main(label: str, model: str, out: str, options: str = "{}") -> None:
  imported = time.perf_counter() - START
  opts = json.loads(options)
  workers, only = opts.pop("workers", None), opts.pop("only", None)
  if opts.get("prefill_options"):
    add_prefill_options(opts.pop("prefill_options"))
  opts.setdefault("max_seq_len", 1024)
  begin = time.perf_counter()
  engine = Engine.from_pretrained(model, **opts)
  loaded = time.perf_counter() - begin
  cpu, begin = cpu_seconds(), time.perf_counter()
  if only:
    keys = [tuple(int(p) if p.isdigit() else p for p in name.split("/")) for name in only]
    seconds = engine.executables.compile(keys, progress=False, workers=workers or 1)
  else:
    seconds = engine.warmup(progress=False, workers=workers)
  row = dict(label=label, model=os.path.basename(model.rstrip("/")), options=options,
             token_buckets=engine.config.token_buckets, prefill_gemm=engine.config.prefill_gemm,
             prefill_xla_options=engine.config.prefill_xla_options, workers=workers,
             import_s=round(imported, 2), load_s=round(loaded, 2),
             warmup_wall_s=round(time.perf_counter() - begin, 2),
             warmup_cpu_s=round(cpu_seconds() - cpu, 1),
             compile_s={k: round(v, 2) for k, v in sorted(seconds.items(), key=lambda kv: -kv[1])},
             device=jax.devices()[0].device_kind, jax=jax.__version__)
  with open(out, "a") as f:
    f.write(json.dumps(dict(row, kind="compile")) + "\n")
  print(f"[{label}] load {loaded:.1f} s, warm-up {row['warmup_wall_s']} s ({row['warmup_cpu_s']} "
        f"CPU s); slowest: " + ", ".join(f"{k} {v}" for k, v in list(row["compile_s"].items())[:4]),
        flush=True)
  if only:
    return
  row.update(timings(engine))
  with open(out, "a") as f:
    f.write(json.dumps(dict(row, kind="timing")) + "\n")
  print(f"[{label}] " + " ".join(f"{k} {v}" for k, v in row.items()
                                 if k.startswith(("step_us", "b1", "b32", "r64"))), flush=True)


if __name__ == "__main__":
  main(*sys.argv[1:])
