r"""How well an acceptance predictor (SpecDec++'s head as a linear probe: a
logistic regression on the draft's softmax statistics, and on those plus its
hidden state) fitted on a held-out split's rounds predicts x_i's acceptance in
--source's (``lab.probes.head_auc``; no timing).

  python scripts/acceptance_head.py --gammas=7 --num_examples=500 --temperatures=0,1
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional, Sequence

from specdec_jax.scripting import script_args

sys.path.append(str(Path(__file__).resolve().parents[1]))  # lab/, beside scripts/ (not installed)
from lab import common, probes  # noqa: E402


def main(argv: Optional[Sequence[str]] = None) -> None:
  p = common.study_parser(__doc__)
  p.add_argument("--head_source", default=script_args.ALPHA_SOURCE,
                 help="held-out inputs the predictors are fitted on")
  probes.head_report(script_args.parse(p, argv, paths=("head_source",)))


if __name__ == "__main__":
  script_args.run_main(main)
