"""The one row schema of `python -m cg_jax bench`: every subcommand (and the PyTorch peers in
benchmarks/) writes `Row`s as JSON lines, so rows of different runs and systems compare by
field name.

A row names the system that ran, the model, the workload (what was asked: kind, batch, prompt
and output lengths, request count, arrival rate, ...), the figures measured (flat name -> float:
`ttft_ms_p50`, `tpot_ms_p50`, `tokens_per_s`, ...; times in the unit their name ends with) and
where: device, jax version, commit, date; `software` names other versions that ran (a peer's
torch and transformers). Percentile figures are named `<figure>_p<q>`.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import subprocess
from collections.abc import Iterable, Sequence
from typing import Any

import jax
import numpy as np

SCHEMA = 1
PERCENTILES = (50, 90, 99)


@dataclasses.dataclass(frozen=True)
class Row:
  """One measured cell. `workload` and `figures` are flat dicts of JSON scalars."""

  system: str
  model: str
  workload: dict[str, Any]
  figures: dict[str, float]
  device: str
  jax: str
  commit: str
  date: str
  schema: int = SCHEMA
  software: dict[str, str] = dataclasses.field(default_factory=dict)

  def to_json(self) -> str:
    return json.dumps(dataclasses.asdict(self), sort_keys=True)

  @classmethod
  def from_json(cls, line: str) -> "Row":
    fields = json.loads(line)
    if fields.get("schema") != SCHEMA:
      raise ValueError(f"a bench row of schema {fields.get('schema')!r}; this version reads "
                       f"schema {SCHEMA}")
    return cls(**fields)


def percentiles(name: str, values: Sequence[float],
                quantiles: Sequence[int] = PERCENTILES) -> dict[str, float]:
  """{name_p50: ..., name_p90: ..., ...} of `values` (empty values: no figures)."""
  if len(values) == 0:
    return {}
  return {f"{name}_p{q}": float(np.percentile(values, q)) for q in quantiles}


def git_commit() -> str:
  """$CG_JAX_COMMIT (a copied checkout's HEAD can be stale), else the short hash of the
  checkout this package lies in, else "unknown"."""
  if os.environ.get("CG_JAX_COMMIT"):
    return os.environ["CG_JAX_COMMIT"]
  here = os.path.dirname(os.path.abspath(__file__))
  try:
    return subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True, check=True, timeout=10).stdout.strip()
  except (OSError, subprocess.SubprocessError):
    return "unknown"


def where(device: str | None = None) -> dict[str, str]:
  """The device (the first jax device's kind unless given), jax version, commit and date."""
  return {"device": device or jax.devices()[0].device_kind, "jax": jax.__version__,
          "commit": git_commit(), "date": datetime.date.today().isoformat()}


def write(path: str | None, rows: Iterable[Row]) -> None:
  """Append the rows to `path` as JSON lines (None: nothing)."""
  if path is None:
    return
  with open(path, "a") as f:
    for row in rows:
      f.write(row.to_json() + "\n")


def read(paths: Sequence[str]) -> list[Row]:
  """The rows of JSON-lines files, in order."""
  rows = []
  for path in paths:
    with open(path) as f:
      rows += [Row.from_json(line) for line in f if line.strip()]
  return rows


def compare(rows: Sequence[Row], figures: Sequence[str] | None = None) -> str:
  """A Markdown table of rows side by side: one line per row, grouped by model and workload,
  the figures as columns (all that any row has, or `figures`), and for each figure after the
  first row of a group its ratio to that row's. A workload is written as `key=value` items in
  key order (as the JSON lines store it), so fresh rows and rows read back look alike."""
  names = list(figures) if figures else sorted({f for row in rows for f in row.figures})
  key = lambda row: (row.model, json.dumps(row.workload, sort_keys=True))
  groups: dict[tuple, list[Row]] = {}
  for row in rows:
    groups.setdefault(key(row), []).append(row)
  head = ["system", "model", "workload", *names, "device", "commit"]
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for group in groups.values():
    first = group[0]
    for row in group:
      cells = []
      for name in names:
        value = row.figures.get(name)
        if value is None:
          cells.append("-")
          continue
        cell = f"{value:.4g}"
        base = first.figures.get(name)
        if row is not first and base:
          cell += f" ({value / base:.2f}x)"
        cells.append(cell)
      workload = ", ".join(f"{k}={v}" for k, v in sorted(row.workload.items()))
      lines.append("| " + " | ".join([row.system, row.model, workload, *cells, row.device,
                                      row.commit]) + " |")
  return "\n".join(lines)
