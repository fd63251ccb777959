"""Generation results and their text: `GenerationResult`, `StreamChunk`, and `RowText`, which
follows a row's text token by token (deltas that never split a character or show the start of a
stop string). A row with stop strings ends once its text holds one: the text is cut before it,
the tokens end with the one that completed it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from cg_jax import text


@dataclasses.dataclass(frozen=True)
class StreamChunk:
  """Tokens produced in one step, {row index in the request: token id}, and with a tokenizer the
  rows' text deltas. A last chunk with no tokens may carry text held back until the end (an
  incomplete character, or what might have begun a stop string)."""

  step: int
  tokens: dict[int, int]
  texts: dict[int, str] | None = None


class GenerationResult(list):
  """The new token ids per prompt (a list of lists), with `.texts` and `.stats` attached."""

  def __init__(self, tokens: list[list[int]], texts: list[str] | None, stats: dict[str, Any]):
    super().__init__(tokens)
    self.texts = texts
    self.stats = stats


class RowText:
  """One row's text, decoded as tokens arrive; `push` returns what may be shown so far, never
  a split character or the start of a stop string."""

  def __init__(self, tokenizer, stop: tuple[str, ...]):
    self.tokenizer, self.stop = tokenizer, stop
    self.ids: list[int] = []
    self.text = ""  # shown so far
    self.stopped = False

  def push(self, token: int) -> str:
    self.ids.append(token)
    full = text.decode(self.tokenizer, self.ids)
    found = [i for i in (full.find(s) for s in self.stop) if i >= 0]
    if found:
      self.stopped = True
      return self._show(full[:min(found)])
    held = max((k for s in self.stop for k in range(1, len(s)) if full.endswith(s[:k])),
               default=0)
    # A trailing U+FFFD is an incomplete UTF-8 sequence until the next token completes it.
    return self._show(full[:len(full) - held].rstrip("\ufffd"))

  def finish(self) -> str:
    """What was held back, once the row has ended."""
    return "" if self.stopped else self._show(text.decode(self.tokenizer, self.ids))

  def _show(self, visible: str) -> str:
    if not visible.startswith(self.text):
      return ""  # the decoded prefix changed (a byte sequence completed): wait for consistency
    delta, self.text = visible[len(self.text):], visible
    return delta


def final_text(tokenizer, tokens: list[int], stop: tuple[str, ...]) -> str:
  """A finished row's text: decoded once, or followed token by token and cut before its first
  stop string."""
  if not stop:
    return text.decode(tokenizer, tokens)
  row = RowText(tokenizer, stop)
  for token in tokens:
    row.push(token)
  row.finish()
  return row.text
