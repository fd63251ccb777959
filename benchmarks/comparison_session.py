"""The whole cg_jax-against-PyTorch comparison (every system x model x cache length x batch) spread
over the host's GPUs within a deadline, resumable over device calls.

Jobs: one checkpoint job per model (benchmarks/make_checkpoints.py); one PyTorch/HF run per
(model, cache length, system) (benchmarks/run_baselines.sh, one process each); one cg_jax run per
(model, cache length) (benchmarks/graphs_bench.py, graphs `full`, Pallas attention, loading the
same checkpoint files). Each GPU gets a worker (CUDA_VISIBLE_DEVICES=i) that starts the longest
pending job whose checkpoint is ready and whose estimate fits the time left; checkpoint jobs (CPU
work) go to one more worker that sees no GPU, so no GPU waits on them; a job still running at
the deadline is stopped and stays pending. Finished jobs are marked under --state, which outlives
the call while the machine stays warm, so a second call runs only what is left. Each call ends by
collecting every row found so far into OUT/comparison/ (baselines.json, graphs_rows.json,
comparison_h200.md and .png, the logs) and printing the table and the pending jobs.

  PYTHONPATH=$PWD python3 benchmarks/comparison_session.py --out $OUT [--deadline-s 540]
  PYTHONPATH=$PWD python3 benchmarks/comparison_session.py --out /tmp/c --smoke   # CPU, tiny
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import shutil
import subprocess
import sys
import threading
import time

BENCHMARKS = os.path.dirname(os.path.abspath(__file__))
SYSTEMS = ("torch_compile", "torch_gptfast", "torch_cuda_graph", "hf_static", "torch_eager",
           "hf_dynamic")
# Systems 10x slower than the rest: fewer samples (their medians are stable at ~10 ms per step).
SLOW_SYSTEM_ARGS = {"torch_eager": "--repeats 8 --generate-repeats 2",
                    "hf_dynamic": "--repeats 8 --generate-repeats 2"}


@dataclasses.dataclass(frozen=True)
class Job:
  """One process: argv run from the repo root with env added; `needs` names jobs that must be
  done first; `estimate_s` orders the queue (longest first) and keeps a job from starting when
  less time is left; `on_gpu` False sends it to the host worker."""

  name: str
  argv: tuple[str, ...]
  env: tuple[tuple[str, str], ...] = ()
  needs: tuple[str, ...] = ()
  estimate_s: float = 60.0
  on_gpu: bool = True


@dataclasses.dataclass(frozen=True)
class Plan:
  """The shapes of one comparison: models at the short cache, the long-cache model, batches."""

  models: tuple[str, ...]
  long_model: str
  max_len: int
  long_max_len: int
  position: int
  batches: str
  smoke: bool


FULL = Plan(models=("gpt2", "gpt2-large", "llama-3.2-1b"), long_model="llama-3.2-1b",
            max_len=1024, long_max_len=4096, position=512, batches="1,8,32", smoke=False)
SMOKE = Plan(models=("smoke-gpt2", "smoke-llama"), long_model="smoke-llama", max_len=64,
             long_max_len=256, position=24, batches="1,3", smoke=True)
# A host job must not touch a GPU, and leaves most cores to the timed runs beside it.
HOST_JOB_ENV = (("CUDA_VISIBLE_DEVICES", ""), ("OMP_NUM_THREADS", "4"))
# Seconds per job at a 1024-long cache, as measured on the H200 x2 (2026-11-30, the two-call run)
# plus ~20%; a 4096-long cache takes 1.2x; an unlisted model the largest listed.
ESTIMATES = {"checkpoint": {"gpt2": 20, "gpt2-large": 40, "llama-3.2-1b": 55},
             "cg_jax": {"gpt2": 45, "gpt2-large": 135, "llama-3.2-1b": 60},
             "torch_compile": {"gpt2": 95, "gpt2-large": 235, "llama-3.2-1b": 155},
             # gpt2 and llama-3.2-1b measured on one H200 (2026-12-01, ~65 s and ~105 s a batch,
             # mostly compiling); gpt2-large scaled from gpt2 as torch_compile's is (2.5x).
             "torch_gptfast": {"gpt2": 250, "gpt2-large": 600, "llama-3.2-1b": 390},
             "torch_cuda_graph": {"gpt2": 35, "gpt2-large": 45, "llama-3.2-1b": 50},
             "hf_static": {"gpt2": 65, "gpt2-large": 110, "llama-3.2-1b": 90},
             "torch_eager": {"gpt2": 45, "gpt2-large": 65, "llama-3.2-1b": 55},
             "hf_dynamic": {"gpt2": 45, "gpt2-large": 55, "llama-3.2-1b": 50}}


def estimate_s(kind: str, model: str) -> float:
  """The job's estimate from ESTIMATES (an unlisted model: the kind's largest)."""
  return ESTIMATES[kind].get(model, max(ESTIMATES[kind].values()))


def plan_jobs(plan: Plan, state: str) -> list[Job]:
  """Every job of the comparison, with its checkpoint prerequisite."""
  python = sys.executable
  checkpoints = os.path.join(state, "checkpoints")
  scale = 0.05 if plan.smoke else 1.0
  smoke = ("--smoke",) if plan.smoke else ()
  jobs = []
  for model in plan.models:
    jobs.append(Job(f"checkpoint.{model}",
                    (python, f"{BENCHMARKS}/make_checkpoints.py", "--out-dir", checkpoints,
                     "--models", model) + smoke,
                    env=HOST_JOB_ENV, estimate_s=scale * estimate_s("checkpoint", model),
                    on_gpu=False))
  cells = [(model, plan.max_len) for model in plan.models] + [(plan.long_model, plan.long_max_len)]
  for model, max_len in cells:
    needs = (f"checkpoint.{model}",)
    long_runs = "only" if max_len == plan.long_max_len else "0"
    for system in SYSTEMS:
      env = dict(MODELS=model, SYSTEMS=system, LONG_RUNS=long_runs, BATCHES=plan.batches,
                 CKPT_DIR=checkpoints, PYTHON=python, RUN_TIMEOUT_S="900",
                 EXTRA_ARGS=SLOW_SYSTEM_ARGS.get(system, ""))
      argv = ("bash", f"{BENCHMARKS}/run_baselines.sh", os.path.join(state, "baselines")) + smoke
      jobs.append(Job(f"{system}.{model}.{max_len}", argv, tuple(sorted(env.items())), needs,
                      scale * estimate_s(system, model) * (1.0 if max_len == plan.max_len else 1.2)))
    argv = (python, f"{BENCHMARKS}/graphs_bench.py", "--attention", "pallas", "--models", model,
            "--checkpoint-dir", checkpoints, "--modes", "full", "--layer-loops", "unroll",
            "--batches", plan.batches, "--traces", "none",
            "--max-seq-len", str(max_len), "--position", str(plan.position),
            "--out", os.path.join(state, "cg_jax", f"{model}.{max_len}"))
    if plan.smoke:
      argv += ("--ttft-len", "0")
    jobs.append(Job(f"cg_jax.{model}.{max_len}", argv, needs=needs,
                    estimate_s=scale * estimate_s("cg_jax", model)))
  return jobs


class Queue:
  """Pending jobs shared by the workers; done jobs are files under state/done."""

  def __init__(self, jobs: list[Job], state: str, deadline: float):
    self.done_dir = os.path.join(state, "done")
    self.log_dir = os.path.join(state, "logs")
    os.makedirs(self.done_dir, exist_ok=True)
    os.makedirs(self.log_dir, exist_ok=True)
    self.pending = sorted((j for j in jobs if not self.is_done(j.name)),
                          key=lambda j: -j.estimate_s)
    self.running: set[str] = set()
    self.deadline = deadline
    self.lock = threading.Lock()

  def is_done(self, name: str) -> bool:
    return os.path.exists(os.path.join(self.done_dir, name))

  def take(self, on_gpu: bool) -> Job | None:
    """The longest ready job of the worker's kind (GPU or host) that fits the time left; None
    when nothing of that kind will fit any more."""
    while True:
      with self.lock:
        left = self.deadline - time.monotonic()
        mine = [j for j in self.pending if j.on_gpu == on_gpu]
        ready = [j for j in mine if all(self.is_done(n) for n in j.needs)]
        fitting = [j for j in ready if j.estimate_s <= left]
        if fitting:
          self.pending.remove(fitting[0])
          self.running.add(fitting[0].name)
          return fitting[0]
        # Wait only for jobs that could still fit once their prerequisites, running or about to
        # start on another worker, are done.
        coming = self.running | {j.name for j in self.pending if j.estimate_s <= left}
        waiting = [j for j in mine if j.estimate_s <= left
                   and all(self.is_done(n) or n in coming for n in j.needs)]
        if not waiting:
          return None
      time.sleep(1.0)

  def finish(self, job: Job, returncode: int | None) -> None:
    with self.lock:
      self.running.discard(job.name)
      if returncode is None:  # stopped at the deadline: pending for the next call
        self.pending.append(job)
      elif returncode == 0 or not job.name.startswith("checkpoint."):
        # A failed measurement run leaves failed rows (it is not retried); a failed checkpoint
        # stays pending so that its runs are not started on missing files.
        open(os.path.join(self.done_dir, job.name), "w").write(f"{returncode}\n")


def worker(queue: Queue, gpu: str | None, on_gpu: bool = True) -> None:
  while (job := queue.take(on_gpu)) is not None:
    env = dict(os.environ)
    if gpu is not None:
      env["CUDA_VISIBLE_DEVICES"] = gpu
    env.update(job.env)
    start = time.monotonic()
    with open(os.path.join(queue.log_dir, f"{job.name}.log"), "w") as log:
      process = subprocess.Popen(job.argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                 start_new_session=True)
      try:
        returncode = process.wait(timeout=max(1.0, queue.deadline - time.monotonic()))
      except subprocess.TimeoutExpired:
        os.killpg(process.pid, 9)
        process.wait()
        returncode = None
    queue.finish(job, returncode)
    seconds = time.monotonic() - start
    status = "stopped at the deadline" if returncode is None else f"exit {returncode}"
    where = f"gpu {gpu}" if on_gpu else "host"
    print(f"[{where}] {job.name}: {status} after {seconds:.0f} s", flush=True)


def run(jobs: list[Job], state: str, deadline_s: float, gpus: list[str | None]) -> Queue:
  """Runs the pending jobs on one worker per GPU until done or the deadline; returns the queue
  (its `pending` jobs are what is left). Host jobs get one worker of their own."""
  queue = Queue(jobs, state, time.monotonic() + deadline_s)
  threads = [threading.Thread(target=worker, args=(queue, gpu)) for gpu in gpus]
  threads.append(threading.Thread(target=worker, args=(queue, None, False)))
  for thread in threads:
    thread.start()
  for thread in threads:
    thread.join()
  return queue


def collect(state: str, out: str) -> tuple[str, str]:
  """Every row found so far: OUT/comparison/baselines.json and graphs_rows.json."""
  os.makedirs(out, exist_ok=True)
  def rows_in(pattern: str) -> list[dict]:
    rows = []
    for path in sorted(glob.glob(os.path.join(state, pattern))):
      try:
        rows.extend(json.load(open(path)))
      except (OSError, json.JSONDecodeError) as error:  # a run stopped while writing
        print(f"skipped {path}: {error}", flush=True)
    return rows

  baselines = rows_in(os.path.join("baselines", "rows", "*.json"))
  graphs = rows_in(os.path.join("cg_jax", "*", "graphs_rows.json"))
  paths = os.path.join(out, "baselines.json"), os.path.join(out, "graphs_rows.json")
  for path, rows in zip(paths, (baselines, graphs)):
    with open(path, "w") as f:
      json.dump(rows, f, indent=1)
  shutil.make_archive(os.path.join(out, "logs"), "gztar", state, "logs")
  return paths


def visible_gpus() -> list[str | None]:
  try:
    listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=True)
  except (OSError, subprocess.CalledProcessError):
    return [None]
  count = sum(line.startswith("GPU ") for line in listing.stdout.splitlines())
  return [str(i) for i in range(count)] or [None]


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/comparison_out"))
  parser.add_argument("--state", default="/tmp/cg_jax_comparison",
                      help="checkpoints, rows, logs and done marks kept between calls")
  parser.add_argument("--deadline-s", type=float, default=540.0)
  parser.add_argument("--workers", type=int, default=None,
                      help="default: one per GPU (nvidia-smi), else 1")
  parser.add_argument("--smoke", action="store_true", help="tiny checkpoints on the CPU")
  args = parser.parse_args()
  plan = SMOKE if args.smoke else FULL
  gpus = visible_gpus() if args.workers is None else [None] * args.workers
  jobs = plan_jobs(plan, args.state)
  print(f"{len(jobs)} jobs, {len(gpus)} workers, deadline {args.deadline_s:.0f} s", flush=True)
  queue = run(jobs, args.state, args.deadline_s, gpus)
  out = os.path.join(args.out, "comparison")
  baselines, graphs = collect(args.state, out)
  sys.path.insert(0, BENCHMARKS)
  from render_results import comparison
  if json.load(open(baselines)) and json.load(open(graphs)):
    comparison(baselines, [graphs], os.path.join(out, "comparison_h200.md"),
               os.path.join(out, "comparison_h200.png"))
    print(open(os.path.join(out, "comparison_h200.md")).read().split("\n\nTime to first")[0])
  left = sorted(j.name for j in queue.pending)
  print(f"\n{len(jobs) - len(left)} of {len(jobs)} jobs done; pending: {', '.join(left) or 'none'}")


if __name__ == "__main__":
  main()
