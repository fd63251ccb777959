"""scripts/train_default_model.py end to end on a tiny corpus: the tokenizer, the held-out split,
a falling loss, and a written checkpoint that loads with the trained parameters' logits."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("optax")

from cg_jax import Engine  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VERSES = [
    "In the beginning God created the heaven and the earth.",
    "And the earth was without form, and void; and darkness was upon the face of the deep.",
    "And God said, Let there be light: and there was light.",
    "And God saw the light, that it was good: and God divided the light from the darkness.",
]


def test_training_script_tiny(tmp_path):
  corpus = tmp_path / "corpus.txt"
  # 120 "chapters" of four verses each (chapters are separated by blank lines).
  corpus.write_text("\n\n".join("\n".join(VERSES) for _ in range(120)) + "\n")
  out, work = tmp_path / "model", tmp_path / "work"
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
  args = [sys.executable, os.path.join(ROOT, "scripts", "train_default_model.py"),
          "--corpus", str(corpus), "--work", str(work), "--out", str(out),
          "--vocab-size", "300", "--hidden-size", "32", "--num-layers", "2", "--num-heads", "2",
          "--num-kv-heads", "1", "--head-dim", "16", "--intermediate-size", "64",
          "--max-position-embeddings", "128", "--seq-len", "32", "--batch-size", "8",
          "--steps", "40", "--warmup-steps", "5", "--eval-every", "20", "--eval-windows", "4"]
  run = subprocess.run(args, capture_output=True, text=True, env=env, timeout=600)
  assert run.returncode == 0, run.stderr[-3000:]
  with open(out / "training.json") as f:
    training = json.load(f)
  history = training["history"]
  assert [h["step"] for h in history] == [20, 40]
  assert history[-1]["valid_loss"] < history[0]["valid_loss"] < np.log(300)
  assert training["best_step"] == 40
  # Every 50th chapter is held out: 120 chapters -> 2 validation chapters.
  tokens = np.load(work / "tokens.npz")
  assert len(tokens["valid"]) * 50 < len(tokens["train"])
  engine = Engine.from_pretrained(out, batch_buckets=(1,), prompt_buckets=(32,))
  ids = engine.tokenizer.encode(VERSES[2]).ids
  logits = np.asarray(engine.logits([ids])[0], np.float64)
  log_probs = logits - logits.max(-1, keepdims=True)
  log_probs -= np.log(np.exp(log_probs).sum(-1, keepdims=True))
  loss = -np.mean(log_probs[np.arange(len(ids) - 1), ids[1:]])
  # The checkpoint holds the trained weights (bfloat16 on disk): close to the logged loss.
  assert loss < history[0]["valid_loss"], (loss, history)
