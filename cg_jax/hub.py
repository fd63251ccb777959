"""Finding a model: a checkpoint directory, or a Hugging Face model name in the local HF cache."""

from __future__ import annotations

import os

from models.config import PRESETS


def resolve_model(name: str | os.PathLike) -> str:
  """A checkpoint directory, or a Hugging Face model name found in the local HF cache.

  Raises:
    ValueError: neither a directory nor a cached model (no network access is attempted).
  """
  path = os.fspath(name)
  if os.path.isdir(path):
    return path
  hub = os.environ.get("HF_HUB_CACHE") or os.path.join(
      os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface"),
      "hub")
  repo = os.path.join(hub, "models--" + path.replace("/", "--"))
  snapshots = os.path.join(repo, "snapshots")
  ref = os.path.join(repo, "refs", "main")
  if os.path.isfile(ref):
    with open(ref) as f:
      candidate = os.path.join(snapshots, f.read().strip())
    if os.path.isdir(candidate):
      return candidate
  if os.path.isdir(snapshots) and os.listdir(snapshots):
    newest = max(os.listdir(snapshots), key=lambda s: os.path.getmtime(os.path.join(snapshots, s)))
    return os.path.join(snapshots, newest)
  raise ValueError(
      f"model {path!r} is not a directory, a preset ({', '.join(PRESETS)}), or a model in the "
      f"local Hugging Face cache ({hub}); no network access is attempted. Download it first "
      f"(e.g. `huggingface-cli download {path}`) or pass a checkpoint directory.")
