r"""For a finished fixed-γ batch-1 runner workdir, how its SPEED falls short of
EXP (with v) step by step: the round's interplay, the measured tokens per
target call, and each example's prefill (timed here per input width), then
what is left (``specdec_jax.run.account``, ``lab.accounting``).

  python -m specdec_jax.run --config=configs/demo.gin --workdir=runs/demo
  python scripts/account_run.py --workdir=runs/demo
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional, Sequence

from specdec_jax.scripting import script_args

sys.path.append(str(Path(__file__).resolve().parents[1]))  # lab/, beside scripts/ (not installed)
from lab import accounting  # noqa: E402


def main(argv: Optional[Sequence[str]] = None) -> None:
  p = script_args.new_parser(__doc__)
  p.add_argument("--workdir", required=True, help="a finished runner workdir")
  p.add_argument("--repeats", type=int, default=9, help="interleaved passes of the prefills")
  args = script_args.parse(p, argv)
  accounting.report(args.workdir, args.repeats)


if __name__ == "__main__":
  script_args.run_main(main)
