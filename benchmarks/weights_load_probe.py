"""Where loading a checkpoint's weights spends its seconds, by part (twice over):
`models.hf.load_checkpoint` (safetensors read, then transposes, q/k/v concatenation and layer
stacking on the host), the `device_put` of its arrays as `cg_jax.core.weights.place` does,
`np.ascontiguousarray` of them then `device_put`, the raw tensors as stored (`get_tensor`) and
their `device_put`, and the q/k/v kernel assembled on the device by one jit from the raw
tensors (first call: compile and run; second: run), checked equal to the host's.

Usage: PYTHONPATH=. python3 benchmarks/weights_load_probe.py CHECKPOINT_DIR
Results: results/startup_load_h100.*
"""
import sys
import time

START = time.perf_counter()
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from safetensors import safe_open  # noqa: E402

from models import hf  # noqa: E402


def timed(f):
  start = time.perf_counter()
  result = f()
  return result, time.perf_counter() - start


def put(weights, device):
  placed = {k: jax.device_put(jnp.asarray(v), device) for k, v in weights.items()}
  jax.block_until_ready(placed)
  return placed


def main(directory: str) -> None:
  print(f"import {time.perf_counter() - START:.2f} s", flush=True)
  device = jax.devices()[0]
  _, init = timed(lambda: jnp.zeros(1).block_until_ready())
  print(f"backend init {init:.2f} s", flush=True)
  for rep in range(2):
    (config, weights), read = timed(lambda: hf.load_checkpoint(directory, "bfloat16"))
    total = sum(v.nbytes for v in weights.values())
    strided = sum(v.nbytes for v in weights.values() if not v.flags.c_contiguous)
    _, placed = timed(lambda: put(weights, device))
    contiguous, relayout = timed(lambda: {k: np.ascontiguousarray(v) for k, v in weights.items()})
    _, placed_contiguous = timed(lambda: put(contiguous, device))
    contiguous = None  # (freed before the next part)
    stored = safe_open(f"{directory}/model.safetensors", "numpy")
    raw, raw_read = timed(lambda: {n: stored.get_tensor(n) for n in stored.keys()})
    _, raw_placed = timed(lambda: put(raw, device))
    print(f"rep {rep}: {total / 1e9:.2f} GB ({strided / 1e9:.2f} GB not C-contiguous) | "
          f"load_checkpoint {read:.2f} s | device_put as place() {placed:.2f} s | "
          f"ascontiguousarray {relayout:.2f} s then device_put {placed_contiguous:.2f} s | "
          f"raw get_tensor {raw_read:.2f} s then device_put of {len(raw)} {raw_placed:.2f} s",
          flush=True)
    names = [[f"model.layers.{i}.self_attn.{p}_proj.weight" for p in "qkv"]
             for i in range(config.num_layers)]
    rows = [[jax.device_put(raw[n], device) for n in row] for row in names]
    # per layer q, k, v [out, in] -> qkv_kernel [L, in, out_q + out_k + out_v]
    assemble = jax.jit(lambda rows: jnp.stack([jnp.concatenate(r, 0).T for r in rows]))
    _, first = timed(lambda: assemble(rows).block_until_ready())
    again, second = timed(lambda: assemble(rows).block_until_ready())
    equal = bool(np.array_equal(np.asarray(again), weights["qkv_kernel"]))
    print(f"  q/k/v kernel assembled on the device: first call {first:.2f} s, then "
          f"{second * 1e3:.1f} ms; equal to the host's: {equal}", flush=True)


if __name__ == "__main__":
  main(sys.argv[1])
