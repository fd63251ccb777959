# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # CUDA graphs through XLA command buffers
#
# The graph modes are XLA options applied per executable. This notebook shows the modes, the
# launch accounting of the committed H200 run, and one decode step's timeline per mode, read
# from recorded profiles. On a GPU it also profiles live.

# %%
import json
import os

import jax
import matplotlib.pyplot as plt

from cg_jax import Engine, profile
from cg_jax.core.graphs import GRAPH_MODES

ROOT = next(p for p in (".", "..") if os.path.isdir(os.path.join(p, "benchmarks")))  # repo root
for mode, options in GRAPH_MODES.items():
  print(f"{mode:12s} {options}")

# %% [markdown]
# ## Launch accounting (H200, committed results)

# %%
rows = json.load(open(os.path.join(ROOT, "benchmarks/results/graphs_h200.json")))
print(f"{'model':14s} {'mode':12s} B  step_us  kernels  graphs/step  outside  floor_us")
for r in rows:
  print(f"{r['model']:14s} {r['mode']:12s} {r['batch']:<2d} {r['step_us']:7.0f} "
        f"{r['kernels_per_step']:8.0f} {r['graph_launches_per_step']:11.2f} "
        f"{r['kernel_launches_outside_graphs_per_step']:8.0f} {r['floor_us']:9.0f}")

# %%
fig, ax = plt.subplots(figsize=(8, 3))
# The (model, batch) cells measured in every mode.
step = {(r["model"], r["batch"], r["mode"]): r["step_us"] for r in rows}
cells = [(r["model"], r["batch"]) for r in rows if r["mode"] == "off"
         and all((r["model"], r["batch"], mode) in step for mode in GRAPH_MODES)]
labels = [f"{model}\nB={batch}" for model, batch in cells]
for offset, mode in enumerate(GRAPH_MODES):
  steps = [step[(model, batch, mode)] for model, batch in cells]
  ax.bar([i + 0.27 * offset for i in range(len(steps))], steps, width=0.27, label=mode)
ax.set_xticks([i + 0.27 for i in range(len(labels))], labels, fontsize=7)
ax.set_ylabel("decode step (us)")
ax.legend()
plt.show()

# %% [markdown]
# ## One decode step's timeline per mode (gpt2 shape, batch 1, recorded on the H200)
# Without graphs every kernel is launched by the host and the GPU waits between them; with one
# graph per step the kernels run back to back.

# %%
import gzip


def kernel_intervals(path, step_index=5, steps=10):
  events = json.load(gzip.open(path, "rt"))["traceEvents"]
  names = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
  device = [e for e in events if e.get("ph") == "X" and "/device:GPU" in names.get(e["pid"], "")]
  device.sort(key=lambda e: e["ts"])
  per_step = len(device) // steps
  chunk = device[step_index * per_step:(step_index + 1) * per_step]
  start = chunk[0]["ts"]
  return [(e["ts"] - start, e["dur"]) for e in chunk]


fig, ax = plt.subplots(figsize=(9, 2.2))
for row, mode in enumerate(("off", "xla-default")):
  path = os.path.join(ROOT, f"tests/fixtures/trace_h200_gpt2_b1_unroll_{mode}.json.gz")
  ax.broken_barh(kernel_intervals(path), (row - 0.4, 0.8))
ax.set_yticks([0, 1], ["off", "xla-default"])
ax.set_xlabel("us from the step's first kernel (profiled)")
plt.show()

# %% [markdown]
# ## Live profile
# On a GPU this runs the real thing; on a CPU it reports what exists there (no graphs).

# %%
engine = Engine.from_pretrained("tiny-gpt2", batch_buckets=(1,), prompt_buckets=(16,),
                                max_seq_len=64, graphs="full", layer_loop="unroll")
report, trace = profile.profile_decode(engine, 1, position=20, steps=5)
print(jax.default_backend(), report)
