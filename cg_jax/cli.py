"""Command line: `python -m cg_jax generate [--model PATH_OR_NAME] --prompt TEXT ...`,
`python -m cg_jax serve [--model PATH_OR_NAME] [--port 8000]` (an OpenAI-compatible HTTP server;
needs the `serve` extra), `python -m cg_jax profile --model NAME` and
`python -m cg_jax bench latency|throughput|serve|startup` (benchmarks writing `cg_jax.bench.rows`
rows)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import time
import warnings

from cg_jax import profile
from cg_jax.bench import latency as bench_latency
from cg_jax.bench import rows as bench_rows
from cg_jax.bench import serve as bench_serve
from cg_jax.bench import startup as bench_startup
from cg_jax.bench import throughput as bench_throughput
from cg_jax.core.buckets import DEFAULT_BATCH_BUCKETS
from cg_jax.core.config import DEFAULT_MAX_SEQ_LEN, on_gpu
from cg_jax.core.graphs import GRAPH_MODES
from cg_jax.engine import Engine
from cg_jax.hub import DEFAULT_MODEL, resolve_model
from cg_jax.sampling_params import ParamError, SamplingParams
from cg_jax.validation import IgnoredSamplingWarning
from models import hf
from models.config import PRESETS

try:  # the HTTP server needs the `serve` extra (fastapi, uvicorn, prometheus-client, jinja2)
  from cg_jax import serving as server
  from cg_jax.serving import launch
except ImportError as missing:
  server = None
  SERVER_MISSING = str(missing)
else:
  SERVER_MISSING = ""


class _DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
  """Every option's help ends with its default, except a required option's (it has none)."""

  def _get_help_string(self, action):
    return action.help if action.required else super()._get_help_string(action)


_HELP = _DefaultsFormatter


class _BenchFormatter(argparse.RawDescriptionHelpFormatter, _DefaultsFormatter):
  """The module docstring as written; every option's help ends with its default."""


_DTYPES = ("float32", "bfloat16", "float16")
_MODEL_HELP = ("checkpoint directory, bundled model (kjv-llama-6m is trained on the King James "
               "Bible), preset name (random weights, no tokenizer) or HF model name in the local "
               "Hugging Face cache")

# Engine parameter names -> the flags that set them, for error messages.
GENERATE_FLAGS = {
    "max_new_tokens": "--max-new-tokens", "temperature": "--temperature", "top_k": "--top-k",
    "top_p": "--top-p", "seed": "--seed", "max_seq_len": "--max-seq-len",
    "tensor_parallel": "--tensor-parallel", "batch_buckets": "--batch-buckets",
    "batch_sizes": "--batch-buckets", "stop": "--stop", "batch_invariant": "--batch-invariant",
    "max_num_seqs": "--max-num-seqs"}
SERVE_FLAGS = {
    "max_seq_len": "--max-seq-len", "tensor_parallel": "--tensor-parallel",
    "batch_buckets": "--batch-buckets", "batch_sizes": "--batch-buckets",
    "max_num_seqs": "--max-num-seqs",
    "prompt_buckets": "--prompt-buckets", "max_waiting": "--max-waiting",
    "max_num_batched_tokens": "--max-num-batched-tokens", "token_buckets": "--token-buckets",
    "request_timeout": "--request-timeout", "batch_invariant": "--batch-invariant"}
PROFILE_FLAGS = {
    "max_seq_len": "--max-seq-len", "tensor_parallel": "--tensor-parallel",
    "position": "--position", "batch_buckets": "--batch", "batch_sizes": "--batch"}
BENCH_FLAGS = {
    "max_seq_len": "--max-seq-len", "batch_buckets": "--batch-buckets",
    "batch_sizes": "--batch-buckets", "prompt_buckets": "--prompt-buckets",
    "max_num_seqs": "--max-num-seqs",
    "max_num_batched_tokens": "--max-num-batched-tokens", "token_buckets": "--token-buckets",
    "max_new_tokens": "--output-len"}
# `bench` subcommand -> its module (`add_arguments(parser)`, `run(args) -> list[Row]`).
BENCHES = {"latency": bench_latency, "throughput": bench_throughput, "serve": bench_serve,
           "startup": bench_startup}


