"""A warm engine start as `serve`'s core makes it, with the stored executables loaded after the
checkpoint is read (today: `ExecutableTable.compile_behind` leaves stored keys to `warmup`) or
beside the read (`compile_behind` given every key). One cold start fills a fresh cache, then
warm starts alternate between the two, each a new process:

  PYTHONSAFEPATH=1 PYTHONPATH=$PWD python3 benchmarks/warm_start_probe.py MODEL_DIR OUT.jsonl \
      [--rounds 3] [--max-seq-len 1024]

Each row: seconds from the process's start to cg_jax imported (`import_s`), `from_pretrained`
returned (`loaded_s`), `warmup()` returned (`ready_s`) and a first 4-token answer (`first_s`),
the executables loaded from the store, and the checkpoint's read and place seconds. The cold
start waits for its autotuned decode steps (`final_s`), so that the warm ones load every
executable as `serve`'s second start does. Why: on the CPU machine loading beside the read slowed it
(results/compile_while_loading_cpu.md); a GPU host has the cores for both.
"""

import time

T0 = time.time()

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402


def start(mode: str, model: str, cache: str, max_seq_len: int) -> dict:
  """One start in this process (mode "cold", "after" or "beside"); its row."""
  from cg_jax import Engine
  from cg_jax.core import executables
  from cg_jax.serving.service import WARMUP_PHASES
  imported = time.time()
  if mode == "beside":
    def behind(self, keys):
      def run():
        with contextlib.suppress(Exception):  # (raised again to the key's waiters)
          self.compile(list(keys), progress=False)
      threading.Thread(target=run, daemon=True).start()
    executables.ExecutableTable.compile_behind = behind
  engine = Engine.from_pretrained(model, max_seq_len=max_seq_len, compilation_cache=cache,
                                  compile_while_loading=WARMUP_PHASES)
  loaded = time.time()
  engine.warmup(progress=False)
  ready = time.time()
  engine.generate([[1, 2, 3, 4]], 4, eos_token_id=[])
  first = time.time()
  if mode == "cold":
    engine.wait_for_final_steps(600)
  stats = engine.stats()
  return dict(mode=mode, import_s=imported - T0, loaded_s=loaded - T0, ready_s=ready - T0,
              first_s=first - T0, final_s=time.time() - T0,
              executables_loaded=stats["executables_loaded"],
              checkpoint_read_s=stats["checkpoint_read_s"],
              weights_place_s=stats["weights_place_s"])


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("model")
  parser.add_argument("output")
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--max-seq-len", type=int, default=1024)
  parser.add_argument("--child", nargs=2, metavar=("MODE", "CACHE"), help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.child:
    mode, cache = args.child
    print(json.dumps(start(mode, args.model, cache, args.max_seq_len)), flush=True)
    os._exit(0)  # (the cold start's decode steps may still be building behind)
  with tempfile.TemporaryDirectory(prefix="cg_jax_warm_") as cache:
    for mode in ["cold"] + ["after", "beside"] * args.rounds:
      done = subprocess.run([sys.executable, __file__, args.model, args.output, "--max-seq-len",
                             str(args.max_seq_len), "--child", mode, cache],
                            capture_output=True, text=True)
      if done.returncode:
        sys.exit(f"the {mode} start failed ({done.returncode}):\n{done.stderr[-3000:]}")
      row = json.loads(done.stdout.strip().splitlines()[-1])
      with open(args.output, "a") as out:
        out.write(json.dumps(row) + "\n")
      print(f"{mode:6s} loaded {row['loaded_s']:6.2f} s  ready {row['ready_s']:6.2f} s  "
            f"first {row['first_s']:6.2f} s  ({row['executables_loaded']} loaded)", flush=True)


if __name__ == "__main__":
  main()
