"""Train the bundled default model: a small Llama-architecture decoder on the King James Bible.

Recipe (the committed `models/pretrained/kjv-llama-6m` was made exactly so; training on one H200
takes about a minute, on a CPU hours):

  bash scripts/kjv_corpus.sh /tmp/kjv.txt                        # public-domain text (Debian)
  python scripts/train_default_model.py --corpus /tmp/kjv.txt --work /tmp/kjv-work \\
      --out models/pretrained/kjv-llama-6m

Stages (each cached in --work, so the tokenizer and the token ids can be made on a CPU machine
and carried to a GPU machine that lacks the corpus): a byte-level BPE tokenizer trained with
`tokenizers` (tokenizer.json), the corpus as token ids (tokens.npz; every 50th chapter held out for
validation), then next-token training of `models.Decoder` with AdamW (optax), keeping the
parameters of the best validation loss. The output directory is a Hugging Face checkpoint
(config.json, model.safetensors in bfloat16, tokenizer.json, tokenizer_config.json,
generation_config.json) plus training.json with the settings, the loss curve and the corpus hash.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import hashlib
import json
import os
import shutil
import time

import jax
import numpy as np
import optax
from flax import nnx

from models.attention import XlaAttention
from models.config import DecoderConfig
from models.decoder import Decoder
from models.hf import save_checkpoint

END_OF_TEXT = "<|endoftext|>"


@dataclasses.dataclass(frozen=True)
class TrainSettings:
  vocab_size: int = 4096
  hidden_size: int = 256
  num_layers: int = 6
  num_heads: int = 4
  num_kv_heads: int = 2
  head_dim: int = 64
  intermediate_size: int = 768
  max_position_embeddings: int = 1024
  seq_len: int = 512
  batch_size: int = 32
  steps: int = 700
  learning_rate: float = 2e-3
  warmup_steps: int = 50
  weight_decay: float = 0.1
  eval_every: int = 50
  eval_windows: int = 64
  seed: int = 0


def model_config(s: TrainSettings) -> DecoderConfig:
  return DecoderConfig(
      family="llama", vocab_size=s.vocab_size, hidden_size=s.hidden_size,
      num_layers=s.num_layers, num_heads=s.num_heads, num_kv_heads=s.num_kv_heads,
      head_dim=s.head_dim, intermediate_size=s.intermediate_size,
      max_position_embeddings=s.max_position_embeddings, norm_eps=1e-5, tie_word_embeddings=True,
      attention_bias=False, mlp_bias=False, activation="silu", rope_theta=10000.0,
      bos_token_id=0, eos_token_id=(0,))


# --------------------------------------------------------------------------------------------------
# Tokenizer and token ids


def chapters(corpus: str) -> list[str]:
  """The corpus cut at blank lines (one chapter of the Bible each)."""
  with open(corpus) as f:
    return [c.strip() for c in f.read().split("\n\n") if c.strip()]


def train_tokenizer(texts: list[str], vocab_size: int, path: str):
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

  tokenizer = Tokenizer(models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[END_OF_TEXT],
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                show_progress=False)
  tokenizer.train_from_iterator(texts, trainer)
  tokenizer.save(path)
  return tokenizer


def token_ids(corpus: str, work: str, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
  """(train ids, validation ids), uint16, chapters joined by the end-of-text id 0."""
  cache = os.path.join(work, "tokens.npz")
  if os.path.isfile(cache):
    data = np.load(cache)
    return data["train"], data["valid"]
  from tokenizers import Tokenizer

  texts = chapters(corpus)
  tokenizer_path = os.path.join(work, "tokenizer.json")
  tokenizer = (Tokenizer.from_file(tokenizer_path) if os.path.isfile(tokenizer_path)
               else train_tokenizer(texts, vocab_size, tokenizer_path))
  assert tokenizer.token_to_id(END_OF_TEXT) == 0
  encoded = [e.ids + [0] for e in tokenizer.encode_batch(texts)]
  valid = [ids for i, ids in enumerate(encoded) if i % 50 == 49]
  train = [ids for i, ids in enumerate(encoded) if i % 50 != 49]
  arrays = {name: np.concatenate([np.asarray(ids, np.uint16) for ids in part])
            for name, part in (("train", train), ("valid", valid))}
  np.savez(cache, **arrays, corpus_sha256=hashlib.sha256(open(corpus, "rb").read()).hexdigest())
  return arrays["train"], arrays["valid"]


# --------------------------------------------------------------------------------------------------
# Training


def windows(ids: np.ndarray, starts: np.ndarray, length: int) -> np.ndarray:
  # [N, length + 1] int32: inputs are [:, :-1], targets [:, 1:]
  return np.stack([ids[s:s + length + 1] for s in starts]).astype(np.int32)


def make_steps(graphdef, optimizer):
  """Jitted (train_step, eval_loss) over the flat parameter state."""

  def loss_fn(params, batch):
    model = nnx.merge(graphdef, params)
    # [B, S, V] float32
    logits = model.logits(batch[:, :-1], attention=XlaAttention(), layer_loop="scan")
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()

  def train_step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return jax.jit(train_step, donate_argnums=(0, 1)), jax.jit(loss_fn)


def train(settings: TrainSettings, train_ids: np.ndarray, valid_ids: np.ndarray, log=print):
  """Returns (config, best parameters as NumPy weights, history)."""
  config = model_config(settings)
  graphdef, params = nnx.split(Decoder(config, rngs=nnx.Rngs(settings.seed)), nnx.Param)
  schedule = optax.warmup_cosine_decay_schedule(
      0.0, settings.learning_rate, settings.warmup_steps, settings.steps,
      end_value=settings.learning_rate / 10)
  optimizer = optax.chain(optax.clip_by_global_norm(1.0),
                          optax.adamw(schedule, b2=0.95, weight_decay=settings.weight_decay))
  opt_state = optimizer.init(params)
  train_step, eval_loss = make_steps(graphdef, optimizer)
  rng = np.random.default_rng(settings.seed)
  span = settings.seq_len + 1
  eval_starts = np.linspace(0, len(valid_ids) - span, settings.eval_windows).astype(np.int64)
  eval_batch = windows(valid_ids, eval_starts, settings.seq_len)
  history, best = [], (float("inf"), None, 0)
  start = time.perf_counter()
  for step in range(1, settings.steps + 1):
    batch = windows(train_ids, rng.integers(0, len(train_ids) - span, settings.batch_size),
                    settings.seq_len)
    params, opt_state, loss = train_step(params, opt_state, batch)
    if step % settings.eval_every == 0 or step == settings.steps:
      valid = float(eval_loss(params, eval_batch))
      history.append(dict(step=step, train_loss=float(loss), valid_loss=valid,
                          seconds=time.perf_counter() - start))
      log(f"step {step:5d}  train {float(loss):.3f}  valid {valid:.3f}  "
          f"{time.perf_counter() - start:6.1f} s")
      if valid < best[0]:
        best = (valid, jax.tree.map(np.asarray, params), step)
  model = nnx.merge(graphdef, best[1])
  weights = {name: np.asarray(value[...]) for name, value in vars(model).items()
             if isinstance(value, nnx.Param)}
  return config, weights, dict(history=history, best_step=best[2], best_valid_loss=best[0])


# --------------------------------------------------------------------------------------------------
# Output


def write_model(out: str, config: DecoderConfig, weights, work: str, settings: TrainSettings,
                result: dict, corpus_sha256: str) -> None:
  save_checkpoint(out, config, weights, dtype="bfloat16")
  shutil.copyfile(os.path.join(work, "tokenizer.json"), os.path.join(out, "tokenizer.json"))
  with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
    json.dump(dict(tokenizer_class="PreTrainedTokenizerFast", bos_token=END_OF_TEXT,
                   eos_token=END_OF_TEXT, unk_token=None, model_max_length=config.max_position_embeddings),
              f, indent=2)
  with open(os.path.join(out, "generation_config.json"), "w") as f:
    json.dump(dict(bos_token_id=0, eos_token_id=0, pad_token_id=0), f, indent=2)
  with open(os.path.join(out, "training.json"), "w") as f:
    json.dump(dict(settings=dataclasses.asdict(settings), corpus="King James Bible (1611), "
                   "Debian package bible-kjv-text 4.38, via scripts/kjv_corpus.sh",
                   corpus_sha256=corpus_sha256, num_parameters=config.num_parameters(),
                   device=jax.devices()[0].device_kind, jax_version=jax.__version__,
                   date=datetime.date.today().isoformat(), **result), f, indent=1)


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--corpus", help="plain-text corpus (scripts/kjv_corpus.sh); not needed "
                      "when --work already holds tokens.npz")
  parser.add_argument("--work", required=True, help="cache directory (tokenizer, token ids)")
  parser.add_argument("--out", required=True, help="output checkpoint directory")
  for field in dataclasses.fields(TrainSettings):
    parser.add_argument("--" + field.name.replace("_", "-"), type=type(field.default),
                        default=field.default)
  args = parser.parse_args()
  settings = TrainSettings(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainSettings)})
  os.makedirs(args.work, exist_ok=True)
  if not os.path.isfile(os.path.join(args.work, "tokens.npz")) and not args.corpus:
    parser.error("--corpus is needed to build the tokenizer and token ids")
  train_ids, valid_ids = token_ids(args.corpus, args.work, settings.vocab_size)
  corpus_sha256 = str(np.load(os.path.join(args.work, "tokens.npz"))["corpus_sha256"])
  print(f"{len(train_ids)} training tokens, {len(valid_ids)} validation tokens; "
        f"{model_config(settings).num_parameters() / 1e6:.2f}M parameters on {jax.devices()[0]}")
  config, weights, result = train(settings, train_ids, valid_ids)
  write_model(args.out, config, weights, args.work, settings, result, corpus_sha256)
  print(f"best validation loss {result['best_valid_loss']:.3f} at step {result['best_step']}; "
        f"wrote {args.out}")


if __name__ == "__main__":
  main()
