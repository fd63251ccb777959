"""SamplingParams: every rule's error names its parameter; it is frozen and normalised; the
engine takes it or the keywords (not both); the server's 400s name the OpenAI field."""

import dataclasses
import pickle

import numpy as np
import pytest

from cg_jax import Engine, ParamError, SamplingParams
from cg_jax import serving as server
from cg_jax.sampling_params import ParamTypeError
from cg_jax.serving.protocol import CompletionRequest
from cg_jax.validation import IgnoredSamplingWarning

NAN = float("nan")

# (fields, param, error type, the whole message)
BAD = [
    (dict(max_new_tokens=0), "max_new_tokens", ValueError, "max_new_tokens must be >= 1, got 0"),
    (dict(max_new_tokens=2.5), "max_new_tokens", TypeError,
     "max_new_tokens must be an int, got 2.5"),
    (dict(max_new_tokens=True), "max_new_tokens", TypeError,
     "max_new_tokens must be an int, got True"),
    (dict(do_sample=1), "do_sample", TypeError, "do_sample must be a bool, got 1"),
    (dict(temperature=-0.1), "temperature", ValueError,
     "temperature must be a finite number >= 0, got -0.1"),
    (dict(temperature=NAN), "temperature", ValueError,
     "temperature must be a finite number >= 0, got nan"),
    (dict(temperature=float("inf")), "temperature", ValueError,
     "temperature must be a finite number >= 0, got inf"),
    (dict(temperature="hot"), "temperature", ValueError,
     "temperature must be a finite number >= 0, got 'hot'"),
    (dict(top_k=-1), "top_k", ValueError, "top_k must be >= 0 (0 disables it), got -1"),
    (dict(top_k=2.0), "top_k", TypeError, "top_k must be an int >= 0 (0 disables it), got 2.0"),
    (dict(top_p=0.0), "top_p", ValueError, "top_p must be in (0, 1] (1 disables it), got 0.0"),
    (dict(top_p=1.5), "top_p", ValueError, "top_p must be in (0, 1] (1 disables it), got 1.5"),
    (dict(top_p=NAN), "top_p", ValueError, "top_p must be in (0, 1] (1 disables it), got nan"),
    (dict(seed=-3), "seed", ValueError, "seed must be None or an int in [0, 2**32), got -3"),
    (dict(seed=2**32), "seed", ValueError,
     "seed must be None or an int in [0, 2**32), got 4294967296"),
    (dict(seed=1.0), "seed", ValueError, "seed must be None or an int in [0, 2**32), got 1.0"),
    (dict(eos_token_id="2"), "eos_token_id", TypeError,
     "eos_token_id must be None, an int or a list of ints, got '2'"),
    (dict(eos_token_id=[1, 2.0]), "eos_token_id", TypeError,
     "eos_token_id must be None, an int or a list of ints, got [1, 2.0]"),
    (dict(eos_token_id=list(range(9))), "eos_token_id", ValueError,
     "eos_token_id has 9 ids; at most 8 are supported"),
    (dict(stop=[1]), "stop", TypeError,
     "stop must be None, a string or a list of strings, got [1]"),
    (dict(stop=["x", ""]), "stop", ValueError, "stop strings must be non-empty, got ['x', '']"),
    (dict(stop=["s"] * 9), "stop", ValueError, "stop has 9 strings; at most 8 are supported"),
    (dict(logprobs=21), "logprobs", ValueError,
     "logprobs must be None or an int in [0, 20], got 21"),
    (dict(logprobs=-1), "logprobs", ValueError,
     "logprobs must be None or an int in [0, 20], got -1"),
    (dict(logprobs=True), "logprobs", ValueError,
     "logprobs must be None or an int in [0, 20], got True"),
]


