"""Chat templates: a checkpoint's Jinja `chat_template`, rendered the way Hugging Face
transformers' `tokenizer.apply_chat_template(messages, tokenize=False)` renders it.

The rules are transformers': a sandboxed, immutable Jinja environment with `trim_blocks` and
`lstrip_blocks`, the `loopcontrols` extension and a pass-through `{% generation %}` tag; the
globals `raise_exception(message)` (a `TemplateError`), `strftime_now(format)`, `dict` and
`namespace` (no underscore-prefixed attributes); a `tojson` filter that keeps non-ASCII
characters and takes `indent`, `separators` and `sort_keys`. The template sees `messages`
(each a dict, keys whose value is None dropped), `tools` and `documents` (None),
`add_generation_prompt` and the tokenizer's named special tokens (`bos_token`, `eos_token`, ...)
from tokenizer_config.json.

The template comes from `chat_template.jinja` in the checkpoint directory, or else the
`chat_template` entry of tokenizer_config.json (a string, or a list of {"name", "template"}
whose "default" one is used).
"""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import jinja2.utils

# The named special tokens transformers passes to a template (SPECIAL_TOKENS_ATTRIBUTES).
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                  "mask_token")


class TemplateError(ValueError):
  """The template could not be compiled or rendered (including its own `raise_exception`)."""


class _Generation(jinja2.ext.Extension):
  """`{% generation %}...{% endgeneration %}` renders its body (transformers uses it to mark
  assistant tokens)."""

  tags: ClassVar[set[str]] = {"generation"}

  def parse(self, parser):
    lineno = next(parser.stream).lineno
    body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
    return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

  def _render(self, caller):
    return caller()


class _Namespace(jinja2.utils.Namespace):
  """Jinja's `namespace`, refusing underscore-prefixed attributes."""

  def __init__(*args, **kwargs):  # Jinja's own signature trick: `namespace(self=...)` works
    self, args = args[0], args[1:]
    attrs = dict(*args, **kwargs)
    for name in attrs:
      _Namespace._check(name)
    jinja2.utils.Namespace.__init__(self, attrs)

  def __setitem__(self, name, value):
    _Namespace._check(name)
    jinja2.utils.Namespace.__setitem__(self, name, value)

  @staticmethod
  def _check(name):
    if isinstance(name, str) and name.startswith("_"):
      raise jinja2.exceptions.SecurityError(
          f"chat templates cannot store underscore-prefixed attributes on a namespace, got "
          f"{name!r}")


class _Dict:
  """`dict(...)` and `dict.fromkeys(...)` inside templates, without the type itself."""

  def __call__(self, *args, **kwargs):
    return dict(*args, **kwargs)

  def fromkeys(self, *args, **kwargs):
    return dict.fromkeys(*args, **kwargs)


def _raise_exception(message):
  raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
  return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                    sort_keys=sort_keys)


def _strftime_now(format):
  return datetime.datetime.now().strftime(format)


def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
  env = jinja2.sandbox.ImmutableSandboxedEnvironment(
      trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols])
  env.filters["tojson"] = _tojson
  env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_Dict(),
                     namespace=_Namespace)
  return env


def _plain(value: Any) -> Any:
  """JSON-like data rebuilt from plain types, so the sandbox sees no foreign methods."""
  if value is None or type(value) in (str, int, float, bool):
    return value
  if isinstance(value, str):
    return str.__str__(value)
  if isinstance(value, int):
    return int.__int__(value)
  if isinstance(value, float):
    return float.__float__(value)
  if isinstance(value, Mapping):
    return {_plain(k): _plain(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_plain(v) for v in value]
  return f"<{type(value).__name__}>"


def _token_text(value) -> str | None:
  """A special token as tokenizer_config.json stores it: a string or an AddedToken dict."""
  if isinstance(value, str):
    return value
  if isinstance(value, Mapping) and isinstance(value.get("content"), str):
    return value["content"]
  return None


class ChatTemplate:
  """A compiled chat template and the special tokens it is rendered with.

  Args:
    source: the Jinja template text.
    special_tokens: {name: text} of the tokenizer's named special tokens (`bos_token`, ...).
  Raises:
    TemplateError: the template does not compile.
  """

  def __init__(self, source: str, special_tokens: Mapping[str, str] | None = None):
    if not isinstance(source, str) or not source:
      raise TemplateError(f"a chat template must be a non-empty string, got {source!r}")
    try:
      self._template = _environment().from_string(source)
    except jinja2.exceptions.TemplateError as error:
      raise TemplateError(f"the chat template does not compile: {error}") from error
    self.source = source
    self.special_tokens = dict(special_tokens or {})

  @classmethod
  def from_directory(cls, directory: str | os.PathLike) -> ChatTemplate | None:
    """The template of a checkpoint directory (see the module docstring), or None when it has
    none."""
    config = {}
    path = os.path.join(directory, "tokenizer_config.json")
    if os.path.isfile(path):
      with open(path, encoding="utf-8") as f:
        config = json.load(f)
    special = {name: text for name in SPECIAL_TOKENS
               if (text := _token_text(config.get(name))) is not None}
    jinja_file = os.path.join(directory, "chat_template.jinja")
    if os.path.isfile(jinja_file):
      with open(jinja_file, encoding="utf-8") as f:
        return cls(f.read(), special)
    source = config.get("chat_template")
    if isinstance(source, list):
      named = {t.get("name"): t.get("template") for t in source if isinstance(t, Mapping)}
      source = named.get("default")
    if not source:
      return None
    return cls(source, special)

  def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
             **variables) -> str:
    """The prompt text of `messages` (dicts with "role" and "content"); `variables` are extra
    template variables, which override the special tokens.

    Raises:
      TemplateError: the template failed, or called `raise_exception`.
    """
    chat = [{k: v for k, v in _plain(m).items() if v is not None} for m in messages]
    context = _plain({**self.special_tokens, **variables})
    try:
      return self._template.render(messages=chat, tools=None, documents=None,
                                   add_generation_prompt=add_generation_prompt, **context)
    except jinja2.exceptions.TemplateError as error:
      raise TemplateError(str(error)) from error
    except (TypeError, ValueError, KeyError, IndexError, AttributeError) as error:
      raise TemplateError(f"the chat template failed: {type(error).__name__}: {error}") from error
