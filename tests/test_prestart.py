"""The pre-started engine-core process (`cg_jax.core.prestart`): `import cg_jax` imports no jax;
a pre-started process imports its modules, runs the one call it is sent, and ends with its
launcher when none comes (`serve --help`)."""

import os
import subprocess
import sys
import textwrap
import time

import pytest

import cg_jax
from cg_jax.core import prestart

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _python(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                        text=True, cwd=ROOT, timeout=timeout,
                        env=dict(os.environ, JAX_PLATFORMS="cpu"))


def _gone(pid: int, within: float) -> bool:
  end = time.monotonic() + within
  while time.monotonic() < end:
    try:
      os.kill(pid, 0)
    except ProcessLookupError:
      return True
    time.sleep(0.05)
  return False


def test_import_cg_jax_imports_no_jax_until_a_public_name_is_used():
  out = _python("""
      import sys, cg_jax, cg_jax.core.prestart
      before = "jax" in sys.modules
      engine = cg_jax.Engine
      print(before, "jax" in sys.modules, engine.__module__, "Engine" in dir(cg_jax))
  """)
  assert out.returncode == 0, out.stderr
  assert out.stdout.split() == ["False", "True", "cg_jax.engine", "True"]
  assert sorted(cg_jax._EXPORTS) == sorted(set(cg_jax.__all__) - {"__version__"})
  with pytest.raises(AttributeError, match="no attribute 'Engin'"):
    cg_jax.Engin  # noqa: B018


def test_prestarted_process_preloads_then_runs_the_call(tmp_path):
  target = tmp_path / "made"
  started = prestart.Prestarted("cg_jax-test", preload=("json",))
  process = started.run(os.mkdir, str(target))
  process.join(60)
  assert process.exitcode == 0 and target.is_dir()
  assert process.name == "cg_jax-test" and process.daemon


def test_a_failed_preload_is_an_error_when_the_call_is_sent():
  started = prestart.Prestarted("cg_jax-test", preload=("cg_jax.no_such_module",))
  started.process.join(60)  # (it fails while importing)
  with pytest.raises(RuntimeError, match=r"cg_jax-test process \(pid \d+\) exited with code 1 "
                                         r"before its call"):
    started.run(os.getpid)


def test_take_gives_the_started_process_once_then_new_ones():
  prestart.start("cg_jax-test")
  first = prestart.take("cg_jax-test")
  second = prestart.take("cg_jax-test")
  assert first is not second and first.process.pid != second.process.pid
  for started in (first, second):
    started.run(os.getpid).join(60)
    assert started.process.exitcode == 0


def test_a_prestarted_process_ends_with_a_launcher_that_sends_no_call():
  out = _python("""
      from cg_jax.core import prestart
      prestart.start()
      print(prestart._started.process.pid, flush=True)
  """)
  assert out.returncode == 0, out.stderr
  assert _gone(int(out.stdout), within=10)


def _session(sid: int) -> list[int]:
  """The live processes of session `sid` (Linux /proc)."""
  members = []
  for name in os.listdir("/proc"):
    try:
      with open(f"/proc/{name}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, ValueError):
      continue
    if fields[3] == str(sid) and fields[0] != "Z":
      members.append(int(name))
  return members


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc")
def test_serve_help_leaves_no_process_behind():
  with subprocess.Popen([sys.executable, "-m", "cg_jax", "serve", "--help"], cwd=ROOT,
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                        start_new_session=True, env=dict(os.environ, JAX_PLATFORMS="cpu")) as p:
    out, err = p.communicate(timeout=120)
  assert p.returncode == 0 and "--api-servers" in out, err
  assert "Traceback" not in err, err
  end = time.monotonic() + 10
  while _session(p.pid) and time.monotonic() < end:
    time.sleep(0.05)
  assert _session(p.pid) == []
