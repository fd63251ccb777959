"""Incremental detokenization (`RowText`): the same deltas as decoding every id so far on each
token, for byte-level and metaspace tokenizers with and without stop strings, at linear cost."""

from __future__ import annotations

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from cg_jax import text
from cg_jax.generation import RowText
from cg_jax.hub import resolve_model

CORPUS = ["In the beginning God created the heaven and the earth.",
          "And the earth was without form, and void; naïve café déjà vu — ünïcödé ✓ 東京",
          "And God said, Let there be light: and there was light."]


class QuadraticRowText:
  """The reference: every push decodes all ids so far (the behaviour RowText replaced, less one
  bug: it looked for the start of a stop string before dropping a trailing incomplete
  character, so the start of "ïcödé" was shown while "ö" was half there)."""

  def __init__(self, tokenizer, stop):
    self.tokenizer, self.stop, self.ids, self.text, self.stopped = tokenizer, stop, [], "", False

  def push(self, token: int) -> str:
    self.ids.append(token)
    full = text.decode(self.tokenizer, self.ids)
    found = [i for i in (full.find(s) for s in self.stop) if i >= 0]
    if found:
      self.stopped = True
      return self._show(full[:min(found)])
    whole = full.rstrip("\ufffd")
    held = max((k for s in self.stop for k in range(1, len(s)) if whole.endswith(s[:k])),
               default=0)
    return self._show(whole[:len(whole) - held])

  def finish(self) -> str:
    return "" if self.stopped else self._show(text.decode(self.tokenizer, self.ids))

  def _show(self, visible: str) -> str:
    if not visible.startswith(self.text):
      return ""
    delta, self.text = visible[len(self.text):], visible
    return delta


class _Bytes:
  """Single UTF-8 bytes as tokens; incomplete sequences decode to U+FFFD."""

  def decode(self, ids, skip_special_tokens=True):
    return bytes(ids).decode("utf-8", errors="replace")

  def encode_ids(self, line: str) -> list[int]:
    return list(line.encode())


class _Counting:
  """A tokenizer that counts the ids it is asked to decode."""

  def __init__(self, tokenizer):
    self.tokenizer, self.decoded_ids = tokenizer, 0

  def decode(self, ids, skip_special_tokens=True):
    self.decoded_ids += len(ids)
    return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def _metaspace() -> Tokenizer:
  """A SentencePiece-style BPE (words start with "▁", the decoder strips a leading space)."""
  tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
  tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
  tokenizer.decoder = decoders.Metaspace()
  tokenizer.train_from_iterator(CORPUS * 4, trainers.BpeTrainer(
      vocab_size=200, special_tokens=["<unk>", "<s>"], show_progress=False))
  return tokenizer


def _tokenizers():
  bundled = Tokenizer.from_file(f"{resolve_model('kjv-llama-6m')}/tokenizer.json")
  return {"byte-level": bundled, "metaspace": _metaspace(), "bytes": _Bytes()}


def _ids(tokenizer, line: str) -> list[int]:
  if isinstance(tokenizer, _Bytes):
    return tokenizer.encode_ids(line)
  return tokenizer.encode(line).ids


def _follow(row, ids):
  return [row.push(token) for token in ids], row.finish()


@pytest.mark.parametrize("name", ["byte-level", "metaspace", "bytes"])
def test_deltas_equal_decoding_every_id_so_far(name):
  tokenizer = _tokenizers()[name]
  rng = np.random.default_rng(7)
  vocab = 256 if isinstance(tokenizer, _Bytes) else tokenizer.get_vocab_size()
  sequences = [_ids(tokenizer, line) for line in CORPUS]
  # Random ids too: byte-level pieces that split characters, special tokens, unknowns.
  sequences += [list(rng.integers(0, vocab, 60)) for _ in range(6)]
  checked = 0
  for ids in sequences:
    full = text.decode(tokenizer, ids)
    stops = [(), ("STOP",)] + [(full[a:a + n],) for a, n in
                               zip(rng.integers(0, max(len(full) - 4, 1), 4), (1, 2, 3, 5))]
    stops.append(tuple(full[a:a + 3] for a in rng.integers(0, max(len(full) - 3, 1), 2)))
    for stop in stops:
      stop = tuple(s for s in stop if s)
      expected = _follow(QuadraticRowText(tokenizer, stop), ids)
      row = RowText(tokenizer, stop)
      assert _follow(row, ids) == expected, (name, ids, stop)
      shown = "".join(expected[0]) + expected[1]
      assert row.text == shown
      if not stop:
        assert shown == full
      checked += 1
  assert checked > 50


def test_a_4096_token_stream_decodes_in_linear_time():
  """Each push decodes a window of the newest ids, not all of them: 4,096 tokens ask the
  tokenizer for O(n) ids in all (every id so far on each token would be n (n + 1) / 2, 8.4M)."""
  base = _tokenizers()["byte-level"]
  line = " ".join(CORPUS)
  ids = (_ids(base, line) * 400)[:4096]
  counting = _Counting(base)
  row = RowText(counting, ("no such stop",))
  shown = "".join(row.push(token) for token in ids) + row.finish()
  assert shown == text.decode(base, ids)
  assert counting.decoded_ids <= 8 * len(ids), counting.decoded_ids
