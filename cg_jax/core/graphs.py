"""CUDA-graph modes: named sets of XLA command-buffer options, applied per executable.

XLA records runs of GPU work into command buffers (CUDA graphs) by command type. Passing the
options through `compile(compiler_options=...)` rather than process-wide XLA_FLAGS lets one
process hold executables of several modes side by side (benchmarks, A/B tests).

  off:          no command buffers: every kernel is launched on its own.
  xla-default:  XLA's default command types (on a `lax.scan` layer loop: one graph launch per
                loop iteration, since the WHILE command is not in the default set).
  full:         every command type that helps a decode step, WHILE and CONDITIONAL included,
                so loops run inside the graph; minimum graph size 1.

Every mode keeps command buffers on while `jax.profiler` traces (XLA otherwise falls back to
op-by-op launches under the profiler, and a profile would show a different program).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

_PROFILE_AS_RUN = {"xla_enable_command_buffers_during_profiling": True}

GRAPH_MODES: dict[str, dict[str, Any]] = {
    "off": {"xla_gpu_enable_command_buffer": ""},
    "xla-default": dict(_PROFILE_AS_RUN),
    "full": {
        "xla_gpu_enable_command_buffer":
            "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION,WHILE,CONDITIONAL",
        "xla_gpu_graph_min_graph_size": 1,
        **_PROFILE_AS_RUN,
    },
}


def compiler_options(mode: str, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
  """XLA compiler options of a graph mode, with `extra` options layered on top."""
  if mode not in GRAPH_MODES:
    raise ValueError(f"graphs must be one of {tuple(GRAPH_MODES)}, got {mode!r}")
  return {**GRAPH_MODES[mode], **(extra or {})}
