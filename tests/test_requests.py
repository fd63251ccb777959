"""Request-side behaviour of the public API: stop strings (generate and stream), names brought
from transformers, the dtype default and its CPU warning, greedy decoding with sampling knobs
(one warning per call, naming them)."""

import warnings

import numpy as np
import pytest

from cg_jax import Engine
from cg_jax.generation import RowText
from cg_jax.hub import DEFAULT_MODEL
from cg_jax.validation import IgnoredSamplingWarning

PROMPT = "And God said"


@pytest.fixture(scope="module")
def engine():
  return Engine.from_pretrained(DEFAULT_MODEL, max_seq_len=96, batch_buckets=(1, 2),
                                prompt_buckets=(16,))


def _stop_inside(engine, tokens: list[int]) -> tuple[str, str]:
  """A stop string that first appears inside the generated text, and the text before it."""
  text = engine.tokenizer.decode(tokens, skip_special_tokens=True)
  # A word from the middle of the text, with its leading space.
  words = text.split(" ")
  stop = " " + words[len(words) // 2]
  return stop, text[:text.find(stop)]


def test_stop_strings_cut_the_text_and_end_the_row(engine):
  free = engine.generate([PROMPT, "In the beginning"], max_new_tokens=40, eos_token_id=[])
  stop, before = _stop_inside(engine, free[0])
  result = engine.generate([PROMPT, "In the beginning"], max_new_tokens=40, eos_token_id=[],
                           stop=[stop])
  assert result.texts[0] == before
  assert stop not in result.texts[0]
  # The tokens are the free run's, ending with the one that completed the stop string.
  tokens = result[0]
  assert tokens == free[0][:len(tokens)] and len(tokens) < len(free[0])
  assert stop in engine.tokenizer.decode(tokens, skip_special_tokens=True)
  assert stop not in engine.tokenizer.decode(tokens[:-1], skip_special_tokens=True)
  # The other row goes on to its own stop (or the budget) untouched by row 0's.
  other = result.texts[1]
  assert free.texts[1].startswith(other)
  if stop not in free.texts[1]:
    assert result[1] == free[1]


def test_stream_never_shows_the_stop_string(engine):
  free = engine.generate([PROMPT], max_new_tokens=40, eos_token_id=[])
  stop, before = _stop_inside(engine, free[0])
  chunks = list(engine.stream([PROMPT], max_new_tokens=40, eos_token_id=[], stop=stop))
  shown = "".join(c.texts.get(0, "") for c in chunks)
  assert shown == before
  tokens = [c.tokens[0] for c in chunks if 0 in c.tokens]
  result = engine.generate([PROMPT], max_new_tokens=40, eos_token_id=[], stop=stop)
  assert tokens == result[0]


def test_stream_texts_add_up_to_the_generated_text(engine):
  result = engine.generate([PROMPT], max_new_tokens=24, eos_token_id=[])
  shown = "".join(c.texts.get(0, "") for c in engine.stream([PROMPT], max_new_tokens=24,
                                                             eos_token_id=[]))
  assert shown == result.texts[0]


class _Bytes:
  """A tokenizer of single bytes (UTF-8), decoding incomplete sequences to U+FFFD."""

  def decode(self, ids, skip_special_tokens=True):
    return bytes(ids).decode("utf-8", errors="replace")


def test_row_text_holds_back_split_characters_and_partial_stops():
  row = RowText(_Bytes(), ("STOP",))
  shown = [row.push(b) for b in "a é S".encode()]
  # "é" is two bytes: nothing of it is shown until both arrived; "S" might begin "STOP".
  assert shown == ["a", " ", "", "é", " ", ""]
  assert [row.push(b) for b in b"TOx"] == ["", "", "STOx"]
  assert [row.push(b) for b in b" STOP tail"][-1] == "" and row.stopped
  assert row.text == "a é STOx "
  assert row.finish() == ""


@pytest.mark.parametrize("stop, error, match", [
    (["x", ""], ValueError, r"stop strings must be non-empty, got \['x', ''\]"),
    ([1], TypeError, "stop must be None, a string or a list of strings, got"),
    (["s"] * 9, ValueError, "stop has 9 strings; at most 8"),
])
def test_bad_stop_strings(engine, stop, error, match):
  with pytest.raises(error, match=match):
    engine.generate([PROMPT], max_new_tokens=4, stop=stop)


def test_stop_strings_need_a_tokenizer():
  engine = Engine.from_pretrained("tiny-gpt2", max_seq_len=32, prompt_buckets=(16,))
  with pytest.raises(TypeError, match="stop strings need a tokenizer"):
    engine.generate([[1, 2]], max_new_tokens=4, stop=["a"])


@pytest.mark.parametrize("name, hint", [
    ("max_length", "use max_new_tokens"), ("num_beams", "beam search is not supported"),
    ("stop_strings", "use stop"), ("repetition_penalty", "repetition penalties are not"),
    ("device_loop", "removed: it was slower than the pipelined host loop"),
])
def test_transformers_names_say_what_to_use(engine, name, hint):
  with pytest.raises(TypeError, match=rf"generate\(\) got unexpected keyword argument\(s\): "
                                      rf"'{name}' \({hint}"):
    engine.generate([PROMPT], **{name: 4})
  with pytest.raises(TypeError, match=name):
    engine.stream([PROMPT], **{name: 4})


def test_cpu_dtype_default_and_warning():
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    engine = Engine.from_pretrained("tiny-gpt2", max_seq_len=32, prompt_buckets=(16,))
  assert engine.stats()["dtype"] == "float32"
  with pytest.warns(UserWarning, match=r"dtype=bfloat16 on the CPU is emulated"):
    Engine.from_pretrained("tiny-gpt2", dtype="bfloat16", max_seq_len=32, prompt_buckets=(16,))


SAMPLE = "pass do_sample=True and temperature > 0 to sample"


@pytest.mark.parametrize("options, message", [
    (dict(top_k=5), "top_k=5 has no effect with greedy decoding (do_sample=False, "
                    f"temperature=1.0): {SAMPLE}"),
    (dict(seed=3), f"seed=3 has no effect with greedy decoding (do_sample=False, "
                   f"temperature=1.0): {SAMPLE}"),
    (dict(temperature=0.7, top_k=5, top_p=0.9, seed=3),
     "temperature=0.7, top_k=5, top_p=0.9, seed=3 have no effect with greedy decoding "
     f"(do_sample=False, temperature=0.7): {SAMPLE}"),
    (dict(do_sample=True, temperature=0, top_p=0.5, seed=3),
     f"top_p=0.5, seed=3 have no effect with greedy decoding (do_sample=True, temperature=0): "
     f"{SAMPLE}"),
])
def test_sampling_knobs_without_sampling_warn_once_per_call_and_decode_greedily(
    engine, options, message):
  greedy = engine.generate([PROMPT], max_new_tokens=6)
  calls = {
      "generate": lambda: engine.generate([PROMPT], max_new_tokens=6, **options),
      "stream": lambda: engine.stream([PROMPT], max_new_tokens=6, **options),
      "submit": lambda: engine.submit(PROMPT, max_new_tokens=6, **options),
      "validate": lambda: engine.validate([PROMPT], 6, **options),
  }
  for name, call in calls.items():
    with pytest.warns(IgnoredSamplingWarning) as record:
      result = call()  # stream and submit warn when called, before any token is asked for
    assert [str(r.message) for r in record] == [message], name
    assert record[0].filename == __file__, name  # pointed at the call above, not at cg_jax
    if name == "generate":
      assert result == greedy
    elif name == "stream":
      assert [t for chunk in result for t in chunk.tokens.values()] == greedy[0]
    elif name == "submit":
      assert result.result().tokens == greedy[0]


@pytest.mark.parametrize("options", [
    {}, dict(temperature=0), dict(do_sample=True, temperature=0),
    dict(do_sample=True, temperature=0.8, top_k=5, top_p=0.9, seed=3)])
def test_sampling_options_that_take_effect_do_not_warn(engine, options):
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    tokens = engine.generate([PROMPT], max_new_tokens=6, **options)
  assert np.all(np.asarray(tokens[0]) >= 0)