def _int_list(text: str) -> list[int]:
  try:
    return [int(x) for x in text.replace(",", " ").split()]
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected integers separated by commas, got {text!r}") from None


def _engine_flags(parser: argparse.ArgumentParser) -> None:
  """The engine options `generate` and `serve` share."""
  parser.add_argument("--dtype", default=None, choices=_DTYPES,
                      help="weight and compute dtype; None = auto (bfloat16 on GPU, float32 "
                           "elsewhere)")
  parser.add_argument("--max-num-seqs", type=int, default=None,
                      help="the most requests running at once (more wait); None = 256 on a GPU, "
                           "32 elsewhere (the largest --batch-buckets when given)")
  parser.add_argument("--batch-buckets", type=_int_list, default=None,
                      help="batch sizes of the static prefill executables, comma separated, "
                           "none above --max-num-seqs; None = "
                           f"{', '.join(map(str, DEFAULT_BATCH_BUCKETS))} (those up to "
                           "--max-num-seqs)")
  parser.add_argument("--max-seq-len", type=int, default=None,
                      help="KV cache length (prompt + new tokens); None = min(model context, "
                           "2048)")
  parser.add_argument("--tensor-parallel", type=int, default=1,
                      help="split the model over this many devices (cg_jax.core.sharding)")
  parser.add_argument("--batch-invariant", action="store_true",
                      help="a request's tokens do not depend on the other requests or the load "
                           "(EngineConfig.batch_invariant)")


