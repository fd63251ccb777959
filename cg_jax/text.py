"""Tokenizer loading (Hugging Face `tokenizers`, from a checkpoint's tokenizer.json)."""

from __future__ import annotations

import os

from tokenizers import Tokenizer


def load_tokenizer(path: str | os.PathLike | None) -> Tokenizer | None:
  """The tokenizer in `path`/tokenizer.json, or None when there is none."""
  if path is None:
    return None
  file = os.path.join(path, "tokenizer.json")
  return Tokenizer.from_file(file) if os.path.isfile(file) else None


def decode(tokenizer: Tokenizer, ids: list[int]) -> str:
  return tokenizer.decode(ids, skip_special_tokens=True)
