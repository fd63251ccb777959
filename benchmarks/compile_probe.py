"""One cold engine start (no persistent cache, nothing stored) and what its executables cost.

  python benchmarks/compile_probe.py LABEL MODEL_DIR OUT.jsonl ['{"token_buckets": [...], ...}']

The JSON holds `Engine.from_pretrained` options (max_seq_len 1024 unless given) and, for the
probe only: "workers" (warm-up threads), "only" (compile just these keys, e.g. "step/8", on
`workers` threads, default one, and stop), "prefill_options" ({prefill_gemm choice: XLA options
added to that choice's}, to compare option sets that are not an engine option),
"prefill_gemm_tokens" (`executables.PREFILL_GEMM_TOKENS`). Appends two
rows to OUT.jsonl: "compile" (import, load and warm-up seconds, the process's CPU seconds during
the warm-up, each executable's seconds; the warm-up returns when the decode steps' stand-ins are
ready, "final_steps_s" once their own executables replaced them) and "timing" (`profile.time_decode` at 1 to 256 rows
(up to max_num_seqs), at position 512 (or half the cache); `generate`'s TTFT and per-token time
for one prompt of that many tokens and 128 new (and its per-token time sampled), the last
row's TTFT of 32 such prompts, and tokens/s of 64 and of 256 requests of 64-480 prompt tokens
and 128 new; medians). Results: results/compile_time_h100.md.
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
from cg_jax.core import executables  # noqa: E402


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
  for batch in (1, 8, 16, 32, 64, 128, 256):
    if batch <= engine.config.step_rows:
      row[f"step_us_b{batch}"] = round(profile.time_decode(
          engine, batch, position=position, steps=32, repeats=5)["step_us"], 1)
  rng = np.random.default_rng(0)
  vocab = engine.model_config.vocab_size

  def stats(n, length, new, **sampling):
    lengths = [length] * n if isinstance(length, int) else rng.integers(*length, n)
    prompts = [rng.integers(0, vocab, int(k)).tolist() for k in lengths]
    return engine.generate(prompts, new, eos_token_id=[], **sampling).stats

  ones = [stats(1, position, 128) for _ in range(4)][1:]
  row["b1_ttft_ms"] = round(statistics.median(s["ttft_s"] for s in ones) * 1e3, 2)
  row["b1_per_token_us"] = round(statistics.median(s["per_token_s"] for s in ones) * 1e6, 1)
  sampled = [stats(1, position, 128, do_sample=True, temperature=0.8, top_p=0.9, seed=0)
             for _ in range(3)][1:]
  row["b1_sampled_per_token_us"] = round(
      statistics.median(s["per_token_s"] for s in sampled) * 1e6, 1)
  batches = [stats(32, position, 1) for _ in range(3)][1:]
  row["b32x512_last_ttft_ms"] = round(
      statistics.median(s["ttft_s_last"] for s in batches) * 1e3, 2)
  # The offline workloads: prompts of 64-480 tokens, 128 new each (median of 2 after one).
  for n in (64, 256):
    runs = [stats(n, (64, 481), 128)["tokens_per_s"] for _ in range(3)][1:]
    row[f"r{n}_tok_s"] = round(statistics.median(runs))
  return row


def main(label: str, model: str, out: str, options: str = "{}") -> None:
  imported = time.perf_counter() - START
  opts = json.loads(options)
  workers, only = opts.pop("workers", None), opts.pop("only", None)
  if opts.get("prefill_options"):
    add_prefill_options(opts.pop("prefill_options"))
  if "prefill_gemm_tokens" in opts:  # (steps of this many decode rows on the prefill GEMMs)
    executables.PREFILL_GEMM_TOKENS = opts.pop("prefill_gemm_tokens")
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
  ready = time.perf_counter() - begin
  getattr(engine, "wait_for_final_steps", lambda: True)()  # (older trees have none)
  row = dict(label=label, model=os.path.basename(model.rstrip("/")), options=options,
             token_buckets=engine.config.token_buckets, prefill_gemm=engine.config.prefill_gemm,
             prefill_xla_options=engine.config.prefill_xla_options, workers=workers,
             max_num_seqs=engine.config.max_num_seqs, kv_blocks=engine.config.num_blocks,
             executables=len(seconds),
             import_s=round(imported, 2), load_s=round(loaded, 2),
             warmup_wall_s=round(ready, 2),
             final_steps_s=round(time.perf_counter() - begin, 2),
             warmup_cpu_s=round(cpu_seconds() - cpu, 1),
             compile_s={k: round(v, 2) for k, v in sorted(seconds.items(), key=lambda kv: -kv[1])},
             final_compile_s={"/".join(map(str, k)): round(v, 2)
                              for k, v in engine.executables.compile_seconds.items()
                              if "/".join(map(str, k)) not in seconds},
             device=jax.devices()[0].device_kind, jax=jax.__version__)
  with open(out, "a") as f:
    f.write(json.dumps(dict(row, kind="compile")) + "\n")
  print(f"[{label}] load {loaded:.1f} s, warm-up {row['warmup_wall_s']} s (final steps "
        f"{row['final_steps_s']} s; {row['warmup_cpu_s']} "
        f"CPU s); slowest: " + ", ".join(f"{k} {v}" for k, v in list(row["compile_s"].items())[:4]),
        flush=True)
  if only:
    return
  row.update(timings(engine))
  with open(out, "a") as f:
    f.write(json.dumps(dict(row, kind="timing")) + "\n")
  print(f"[{label}] " + " ".join(f"{k} {v}" for k, v in row.items()
                                 if k.startswith(("step_us", "b1", "b32", "r64", "r256"))),
        flush=True)


if __name__ == "__main__":
  main(*sys.argv[1:])