@pytest.mark.parametrize("fields, param, kind, message", BAD)
def test_every_rule_names_its_parameter(fields, param, kind, message):
  with pytest.raises(ParamError) as error:
    SamplingParams(**fields)
  assert isinstance(error.value, ValueError) and isinstance(error.value, kind)
  assert isinstance(error.value, ParamTypeError) == (kind is TypeError)
  assert error.value.param == param
  assert str(error.value) == message
  # Under another name (a CLI flag, an OpenAI field) the message names that instead.
  assert error.value.message("--flag") == message.replace(param, "--flag", 1)
  assert str(pickle.loads(pickle.dumps(error.value))) == message


@pytest.mark.parametrize("fields, param, message", [
    (dict(eos_token_id=263), "eos_token_id", "eos_token_id 263 is out of range; allowed [0, 262]"),
    (dict(stop="x"), "stop", "stop strings need a tokenizer (tokenizer.json in the checkpoint "
                             "directory); use eos_token_id to stop on token ids"),
    (dict(logprobs=12), "logprobs", "logprobs must be None or an int in [0, 10], got 12"),
])
def test_model_dependent_rules(fields, param, message):
  params = SamplingParams(**fields)
  with pytest.raises(ParamError) as error:
    params.settings(vocab_size=263 if param != "logprobs" else 10, default_eos=(1,),
                    has_tokenizer=False)
  assert (error.value.param, str(error.value)) == (param, message)


def test_frozen_normalised_and_settings():
  params = SamplingParams(max_new_tokens=np.int64(5), do_sample=np.bool_(True), top_k=np.int32(3),
                          seed=7, eos_token_id=4, stop="END", logprobs=2)
  with pytest.raises(dataclasses.FrozenInstanceError):
    params.temperature = 0.5
  assert (params.max_new_tokens, params.do_sample, params.top_k) == (5, True, 3)
  assert type(params.max_new_tokens) is int and type(params.do_sample) is bool
  assert (params.eos_token_id, params.stop, params.logprobs) == ((4,), ("END",), 2)
  assert SamplingParams(eos_token_id=[]).eos_token_id == ()
  assert SamplingParams().eos_token_id is None and SamplingParams().stop == ()
  assert hash(params) == hash(dataclasses.replace(params))
  settings, stop, top = params.settings(vocab_size=263, default_eos=(1,), has_tokenizer=True)
  assert (settings.greedy, settings.seed, settings.eos_ids, settings.top_k) == (False, 7, (4,), 3)
  assert (stop, top) == (("END",), 2)
  settings, _, _ = SamplingParams().settings(vocab_size=263, default_eos=(1, 2),
                                             has_tokenizer=False)
  assert settings.greedy and settings.eos_ids == (1, 2) and 0 <= settings.seed < 2**32


def test_greedy_with_sampling_options_warns_at_settings_not_construction():
  params = SamplingParams(top_k=5)  # no warning here
  with pytest.warns(IgnoredSamplingWarning, match="top_k=5 has no effect") as record:
    params.settings(vocab_size=263, default_eos=(), has_tokenizer=False)
  assert len(record) == 1 and record[0].filename == __file__


@pytest.fixture(scope="module")
def engine():
  return Engine.from_pretrained("tiny-llama", max_seq_len=64, batch_buckets=(1, 2),
                                prompt_buckets=(16,))


PROMPTS = [[5, 6, 7, 8], [9, 10, 11]]


def test_params_give_the_keyword_forms_tokens(engine):
  fields = dict(max_new_tokens=6, do_sample=True, temperature=0.8, top_k=20, top_p=0.9, seed=3,
                eos_token_id=[])
  params = SamplingParams(**fields)
  expected = engine.generate(PROMPTS, **fields)
  assert engine.generate(PROMPTS, params=params) == expected
  assert engine.generate(PROMPTS, 6, **{k: v for k, v in fields.items()
                                        if k != "max_new_tokens"}) == expected
  streamed = list(engine.stream([PROMPTS[0]], params=params))
  assert [t for chunk in streamed for t in chunk.tokens.values()] == expected[0]
  # (a seeded row's tokens depend on its row in the call: submit's against submit's)
  assert (engine.submit(PROMPTS[1], params=params).result().tokens
          == engine.submit(PROMPTS[1], **fields).result().tokens)
  request = engine.validate(PROMPTS, params=params)
  assert (request.max_new_tokens, request.settings.seed, request.settings.eos_ids) == (6, 3, ())


