"""The PyTorch baseline harness' correctness check (benchmarks/torch_baselines.py): logits and K/V
are compared only on steps computed from equal inputs, a token divergence passes only at a near
tie, and a graph that rounds apart from eager must be as close to float32 as eager is. The
torch_gptfast peer: its hand-written decoder equals transformers in float32, and its CPU smoke
run writes checked rows (and fails a wrong model)."""

import json
import os
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))
from torch_baselines import check_against_float32, compare_to_eager  # noqa: E402

pytestmark = pytest.mark.torch


def _run(logits_rows):
  """[(token, logits)] per step, tokens = argmax of the logits."""
  return [(torch.tensor([int(l.argmax())]), l[None]) for l in logits_rows]


def _kv(steps, seed):
  return torch.randn(4, 1, 2, steps, 8, generator=torch.Generator().manual_seed(seed))


def test_identical_runs_match():
  steps = [torch.tensor([0.1, 2.0, -1.0]), torch.tensor([3.0, 0.0, 1.0])]
  kv = _kv(2, 0)
  check = compare_to_eager(_run(steps), kv, _run(steps), kv.clone(), "same")
  assert check["tokens_match_eager"] and check["logits_max_rel_diff"] == 0.0
  assert check["first_divergent_step"] is None and check["divergence_at_near_tie"]


def test_near_tie_divergence_is_accepted_and_later_steps_ignored():
  eager = [torch.tensor([1.0, 0.0, 0.0]), torch.tensor([2.000, 1.999, 0.0]),
           torch.tensor([5.0, 0.0, 0.0])]
  # Step 1 flips within the logits' difference; step 2 then runs on another token (anything).
  graph = [torch.tensor([1.0, 0.0, 0.0]), torch.tensor([1.998, 2.0, 0.0]),
           torch.tensor([-9.0, 9.0, 9.0])]
  kv_eager, kv_graph = _kv(3, 1), _kv(3, 1)
  kv_graph[..., 2, :] += 100.0  # written from the diverged token: not compared
  check = compare_to_eager(_run(eager), kv_eager, _run(graph), kv_graph, "tie")
  assert not check["tokens_match_eager"] and check["first_divergent_step"] == 1
  assert check["divergence_at_near_tie"]
  assert check["logits_max_rel_diff"] < 1e-3 and check["kv_max_rel_diff"] == 0.0


def test_divergence_without_a_tie_is_flagged():
  eager = [torch.tensor([5.0, 0.0, 0.0])]
  graph = [torch.tensor([0.0, 5.0, 0.0])]
  kv = _kv(1, 2)
  check = compare_to_eager(_run(eager), kv, _run(graph), kv.clone(), "broken")
  assert not check["divergence_at_near_tie"] and check["logits_max_rel_diff"] == 1.0


def test_float32_judges_a_graph_that_rounds_apart_from_eager():
  """A graph whose logits and K/V differ from eager beyond the tolerance passes when it is as
  close to float32 as eager is, and fails when it is markedly further (logits or K/V)."""
  generator = torch.Generator().manual_seed(3)
  exact = [torch.randn(1, 50, generator=generator) for _ in range(3)]
  exact_kv = torch.randn(4, 1, 2, 3, 8, generator=generator)

  def rounded(scale, seed):  # float32 plus noise of `scale` x its max
    noise = torch.Generator().manual_seed(seed)
    logits = [l + scale * l.abs().max() * torch.randn(l.shape, generator=noise) / 3
              for l in exact]
    kv = exact_kv + scale * exact_kv.abs().max() * torch.randn(exact_kv.shape, generator=noise) / 3
    return [(l.argmax(-1), l) for l in logits], kv

  eager, eager_kv = rounded(0.02, 4)
  graph, graph_kv = rounded(0.02, 5)
  check = compare_to_eager(eager, eager_kv, graph, graph_kv, "rounded apart")
  assert check["kv_max_rel_diff"] > 1e-2
  errors = check_against_float32(check, eager, eager_kv, graph, graph_kv, exact, exact_kv)
  assert errors["kv_fp32_rel_err_graph"] <= 1.25 * errors["kv_fp32_rel_err_eager"]
  worse, worse_kv = rounded(0.2, 6)
  for candidate, candidate_kv, what in ((worse, graph_kv, "logits"), (graph, worse_kv, "kv")):
    check = compare_to_eager(eager, eager_kv, candidate, candidate_kv, "worse")
    with pytest.raises(AssertionError, match=f"{what} differ from torch_eager"):
      check_against_float32(check, eager, eager_kv, candidate, candidate_kv, exact, exact_kv)


