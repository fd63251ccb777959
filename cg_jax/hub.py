"""Finding a model: a checkpoint directory, a model bundled with the package, or a Hugging Face
model name in the local HF cache (looked up by `huggingface_hub`, never over the network)."""

from __future__ import annotations

import os

from huggingface_hub import constants, snapshot_download
from huggingface_hub.utils import HFValidationError, LocalEntryNotFoundError

import models
from models.config import PRESETS

# Trained checkpoints shipped inside the package (models/pretrained/<name>, Hugging Face format).
BUNDLED_DIR = os.path.join(os.path.dirname(os.path.abspath(models.__file__)), "pretrained")
DEFAULT_MODEL = "kjv-llama-6m"


def bundled_models() -> tuple[str, ...]:
  """Names of the checkpoints bundled with the package."""
  if not os.path.isdir(BUNDLED_DIR):
    return ()
  return tuple(sorted(n for n in os.listdir(BUNDLED_DIR)
                      if os.path.isfile(os.path.join(BUNDLED_DIR, n, "config.json"))))


def looks_like_path(name: str) -> bool:
  """Whether `name` is clearly a filesystem path rather than a Hub name (`gpt2`, `org/name`):
  absolute, starting with `.` or `~`, with more than one `/`, or ending in `/`."""
  return (os.path.isabs(name) or name.startswith((".", "~")) or name.count("/") > 1
          or name.endswith("/"))


def resolve_model(name: str | os.PathLike) -> str:
  """A checkpoint directory (`~` expanded), a bundled model's name, or a Hugging Face model name
  found in the local HF cache: the snapshot that the cache's `main` ref names
  (`huggingface_hub.snapshot_download(name, local_files_only=True)`), in huggingface_hub's cache
  directory (HF_HUB_CACHE, else HF_HOME/hub; read when huggingface_hub is imported).

  Raises:
    ValueError: neither a directory nor a cached model (no network access is attempted).
  """
  path = os.fspath(name)
  directory = os.path.expanduser(path)
  if os.path.isdir(directory):
    return directory
  if path in bundled_models():
    return os.path.join(BUNDLED_DIR, path)
  if looks_like_path(path):
    absolute = os.path.abspath(directory)
    if os.path.exists(absolute):
      raise ValueError(f"model {path!r}: {absolute} is a file, not a checkpoint directory; pass "
                       "the directory that holds config.json and model.safetensors")
    raise ValueError(f"model {path!r}: there is no checkpoint directory at {absolute}")
  try:
    return snapshot_download(path, local_files_only=True)
  except (LocalEntryNotFoundError, HFValidationError):  # not cached, or not a Hub name at all
    raise ValueError(
        f"model {path!r} is not a directory, a bundled model ({', '.join(bundled_models())}), a "
        f"preset ({', '.join(PRESETS)}), or a model in the local Hugging Face cache "
        f"({constants.HF_HUB_CACHE}); no network access is attempted. Download it first (e.g. "
        f"`hf download {path}`) or pass a checkpoint directory.") from None