def _engine_options(args) -> dict:
  """The engine keywords of `_engine_flags` (dtype only when given: None is the default)."""
  options = dict(batch_buckets=args.batch_buckets, max_num_seqs=args.max_num_seqs,
                 max_seq_len=args.max_seq_len, tensor_parallel=args.tensor_parallel,
                 batch_invariant=args.batch_invariant)
  if args.dtype is not None:
    options["dtype"] = args.dtype
  return options


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="python -m cg_jax", description=__doc__,
                                   formatter_class=_HELP)
  sub = parser.add_subparsers(dest="command", required=True)
  gen = sub.add_parser("generate", help="generate a continuation and print it with stats",
                       formatter_class=_HELP)
  gen.add_argument("--model", default=DEFAULT_MODEL, help=_MODEL_HELP)
  prompt = gen.add_mutually_exclusive_group(required=True)
  prompt.add_argument("--prompt", action="append",
                      help="prompt text (repeat for a batch); needs a tokenizer.json")
  prompt.add_argument("--prompt-ids", action="append", type=_int_list,
                      help="prompt token ids, comma separated (repeat for a batch)")
  gen.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate per prompt")
  gen.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature; 0 = greedy (then --top-k and --top-p do nothing)")
  gen.add_argument("--top-k", type=int, default=0,
                   help="sample among the k most likely tokens; 0 = off")
  gen.add_argument("--top-p", type=float, default=1.0,
                   help="sample among the most likely tokens of this total probability; 1 = off")
  gen.add_argument("--seed", type=int, default=None, help="sampling seed; None = random")
  gen.add_argument("--stop", action="append", metavar="TEXT",
                   help="finish a row when its text contains TEXT, cut before it (repeatable); "
                        "needs a tokenizer")
  _engine_flags(gen)
  output = gen.add_mutually_exclusive_group()
  output.add_argument("--stream", action="store_true",
                      help="print the text (or token ids) as it is produced; one prompt only")
  output.add_argument("--json", action="store_true", help="print one JSON object")

  srv = sub.add_parser("serve", help="serve the model over HTTP with OpenAI's API "
                       "(/v1/completions, /v1/chat/completions)", formatter_class=_HELP)
  srv.add_argument("--model", default=DEFAULT_MODEL, help=_MODEL_HELP)
  srv.add_argument("--served-model-name", default=None,
                   help="the name clients pass as `model`; None = --model as given")
  srv.add_argument("--host", default="127.0.0.1", help="address to listen on")
  srv.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free one)")
  _engine_flags(srv)
  srv.add_argument("--prompt-buckets", type=_int_list, default=None,
                   help="prompt lengths of the scoring executables (echo with logprobs), comma "
                        "separated; None = powers of two from 16 below --max-seq-len")
  srv.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="prompt tokens one engine step takes at most (the step executables' "
                        "largest token bucket); None = 2048 on a GPU, 256 elsewhere")
  srv.add_argument("--token-buckets", type=_int_list, default=None,
                   help="the step executables' token counts, comma separated, ascending, the "
                        "last the step budget (--max-num-batched-tokens); None = powers of two "
                        "from 8 on a GPU, from 1 elsewhere")
  srv.add_argument("--max-waiting", type=int, default=1024,
                   help="requests that may wait to run; more are answered 429")
  srv.add_argument("--request-timeout", type=float, default=None,
                   help="seconds a request may take (past it: 504); None = no limit")
  srv.add_argument("--api-servers", type=int, default=1,
                   help="front-end processes (HTTP, tokenizing, text) on the one port, all "
                        "served by one engine-core process")
  srv.add_argument("--graceful-timeout", type=float, default=30.0,
                   help="seconds in-flight requests may take to finish after SIGTERM / SIGINT")
  srv.add_argument("--log-level", default="info",
                   choices=("critical", "error", "warning", "info", "debug", "trace"),
                   help="uvicorn's log level")

  prof = sub.add_parser(
      "profile", help="launch accounting of decode steps from a real profile",
      description="Time decode steps and count their launches in a jax.profiler trace. The GPU "
                  "counters (kernels, graph launches, kernel launches outside graphs and "
                  "memcpys per step, GPU busy time, idle-gap share) are read from the GPU's "
                  "activity in the trace: on another backend they print as `n/a (needs a GPU)` "
                  "(null in --json, with gpu_counters false); the step timings and the host "
                  "dispatch time are measured on any backend.", formatter_class=_HELP)
  prof.add_argument("--model", required=True, help=_MODEL_HELP)
  prof.add_argument("--batch", type=int, default=1, help="batch size of the decode step")
  prof.add_argument("--graphs", default="xla-default", choices=tuple(GRAPH_MODES),
                    help="CUDA graph mode (cg_jax.core.graphs)")
  prof.add_argument("--layer-loop", default="unroll", choices=("scan", "unroll"),
                    help="run the layers as a lax.scan or unrolled")
  prof.add_argument("--dtype", default=None, choices=_DTYPES,
                    help="weight and compute dtype; None = auto (bfloat16 on GPU, float32 "
                         "elsewhere)")
  prof.add_argument("--max-seq-len", type=int, default=None,
                    help=f"KV cache length; None = min(model context, {DEFAULT_MAX_SEQ_LEN})")
  prof.add_argument("--position", type=int, default=None,
                    help="cache position of the timed steps; None = min(512, max seq len // 2)")
  prof.add_argument("--steps", type=int, default=10, help="decode steps to profile")
  prof.add_argument("--tensor-parallel", type=int, default=1,
                    help="split the model over this many devices (cg_jax.core.sharding)")
  prof.add_argument("--json", action="store_true",
                    help="print one JSON object (off a GPU: the GPU counters null, gpu_counters "
                         "false)")

  bench = sub.add_parser("bench", help="benchmarks on the public APIs, as rows of one schema "
                         "(cg_jax.bench.rows)", formatter_class=_HELP)
  kinds = bench.add_subparsers(dest="bench", required=True, metavar="BENCHMARK",
                               help="latency, throughput, serve or startup (each has --help)")
  for name, module in BENCHES.items():
    doc = module.__doc__ or name
    kind = kinds.add_parser(name, help=doc.split("\n\n")[0].split(": ", 1)[-1],
                            description=doc, formatter_class=_BenchFormatter)
    module.add_arguments(kind)
    kind.add_argument("--output", default=None, metavar="FILE",
                      help="append this run's rows to FILE as JSON lines")
    kind.add_argument("--system", default="cg_jax", help="the system named in the rows")
    kind.add_argument("--compare", action="append", default=[], metavar="FILE",
                      help="rows of earlier runs (JSON lines) to print beside this run's "
                           "(repeatable)")
  return parser