def test_float32_reference_follows_the_eager_trajectory():
  """float32_reference re-runs the eager loop's steps with its tokens: on a float32 model it gives
  the eager logits exactly (a token fed one step late or early would not); on a bfloat16 model
  the eager logits are within bfloat16 rounding of it."""
  from transformers import GPT2Config, GPT2LMHeadModel
  from torch_baselines import EagerLoop, StaticDecoder, float32_reference, written_kv

  config = GPT2Config(vocab_size=97, n_positions=64, n_embd=32, n_layer=2, n_head=2)
  torch.manual_seed(0)
  model32 = GPT2LMHeadModel(config).eval()
  prompt = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(1))
  for dtype, tolerance in ((torch.float32, 0.0), (torch.bfloat16, 3e-2)):
    model = model32.to(dtype) if dtype != torch.float32 else model32
    with torch.no_grad():
      decoder = StaticDecoder(model, 2, 32)
      first = decoder.prefill(prompt)
      eager = EagerLoop(decoder, first, 12)
      reference = eager.run(5, collect=True)
      kv = written_kv(decoder, 12, 5).clone()
      exact, exact_kv = float32_reference(model, prompt, first, 12, 32, reference)
    assert len(exact) == 5 and exact_kv.shape == kv.shape
    assert float((kv - exact_kv).abs().max() / exact_kv.abs().max()) <= tolerance, dtype
    for (_, logits), logits32 in zip(reference, exact):
      error = float((logits - logits32).abs().max() / logits32.abs().max())
      assert error <= tolerance, (dtype, error)


# ------------------------------------------------------------------------------------------------
# torch_gptfast: the hand-written decoder against transformers, and its smoke run


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
  from tests.helpers import random_tensors, write_checkpoint
  from transformers import AutoModelForCausalLM
  from torch_baselines import gptfast_decode_step, gptfast_prefill, load_gptfast

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


@pytest.fixture
def restore_torch_threads():
  """main(--smoke) sets torch to one thread; later tests get the count back."""
  threads = torch.get_num_threads()
  yield
  torch.set_num_threads(threads)


def _smoke_checkpoint(tmp_path, family):
  from tests.helpers import hf_gpt2_config, hf_llama_config, random_tensors, write_checkpoint
  config = hf_gpt2_config() if family == "gpt2" else hf_llama_config()
  return write_checkpoint(tmp_path / f"smoke-{family}", config, random_tensors(config, seed=3),
                          dtype="bfloat16")


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_gptfast_smoke_run_writes_checked_rows(family, tmp_path, restore_torch_threads):
  """`--smoke --system torch_gptfast` on the CPU: one ok row per batch with torch_eager's row
  fields (and its own), a step time and TTFT, the eager fallback flagged, and the check against
  torch_eager passed (tokens equal or diverging only at a near tie)."""
  import torch_baselines
  directory = _smoke_checkpoint(tmp_path, family)
  out = str(tmp_path / "rows.json")
  for system in ("torch_eager", "torch_gptfast"):
    assert torch_baselines.main(["--smoke", "--system", system, "--model-dir", directory,
                                 "--batches", "1,3", "--out", out]) == 0
  with open(out) as f:
    rows = json.load(f)
  eager_rows = [r for r in rows if r["system"] == "torch_eager"]
  rows = [r for r in rows if r["system"] == "torch_gptfast"]
  assert [r["batch"] for r in rows] == [1, 3]
  for row, eager_row in zip(rows, eager_rows):
    assert set(eager_row) <= set(row), set(eager_row) - set(row)
    assert row["status"] == "ok", row["error"]
    assert row["model"] == f"smoke-{family}" and row["device"] == "cpu"
    assert row["step_us"] > 0 and row["ttft_ms"] > 0 and row["tokens_per_s"] > 0
    assert row["eager_fallback"] and row["decode"] == "eager" and row["compile_s"] is None
    assert row["tokens_match_eager"] or row["divergence_at_near_tie"]
    assert row["logits_max_rel_diff"] <= 1e-2 and row["kv_max_rel_diff"] <= 1e-2


def test_gptfast_smoke_run_fails_a_wrong_model(tmp_path, restore_torch_threads, monkeypatch):
  """A decoder with a bug (RoPE left out) fails the check against torch_eager: `failed` rows
  with the assertion, no step time, and main's exit status 1."""
  import torch_baselines
  directory = _smoke_checkpoint(tmp_path, "llama")
  monkeypatch.setattr(torch_baselines, "apply_rope", lambda x, cos, sin: x)
  out = str(tmp_path / "rows.json")
  assert torch_baselines.main(["--smoke", "--system", "torch_gptfast", "--model-dir", directory,
                               "--batches", "2", "--out", out]) == 1
  with open(out) as f:
    (row,) = json.load(f)
  assert row["status"] == "failed" and row["step_us"] is None
  assert "torch_gptfast: " in row["error"] and "differ from torch_eager" in row["error"]
