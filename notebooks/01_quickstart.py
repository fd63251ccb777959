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
# # cg_jax quickstart
#
# Load a model, compile every bucket ahead of time, generate, stream, and read the stats.
# `CG_JAX_DEMO_MODEL` picks the model: a checkpoint directory, a preset (random weights), or by
# default the bundled `kjv-llama-6m`, a 5.8M-parameter Llama trained by this project on the King
# James Bible (`scripts/train_default_model.py`), small enough to run anywhere in seconds.

# %%
import os

from cg_jax import Engine
from cg_jax.hub import DEFAULT_MODEL

model = os.environ.get("CG_JAX_DEMO_MODEL", DEFAULT_MODEL)
engine = Engine.from_pretrained(model, batch_buckets=(1, 2), prompt_buckets=(16, 32),
                                max_seq_len=96)
compile_seconds = engine.warmup(progress=False)
print(f"{len(compile_seconds)} executables compiled in {sum(compile_seconds.values()):.1f} s")

# %% [markdown]
# ## Generate
# A batch of prompts of different lengths; each is padded to its bucket and routed to a ready
# executable. With a tokenizer in the checkpoint, prompts are strings and `result.texts` holds
# the continuations; token-id lists work with any model.

# %%
prompts = ["And God said", "The king of Israel went up to"]
if engine.tokenizer is None:  # a preset: random weights, no tokenizer
  prompts = [[5, 17, 42, 8], [99, 3, 14, 15, 92, 65, 35]]
result = engine.generate(prompts, max_new_tokens=24)
for i, prompt in enumerate(prompts):
  print(prompt, "->", result.texts[i] if result.texts is not None else result[i])
print({k: round(v, 5) if isinstance(v, float) else v for k, v in result.stats.items()})

# %% [markdown]
# ## Stream
# Tokens arrive as they are produced (read back asynchronously, `readback_lag` steps behind the
# device).

# %%
for chunk in engine.stream([prompts[0]], max_new_tokens=12, do_sample=True, temperature=0.8,
                           top_p=0.9, seed=0):
  print(chunk.step, chunk.tokens, chunk.texts)

# %% [markdown]
# ## Engine stats
# Compile counters: nothing compiles after warmup.

# %%
stats = engine.stats()
assert stats["compiles_since_warmup"] == 0, stats
stats
