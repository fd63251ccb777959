"""Model names looked up in the local Hugging Face cache by huggingface_hub: the snapshot that
refs/main names, in the cache that HF_HUB_CACHE or HF_HOME selects; a missing name is a
ValueError with the `hf download` hint, and nothing touches the network."""

import os
import socket
import subprocess
import sys

import pytest
from huggingface_hub import constants as hf_constants

from cg_jax import hub

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _fake_cache(hub_dir, repo_id: str = "acme/tiny", commit: str = "abc123"):
  """A cache holding `repo_id` at `commit` (its snapshot has a config.json), with refs/main
  naming that commit; returns the snapshot directory."""
  repo = hub_dir / ("models--" + repo_id.replace("/", "--"))
  snapshot = repo / "snapshots" / commit
  snapshot.mkdir(parents=True)
  (snapshot / "config.json").write_text("{}")
  (repo / "refs").mkdir()
  (repo / "refs" / "main").write_text(commit)
  return snapshot


@pytest.fixture
def cache(tmp_path, monkeypatch):
  """An empty cache directory that huggingface_hub uses (it reads HF_HUB_CACHE at import, so
  the constant is set too), with the network refused."""
  path = tmp_path / "hub"
  path.mkdir()
  monkeypatch.setenv("HF_HUB_CACHE", str(path))
  monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(path))

  def refuse(*args, **kwargs):
    raise AssertionError("resolve_model opened a network connection")

  monkeypatch.setattr(socket.socket, "connect", refuse)
  monkeypatch.setattr(socket, "create_connection", refuse)
  return path


def test_a_cached_name_resolves_to_its_main_snapshot(cache):
  snapshot = _fake_cache(cache)
  _fake_cache(cache, "gpt3", "def456")
  # huggingface_hub returns the path with symbolic links resolved.
  assert hub.resolve_model("acme/tiny") == os.path.realpath(snapshot)
  assert hub.resolve_model("gpt3") == os.path.realpath(cache / "models--gpt3" / "snapshots" /
                                                       "def456")


@pytest.mark.parametrize("name", ["acme/missing", "gpt3", "not a name"])
def test_a_missing_name_says_how_to_download_it(cache, name):
  _fake_cache(cache)
  with pytest.raises(ValueError) as info:
    hub.resolve_model(name)
  assert str(info.value).startswith(f"model {name!r} is not a directory, a bundled model (")
  assert str(info.value).endswith(
      f"or a model in the local Hugging Face cache ({cache}); no network access is attempted. "
      f"Download it first (e.g. `hf download {name}`) or pass a checkpoint directory.")


def test_a_ref_to_a_missing_snapshot_is_not_found(cache):
  snapshot = _fake_cache(cache)
  (snapshot.parent.parent / "refs" / "main").write_text("0" * 40)
  with pytest.raises(ValueError, match="hf download acme/tiny"):
    hub.resolve_model("acme/tiny")


@pytest.mark.parametrize("variable, cache_dir", [("HF_HUB_CACHE", "hub"),
                                                  ("HF_HOME", "home/hub")])
def test_the_environment_selects_the_cache(tmp_path, variable, cache_dir):
  """A new process, as a user starts one: huggingface_hub reads the variables at import."""
  snapshot = _fake_cache(tmp_path / cache_dir)
  env = {k: v for k, v in os.environ.items()
         if k not in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME")}
  env.update({variable: str(tmp_path / cache_dir.split("/")[0]), "HF_HUB_OFFLINE": "1"})
  out = subprocess.run(
      [sys.executable, "-c", "from cg_jax import hub; print(hub.resolve_model('acme/tiny'))"],
      capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
  assert out.returncode == 0, out.stderr
  assert out.stdout.strip() == os.path.realpath(snapshot)
