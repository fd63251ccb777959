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
# # Accuracy against PyTorch (Hugging Face transformers)
#
# A random Llama-architecture model (GQA, llama3 RoPE scaling) is built in PyTorch, converted
# into cg_jax from its state_dict, and compared position by position on a 320-token prompt,
# then greedy continuations are compared token by token.

# %%
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax  # noqa: E402  (initialise JAX before torch)

jax.config.update("jax_default_matmul_precision", "highest")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

from cg_jax import Engine  # noqa: E402

torch.manual_seed(0)
config = transformers.LlamaConfig(
    vocab_size=389, hidden_size=64, intermediate_size=112, num_hidden_layers=3,
    num_attention_heads=8, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
    rope_theta=50000.0, tie_word_embeddings=False,
    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
model = transformers.LlamaForCausalLM(config).eval()
with torch.no_grad():
  for name, param in model.named_parameters():
    param.copy_(1 + 0.1 * torch.randn_like(param) if "norm" in name else 0.1 * torch.randn_like(param))
engine = Engine.from_state_dict(model.config.to_dict(), model.state_dict(),
                                batch_buckets=(1,), prompt_buckets=(64,))

# %% [markdown]
# ## Per-position logit differences (float32)

# %%
tokens = np.random.default_rng(1).integers(0, 389, (1, 320))
with torch.no_grad():
  reference = model(torch.as_tensor(tokens)).logits.numpy()[0]
ours = engine.logits(tokens.tolist())[0]
relative = np.abs(ours - reference).max(-1) / np.abs(reference).max()
print(f"max over positions: {relative.max():.2e} (test bound 1e-4)")
fig, ax = plt.subplots(figsize=(7, 2.5))
ax.semilogy(relative)
ax.set_xlabel("position")
ax.set_ylabel("max |diff| / max |ref|")
plt.show()

# %% [markdown]
# ## Greedy agreement

# %%
model.generation_config.eos_token_id = None
model.generation_config.pad_token_id = 0
prompt = tokens[0, :40].tolist()
with torch.no_grad():
  expected = model.generate(torch.as_tensor([prompt]), attention_mask=torch.ones(1, 40, dtype=torch.long),
                            max_new_tokens=24, do_sample=False)[0, 40:].tolist()
ours = engine.generate([prompt], max_new_tokens=24, eos_token_id=[])[0]
agree = sum(a == b for a, b in zip(ours, expected))
print(f"{agree}/{len(expected)} greedy tokens identical")
assert ours == expected
