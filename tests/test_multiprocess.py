"""One tensor-parallel engine spanning two processes (jax.distributed on 127.0.0.1, one CPU device
per process) gives the single-process engine's tokens."""

import json
import os
import socket
import subprocess
import sys

from cg_jax import Engine
from tests.multiprocess_worker import OPTIONS, PROMPTS  # (never tests/ itself on sys.path:
# tests/kernels would be a top-level `kernels`, which transformers >= 5.25 imports if it finds one)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_port() -> int:
  with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    return sock.getsockname()[1]


def test_two_processes_run_one_engine_with_the_single_process_tokens():
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
  env.pop("XLA_FLAGS", None)  # one CPU device per process
  port = _free_port()
  workers = [subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", "multiprocess_worker.py"),
                               str(i), str(port)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env) for i in (0, 1)]
  try:
    outputs = [worker.communicate(timeout=300) for worker in workers]
  finally:
    for worker in workers:  # nothing is left running, whatever happened
      if worker.poll() is None:
        worker.kill()
        worker.wait()
  results = []
  for worker, (out, err) in zip(workers, outputs):
    assert worker.returncode == 0, err[-3000:]
    results.append(json.loads(next(line for line in out.splitlines()
                                   if line.startswith("RESULT "))[len("RESULT "):]))
  expected = Engine.from_pretrained("tiny-llama", **OPTIONS).generate(
      PROMPTS, max_new_tokens=8, eos_token_id=[])
  for result in results:
    assert result["devices"] == 2
    assert result["tokens"] == [list(row) for row in expected]
    assert result["streamed"] == result["tokens"]
