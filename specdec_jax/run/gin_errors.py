"""Gin's parse and binding errors as one line naming the binding, where it was
written and, for a misspelling, the setting probably meant.
"""

from __future__ import annotations

import difflib
import re
import tokenize
from pathlib import Path
from typing import Mapping, Optional, Sequence

# gin's messages (gin-config 0.5): an unknown parameter, an unknown configurable.
_NO_PARAM = re.compile(r"Configurable '([\w.]+)' doesn't have a parameter named '(\w+)'")
_NO_CONFIGURABLE = re.compile(r"No configurable matching '([\w.]+)'")
_BAD_TOKEN = re.compile(r"Failed to parse token '([^']*)'")
_WHERE = re.compile(r"In (?:bindings string|file \"([^\"]+)\"),? line (\d+)")


def _statement(source: Optional[str], line: Optional[int], files: Sequence[str],
               bindings: Sequence[str]) -> tuple[str, str]:
  """(where, text) of the statement at ``line`` of ``source`` (None: --gin_bindings)."""
  if line is None:
    return "", ""
  if source is None:
    lines = "\n".join(bindings).splitlines()
    where = "--gin_bindings"
  else:
    match = [f for f in files if Path(f).name == Path(source).name or f == source]
    path = Path(match[0] if match else source)
    lines = path.read_text().splitlines() if path.is_file() else []
    where = f"{path}, line {line}"
  text = lines[line - 1].strip() if 0 < line <= len(lines) else ""
  return where, text


def _suggest(word: str, choices: Sequence[str]) -> str:
  close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
  return f"; did you mean {close[0]!r}?" if close else ""


def nearest_path(given: str, candidates: Sequence[str]) -> Optional[str]:
  """The candidate closest to a mistyped ``given`` (path, then file name), or None."""
  close = difflib.get_close_matches(given, list(candidates), n=1, cutoff=0.6)
  if close:
    return close[0]
  by_name = {}
  for c in candidates:
    by_name.setdefault(Path(c).name, c)
  close = difflib.get_close_matches(Path(given).name, list(by_name), n=1, cutoff=0.7)
  return by_name[close[0]] if close else None


def explain(e: BaseException, files: Sequence[str], bindings: Sequence[str],
            configurables: Mapping[str, Sequence[str]]) -> Optional[Exception]:
  """A one-line error for gin's ``e`` (None: not a parse or binding error);
  ``configurables``: name -> parameter names, for "did you mean"."""
  text = str(e)
  if isinstance(e, SyntaxError):
    source = e.filename if e.filename not in (None, "", "<string>") else None
    where, stmt = _statement(source, e.lineno, files, bindings)
    token = _BAD_TOKEN.search(text)
    if token:
      value = token.group(1)
      hint = (f" (a string needs quotes: '{value}')" if re.fullmatch(r"[A-Za-z_][\w./-]*", value)
              else "")
      return ValueError(f"{where}: cannot parse the value {value!r} in {stmt!r}{hint}")
    return ValueError(f"{where}: cannot parse {stmt!r}: {text.splitlines()[0]}")
  if isinstance(e, tokenize.TokenError):
    return ValueError(f"gin config: unbalanced brackets or quotes in --config/--gin_bindings "
                      f"({text})")
  if isinstance(e, OSError) and text.startswith("Unable to open file"):
    name = re.search(r"Unable to open file: (.*?)\. Searched", text)
    return FileNotFoundError(f"gin include: no config file {name.group(1) if name else text!r} "
                             "(looked in the working directory and the repository root)")
  if not isinstance(e, (ValueError, KeyError)):
    return None
  m = _WHERE.search(text)
  where, stmt = _statement(m.group(1), int(m.group(2)), files, bindings) if m else ("", "")
  prefix = f"{where}: {stmt!r}: " if stmt else ""
  m = _NO_PARAM.search(text)
  if m:
    name, param = m.group(1), m.group(2)
    fields = configurables.get(name.split(".")[-1], ())
    return ValueError(f"{prefix}{name} has no setting {param!r}{_suggest(param, fields)} "
                      "(--help lists every setting)")
  m = _NO_CONFIGURABLE.search(text)
  if m:
    return ValueError(f"{prefix}no configurable named {m.group(1)!r}"
                      f"{_suggest(m.group(1), list(configurables))} (an approximation model's "
                      "module needs --import before its bindings)")
  return None
