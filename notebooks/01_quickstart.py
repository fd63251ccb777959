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
# `CG_JAX_DEMO_MODEL` picks the model: a checkpoint directory, or a preset (random weights; the
# default `tiny-llama` runs anywhere in seconds, so its tokens are arbitrary).

# %%
import os

from cg_jax import Engine

model = os.environ.get("CG_JAX_DEMO_MODEL", "tiny-llama")
engine = Engine.from_pretrained(model, batch_buckets=(1, 2), prompt_buckets=(16, 32),
                                max_seq_len=96)
compile_seconds = engine.warmup(progress=False)
print(f"{len(compile_seconds)} executables compiled in {sum(compile_seconds.values()):.1f} s")

# %% [markdown]
# ## Generate
# A batch of prompts of different lengths; each is padded to its bucket and routed to a ready
# executable. With a tokenizer in the checkpoint, strings work too and `result.texts` is set.

# %%
prompts = [[5, 17, 42, 8], [99, 3, 14, 15, 92, 65, 35]]
result = engine.generate(prompts, max_new_tokens=16, eos_token_id=[])
for prompt, tokens in zip(prompts, result):
  print(prompt, "->", tokens)
print({k: round(v, 5) if isinstance(v, float) else v for k, v in result.stats.items()})

# %% [markdown]
# ## Stream
# Tokens arrive as they are produced (read back asynchronously, one step behind the device).

# %%
for chunk in engine.stream([prompts[0]], max_new_tokens=8, do_sample=True, temperature=0.8,
                           top_p=0.9, seed=0, eos_token_id=[]):
  print(chunk.step, chunk.tokens)

# %% [markdown]
# ## Engine stats
# Compile counters: nothing compiles after warmup.

# %%
stats = engine.stats()
assert stats["compiles_since_warmup"] == 0, stats
stats
