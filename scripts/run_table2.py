r"""Every row of Table 2 on this machine, one after another, then the table.

Usage:
  python scripts/run_table2.py --family=t5_1_0 --overlay=configs/tpu_v4_1.gin \
      [--gin_bindings="Experiment.tfds_data_dir = 'gs://YOUR_BUCKET/tfds'"] \
      [--root=runs/table2] [--rows=t5_1_0_ende_small_t0,...] [--figures]

--family=t5_1_0: configs/table2_t5_1_0/ (the public T5 1.0 checkpoints);
--family=t5_1_1: configs/table2/ (the paper's fine-tuned T5 1.1 models: bind
their checkpoints with --gin_bindings). Each row runs with the runner
(python -m specdec_jax.run --config=ROW --config=OVERLAY ... --resume) into
ROOT/<row>. Run the same command again after an interruption or a failure: a
row whose summary.json counts all its examples is skipped, any other resumes
after its last complete example (a workdir of other settings is refused: use
another --root). At the end the Table 2 markdown of the rows
(scripts/make_tables.py's) is printed and written to ROOT/table2.md, with
--figures its PNGs beside it. --status prints each row's state and the table
so far, and runs nothing.
"""

from __future__ import annotations

import pathlib
import sys
from typing import Optional, Sequence

from specdec_jax.scripting import figures, script_args, table2, tables


def main(argv: Optional[Sequence[str]] = None) -> int:
  parser = script_args.new_parser(__doc__)
  parser.add_argument("--family", default="t5_1_0", choices=sorted(table2.FAMILIES),
                      help="which rows: t5_1_0 (public checkpoints) or t5_1_1 (the paper's)")
  parser.add_argument("--config_dir", type=pathlib.Path,
                      help="a folder of row configs to run instead of --family's")
  parser.add_argument("--overlay", action="append", default=[],
                      help="a hardware overlay given after each row, e.g. "
                           "configs/tpu_v4_1.gin; may repeat")
  parser.add_argument("--gin_bindings", action="append", default=[],
                      help="a gin binding for every row (after the overlays); may repeat")
  parser.add_argument("--root", type=pathlib.Path, default=pathlib.Path(table2.DEFAULT_ROOT),
                      help="each row's workdir is ROOT/<row>")
  parser.add_argument("--rows", type=script_args.comma_list, default=[],
                      help="comma-separated row names (config stems) to run; default all")
  parser.add_argument("--figures", action="store_true",
                      help='also write PNG figures beside ROOT/table2.md (pip install -e ".[figures]")')
  parser.add_argument("--status", action="store_true",
                      help="print each row's state and the table so far; run nothing")
  args = script_args.parse(parser, argv)

  if args.figures:
    figures.pyplot()  # a missing matplotlib fails now, not after the rows
  config_dir = args.config_dir or table2.family_dir(args.family)
  overlays = [script_args.resolve(o) for o in args.overlay]
  for o in overlays:
    if not pathlib.Path(o).is_file():
      raise FileNotFoundError(f"--overlay={o}: no such file")
  rows = table2.find_rows(config_dir, args.root, args.rows)
  if args.status:
    for row in rows:
      wanted = table2.requested_examples([str(row.config), *overlays], args.gin_bindings)
      print(f"{row.name}: {table2.examples_done(row)} of {wanted} examples ({row.workdir})")
    outcome = table2.Outcome()
  else:
    outcome = table2.run_rows(rows, overlays, args.gin_bindings)
  if outcome.interrupted:
    print(f"interrupted in {outcome.interrupted}: run the same command again to resume",
          file=sys.stderr)
    return table2.INTERRUPTED

  files = tables.find_summary_files([str(r.workdir / "summary.json") for r in rows
                                     if (r.workdir / "summary.json").is_file()])
  if files:
    summaries = tables.load_summaries(files)
    markdown = tables.build_markdown(summaries)
    print(markdown, end="")
    out = args.root / "table2.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(markdown)
    print(f"wrote {out}", file=sys.stderr)
    if args.figures:
      for path in figures.write_figures(summaries, args.root):
        print(f"wrote {path}", file=sys.stderr)
  elif not args.status:
    print("no row has results yet", file=sys.stderr)
  if outcome.failed:
    print("failed rows (see their errors above; rerun to retry): "
          + ", ".join(f"{name} (exit status {code})" for name, code in outcome.failed.items()),
          file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  script_args.run_main(main)
