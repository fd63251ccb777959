"""The PyTorch baseline harness' correctness check (benchmarks/torch_baselines.py): logits and K/V
are compared only on steps computed from equal inputs, a token divergence passes only at a near
tie, and a graph that rounds apart from eager must be as close to float32 as eager is."""

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
