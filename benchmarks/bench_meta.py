"""Shared metadata of benchmark rows (imported by the scripts beside it)."""

from __future__ import annotations

import os
import subprocess

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def git_commit() -> str:
  """$CG_JAX_COMMIT (set by the device scripts: a copied checkout's HEAD can be stale), else the
  short hash of HEAD, else 'unknown'."""
  if os.environ.get("CG_JAX_COMMIT"):
    return os.environ["CG_JAX_COMMIT"]
  try:
    return subprocess.run(["git", "-C", REPO_ROOT, "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True, check=True).stdout.strip()
  except (OSError, subprocess.CalledProcessError):
    return "unknown"