def _is_preset(model: str) -> bool:
  return model in PRESETS and not os.path.isdir(model)


def model_context(model: str) -> int:
  """The context length (max_position_embeddings) of a preset or checkpoint, read from its
  config without loading weights."""
  if _is_preset(model):
    return PRESETS[model].max_position_embeddings
  return hf.config_from_hf(hf.read_config(resolve_model(model))).max_position_embeddings


def profile_lengths(model: str, max_seq_len: int | None, position: int | None) -> tuple[int, int]:
  """`profile`'s (max_seq_len, position): None means min(model context, DEFAULT_MAX_SEQ_LEN), as
  `generate` and `serve` do, and half the cache, at most 512."""
  if max_seq_len is None:
    max_seq_len = min(model_context(model), DEFAULT_MAX_SEQ_LEN)
  if position is None:
    position = min(512, max_seq_len // 2)
  return max_seq_len, position


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
  print(f"warning: {message}", file=sys.stderr if file is None else file)


@contextlib.contextmanager
def _cli_warnings():
  """Python warnings shown as one `warning: MESSAGE` line on stderr (no source location); the
  engine's IgnoredSamplingWarning not at all: `_warn_greedy` says it in flag names."""
  with warnings.catch_warnings():
    warnings.showwarning = _show_warning
    warnings.simplefilter("ignore", IgnoredSamplingWarning)
    yield


@_cli_warnings()
def run_profile(args) -> int:
  max_seq_len, position = profile_lengths(args.model, args.max_seq_len, args.position)
  engine = Engine.from_pretrained(args.model, dtype=args.dtype, batch_buckets=[args.batch],
                                  prompt_buckets=[16], max_seq_len=max_seq_len,
                                  graphs=args.graphs, layer_loop=args.layer_loop,
                                  tensor_parallel=args.tensor_parallel)
  timing = profile.time_decode(engine, args.batch, position=position)
  report, trace = profile.profile_decode(engine, args.batch, position=position, steps=args.steps)
  gpu = on_gpu()
  result = dict(report.as_dict(gpu_counters=gpu), **timing, gpu_counters=gpu, trace=trace,
                graphs=args.graphs, layer_loop=args.layer_loop, max_seq_len=max_seq_len,
                position=position, device=str(engine.weights()["embed"].devices()))
  if args.json:
    print(json.dumps(result))
    return 0
  for key in ("step_us", "host_dispatch_wall_us", "pipelined_call_us", "kernels_per_step",
              "graph_launches_per_step",
              "kernel_launches_outside_graphs_per_step", "memcpy_per_step", "host_dispatch_us",
              "gpu_busy_us", "idle_gap_share"):
    shown = "n/a (needs a GPU)" if result[key] is None else f"{result[key]:10.2f}"
    print(f"{key:42s} {shown}")
  print(f"trace: {trace}")
  return 0


def _check_tokenizer(args) -> None:
  """Text prompts and --stop need a tokenizer: say so before building anything."""
  if args.prompt is None and not args.stop:
    return
  if _is_preset(args.model):
    why = "presets have random weights and none"
  else:
    directory = resolve_model(args.model)
    if os.path.isfile(os.path.join(directory, "tokenizer.json")):
      return
    why = f"no tokenizer.json in {directory}"
  if args.prompt is not None:
    raise ValueError(f"the model {args.model!r} has no tokenizer ({why}): use --prompt-ids or a "
                     "checkpoint directory with tokenizer.json")
  raise ValueError(f"--stop needs a tokenizer and the model {args.model!r} has none ({why}): "
                   "drop --stop or use a checkpoint directory with tokenizer.json")


def _warn_greedy(args) -> None:
  """--top-k, --top-p and --seed only shape sampling; at temperature 0 the decode is greedy."""
  if args.temperature != 0:
    return
  ignored = [flag for flag, off in (("--top-k", args.top_k == 0), ("--top-p", args.top_p == 1.0),
                                    ("--seed", args.seed is None)) if not off]
  if ignored:
    *rest, last = ignored
    flags, verb = (f"{', '.join(rest)} and {last}", "have") if rest else (last, "has")
    print(f"warning: {flags} {verb} no effect without --temperature > 0 (decoding greedily)",
          file=sys.stderr)


def _stream(engine, inputs, prefix: str, params: SamplingParams) -> dict[str, float]:
  """Print one prompt's continuation as it is produced; returns the stats timed here."""
  print(f"[0] {prefix}", end="", flush=True)
  start = time.perf_counter()
  first = None
  count = 0
  for chunk in engine.stream(inputs, params=params):
    if first is None:
      first = time.perf_counter()
    if chunk.texts is not None:  # the last chunk may carry held-back text and no token
      print(chunk.texts.get(0, ""), end="", flush=True)
    for token in chunk.tokens.values():
      if chunk.texts is None:
        print(f"{' ' if count else ''}{token}", end="", flush=True)
      count += 1
  end = time.perf_counter()
  print()
  return {"ttft_s": first - start, "per_token_s": (end - first) / max(count - 1, 1),
          "tokens_per_s": count / (end - start)}


@_cli_warnings()
def generate(args) -> int:
  inputs = args.prompt if args.prompt is not None else args.prompt_ids
  if args.stream and len(inputs) > 1:
    raise ValueError(f"--stream takes one prompt, got {len(inputs)}; drop --stream to generate "
                     "a batch")
  _check_tokenizer(args)
  # The flags' own checks before the model loads.
  params = SamplingParams(max_new_tokens=args.max_new_tokens, do_sample=args.temperature > 0,
                          temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                          seed=args.seed, stop=args.stop or None)
  engine = Engine.from_pretrained(args.model, **_engine_options(args))
  # Validate before compiling anything (a flag that is wrong gets an error, not a warning), then
  # compile only the buckets this request needs.
  request = engine.validate(inputs, params=params)
  _warn_greedy(args)
  start = time.perf_counter()
  # A step holds at most every prompt token and a decode token per request.
  compile_times = engine.warmup(max_step_tokens=sum(map(len, request.rows)) + len(request.rows),
                                draws=params.do_sample, progress=not args.json)
  # Wall time: the executables compile in parallel, so their compile times add up to more.
  warmup = dict(warmup_s=time.perf_counter() - start, compile_s=sum(compile_times.values()),
                executables=len(compile_times))
  prefixes = args.prompt if args.prompt is not None else [""] * len(inputs)
  if args.stream:
    stats = _stream(engine, inputs, prefixes[0], params)
  else:
    result = engine.generate(inputs, params=params)
    stats = result.stats
    if args.json:
      # (compiles_since_warmup: executables the request still had to build, 0 when the
      # warm-up foresaw its steps)
      print(json.dumps({"tokens": list(result), "texts": result.texts,
                        "stats": dict(stats, **warmup, compiles_since_warmup=engine.stats()[
                            "compiles_since_warmup"])}))
      return 0
    for i, tokens in enumerate(result):
      shown = result.texts[i] if result.texts is not None else " ".join(map(str, tokens))
      print(f"[{i}] {prefixes[i]}{shown}")
  ttft = f"time to first token {stats['ttft_s'] * 1e3:.1f} ms"
  if len(inputs) > 1:
    ttft += f" (last row {stats['ttft_s_last'] * 1e3:.1f} ms)"
  print(f"{ttft} | per token {stats['per_token_s'] * 1e3:.2f} ms | "
        f"{stats['tokens_per_s']:.1f} tokens/s | warmup {warmup['warmup_s']:.1f} s "
        f"({warmup['executables']} executables)")
  return 0


def serve(args) -> int:
  """Listen first (a busy --port fails before the model loads or anything compiles: 2), check
  the engine options without the device (a bad one: 2, naming its flag), then start the
  engine-core process and the front ends (`cg_jax.serving.launch`), answering while the core
  warms up; a failed warm-up or the core's death is 1."""
  if server is None:
    print(f"error: `serve` needs the serve extra: pip install 'cg_jax[serve]' ({SERVER_MISSING})",
          file=sys.stderr)
    return 2
  try:
    sock = server.listen(args.host, args.port)
  except server.ListenError as error:
    value = args.port if error.param == "port" else args.host
    print(f"error: --{error.param} {value}: {error}", file=sys.stderr)
    return 2
  try:
    server.load_chat_template(args.model)  # (a model that is not there fails here, at once)
    engine_options = dict(prompt_buckets=args.prompt_buckets, max_waiting=args.max_waiting,
                          max_num_batched_tokens=args.max_num_batched_tokens,
                          token_buckets=args.token_buckets, **_engine_options(args))
    # (here, not in the core process: the server must not listen, then fail its warm-up)
    Engine.check_options(args.model, **engine_options)
    return launch.serve_model(
        args.model, sock=sock, served_model_name=args.served_model_name,
        engine_options=engine_options,
        api_servers=args.api_servers, request_timeout=args.request_timeout,
        graceful_timeout=args.graceful_timeout, log_level=args.log_level)
  finally:
    sock.close()


@_cli_warnings()
def run_bench(args) -> int:
  """Run one benchmark; append its rows to --output; print them (and --compare's) as a table."""
  try:  # (a missing or foreign file fails before anything runs)
    earlier = bench_rows.read(args.compare)
  except (OSError, ValueError, TypeError) as error:
    raise ValueError(f"--compare: cannot read rows from {args.compare}: {error}") from error
  folder = os.path.dirname(os.path.abspath(args.output)) if args.output else None
  if folder is not None and not os.path.isdir(folder):
    raise ValueError(f"--output {args.output}: no directory {folder} to write it in")
  try:
    found = BENCHES[args.bench].run(args)
  except NotImplementedError as error:
    print(f"error: bench {args.bench}: {error}", file=sys.stderr)
    return 1
  bench_rows.write(args.output, found)
  print(bench_rows.compare([*earlier, *found]))
  return 0


def flag_names(message: str, flags: dict[str, str], prompt_flag: str = "--prompt-ids") -> str:
  """An engine error message with its parameter names replaced by the CLI flags that set them:
  `input_ids[0][1]` -> `--prompt-ids #1, token 2`, `prompt 0` -> `--prompt-ids #1`,
  `stop[0]` -> `--stop #1`, `top_k` -> `--top-k`, ..."""
  message = re.sub(r"\binput_ids\[(\d+)\]\[(\d+)\]",
                   lambda m: f"{prompt_flag} #{int(m[1]) + 1}, token {int(m[2]) + 1}", message)
  message = re.sub(r"\binput_ids\[(\d+)\]|\bprompt (\d+)\b",
                   lambda m: f"{prompt_flag} #{int(m[1] or m[2]) + 1}", message)
  message = re.sub(r"\bstop\[(\d+)\]", lambda m: f"--stop #{int(m[1]) + 1}", message)
  names = dict(flags, input_ids=prompt_flag)
  # Whole names only, and not ones already written as flags (`--stop`).
  return re.sub(r"(?<![-\w])(" + "|".join(names) + r")\b", lambda m: names[m[1]], message)


def main(argv: list[str] | None = None) -> int:
  args = build_parser().parse_args(argv)
  try:
    if args.command == "generate":
      return generate(args)
    if args.command == "profile":
      return run_profile(args)
    if args.command == "serve":
      return serve(args)
    if args.command == "bench":
      return run_bench(args)
  except (ValueError, TypeError) as err:
    if args.command == "generate":
      prompt_flag = "--prompt" if args.prompt is not None else "--prompt-ids"
      if isinstance(err, ParamError) and err.param in GENERATE_FLAGS:
        message = err.message(GENERATE_FLAGS[err.param])
      else:
        message = flag_names(str(err), GENERATE_FLAGS, prompt_flag)
    elif args.command == "serve":
      message = flag_names(str(err), SERVE_FLAGS)
    elif args.command == "bench":
      message = flag_names(str(err), BENCH_FLAGS)
    else:
      message = flag_names(str(err), PROFILE_FLAGS)
    print(f"error: {message}", file=sys.stderr)
    return 2
  return 1
