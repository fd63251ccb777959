"""The CLI on a preset and on a checkpoint directory with a tokenizer; text prompts; streaming,
stop strings, help, warnings and errors in flag names; model lookup in the local Hugging Face
cache and of paths; the persistent compilation cache across processes."""

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import warnings

import pytest
from huggingface_hub import constants as hf_constants
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from cg_jax import Engine, EngineConfig, cli, hub, profile
from cg_jax.core.config import on_gpu
from cg_jax.validation import IgnoredSamplingWarning
from models.config import PRESETS, preset
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
             "--max-new-tokens", "4", "--batch-buckets", "1,2", "--max-seq-len", "32", "--json")
  assert out.returncode == 0, out.stderr
  result = json.loads(out.stdout)
  assert [len(t) <= 4 for t in result["tokens"]] == [True, True]
  assert result["stats"]["tokens_per_s"] > 0 and result["texts"] is None
  # The warm-up built the steps a step of these two prompts can need (5 prompt tokens and two
  # decode tokens: up to the bucket of 7) and no draw (greedy); nothing compiled after it.
  engine = Engine(preset("tiny-gpt2"), None, batch_buckets=(1, 2), max_seq_len=32)
  assert result["stats"]["executables"] == len(
      engine.executable_keys(max_step_tokens=7, draws=False))
  assert result["stats"]["compiles_since_warmup"] == 0
  sampled = _run("generate", "--model", "tiny-gpt2", "--prompt-ids", "1,2,3", "--temperature",
                 "0.8", "--max-new-tokens", "4", "--max-seq-len", "32", "--json")
  assert sampled.returncode == 0, sampled.stderr
  assert json.loads(sampled.stdout)["stats"]["compiles_since_warmup"] == 0


def test_cli_checkpoint_with_tokenizer(checkpoint):
  out = _run("generate", "--model", str(checkpoint), "--prompt", "the quick brown",
             "--max-new-tokens", "6", "--batch-buckets", "1", "--max-seq-len", "32", "--json")
  assert out.returncode == 0, out.stderr
  result = json.loads(out.stdout)
  engine = Engine.from_pretrained(checkpoint, batch_buckets=(1,), max_seq_len=32)
  expected = engine.generate("the quick brown", max_new_tokens=6)
  assert result["tokens"] == list(expected)
  assert result["texts"] == expected.texts
  plain = _run("generate", "--model", str(checkpoint), "--prompt", "the quick brown",
               "--max-new-tokens", "6", "--batch-buckets", "1", "--max-seq-len", "32",
               "--temperature", "0.7", "--top-k", "5", "--top-p", "0.9", "--seed", "1")
  assert plain.returncode == 0, plain.stderr
  assert plain.stdout.startswith("[0] the quick brown") and "tokens/s" in plain.stdout


def test_cli_tensor_parallel_gives_the_one_device_tokens():
  """--tensor-parallel 2 on two host devices prints the single-device run's tokens; a value the
  machine cannot take is a clear error before any compile."""
  args = ("generate", "--model", "tiny-gpt2", "--prompt-ids", "5,6,7", "--max-new-tokens", "6",
          "--batch-buckets", "1", "--max-seq-len", "32", "--json")
  two_devices = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
  one = _run(*args, env=two_devices)
  split = _run(*args, "--tensor-parallel", "2", env=two_devices)
  assert one.returncode == 0 and split.returncode == 0, one.stderr + split.stderr
  assert json.loads(split.stdout)["tokens"] == json.loads(one.stdout)["tokens"]
  bad = _run(*args, "--tensor-parallel", "3", env=two_devices)
  assert bad.returncode == 2
  assert "error: --tensor-parallel must be an int in [1, 2] (the devices here), got 3" in bad.stderr


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
  # huggingface_hub reads HF_HUB_CACHE when it is imported (tests/test_hub.py runs a process).
  monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
  engine = Engine.from_pretrained("acme/tiny", batch_buckets=(1,), prompt_buckets=(16,))
  assert engine.tokenizer is not None
  with pytest.raises(ValueError, match="no network access"):
    Engine.from_pretrained("acme/missing")


