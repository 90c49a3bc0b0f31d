r"""Per k, the draft's k proposals and the target's (k+1)-token pass as the
fixed-γ loop runs them and as an adaptive round with γ_max = max(--gammas) runs
them (``lab.replay.adaptive_pieces``).

  python scripts/adaptive_pieces.py --ks=1,2,3,4 --gammas=7
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional, Sequence

from specdec_jax.scripting import script_args

sys.path.append(str(Path(__file__).resolve().parents[1]))  # lab/, beside scripts/ (not installed)
from lab import common, replay  # noqa: E402


def main(argv: Optional[Sequence[str]] = None) -> None:
  p = common.study_parser(__doc__)
  p.add_argument("--ks", default="1,2,3,4", help="proposal counts k")
  replay.pieces_report(script_args.parse(p, argv))


if __name__ == "__main__":
  script_args.run_main(main)
