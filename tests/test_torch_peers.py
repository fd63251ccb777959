"""The PyTorch and HF peers (benchmarks/torch_peers.py): the hand-written gpt-fast decoder equals
transformers in float32; each system writes the rows `python -m cg_jax bench` writes for the same
options (workload equal, figures sane) on tiny CPU checkpoints; a wrong model fails the logits
check before anything is timed; bad options are refused naming the flag."""

import os
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))
import torch_peers  # noqa: E402

from cg_jax.bench import latency, rows, throughput  # noqa: E402

pytestmark = pytest.mark.torch


def _gptfast_configs():
  """Tiny configs from tests/helpers.py: GPT-2 with a tied and an untied head; Llama with GQA
  and llama3 RoPE scaling as transformers 5 writes it (rope_parameters), and as 4.x wrote it
  (rope_theta beside rope_scaling) with one K/V head and a tied head."""
  from tests.helpers import hf_gpt2_config, hf_llama_config
  legacy = hf_llama_config(num_key_value_heads=1, tie_word_embeddings=True, rope_theta=500000.0,
                           rope_scaling={"rope_type": "llama3", "factor": 4.0,
                                         "low_freq_factor": 1.0, "high_freq_factor": 2.0,
                                         "original_max_position_embeddings": 64})
  del legacy["rope_parameters"]
  return {"gpt2_tied": hf_gpt2_config(), "gpt2_untied": hf_gpt2_config(tie_word_embeddings=False),
          "llama_gqa_llama3": hf_llama_config(), "llama_legacy_rope_mqa_tied": legacy}


@pytest.mark.parametrize("name", list(_gptfast_configs()))
def test_gptfast_matches_transformers_in_float32(name, tmp_path):
  """On a tiny random float32 checkpoint the hand-written decoder's prefill logits (every prompt
  position) and its decode-step logits after that prefill (fed given tokens, at positions past
  the prompt) equal HF transformers' full-sequence logits (atol 1e-4). The caches start filled
  with large garbage, so a decode step that read a slot past its position, or a prefill that
  read the cache, would show."""
  from torch_peers import gptfast_decode_step, gptfast_prefill, load_gptfast
  from transformers import AutoModelForCausalLM

  from tests.helpers import random_tensors, write_checkpoint

  config = _gptfast_configs()[name]
  directory = write_checkpoint(tmp_path / name, config, random_tensors(config, seed=1))
  reference_model = AutoModelForCausalLM.from_pretrained(
      directory, dtype=torch.float32, attn_implementation="eager").eval()
  model = load_gptfast(directory, torch.float32, torch.device("cpu"))
  assert model.spec.tied == config["tie_word_embeddings"]
  assert (model.head is model.embedding) == config["tie_word_embeddings"]
  batch, prompt_len, decode_steps = 2, 11, 4
  generator = torch.Generator().manual_seed(2)
  tokens = torch.randint(0, config["vocab_size"], (batch, prompt_len + decode_steps),
                         generator=generator)
  with torch.no_grad():
    expected = reference_model(input_ids=tokens, use_cache=False).logits  # [B, S, V]
    model.setup_caches(batch, 32)
    for layer in model.layers:
      layer.k_cache.normal_(0.0, 100.0, generator=generator)
      layer.v_cache.normal_(0.0, 100.0, generator=generator)
    prompt = tokens[:, :prompt_len]
    prefill_logits = model(prompt, torch.arange(prompt_len), prefill=True, all_positions=True)
    torch.testing.assert_close(prefill_logits, expected[:, :prompt_len], atol=1e-4, rtol=1e-5)
    first = gptfast_prefill(model, prompt)  # rewrites the same slots; greedy from the last
    assert torch.equal(first, prefill_logits[:, -1].argmax(-1, keepdim=True))
    for i in range(decode_steps):
      position = prompt_len + i
      next_tokens, logits = gptfast_decode_step(model, tokens[:, position:position + 1],
                                                torch.tensor([position]))
      torch.testing.assert_close(logits, expected[:, position], atol=1e-4, rtol=1e-5,
                                 msg=lambda m: f"decode step at position {position}: {m}")
      assert torch.equal(next_tokens, logits.argmax(-1, keepdim=True))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
  """Tiny bfloat16 GPT-2 and Llama checkpoints (tests/helpers.py's configs)."""
  from tests.helpers import (hf_gpt2_config, hf_llama_config, random_tensors,
                             write_checkpoint)
  root = tmp_path_factory.mktemp("peers")
  return {family: write_checkpoint(root / family, config, random_tensors(config, seed=3),
                                   dtype="bfloat16")
          for family, config in (("gpt2", hf_gpt2_config()), ("llama", hf_llama_config()))}


