"""The CLI on a preset and on a checkpoint directory with a tokenizer; text prompts; model lookup
in the local Hugging Face cache; the persistent compilation cache across processes."""

import json
import os
import subprocess
import sys

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from cg_jax import Engine
from tests.helpers import hf_llama_config, random_tensors, write_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXT = ("the quick brown fox jumps over the lazy dog. " * 20 +
        "a journey of a thousand miles begins with a single step. " * 20)


def _run(*args, env=None):
  full_env = dict(os.environ, JAX_PLATFORMS="cpu", CG_JAX_COMPILATION_CACHE="off")
  full_env.update(env or {})
  return subprocess.run([sys.executable, "-m", "cg_jax", *args], capture_output=True, text=True,
                        cwd=ROOT, env=full_env, timeout=600)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  """A Llama checkpoint directory with a ByteLevel BPE tokenizer.json trained here."""
  path = tmp_path_factory.mktemp("ckpt")
  tokenizer = Tokenizer(models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>"],
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tokenizer.train_from_iterator([TEXT], trainer)
  tokenizer.save(str(path / "tokenizer.json"))
  config = hf_llama_config(vocab_size=tokenizer.get_vocab_size(), eos_token_id=0)
  write_checkpoint(path, config, random_tensors(config))
  return path


def test_cli_preset_prints_ids_and_stats():
  out = _run("generate", "--model", "tiny-gpt2", "--prompt-ids", "1,2,3", "--prompt-ids", "4,5",
             "--max-new-tokens", "4", "--batch-buckets", "1,2", "--json")
  assert out.returncode == 0, out.stderr
  result = json.loads(out.stdout)
  assert [len(t) <= 4 for t in result["tokens"]] == [True, True]
  assert result["stats"]["tokens_per_s"] > 0 and result["texts"] is None


def test_cli_checkpoint_with_tokenizer(checkpoint):
  out = _run("generate", "--model", str(checkpoint), "--prompt", "the quick brown",
             "--max-new-tokens", "6", "--batch-buckets", "1", "--json")
  assert out.returncode == 0, out.stderr
  result = json.loads(out.stdout)
  engine = Engine.from_pretrained(checkpoint, batch_buckets=(1,))
  expected = engine.generate("the quick brown", max_new_tokens=6)
  assert result["tokens"] == list(expected)
  assert result["texts"] == expected.texts
  plain = _run("generate", "--model", str(checkpoint), "--prompt", "the quick brown",
               "--max-new-tokens", "6", "--batch-buckets", "1", "--temperature", "0.7",
               "--top-k", "5", "--top-p", "0.9", "--seed", "1")
  assert plain.returncode == 0, plain.stderr
  assert plain.stdout.startswith("[0] the quick brown") and "tokens/s" in plain.stdout


def test_cli_tensor_parallel_gives_the_one_device_tokens():
  """--tensor-parallel 2 on two host devices prints the single-device run's tokens; a value the
  machine cannot take is a clear error before any compile."""
  args = ("generate", "--model", "tiny-gpt2", "--prompt-ids", "5,6,7", "--max-new-tokens", "6",
          "--batch-buckets", "1", "--json")
  two_devices = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
  one = _run(*args, env=two_devices)
  split = _run(*args, "--tensor-parallel", "2", env=two_devices)
  assert one.returncode == 0 and split.returncode == 0, one.stderr + split.stderr
  assert json.loads(split.stdout)["tokens"] == json.loads(one.stdout)["tokens"]
  bad = _run(*args, "--tensor-parallel", "3", env=two_devices)
  assert bad.returncode == 2
  assert "tensor_parallel must be an int in [1, 2] (the devices here), got 3" in bad.stderr


def test_cli_reports_bad_input():
  out = _run("generate", "--model", "tiny-gpt2", "--prompt-ids", "1,999",
             "--max-new-tokens", "4", "--batch-buckets", "1")
  assert out.returncode == 2
  assert "999 is out of range" in out.stderr and "compiling" not in out.stderr
  out = _run("generate", "--model", "no/such-model", "--prompt-ids", "1")
  assert out.returncode == 2 and "local Hugging Face cache" in out.stderr


def test_text_prompts_and_streamed_text(checkpoint):
  engine = Engine.from_pretrained(checkpoint, batch_buckets=(1, 2), prompt_buckets=(16,))
  result = engine.generate(["the lazy dog", "a single"], max_new_tokens=8, eos_token_id=[])
  assert result.texts == [engine.tokenizer.decode(t, skip_special_tokens=True) for t in result]
  streamed = ""
  for chunk in engine.stream("the lazy dog", max_new_tokens=8, eos_token_id=[]):
    streamed += chunk.texts[0]
  assert streamed == result.texts[0]


def test_model_name_from_local_hf_cache(tmp_path, checkpoint, monkeypatch):
  repo = tmp_path / "hub" / "models--acme--tiny"
  snapshot = repo / "snapshots" / "abc123"
  snapshot.mkdir(parents=True)
  for name in os.listdir(checkpoint):
    os.symlink(checkpoint / name, snapshot / name)
  (repo / "refs").mkdir()
  (repo / "refs" / "main").write_text("abc123")
  monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
  engine = Engine.from_pretrained("acme/tiny", batch_buckets=(1,), prompt_buckets=(16,))
  assert engine.tokenizer is not None
  with pytest.raises(ValueError, match="no network access"):
    Engine.from_pretrained("acme/missing")


def test_persistent_cache_serves_the_second_start(tmp_path):
  script = ("import json; from cg_jax import Engine, compile_stats;"
            "e = Engine.from_pretrained('tiny-gpt2', batch_buckets=(1,), prompt_buckets=(8,));"
            "e.warmup(progress=False); print(json.dumps(e.stats()))")
  env = dict(os.environ, JAX_PLATFORMS="cpu", CG_JAX_COMPILATION_CACHE=str(tmp_path / "xla"))
  runs = [json.loads(subprocess.run([sys.executable, "-c", script], capture_output=True,
                                    text=True, cwd=ROOT, env=env, check=True).stdout)
          for _ in range(2)]
  assert runs[0]["compilation_cache_dir"] == str(tmp_path / "xla")
  assert runs[0]["persistent_cache_hits"] == 0
  # Every engine executable (and the weight initialiser) comes from the cache.
  assert runs[1]["persistent_cache_hits"] >= runs[1]["executables"] > 0


def test_cli_profile_reports_per_step_numbers():
  out = _run("profile", "--model", "tiny-gpt2", "--max-seq-len", "64", "--position", "20",
             "--steps", "3", "--graphs", "full", "--json")
  assert out.returncode == 0, out.stderr
  report = json.loads(out.stdout)
  assert report["steps"] == 3 and report["graphs"] == "full"
  assert report["step_us"] > 0 and os.path.exists(report["trace"])
