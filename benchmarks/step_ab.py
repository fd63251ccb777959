"""A/B of engine trees, one engine per process: run it once per tree, each with that tree first on
the path (`PYTHONSAFEPATH=1 PYTHONPATH=<tree>:<repo> python3 benchmarks/step_ab.py MODEL_DIR TAG`),
on one machine in one device call, so the rows compare.

The engine has default options but max_seq_len (MAXLEN, 1024) and the batch buckets up to U (env,
32; 256: 1..256, so max_num_seqs U); KV_BLOCKS sets kv_blocks; CACHE a persistent compilation
cache (none by default: cold compiles). It measures the per-executable compile seconds; for each
of BATCHES (1,8,32) `generate` of PROMPT (512) random tokens and NEW (128) new ones (6 calls, the
first dropped; median TTFT, last row's TTFT and per-row per-token time), the decode step alone
(`profile.time_decode`) and its kernels per step and top kernel families
(`profile.profile_decode`); then a lone PROMPT-token request's first token (10 calls, the first
dropped) and that call's kernels (`profile.profile_calls`). Writes $OUT/step_ab_TAG.json and
prints one line. Results: results/step_ab_h100.md."""
import json, os, statistics, sys, time
import numpy as np

os.environ.setdefault("CG_JAX_COMPILATION_CACHE", "off")
from cg_jax import Engine, profile  # noqa: E402

model, tag = sys.argv[1], sys.argv[2]
U = int(os.environ.get("U", 32))
BATCHES = [int(b) for b in os.environ.get("BATCHES", "1,8,32").split(",")]
PROMPT, MAXLEN, NEW = (int(os.environ.get(k, d))
                       for k, d in (("PROMPT", 512), ("MAXLEN", 1024), ("NEW", 128)))
buckets = tuple(b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b <= U)
t0 = time.perf_counter()
extra = {"kv_blocks": int(os.environ["KV_BLOCKS"])} if os.environ.get("KV_BLOCKS") else {}
e = Engine.from_pretrained(model, max_seq_len=MAXLEN, batch_buckets=buckets,
                           compilation_cache=os.environ.get("CACHE") or False, **extra)
loaded = time.perf_counter() - t0
times = e.warmup(progress=False)
ready = time.perf_counter() - t0
out = {"tag": tag, "U": U, "kv_blocks": e.config.num_blocks, "load_s": loaded, "ready_s": ready,
       "compile_s": sorted(((str(k), round(v, 1)) for k, v in times.items()),
                           key=lambda kv: -kv[1])}
rng = np.random.default_rng(0)
vocab = min(1000, e.model_config.vocab_size)
for batch in BATCHES:
  stats = []
  for _ in range(6):
    prompts = rng.integers(0, vocab, (batch, PROMPT)).tolist()
    stats.append(e.generate(prompts, NEW, eos_token_id=[]).stats)
  stats = stats[1:]
  row = {k: statistics.median(s[k] for s in stats) * 1e3
         for k in ("ttft_s", "ttft_s_last", "per_token_s")}
  row["tokens_per_s"] = statistics.median(s["tokens_per_s"] for s in stats)
  row["step_us"] = profile.time_decode(e, batch, position=PROMPT + NEW // 2, steps=32,
                                       repeats=5)["step_us"]
  report, _ = profile.profile_decode(e, batch, position=PROMPT + NEW // 2, steps=10)
  row["kernels_per_step"] = report.kernels_per_step
  row["gpu_busy_us"] = report.gpu_busy_us
  row["top_kernels"] = [(k, round(v, 1)) for k, v in report.top_kernels]
  out[f"B{batch}"] = row
# a fresh prompt each call: a repeated one would hit the prefix cache (seven of its eight pages)
def lone_prompt():
  return rng.integers(0, vocab, PROMPT).tolist()
ttft = []
for _ in range(10):
  prompt = lone_prompt()
  t = time.perf_counter()
  e.generate([prompt], 1, eos_token_id=[])
  ttft.append((time.perf_counter() - t) * 1e3)
lone = profile.profile_calls(lambda: e.generate([lone_prompt()], 1, eos_token_id=[]), calls=3)
out["lone512"] = {"ttft_ms": statistics.median(ttft[1:]), "all": ttft[1:],
                  "kernels_per_call": lone.kernels_per_step, "gpu_busy_us": lone.gpu_busy_us,
                  "top_kernels": [(k, round(v, 1)) for k, v in lone.top_kernels]}
e.close()
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), f"step_ab_{tag}.json"), "w"),
          indent=1)
short = {k: {m: round(v, 3) for m, v in r.items() if m in ("ttft_s", "per_token_s", "step_us",
                                                             "kernels_per_step")}
         for k, r in out.items() if k.startswith("B")}
print(tag, f"ready {ready:.1f}s slowest {out['compile_s'][:2]}", short,
      f"lone TTFT {out['lone512']['ttft_ms']:.2f} ms ({out['lone512']['kernels_per_call']:.0f} "
      f"kernels, busy {out['lone512']['gpu_busy_us']:.0f} us)", flush=True)
