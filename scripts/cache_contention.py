r"""How much the target's k-token pass slows down when that much other data (a
stand-in for the draft's weights) is read before each pass: the models'
contention for the last-level cache that Theorem 3.8's additive cost model
leaves out (``lab.contention``).

  python scripts/cache_contention.py --megabytes=4,8,12,16 --repeats=15
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional, Sequence

from specdec_jax.scripting import script_args

sys.path.append(str(Path(__file__).resolve().parents[1]))  # lab/, beside scripts/ (not installed)
from lab import common, contention  # noqa: E402


def main(argv: Optional[Sequence[str]] = None) -> None:
  p = common.study_parser(__doc__)
  p.add_argument("--megabytes", default="4,8,12,16",
                 help="MB read before each pass (the draft's footprint in a round)")
  p.add_argument("--ks", default="1,3", help="target pass widths")
  contention.report(script_args.parse(p, argv))


if __name__ == "__main__":
  script_args.run_main(main)
