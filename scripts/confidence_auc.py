r"""In the engine's fixed-γ rounds at T > 0, how well each confidence an
adaptive rule can read after x_i (max q_i, or q_i(x_i) of the token drawn:
``AdaptiveConfig.confidence``) predicts x_i's acceptance
(``lab.probes.confidence_auc``; no timing).

  python scripts/confidence_auc.py --temperatures=1 --gammas=5 \
      --source=data/bible/validation.tsv --num_examples=150
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional, Sequence

from specdec_jax.scripting import script_args

sys.path.append(str(Path(__file__).resolve().parents[1]))  # lab/, beside scripts/ (not installed)
from lab import common, probes  # noqa: E402


def main(argv: Optional[Sequence[str]] = None) -> None:
  args = script_args.parse(common.study_parser(__doc__), argv)
  probes.confidence_report(args)


if __name__ == "__main__":
  script_args.run_main(main)