@pytest.mark.parametrize("call", ["generate", "stream", "submit", "validate"])
def test_params_and_keywords_together_are_a_type_error(engine, call):
  prompt = PROMPTS[0] if call == "submit" else PROMPTS
  method = getattr(engine, call)
  with pytest.raises(TypeError, match=r"got both params and the sampling keyword\(s\) seed, "
                                      r"top_k: pass one or the other"):
    method(prompt, params=SamplingParams(), top_k=3, seed=1)
  with pytest.raises(TypeError, match=r"both params and the sampling keyword\(s\) "
                                      r"max_new_tokens"):
    method(prompt, 4, params=SamplingParams())
  with pytest.raises(TypeError, match=r"'num_beams' \(beam search is not supported"):
    method(prompt, params=SamplingParams(), num_beams=2)
  with pytest.raises(TypeError, match="params must be a SamplingParams, got dict"):
    method(prompt, params={"top_k": 3})


def test_engine_errors_are_param_errors(engine):
  with pytest.raises(ParamError) as error:
    engine.generate(PROMPTS, top_p=2.0)
  assert error.value.param == "top_p"
  with pytest.raises(ParamError) as error:
    engine.submit(PROMPTS[0], eos_token_id=300)
  assert error.value.param == "eos_token_id"


@pytest.mark.parametrize("request_, param, message", [
    (dict(seed=-1), "seed", "seed must be None or an int in [0, 2**32), got -1"),
    (dict(top_p=1.5), "top_p", "top_p must be in (0, 1] (1 disables it), got 1.5"),
    (dict(logprobs=21), "logprobs", "logprobs must be None or an int in [0, 20], got 21"),
    (dict(stop="x"), "stop", "stop strings need a tokenizer (tokenizer.json in the checkpoint "
                             "directory); use eos_token_id to stop on token ids"),
])
def test_the_server_names_the_openai_field(engine, request_, param, message):
  service = server.Service(engine, "m", None, None)
  body = CompletionRequest(model="m", prompt=[5, 6], max_tokens=4, **request_)
  with pytest.raises(server.ApiError) as error:
    service.completion_jobs(body)
  assert (error.value.status, error.value.param, error.value.message) == (400, param, message)


def test_the_server_maps_engine_param_errors_through_one_dict():
  error = server.engine_error(ParamError("max_new_tokens", 0, "{name} must be >= 1, got {value}"))
  assert (error.status, error.param, error.message) == (400, "max_tokens",
                                                        "max_tokens must be >= 1, got 0")
  other = server.engine_error(ValueError("top_p is mentioned but this is no ParamError"))
  assert (other.status, other.param) == (400, None)


def test_the_server_builds_params_for_its_jobs(engine):
  service = server.Service(engine, "m", None, None)
  body = CompletionRequest(model="m", prompt=[5, 6], max_tokens=4, temperature=0.5,
                                  top_k=-1, top_p=0.9, seed=3, ignore_eos=True)
  (job,) = service.completion_jobs(body)
  assert job.params == SamplingParams(max_new_tokens=4, do_sample=True, temperature=0.5, top_k=0,
                                      top_p=0.9, seed=3, eos_token_id=())
  greedy = CompletionRequest(model="m", prompt=[5, 6], max_tokens=4, temperature=0,
                                    top_k=5, top_p=0.9, seed=3)
  (job,) = service.completion_jobs(greedy)  # sampling fields go to the engine as off
  assert job.params == SamplingParams(max_new_tokens=4, temperature=0)
