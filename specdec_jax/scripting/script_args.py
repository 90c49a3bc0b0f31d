"""What the scripts in ``scripts/`` share: the demo pair's defaults, flags that
select a pair, a draft and decoding settings, flags generated from a settings
dataclass (``dataclass_flags``), path resolution, logging, markdown tables.
Paths a script reads are found as the runner finds them (the working
directory, else the repository root); paths it writes are relative to the
working directory.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import traceback
import types
import typing
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence, TypeVar

from specdec_jax.run import logs
from specdec_jax.run.cli import USER_ERRORS
from specdec_jax.run import settings

REPO_ROOT = settings.REPO_ROOT
TARGET = "checkpoints/demo/target"
# configs/demo.gin's draft: draft_tiny with an encoder and a feature bridge.
DRAFT = "checkpoints/demo/draft_tiny_feat"
PLAIN_DRAFT = "checkpoints/demo/draft_tiny"   # before the bridges: a plain T5
# configs/demo.gin's shortlist: the 1000 most frequent reference tokens.
SHORTLIST = "checkpoints/demo/draft_shortlist.json"
VOCAB = "checkpoints/demo/spm.model"
SOURCE = "data/bible/test.tsv"
ALPHA_SOURCE = "data/bible/validation.tsv"   # held out too; for tuning (γ), never for results
TASK = "bible_modernize"

# The arguments of add_pair_arguments / add_shortlist_argument that name files to read.
PAIR_PATHS = ("target", "draft", "vocab", "source", "draft_shortlist")

T = TypeVar("T")


def new_parser(doc: str) -> argparse.ArgumentParser:
  """An ArgumentParser printing ``doc`` as written, with --verbose."""
  p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--verbose", action="store_true",
                 help="show the INFO logs of other libraries (Orbax, JAX)")
  return p


def add_pair_arguments(parser: argparse.ArgumentParser, draft: str = DRAFT,
                       task: bool = True) -> None:
  """--target, --draft, --vocab, --source (and --task), defaulting to the demo pair."""
  where = " (relative: the working directory, else the repository root)"
  parser.add_argument("--target", default=TARGET, help="target (M_p) checkpoint" + where)
  parser.add_argument("--draft", default=draft, help="draft (M_q) checkpoint" + where)
  parser.add_argument("--vocab", default=VOCAB, help="SentencePiece model" + where)
  parser.add_argument("--source", default=SOURCE, help="TSV/JSONL of inputs" + where)
  if task:
    parser.add_argument("--task", default=TASK,
                        help="task name (Experiment.task: its prefix is added to each input)")


def add_shortlist_argument(parser: argparse.ArgumentParser, demo_default: bool = True,
                           note: str = "") -> None:
  """--draft_shortlist (``demo_default``: the demo's for the demo draft)."""
  default = (f"default: {SHORTLIST} for the default --draft (as configs/demo.gin), none for "
             "any other; '' for none") if demo_default else "default: none"
  parser.add_argument("--draft_shortlist", default=None if demo_default else "",
                      help="the draft's vocabulary shortlist (Experiment.draft_shortlist); "
                           + default + (f"; {note}" if note else ""))


def hint_types(hint: Any) -> list[Any]:
  """The annotation's types without None (Optional[int] -> [int])."""
  union = typing.get_origin(hint) in (typing.Union, types.UnionType)
  return [t for t in (typing.get_args(hint) if union else (hint,)) if t is not type(None)]


def parse_value(hint: Any, text: str) -> Any:
  """A field's value from its flag's text ('none': None; a tuple: comma-separated)."""
  kinds = hint_types(hint)
  if text.strip().lower() == "none" and type(None) in typing.get_args(hint):
    return None
  if len(kinds) == 1 and typing.get_origin(kinds[0]) is tuple:
    return tuple(comma_list(text, typing.get_args(kinds[0])[0]))
  if kinds == [bool]:
    if text.lower() not in ("true", "false"):
      raise ValueError(f"expected true or false, got {text!r}")
    return text.lower() == "true"
  return kinds[0](text)


def dataclass_flags(parser: argparse.ArgumentParser, cls: type, defaults: Any = None,
                    prefix: str = "", skip: Sequence[str] = (),
                    special: Optional[dict[str, dict]] = None) -> list[str]:
  """``--{prefix}{name}`` for each field of ``cls`` but ``skip``, typed from its
  annotation, defaulted from ``defaults`` (else the field), its help the
  field's docstring entry; ``special``: name -> ``add_argument`` keywords.
  -> the fields flagged."""
  hints = typing.get_type_hints(cls)
  docs = settings.setting_docs(cls)
  names = []
  for f in dataclasses.fields(cls):
    if f.name in skip:
      continue
    has_default = (f.default is not dataclasses.MISSING
                   or f.default_factory is not dataclasses.MISSING)
    default = (getattr(defaults, f.name) if defaults is not None
               else f.default if f.default is not dataclasses.MISSING
               else f.default_factory() if has_default else None)
    text = f"{cls.__name__}.{f.name}" + (f": {docs[f.name]}" if f.name in docs else "")
    kinds = hint_types(hints[f.name])
    if kinds == [bool]:
      kw: dict[str, Any] = dict(default=default, action=argparse.BooleanOptionalAction, help=text)
    elif len(kinds) == 1 and (kinds[0] in (str, int, float)
                              or typing.get_origin(kinds[0]) is tuple):
      kw = dict(default=default, required=defaults is None and not has_default, help=text,
                type=lambda s, h=hints[f.name]: parse_value(h, s))
    elif f.name in (special or {}):
      kw = dict(default=default, help=text)
    else:
      raise TypeError(f"{cls.__name__}.{f.name} ({hints[f.name]}) has no generated flag: give "
                      "it a special entry or skip it")
    kw["help"] = kw["help"].replace("%", "%%")
    kw.update((special or {}).get(f.name, {}))
    parser.add_argument(f"--{prefix}{f.name}", **kw)
    names.append(f.name)
  return names


def dataclass_from_flags(cls: type, args: argparse.Namespace, prefix: str = "",
                         **fixed: Any) -> Any:
  """``cls`` from ``dataclass_flags``' flags (``fixed`` fields as given)."""
  values = {f.name: getattr(args, prefix + f.name) for f in dataclasses.fields(cls)
            if hasattr(args, prefix + f.name)}
  return cls(**{**values, **fixed})


def shortlist_for(args: argparse.Namespace) -> str:
  """--draft_shortlist as given, or the demo's for the demo T5 draft."""
  if args.draft_shortlist is not None:
    return args.draft_shortlist
  return SHORTLIST if args.draft == DRAFT and getattr(args, "draft_name", "t5") == "t5" else ""


def resolve(path: str) -> str:
  """The first of ``settings.candidates(path)`` that exists, else ``path``."""
  if not path:
    return path
  return str(next((c for c in settings.candidates(path) if Path(c).exists()), path))


def parse(parser: argparse.ArgumentParser, argv: Optional[Sequence[str]] = None,
          paths: Sequence[str] = ()) -> argparse.Namespace:
  """Parses ``argv``, sets --draft_shortlist (``shortlist_for``), resolves the
  pair's paths and ``paths``, and sets up logging."""
  args = parser.parse_args(argv)
  if hasattr(args, "draft_shortlist") and hasattr(args, "draft"):
    args.draft_shortlist = shortlist_for(args)
  for name in (*PAIR_PATHS, *paths):
    if isinstance(getattr(args, name, None), str):
      setattr(args, name, resolve(getattr(args, name)))
  logs.script_logging(getattr(args, "verbose", False))
  return args


def run_main(main: Callable[[], Optional[int]]) -> None:
  """Runs ``main()`` and exits with its status; a user error is one line on
  stderr and status 2, as in the runner."""
  try:
    code = main()
  except USER_ERRORS as e:
    if "--verbose" in sys.argv[1:]:
      traceback.print_exc()
    text = e.args[0] if isinstance(e, KeyError) and e.args else e
    print(f"{os.path.basename(sys.argv[0])}: error: {text}", file=sys.stderr)
    sys.exit(2)
  sys.exit(code or 0)


def comma_list(text: str, kind: Callable[[str], T] = str) -> list[T]:
  """'1,2,,3' -> [kind('1'), kind('2'), kind('3')] (empty items dropped)."""
  return [kind(x.strip()) for x in text.split(",") if x.strip()]


def markdown_row(cells: Iterable[Any]) -> str:
  """'| a | b |'."""
  return "| " + " | ".join(str(c) for c in cells) + " |"


def markdown_header(headers: Sequence[str]) -> str:
  """A markdown table's header row and separator row (two lines)."""
  return markdown_row(headers) + "\n|" + "---|" * len(headers)


def markdown_table(headers: Sequence[str], rows: Iterable[Iterable[Any]]) -> str:
  """A GitHub-flavoured markdown table: the header, then one line per row."""
  return "\n".join([markdown_header(headers)] + [markdown_row(r) for r in rows])
