"""Collect experiment summaries into markdown tables laid out like the paper's.

Usage:
  python scripts/make_tables.py RUN_DIRS_OR_GLOBS... [--out FILE] [--figures]

Each argument is a summary.json file, a directory (searched recursively for
summary.json) or a glob of either. Speculative-decoding runs fill Table 2
(walltime) and Table 4 (expected vs. empirical improvement); summaries with
``"mode": "alpha_only"`` fill Table 3 (alpha values). Next to our numbers are
the paper's (Leviathan et al., 2023) for the row with the same task, draft
size and temperature, or '-' when the paper has no such row.

--figures also writes speedup.png (measured against the paper's),
tokens_per_call.png and acceptance.png (per draft position) next to --out
(matplotlib: pip install -e ".[figures]").
"""

from __future__ import annotations

import pathlib
import sys
from typing import Optional, Sequence

from specdec_jax.scripting import figures, script_args
# The library's names, for callers that import this script.
from specdec_jax.scripting.tables import (PAPER_TABLES, build_markdown, canonical_draft,  # noqa: F401
                                          canonical_task, find_summary_files, load_summaries,
                                          model_family)


def main(argv: Optional[Sequence[str]] = None) -> int:
  parser = script_args.new_parser(__doc__)
  parser.add_argument("runs", nargs="+", metavar="RUN_DIRS_OR_GLOBS",
                      help="summary.json files, run directories, or globs of them")
  parser.add_argument("--out", type=pathlib.Path, help="also write the markdown here")
  parser.add_argument("--figures", action="store_true",
                      help="also write PNG figures into --out's directory")
  args = script_args.parse(parser, argv)
  if args.figures and not args.out:
    parser.error("--figures writes the PNGs next to the markdown: give --out too")
  if args.figures:
    figures.pyplot()  # a missing matplotlib fails before anything is written

  files = find_summary_files(args.runs)
  if not files:
    print(f"no summary.json found under {args.runs}", file=sys.stderr)
    return 1
  summaries = load_summaries(files)
  markdown = build_markdown(summaries)
  print(markdown, end="")
  if args.out:
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(markdown)
  if args.figures:
    for path in figures.write_figures(summaries, args.out.parent):
      print(f"wrote {path}", file=sys.stderr)
  return 0


if __name__ == "__main__":
  script_args.run_main(main)
