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
  a split character or the start of a stop string.

  Decoding is incremental, so a row of n tokens costs O(n) (not a decode of every id so far per
  token): each push decodes a window of ids, from the start of the last committed piece
  (context that keeps a tokenizer's word-start spaces right) to the newest, and takes the text
  past the context as new. The new text is committed once it ends in a whole character (no
  trailing U+FFFD); until then its complete characters may be shown, and the window grows.
  Stop strings are searched in the text not yet shown only: what is shown never ends with the
  start of a stop string, so none can begin inside it.
  """

  def __init__(self, tokenizer, stop: tuple[str, ...]):
    self.tokenizer, self.stop = tokenizer, stop
    self.ids: list[int] = []
    self.stopped = False
    self._shown: list[str] = []  # the pieces shown so far
    self._context = 0  # ids[_context:_committed] decode to the window's context
    self._committed = 0  # ids before this are in committed text
    self._unshown = ""  # committed text not shown yet (what might begin a stop string)
    self._early = ""  # the start of the uncommitted text, shown already

  @property
  def text(self) -> str:
    """The text shown so far."""
    return "".join(self._shown)

  def push(self, token: int) -> str:
    self.ids.append(token)
    new = self._new_text()
    if new and not new.endswith("\ufffd"):  # whole characters: commit them
      self._context, self._committed = self._committed, len(self.ids)
      pending, new = self._take(new), ""
      self._unshown += pending
    # The complete characters of the uncommitted text, past what was shown of it.
    partial = new.rstrip("\ufffd")
    if not partial.startswith(self._early):
      return ""  # the uncommitted text changed its start (a byte sequence completed): wait
    candidate = self._unshown + partial[len(self._early):]
    found = [i for i in (candidate.find(s) for s in self.stop) if i >= 0]
    if found:
      self.stopped = True
      return self._show(candidate[:min(found)], partial)
    held = max((k for s in self.stop for k in range(1, len(s)) if candidate.endswith(s[:k])),
               default=0)
    return self._show(candidate[:len(candidate) - held], partial)

  def finish(self) -> str:
    """What was held back, once the row has ended."""
    if self.stopped:
      return ""
    rest = self._unshown + self._take(self._new_text())
    self._unshown = ""
    self._shown.append(rest)
    return rest

  def _new_text(self) -> str:
    """The text of ids[_committed:]: the window's decode past its context's."""
    context = text.decode(self.tokenizer, self.ids[self._context:self._committed])
    return text.decode(self.tokenizer, self.ids[self._context:])[len(context):]

  def _take(self, new: str) -> str:
    """`new` (the uncommitted text, now committed or final) less its start shown already."""
    early, self._early = self._early, ""
    return new[len(early):]

  def _show(self, visible: str, partial: str) -> str:
    """Show `visible` (the start of the unshown committed text, then of `partial`)."""
    if len(visible) <= len(self._unshown):
      self._unshown = self._unshown[len(visible):]
    else:
      self._early += visible[len(self._unshown):]
      self._unshown = ""
    self._shown.append(visible)
    return visible


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
