"""The options the bench subcommands share, their checks (a ValueError naming the flag and the
allowed range, which `python -m cg_jax` prints as `error: ...` and exits 2) and the making of a
`Row` from a run's workload and figures."""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from typing import Any

from cg_jax.bench import rows
from cg_jax.hub import DEFAULT_MODEL

DTYPES = ("float32", "bfloat16", "float16")
MODEL_HELP = ("checkpoint directory, bundled model, preset name (random weights) or HF model name "
              "in the local Hugging Face cache")


def add_model_arguments(parser: argparse.ArgumentParser, *, dtype: bool = True) -> None:
  """--model, (--dtype,) --max-seq-len, --max-num-seqs, --batch-buckets, --prompt-buckets,
  --max-num-batched-tokens and --token-buckets."""
  parser.add_argument("--model", default=DEFAULT_MODEL, help=MODEL_HELP)
  if dtype:
    parser.add_argument("--dtype", default=None, choices=DTYPES,
                        help="weight and compute dtype; None = auto (bfloat16 on GPU, float32 "
                             "elsewhere)")
  parser.add_argument("--max-seq-len", type=int, default=None,
                      help="KV cache length (prompt + output tokens); None = the engine's "
                           "default, min(model context, 2048)")
  parser.add_argument("--max-num-seqs", type=int, default=None,
                      help="the most requests running at once; None = the engine's default (256 "
                           "on a GPU, 32 elsewhere)")
  parser.add_argument("--batch-buckets", default=None,
                      help="batch sizes to compile, comma separated; None = see each benchmark")
  parser.add_argument("--prompt-buckets", default=None,
                      help="prompt lengths of the static prefill and scoring executables, comma "
                           "separated; None = see each benchmark")
  parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                      help="prompt tokens one engine step takes at most; None = the engine's "
                           "default")
  parser.add_argument("--token-buckets", default=None,
                      help="the step executables' token counts, comma separated, ascending, the "
                           "last the step budget; None = the engine's default")


def integer(flag: str, value: int | None, minimum: int = 1, maximum: int | None = None,
            optional: bool = False) -> int | None:
  """`value` when it lies in [minimum, maximum] (None allowed with `optional`)."""
  if value is None and optional:
    return None
  allowed = f"{minimum} to {maximum}" if maximum is not None else f">= {minimum}"
  if not isinstance(value, int) or value < minimum or (maximum is not None and value > maximum):
    raise ValueError(f"{flag} must be an integer {allowed}, got {value!r}")
  return value


def int_list(flag: str, text: str | None, minimum: int = 1) -> list[int] | None:
  """Comma-separated integers, each >= minimum (None: None)."""
  if text is None:
    return None
  try:
    values = [int(x) for x in str(text).replace(",", " ").split()]
  except ValueError:
    raise ValueError(f"{flag} must be integers >= {minimum} separated by commas, got "
                     f"{text!r}") from None
  if not values:
    raise ValueError(f"{flag} must name at least one integer >= {minimum}, got {text!r}")
  for value in values:
    if value < minimum:
      raise ValueError(f"{flag} values must be >= {minimum}, got {value} in {text!r}")
  return values


def length_range(flag: str, text: str, minimum: int = 1) -> tuple[int, int]:
  """A fixed length `N` or an inclusive range `MIN:MAX`, minimum <= MIN <= MAX."""
  parts = str(text).split(":")
  try:
    low, high = (int(parts[0]), int(parts[-1])) if len(parts) <= 2 else (None, None)
  except ValueError:
    low = high = None
  if low is None:
    raise ValueError(f"{flag} must be a length N or an inclusive range MIN:MAX, got {text!r}")
  if low < minimum or high < low:
    raise ValueError(f"{flag} must be N >= {minimum} or MIN:MAX with {minimum} <= MIN <= MAX, "
                     f"got {text!r}")
  return low, high


def rate(flag: str, text: str) -> float:
  """A positive number of requests per second, or `inf`."""
  try:
    value = float(text)
  except ValueError:
    value = math.nan
  if not value > 0:  # (NaN too)
    raise ValueError(f"{flag} must be a number of requests per second > 0, or inf (all at "
                     f"once), got {text!r}")
  return value


def fits(prompt_len: int, output_len: int, max_seq_len: int, prompt_flag: str = "--prompt-len",
         output_flag: str = "--output-len") -> None:
  """The prompt and its output fit the KV cache."""
  if prompt_len + output_len > max_seq_len:
    raise ValueError(f"{prompt_flag} {prompt_len} + {output_flag} {output_len} must be at most "
                     f"the KV cache length, --max-seq-len {max_seq_len}")


def engine_options(args, batch_buckets: Sequence[int] | None,
                   prompt_buckets: Sequence[int] | None) -> dict[str, Any]:
  """`Engine.from_pretrained`'s keywords (the buckets when given; dtype when given)."""
  options: dict[str, Any] = dict(max_seq_len=integer("--max-seq-len", args.max_seq_len, 2,
                                                     optional=True))
  if batch_buckets is not None:
    options["batch_buckets"] = tuple(batch_buckets)
  if prompt_buckets is not None:
    options["prompt_buckets"] = tuple(prompt_buckets)
  if getattr(args, "dtype", None) is not None:
    options["dtype"] = args.dtype
  if getattr(args, "max_num_batched_tokens", None) is not None:
    options["max_num_batched_tokens"] = integer("--max-num-batched-tokens",
                                                args.max_num_batched_tokens)
  if getattr(args, "max_num_seqs", None) is not None:
    options["max_num_seqs"] = integer("--max-num-seqs", args.max_num_seqs)
  if getattr(args, "token_buckets", None) is not None:
    options["token_buckets"] = tuple(int_list("--token-buckets", args.token_buckets))
  return options


def row(args, workload: dict[str, Any], figures: dict[str, float],
        device: str | None = None) -> rows.Row:
  """This run's row: `--system`, `--model`, the workload (with `--max-num-batched-tokens`,
  `--max-num-seqs` and `--token-buckets` when given: rows of the default stay comparable with
  earlier ones), the figures and where it ran."""
  workload = dict(workload)
  for option in ("max_num_batched_tokens", "max_num_seqs", "token_buckets"):
    if getattr(args, option, None) is not None:
      workload[option] = getattr(args, option)
  return rows.Row(system=args.system, model=args.model, workload=workload,
                  figures={k: float(v) for k, v in figures.items()}, **rows.where(device))
