r"""Per-round overhead of speculative decoding: draft, target pass, standardize,
kernel and the rest of a round, in ms per round (``lab.rounds``).

  python scripts/profile_round.py                  # the demo pair
  python scripts/profile_round.py --gammas=1,3,5 --temperatures=0,1 \
      --num_examples=8 --repeats=5

The other studies of a round have a script each: ``compare_revision.py``,
``cache_contention.py``, ``adaptive_pieces.py``, ``adaptive_replay.py``,
``confidence_auc.py``, ``acceptance_head.py`` and ``account_run.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional, Sequence

from specdec_jax.scripting import script_args

sys.path.append(str(Path(__file__).resolve().parents[1]))  # lab/, beside scripts/ (not installed)
from lab import common, rounds  # noqa: E402


def main(argv: Optional[Sequence[str]] = None) -> None:
  args = script_args.parse(common.study_parser(__doc__), argv)
  rounds.report(args)


if __name__ == "__main__":
  script_args.run_main(main)
