"""The comparison scheduler (benchmarks/comparison_session.py): prerequisites first, no job
started that its estimate says cannot finish, a job cut by the deadline stays pending, and a
second call runs only what is left."""

import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))
from comparison_session import FULL, SYSTEMS, Job, plan_jobs, run  # noqa: E402


def _job(name, code, needs=(), estimate_s=1.0):
  return Job(name, (sys.executable, "-c", code), needs=needs, estimate_s=estimate_s)


def test_prerequisites_run_first_and_done_jobs_are_not_rerun(tmp_path):
  marker = tmp_path / "made"
  jobs = [_job("make", f"import time; time.sleep(1); open({str(marker)!r}, 'w')"),
          _job("use", f"import os, sys; sys.exit(0 if os.path.exists({str(marker)!r}) else 3)",
               needs=("make",), estimate_s=5.0)]  # longest first, but it must wait for "make"
  queue = run(jobs, str(tmp_path / "state"), deadline_s=30, gpus=["0", "1"])
  assert not queue.pending
  assert (tmp_path / "state" / "done" / "use").read_text() == "0\n"
  marker.unlink()
  assert not run(jobs, str(tmp_path / "state"), deadline_s=30, gpus=["0"]).pending
  assert not marker.exists()  # nothing ran again


def test_host_jobs_run_beside_the_gpu_workers_and_see_no_gpu(tmp_path):
  state = tmp_path / "state"
  seen = tmp_path / "seen"
  check = ("import os, time; time.sleep(1); "
           f"open({str(seen)!r}, 'w').write(os.environ['CUDA_VISIBLE_DEVICES'])")
  jobs = [Job("checkpoint.m", (sys.executable, "-c", check), env=(("CUDA_VISIBLE_DEVICES", ""),),
              estimate_s=1.0, on_gpu=False),
          _job("other", "import time; time.sleep(1)", estimate_s=2.0),
          _job("run.m", "pass", needs=("checkpoint.m",))]
  start = time.monotonic()
  queue = run(jobs, str(state), deadline_s=30, gpus=["0"])
  assert not queue.pending
  assert seen.read_text() == ""
  assert time.monotonic() - start < 2.9  # the checkpoint ran beside "other", not after it
  assert all((state / "done" / name).exists() for name in ("checkpoint.m", "other", "run.m"))


def test_deadline_stops_a_job_and_the_next_call_resumes_it(tmp_path):
  state = str(tmp_path / "state")
  jobs = [_job("slow", "import time; time.sleep(30)", estimate_s=0.5),
          _job("too_long", "pass", estimate_s=1000.0),
          _job("quick", "pass", estimate_s=0.1)]
  start = time.monotonic()
  queue = run(jobs, state, deadline_s=3, gpus=["0", "1"])
  assert time.monotonic() - start < 15
  assert sorted(j.name for j in queue.pending) == ["slow", "too_long"]
  assert os.path.exists(os.path.join(state, "done", "quick"))
  assert not os.path.exists(os.path.join(state, "done", "slow"))
  fixed = [_job("slow", "pass", estimate_s=0.5)] + jobs[1:]
  queue = run(fixed, state, deadline_s=5, gpus=["0"])
  assert [j.name for j in queue.pending] == ["too_long"]


def test_a_failed_checkpoint_keeps_its_runs_from_starting(tmp_path):
  jobs = [_job("checkpoint.m", "import sys; sys.exit(1)"),
          _job("run.m", "pass", needs=("checkpoint.m",))]
  queue = run(jobs, str(tmp_path / "state"), deadline_s=10, gpus=["0"])
  assert [j.name for j in queue.pending] == ["run.m"]
  assert not os.listdir(tmp_path / "state" / "done")


def test_full_plan_covers_every_cell():
  jobs = plan_jobs(FULL, "/tmp/state")
  names = {j.name for j in jobs}
  cells = [(m, 1024) for m in FULL.models] + [(FULL.long_model, 4096)]
  assert len(jobs) == len(FULL.models) + len(cells) * (len(SYSTEMS) + 1)
  for model, max_len in cells:
    assert f"cg_jax.{model}.{max_len}" in names
    for system in SYSTEMS:
      job = next(j for j in jobs if j.name == f"{system}.{model}.{max_len}")
      env = dict(job.env)
      assert (env["MODELS"], env["SYSTEMS"]) == (model, system)
      assert env["LONG_RUNS"] == ("only" if max_len == 4096 else "0")
      assert job.needs == (f"checkpoint.{model}",) and job.on_gpu
  assert all(not j.on_gpu for j in jobs if j.name.startswith("checkpoint."))


def test_collect_skips_a_rows_file_cut_off_mid_write(tmp_path):
  from comparison_session import collect

  state = tmp_path / "state"
  (state / "baselines" / "rows").mkdir(parents=True)
  (state / "logs").mkdir()
  (state / "baselines" / "rows" / "a.json").write_text('[{"system": "torch_eager"}]')
  (state / "baselines" / "rows" / "b.json").write_text('[{"system": "torch_comp')
  baselines, graphs = collect(str(state), str(tmp_path / "out"))
  assert json.load(open(baselines)) == [{"system": "torch_eager"}]
  assert json.load(open(graphs)) == []
