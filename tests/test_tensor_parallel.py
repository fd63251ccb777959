"""Tensor parallelism: the shard-major weight layout, argument checks, and the engine split over
2 and 4 host CPU devices against the single-device engine (tests/tensor_parallel_cases.py, in a
subprocess because the device count is fixed when JAX starts)."""

import dataclasses
import os
import subprocess
import sys

import numpy as np
import pytest

from cg_jax import Engine
from cg_jax.core.sharding import check_tensor_parallel, from_shard_major, to_shard_major
from models.config import PRESETS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("devices", [2, 4])
def test_engine_split_over_devices_matches_one_device(devices):
  """Logits within 1e-5 (full forward, prefill and decode steps) and identical greedy tokens
  (host loop, device loop, streaming, unrolled layers, after a swap; Pallas attention on 2)."""
  result = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "tensor_parallel_cases.py"),
                           str(devices)], capture_output=True, text=True, timeout=900, cwd=ROOT)
  assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
  assert result.stdout.count(f"ok on {devices} devices") == 2, result.stdout


def test_shard_major_layout_groups_each_devices_heads():
  """[q | k | v] columns -> per shard [q heads | k heads | v heads] of that shard; [gate | up]
  likewise; the inverse restores the canonical layout."""
  config = dataclasses.replace(PRESETS["tiny-llama"], num_heads=4, num_kv_heads=2, head_dim=2,
                               intermediate_size=4)
  q, kv = 4 * 2, 2 * 2
  # Column labels: q columns 0..7, k 100..103, v 200..203; gate 0..3, up 100..103.
  qkv = np.concatenate([np.arange(q), 100 + np.arange(kv), 200 + np.arange(kv)])[None, None]
  mlp = np.concatenate([np.arange(4), 100 + np.arange(4)])[None]
  weights = {"qkv_kernel": np.repeat(qkv, 3, axis=1), "mlp_in_bias": mlp,
             "out_kernel": np.arange(6.0)}
  grouped = to_shard_major(config, weights, 2)
  np.testing.assert_array_equal(grouped["qkv_kernel"][0, 0],
                                [0, 1, 2, 3, 100, 101, 200, 201, 4, 5, 6, 7, 102, 103, 202, 203])
  np.testing.assert_array_equal(grouped["mlp_in_bias"][0], [0, 1, 100, 101, 2, 3, 102, 103])
  np.testing.assert_array_equal(grouped["out_kernel"], weights["out_kernel"])
  back = from_shard_major(config, grouped, 2)
  for name, value in weights.items():
    np.testing.assert_array_equal(back[name], value)
  assert to_shard_major(config, weights, 1)["qkv_kernel"] is weights["qkv_kernel"]


@pytest.mark.parametrize("value, match", [
    (0, r"tensor_parallel must be an int in \[1, 1\]"),
    (2, r"tensor_parallel must be an int in \[1, 1\] \(the devices here\), got 2"),
    (True, "tensor_parallel must be an int"),
    (1.0, "tensor_parallel must be an int"),
])
def test_bad_tensor_parallel_raises(value, match):
  with pytest.raises(ValueError, match=match):
    check_tensor_parallel(PRESETS["tiny-gpt2"], value)
  with pytest.raises(ValueError, match=match):
    Engine.from_pretrained("tiny-gpt2", tensor_parallel=value)


def test_tensor_parallel_must_divide_heads(monkeypatch):
  import jax

  monkeypatch.setattr(jax, "devices", lambda *a: [object()] * 8)
  with pytest.raises(ValueError, match=r"tensor_parallel=3 must divide .*num_heads"):
    check_tensor_parallel(PRESETS["tiny-gpt2"], 3)
  with pytest.raises(ValueError, match=r"must divide \{'num_kv_heads': 2\}"):
    check_tensor_parallel(PRESETS["tiny-llama"], 4)
  check_tensor_parallel(PRESETS["tiny-gpt2"], 4)