def test_persistent_cache_serves_the_second_start(tmp_path):
  script = ("import json, sys; from cg_jax import Engine; from cg_jax.core import compile_stats;"
            "e = Engine.from_pretrained('tiny-gpt2', batch_buckets=(1,), prompt_buckets=(8,),"
            " max_num_batched_tokens=int(sys.argv[1]));"
            "e.warmup(progress=False); s = e.stats();"
            "s['tokens'] = list(e.generate([[3, 4, 5]], 6, eos_token_id=[]));"
            "print(json.dumps(s))")
  env = dict(os.environ, JAX_PLATFORMS="cpu", CG_JAX_COMPILATION_CACHE=str(tmp_path / "xla"))
  runs = []
  # The same build twice, then a build with one more token bucket (16, 32) twice: each build's
  # first start compiles and stores its executables, its second loads them all.
  for budget in ("16", "16", "32", "32"):
    done = subprocess.run([sys.executable, "-c", script, budget], capture_output=True,
                          text=True, cwd=ROOT, env=env)
    assert done.returncode == 0, f"start {len(runs) + 1} failed:\n{done.stderr[-4000:]}"
    runs.append(json.loads(done.stdout))
  assert runs[0]["compilation_cache_dir"] == str(tmp_path / "xla")
  assert runs[0]["persistent_cache_hits"] == 0 and runs[0]["executables_loaded"] == 0
  # Every engine executable is loaded as it was stored (nothing traced or compiled), and
  # generates the same tokens.
  assert runs[1]["executables_loaded"] == runs[1]["executables"] > 0
  assert runs[1]["compiles_total"] < runs[0]["compiles_total"]
  # Executables that XLA's cache supplied are not stored (on the CPU such a copy loads without
  # its kernels and fails when run), so a table names its executables by its build and XLA's
  # cache supplies none of another build's: the other build compiles and stores them all once.
  assert runs[2]["executables_loaded"] == 0
  assert runs[3]["executables_loaded"] == runs[3]["executables"] > runs[1]["executables"]
  assert all(run["tokens"] == runs[0]["tokens"] for run in runs)


def test_cli_profile_reports_per_step_numbers():
  out = _run("profile", "--model", "tiny-gpt2", "--max-seq-len", "64", "--position", "20",
             "--steps", "3", "--graphs", "full", "--json")
  assert out.returncode == 0, out.stderr
  report = json.loads(out.stdout)
  assert report["steps"] == 3 and report["graphs"] == "full"
  assert report["step_us"] > 0 and os.path.exists(report["trace"])
  # On the CPU (JAX_PLATFORMS=cpu): the counters read from the GPU's trace are null.
  assert report["gpu_counters"] is False
  assert {key: report[key] for key in profile.GPU_COUNTERS} == dict.fromkeys(profile.GPU_COUNTERS)
  assert report["host_dispatch_us"] > 0 and report["pipelined_call_us"] > 0


def test_cli_profile_marks_the_gpu_counters_off_a_gpu(capsys):
  assert cli.main(["profile", "--model", "tiny-llama", "--batch", "1", "--steps", "1",
                   "--max-seq-len", "64", "--position", "20"]) == 0
  rows = dict(line.split(None, 1) for line in capsys.readouterr().out.splitlines())
  printed = ("kernels_per_step", "graph_launches_per_step",
             "kernel_launches_outside_graphs_per_step", "memcpy_per_step", "gpu_busy_us",
             "idle_gap_share")
  assert set(printed) <= set(profile.GPU_COUNTERS)
  for key in printed:
    assert (rows[key] == "n/a (needs a GPU)") == (not on_gpu()), (key, rows[key])
  for key in ("step_us", "host_dispatch_wall_us", "pipelined_call_us", "host_dispatch_us"):
    assert float(rows[key]) > 0, (key, rows[key])


STATS = (r"time to first token [\d.]+ ms \| per token [\d.]+ ms \| [\d.]+ tokens/s \| "
         r"warmup [\d.]+ s \(\d+ executables\)")
SMALL = ("--max-new-tokens", "6", "--batch-buckets", "1", "--max-seq-len", "32")


class _Built(Exception):
  """Raised by the stand-in `Engine.from_pretrained`: the CLI got as far as building."""


