"""The bundled trained model (models/pretrained/kjv-llama-6m): packaged, the CLI's default, and
trained: it scores English in its training style far better than the same words shuffled."""

import json
import os
import random
import subprocess
import sys

import numpy as np
import pytest

from cg_jax import Engine
from cg_jax.hub import BUNDLED_DIR, DEFAULT_MODEL, bundled_models, resolve_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PSALM = ("The LORD is my shepherd; I shall not want. He maketh me to lie down in green pastures: "
         "he leadeth me beside the still waters.")


@pytest.fixture(scope="module")
def engine():
  return Engine.from_pretrained(DEFAULT_MODEL, batch_buckets=(1,), prompt_buckets=(64,))


def _mean_loss(engine, text: str) -> float:
  """Mean next-token negative log-likelihood (nats) of `text`, in float64."""
  ids = engine.tokenizer.encode(text).ids
  logits = np.asarray(engine.logits([ids])[0], np.float64)
  shifted = logits - logits.max(-1, keepdims=True)
  log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
  return float(-np.mean(log_probs[np.arange(len(ids) - 1), ids[1:]]))


def test_bundled_checkpoint_is_complete_and_small():
  assert DEFAULT_MODEL in bundled_models()
  path = resolve_model(DEFAULT_MODEL)
  assert path == os.path.join(BUNDLED_DIR, DEFAULT_MODEL)
  files = set(os.listdir(path))
  assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json",
          "training.json"} <= files
  assert sum(os.path.getsize(os.path.join(path, f)) for f in files) <= 20 * 2**20
  with open(os.path.join(path, "training.json")) as f:
    training = json.load(f)
  assert len(training["corpus_sha256"]) == 64 and training["best_valid_loss"] < 3.5


def test_model_prefers_ordered_english(engine):
  """Trained weights: the verse costs < 5 nats/token and shuffling its words costs > 2 more
  (random weights give ~8.3 for both)."""
  ordered = _mean_loss(engine, PSALM)
  words = PSALM.split()
  random.Random(0).shuffle(words)
  shuffled = _mean_loss(engine, " ".join(words))
  assert ordered < 5.0, ordered
  assert shuffled - ordered > 2.0, (ordered, shuffled)


def test_cli_without_model_uses_bundled_model():
  env = dict(os.environ, JAX_PLATFORMS="cpu", CG_JAX_COMPILATION_CACHE="off")
  out = subprocess.run([sys.executable, "-m", "cg_jax", "generate", "--prompt", "And God said",
                        "--max-new-tokens", "24", "--json"], capture_output=True, text=True,
                       cwd=ROOT, env=env, timeout=600)
  assert out.returncode == 0, out.stderr
  text = json.loads(out.stdout)["texts"][0]
  words = text.split()
  assert len(words) >= 8, text
  # Readable: the words are ordinary English words from the corpus' style, not byte soup.
  assert all(w.strip(".,;:!?'()").isalpha() for w in words if w.strip(".,;:!?'()")), text