LATENCY = ["--batch", "1,3", "--prompt-len", "12", "--output-len", "6", "--repeats", "2",
           "--max-seq-len", "32"]


@pytest.mark.parametrize("system", ["torch_compile", "torch_gptfast"])
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_latency_rows_are_the_benchs_rows(system, family, checkpoints, tmp_path):
  """One row per batch size, eagerly on the CPU (named so), with cg_jax's latency workload for
  the same options, its figures and the peer's own, and the check's logits difference."""
  output = tmp_path / "rows.jsonl"
  assert torch_peers.main(["latency", "--system", system, "--model", checkpoints[family],
                           *LATENCY, "--output", str(output)]) == 0
  found = rows.read([str(output)])
  assert [r.workload for r in found] == [latency.workload(b, 12, 6, 2, "float32", 32)
                                         for b in (1, 3)]
  for row in found:
    assert row.system == f"{system} (eager)" and row.device == "cpu"
    assert set(row.software) == {"torch", "transformers"}
    f = row.figures
    for name in ("ttft_ms", "ttft_last_ms", "tpot_ms", "tokens_per_s"):
      assert 0 < f[f"{name}_p50"] <= f[f"{name}_p99"], (name, f)
    assert f["step_us"] > 0 and f["compile_s"] >= 0
    assert 0 <= f["logits_rel_diff"] <= torch_peers.LOGITS_TOLERANCE[torch.float32]


def test_a_wrong_model_fails_the_check(checkpoints, monkeypatch):
  """A decoder with a bug (RoPE left out) is refused before anything is timed."""
  monkeypatch.setattr(torch_peers, "apply_rope", lambda x, cos, sin: x)
  with pytest.raises(AssertionError, match="decode logits differ from the uncompiled "
                                           "transformers model's"):
    torch_peers.main(["latency", "--system", "torch_gptfast", "--model", checkpoints["llama"],
                      *LATENCY])


def test_hf_continuous_serves_the_benchs_requests(checkpoints, tmp_path, monkeypatch):
  """hf_continuous gets throughput.requests' prompts (the same token ids as cg_jax's bench for
  the seed) and writes the throughput row: every request's output_len tokens counted."""
  output = tmp_path / "rows.jsonl"
  sent = []
  real = torch_peers.AutoModelForCausalLM.from_pretrained

  def recording(*args, **kwargs):
    model = real(*args, **kwargs)
    generate_batch = model.generate_batch

    def record(inputs, **options):
      sent.append(inputs)
      return generate_batch(inputs=inputs, **options)
    model.generate_batch = record
    return model

  monkeypatch.setattr(torch_peers.AutoModelForCausalLM, "from_pretrained", recording)
  assert torch_peers.main(["throughput", "--system", "hf_continuous", "--model",
                           checkpoints["gpt2"], "--num-requests", "5", "--prompt-len", "4:20",
                           "--output-len", "6", "--output", str(output)]) == 0
  prompts, _, unmeasured = throughput.requests(5, (4, 20), float("inf"), 0, 261)
  assert sent == [unmeasured, prompts]
  (row,) = rows.read([str(output)])
  assert row.system == "hf_continuous"
  assert row.workload == throughput.workload(5, (4, 20), 6, float("inf"), 0, "float32",
                                             "generate")
  assert row.figures["output_tokens"] == 30 and row.figures["tokens_per_s"] > 0
  assert row.figures["ttft_ms_p50"] <= row.figures["e2e_ms_p50"]


@pytest.mark.parametrize("argv, message", [
    (["throughput", "--system", "hf_continuous", "--rate", "4"], "--rate 4"),
    (["latency", "--system", "torch_compile", "--batch", "0"], "--batch values must be >= 1"),
])
def test_bad_workload_options_name_the_flag(argv, message, checkpoints):
  with pytest.raises(ValueError, match=message):
    torch_peers.main([*argv, "--model", checkpoints["gpt2"]])


@pytest.mark.parametrize("argv, message", [
    (["--batch-buckets", "8"], "--batch-buckets is a cg_jax engine option"),
    (["--model", "gpt2"], "a peer needs a checkpoint directory"),
])
def test_options_a_peer_cannot_take_exit_2(argv, message, checkpoints, capsys):
  with pytest.raises(SystemExit) as exit:
    torch_peers.main(["latency", "--system", "torch_compile", "--model", checkpoints["gpt2"],
                      *argv])
  assert exit.value.code == 2 and message in capsys.readouterr().err