def _stop_at_build(monkeypatch) -> list[dict]:
  """Replace `Engine.from_pretrained` (and `serve`'s launcher, which builds it in the engine-core
  process) by one that records its arguments and raises `_Built`."""
  calls = []

  def from_pretrained(model, **options):
    calls.append(dict(options, model=model))
    raise _Built

  monkeypatch.setattr(Engine, "from_pretrained", from_pretrained)
  if cli.server is not None:
    monkeypatch.setattr(cli.launch, "serve_model", lambda model, *, engine_options, **_:
                        from_pretrained(model, **engine_options))
  return calls


def test_help_shows_every_default(monkeypatch, capsys):
  monkeypatch.setenv("COLUMNS", "200")
  parser = cli.build_parser()
  commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
  bench = next(a for a in commands.choices["bench"]._actions
               if isinstance(a, argparse._SubParsersAction))
  every = [([name], command) for name, command in commands.choices.items()]
  every += [(["bench", name], command) for name, command in bench.choices.items()]
  for argv, command in every:
    name = " ".join(argv)
    with pytest.raises(SystemExit):
      cli.main([*argv, "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    for action in command._actions:
      if isinstance(action, argparse._SubParsersAction):
        assert f"{action.help}" in shown, name
      elif action.dest != "help":
        assert action.help, f"{name} {action.option_strings[0]} has no help"
        if action.required:  # it has no default to show
          assert f"{action.help} (default:" not in shown, (name, action.dest)
          assert f"{action.help}" in shown, (name, action.dest)
        else:
          assert f"{action.help} (default: {action.default})" in shown, (name, action.dest)
    if name == "generate":
      assert "--max-new-tokens MAX_NEW_TOKENS tokens to generate per prompt (default: 32)" in shown
      assert "None = auto (bfloat16 on GPU, float32 elsewhere) (default: None)" in shown
    elif name == "profile":
      assert f"--model MODEL {cli._MODEL_HELP} --batch" in shown
      assert "None = min(model context, 2048) (default: None)" in shown
      assert "None = auto (bfloat16 on GPU, float32 elsewhere) (default: None)" in shown
      assert "they print as `n/a (needs a GPU)` (null in --json, with gpu_counters false)" in shown
    elif name == "serve":
      assert "--port PORT port to listen on (0: any free one) (default: 8000)" in shown
    elif name == "bench latency":
      assert "--batch BATCH batch sizes to measure, comma separated" in shown
      assert "--output FILE append this run's rows to FILE as JSON lines (default: None)" in shown
    else:
      assert name.startswith("bench"), name


def test_stream_prints_what_generate_prints(checkpoint):
  engine = Engine.from_pretrained(checkpoint, batch_buckets=(1,), max_seq_len=32)
  text = engine.generate("the quick brown", max_new_tokens=6).texts[0]
  out = _run("generate", "--model", str(checkpoint), "--prompt", "the quick brown", *SMALL,
             "--stream")
  assert out.returncode == 0, out.stderr
  assert re.fullmatch(re.escape(f"[0] the quick brown{text}\n") + STATS + "\n", out.stdout)
  ids = Engine.from_pretrained("tiny-gpt2", batch_buckets=(1,), max_seq_len=32).generate(
      [[5, 6, 7]], max_new_tokens=6)[0]
  out = _run("generate", "--model", "tiny-gpt2", "--prompt-ids", "5,6,7", *SMALL, "--stream")
  assert out.returncode == 0, out.stderr
  assert re.fullmatch(re.escape(f"[0] {' '.join(map(str, ids))}\n") + STATS + "\n", out.stdout)


def test_stream_takes_one_prompt_and_no_json(monkeypatch, capsys):
  calls = _stop_at_build(monkeypatch)
  args = ["generate", "--model", "tiny-gpt2", "--prompt-ids", "1", "--stream"]
  assert cli.main([*args, "--prompt-ids", "2"]) == 2
  assert capsys.readouterr().err == (
      "error: --stream takes one prompt, got 2; drop --stream to generate a batch\n")
  assert calls == []
  with pytest.raises(SystemExit) as exit_info:
    cli.main([*args, "--json"])
  assert exit_info.value.code == 2
  assert "argument --json: not allowed with argument --stream" in capsys.readouterr().err


def test_stop_cuts_the_text_before_the_stop_string(checkpoint):
  """Waits for the engine's `stop=`."""
  args = ("generate", "--model", str(checkpoint), "--prompt", "the quick brown",
          "--max-new-tokens", "12", "--batch-buckets", "1", "--max-seq-len", "32")
  engine = Engine.from_pretrained(checkpoint, batch_buckets=(1,), max_seq_len=32)
  full = engine.generate("the quick brown", max_new_tokens=12).texts[0]
  words = re.findall(r"[a-z]{2,}", full)  # random weights also emit partial UTF-8 bytes
  assert words, full
  stop = words[-1]
  expected = full[:full.index(stop)]
  out = _run(*args, "--stop", "never in the text", "--stop", stop, "--json")
  assert out.returncode == 0, out.stderr
  assert json.loads(out.stdout)["texts"] == [expected]
  out = _run(*args, "--stop", stop, "--stream")
  assert out.returncode == 0, out.stderr
  assert out.stdout.splitlines()[0] == f"[0] the quick brown{expected}"


def test_stop_and_text_prompts_need_a_tokenizer(tmp_path, monkeypatch, capsys):
  calls = _stop_at_build(monkeypatch)
  assert cli.main(["generate", "--model", "tiny-gpt2", "--prompt", "hello"]) == 2
  assert capsys.readouterr().err == (
      "error: the model 'tiny-gpt2' has no tokenizer (presets have random weights and none): "
      "use --prompt-ids or a checkpoint directory with tokenizer.json\n")
  (tmp_path / "config.json").write_text(json.dumps(hf_llama_config()))
  assert cli.main(["generate", "--model", str(tmp_path), "--prompt", "hello"]) == 2
  assert capsys.readouterr().err == (
      f"error: the model {str(tmp_path)!r} has no tokenizer (no tokenizer.json in {tmp_path}): "
      "use --prompt-ids or a checkpoint directory with tokenizer.json\n")
  assert cli.main(["generate", "--model", "tiny-gpt2", "--prompt-ids", "1", "--stop", "."]) == 2
  assert capsys.readouterr().err == (
      "error: --stop needs a tokenizer and the model 'tiny-gpt2' has none (presets have random "
      "weights and none): drop --stop or use a checkpoint directory with tokenizer.json\n")
  assert calls == []  # refused before building anything


def _stop_at_warmup(monkeypatch) -> None:
  """Replace `Engine.warmup` by one that raises `_Built`: the request was validated."""
  def warmup(self, **options):
    raise _Built

  monkeypatch.setattr(Engine, "warmup", warmup)


GREEDY = "no effect without --temperature > 0 (decoding greedily)\n"


@pytest.mark.parametrize("flags, warning", [
    (["--top-k", "5"], f"warning: --top-k has {GREEDY}"),
    (["--seed", "1"], f"warning: --seed has {GREEDY}"),
    (["--top-k", "5", "--seed", "1"], f"warning: --top-k and --seed have {GREEDY}"),
    (["--top-k", "5", "--top-p", "0.9"], f"warning: --top-k and --top-p have {GREEDY}"),
    (["--top-p", "0.9", "--seed", "1", "--top-k", "5"],
     f"warning: --top-k, --top-p and --seed have {GREEDY}"),
    (["--top-p", "0.9", "--temperature", "0.7", "--seed", "1"], ""),
    (["--top-k", "0", "--top-p", "1"], ""),
])
def test_sampling_flags_without_temperature_warn(monkeypatch, capsys, flags, warning):
  _stop_at_warmup(monkeypatch)
  with warnings.catch_warnings():
    warnings.simplefilter("always")  # the engine's own warning would show, were it not filtered
    with pytest.raises(_Built):
      cli.main(["generate", "--model", "tiny-gpt2", "--prompt-ids", "1", *flags])
  assert capsys.readouterr().err == warning


def test_sampling_flags_without_temperature_warn_once_and_decode_greedily(capsys):
  greedy = Engine.from_pretrained("tiny-gpt2", batch_buckets=(1,), max_seq_len=32).generate(
      [[5, 6, 7]], max_new_tokens=6)
  for flags in (("--top-k", "5"), ("--seed", "1")):
    with warnings.catch_warnings():
      warnings.simplefilter("always")
      assert cli.main(["generate", "--model", "tiny-gpt2", "--prompt-ids", "5,6,7", *SMALL,
                       *flags, "--json"]) == 0
    out = capsys.readouterr()
    assert out.err == f"warning: {flags[0]} has {GREEDY}"  # one line: no engine warning too
    assert json.loads(out.out)["tokens"] == list(greedy)


def test_library_warnings_show_as_one_line(monkeypatch, capsys):
  def from_pretrained(model, **options):
    warnings.warn("something to know", UserWarning)
    warnings.warn("said in flag names instead", IgnoredSamplingWarning)
    raise _Built

  monkeypatch.setattr(Engine, "from_pretrained", from_pretrained)
  with warnings.catch_warnings():
    warnings.simplefilter("always")
    with pytest.raises(_Built):
      cli.main(["generate", "--model", "tiny-gpt2", "--prompt-ids", "1"])
  assert capsys.readouterr().err == "warning: something to know\n"


def test_stats_line_reports_the_last_row_and_the_warmup_wall_time(monkeypatch, capsys):
  """The stats line gives the last row's time to first token beside the first's, and the
  warm-up's wall time (here far below the compile times the stand-in warm-up claims)."""
  warmup = Engine.warmup

  def claimed(self, **options):
    return dict.fromkeys(warmup(self, **options), 100.0)

  monkeypatch.setattr(Engine, "warmup", claimed)
  args = ["generate", "--model", "tiny-gpt2", "--prompt-ids", "5,6,7", "--prompt-ids",
          ",".join(map(str, range(1, 41))), "--max-new-tokens", "4", "--batch-buckets", "2",
          "--max-seq-len", "64"]
  assert cli.main(args) == 0
  line = capsys.readouterr().out.splitlines()[-1]
  match = re.fullmatch(r"time to first token ([\d.]+) ms \(last row ([\d.]+) ms\) \| per token "
                       r"[\d.]+ ms \| [\d.]+ tokens/s \| warmup ([\d.]+) s \((\d+) executables\)",
                       line)
  assert match, line
  first, last, wall, executables = map(float, match.groups())
  assert first <= last and wall < 100 and executables > 0
  assert cli.main([*args, "--json"]) == 0
  stats = json.loads(capsys.readouterr().out)["stats"]
  assert stats["compile_s"] == 100.0 * stats["executables"] and stats["warmup_s"] < 100
  assert len(stats["ttft_s_rows"]) == 2 and stats["ttft_s_last"] == max(stats["ttft_s_rows"])
  assert cli.main(args[:5] + args[7:]) == 0  # one prompt: no last row
  assert "(last row" not in capsys.readouterr().out


def test_profile_lengths_follow_the_model_context(tmp_path):
  args = cli.build_parser().parse_args(["profile", "--model", "tiny-gpt2"])
  assert (args.max_seq_len, args.position) == (None, None)
  assert cli.profile_lengths("tiny-gpt2", None, None) == (512, 256)
  assert cli.profile_lengths("tiny-llama", None, None) == (512, 256)
  assert cli.profile_lengths("gpt2", None, None) == (1024, 512)
  assert cli.profile_lengths("llama-3.2-1b", None, None) == (2048, 512)
  for name in ("gpt2", "llama-3.2-1b"):  # generate's and serve's default (EngineConfig.create)
    default = EngineConfig.create(PRESETS[name]).max_seq_len
    assert cli.profile_lengths(name, None, None)[0] == default, name
  assert cli.profile_lengths("tiny-gpt2", 64, None) == (64, 32)
  assert cli.profile_lengths("tiny-gpt2", 64, 20) == (64, 20)
  (tmp_path / "config.json").write_text(json.dumps(hf_llama_config()))  # 256 positions
  assert cli.profile_lengths(str(tmp_path), None, None) == (256, 128)


@pytest.mark.parametrize("flags, message", [
    (["--prompt-ids", "5,99999"],
     "--prompt-ids #1, token 2 = 99999 is out of range; token ids must be in [0, 262]"),
    (["--prompt-ids", "1", "--prompt-ids", ""],
     "--prompt-ids #2 is empty: every prompt needs at least one token"),
    (["--prompt-ids", "1,2,3", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0"),
    (["--prompt-ids", "1,2,3", "--max-seq-len", "16", "--max-new-tokens", "20"],
     "--prompt-ids #1 (3 tokens) + --max-new-tokens (20) = 23 exceeds the context of 16 tokens; "
     "allowed --max-new-tokens for this prompt: 1..13"),
    (["--prompt-ids", "1", "--temperature", "-1"],
     "--temperature must be a finite number >= 0, got -1.0"),
    (["--prompt-ids", "1", "--temperature", "1", "--top-k", "-1"],
     "--top-k must be >= 0 (0 disables it), got -1"),
    (["--prompt-ids", "1", "--temperature", "1", "--top-p", "1.5"],
     "--top-p must be in (0, 1] (1 disables it), got 1.5"),
    (["--prompt-ids", "1", "--seed", "-1"], "--seed must be None or an int in [0, 2**32), got -1"),
    (["--prompt-ids", "1", "--max-seq-len", "4000"],
     "--max-seq-len must be an int in [2, 512], got 4000"),
    (["--prompt-ids", "1", "--batch-buckets", "2,1"],
     "--batch-buckets must be strictly ascending, got (2, 1)"),
    (["--prompt-ids", "1", "--max-num-seqs", "0"],
     "--max-num-seqs must be an int in [1, 4096], got 0"),
    (["--prompt-ids", "1", "--max-num-seqs", "2", "--batch-buckets", "1,4"],
     "the largest batch bucket (4) must be <= --max-num-seqs (2), the requests that run at once"),
])
def test_cli_errors_name_the_flags(capsys, flags, message):
  assert cli.main(["generate", "--model", "tiny-gpt2", *flags]) == 2
  assert capsys.readouterr().err == f"error: {message}\n"


def test_flag_names_replace_engine_parameters():
  flags = cli.GENERATE_FLAGS
  assert cli.flag_names("input_ids[2][0] must be an int token id, got 1.5 (float)", flags) == (
      "--prompt-ids #3, token 1 must be an int token id, got 1.5 (float)")
  assert cli.flag_names("prompt 1 has 600 tokens; the largest prompt-length bucket is 512",
                        flags, "--prompt") == (
      "--prompt #2 has 600 tokens; the largest prompt-length bucket is 512")
  assert cli.flag_names("stop[1] is empty; stop must be a str or a list of str", flags) == (
      "--stop #2 is empty; --stop must be a str or a list of str")
  assert cli.flag_names("position must be < max_seq_len - 1 (63), got 80; batch_buckets",
                        cli.PROFILE_FLAGS) == (
      "--position must be < --max-seq-len - 1 (63), got 80; --batch")


def test_generate_dtype_defaults_to_auto(monkeypatch):
  calls = _stop_at_build(monkeypatch)
  for flags in ([], ["--dtype", "bfloat16"]):
    with pytest.raises(_Built):
      cli.main(["generate", "--model", "tiny-gpt2", "--prompt-ids", "1", *flags])
  assert calls[0].get("dtype") is None and calls[1]["dtype"] == "bfloat16"


def test_max_num_seqs_flag_reaches_the_engine(monkeypatch):
  calls = _stop_at_build(monkeypatch)
  for flags in ([], ["--max-num-seqs", "256"]):
    with pytest.raises(_Built):
      cli.main(["generate", "--model", "tiny-gpt2", "--prompt-ids", "1", *flags])
  assert calls[0]["max_num_seqs"] is None and calls[0]["batch_buckets"] is None
  assert calls[1]["max_num_seqs"] == 256


def test_profile_defaults_are_generates(monkeypatch):
  calls = _stop_at_build(monkeypatch)
  for flags in ([], ["--dtype", "bfloat16", "--max-seq-len", "64"]):
    with pytest.raises(_Built):
      cli.main(["profile", "--model", "tiny-gpt2", *flags])
  assert (calls[0]["dtype"], calls[0]["max_seq_len"]) == (None, 512)  # tiny-gpt2: 512 positions
  assert (calls[1]["dtype"], calls[1]["max_seq_len"]) == ("bfloat16", 64)


@pytest.mark.parametrize("name", ["./ckpt", "{tmp}/abs/model", "~/model", "ckpt/sub/dir", "ckpt/"])
def test_path_like_model_is_not_a_hub_name(tmp_path, monkeypatch, name):
  name = name.format(tmp=tmp_path)
  monkeypatch.chdir(tmp_path)
  monkeypatch.setenv("HOME", str(tmp_path / "home"))
  monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
  absolute = os.path.abspath(os.path.expanduser(name))
  with pytest.raises(ValueError) as info:
    hub.resolve_model(name)
  assert str(info.value) == f"model {name!r}: there is no checkpoint directory at {absolute}"
  os.makedirs(absolute)
  assert hub.resolve_model(name) == os.path.expanduser(name)


def test_hub_names_and_files_get_their_own_hints(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
  for name in ("gpt3", "acme/tiny"):
    with pytest.raises(ValueError) as info:
      hub.resolve_model(name)
    assert (f"or a model in the local Hugging Face cache ({tmp_path / 'hub'}); no network access "
            f"is attempted. Download it first (e.g. `hf download {name}`) or pass a checkpoint "
            "directory.") in str(info.value)
  (tmp_path / "model.safetensors").write_bytes(b"")
  with pytest.raises(ValueError) as info:
    hub.resolve_model("./model.safetensors")
  assert str(info.value) == (
      f"model './model.safetensors': {tmp_path / 'model.safetensors'} is a file, not a checkpoint "
      "directory; pass the directory that holds config.json and model.safetensors")


def test_serve_checks_engine_options_before_the_core_starts(monkeypatch, capsys):
  """A bad engine option is exit 2 naming its flag, before the engine-core process starts (the
  check needs no device), not a server that listens and then fails its warm-up."""
  calls = _stop_at_build(monkeypatch)
  serve = ["serve", "--model", "tiny-llama", "--port", "0"]
  assert cli.main([*serve, "--max-num-batched-tokens", "0"]) == 2
  assert capsys.readouterr().err == ("error: --max-num-batched-tokens must be an int in [1, "
                                     "65536], got 0\n")
  assert cli.main([*serve, "--token-buckets", "4,16", "--max-num-batched-tokens", "32"]) == 2
  assert capsys.readouterr().err.startswith("error: --token-buckets must end at "
                                            "--max-num-batched-tokens (32)")
  assert cli.main([*serve, "--tensor-parallel", "3"]) == 2
  assert "--tensor-parallel=3 must divide" in capsys.readouterr().err
  assert calls == []
  # Valid on some platform: the core takes it (here, 64 running requests with the GPU's budget).
  with pytest.raises(_Built):
    cli.main([*serve, "--max-num-seqs", "64", "--max-num-batched-tokens", "2048"])
  assert calls[-1]["max_num_seqs"] == 64


def test_engine_check_options_asks_no_device():
  code = ("from jax._src import xla_bridge\n"
          "from cg_jax import Engine\n"
          "Engine.check_options('tiny-llama', max_num_seqs=64, tensor_parallel=2,\n"
          "                     dtype='float16')\n"
          "try:\n"
          "  Engine.check_options('tiny-llama', max_num_seqs=0)\n"
          "except ValueError as error:\n"
          "  print(error)\n"
          "print(xla_bridge.backends_are_initialized())\n")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
  assert out.returncode == 0, out.stderr
  assert out.stdout.splitlines()[-2:] == [
      "max_num_seqs must be an int in [1, 4096], got 0", "False"], out.stdout


def test_serve_checks_the_port_before_building_anything(monkeypatch, capsys):
  """`serve` binds --host:--port first: a busy port (or a bad host) fails at once, exit 2,
  naming the flag and the address, before the model is built; a free one goes on to build,
  and the socket is closed again when serve ends."""
  calls = _stop_at_build(monkeypatch)
  with socket.socket() as busy:
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    assert cli.main(["serve", "--model", "tiny-llama", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --port {port}: address 127.0.0.1:{port} is in use"), err
    assert len(err.splitlines()) == 1 and calls == []
  assert cli.main(["serve", "--host", "no-such-host.invalid", "--port", "0"]) == 2
  assert capsys.readouterr().err.startswith("error: --host no-such-host.invalid: "
                                            "'no-such-host.invalid' is neither an address")
  assert cli.main(["serve", "--port", "65536"]) == 2
  assert capsys.readouterr().err == ("error: --port 65536: port must be 0 to 65535 (0: any "
                                     "free port), got 65536\n")
  assert calls == []
  with pytest.raises(_Built):
    cli.main(["serve", "--model", "tiny-llama", "--port", str(port), "--max-seq-len", "64"])
  assert [(c["model"], c["max_seq_len"]) for c in calls] == [("tiny-llama", 64)]
  with socket.socket() as again:  # serve's socket was closed
    again.bind(("127.0.0.1", port))
