r"""What an adaptive rule's rounds cost as the rule decides them and replayed as
a fixed schedule of the same widths (same rounds, checked), shuffled, and at
each constant width 1..γ_max (``lab.replay.adaptive_replay``); at T=0 also what
fixed γ, threshold and cumulative rules and a perfect acceptance predictor
would cost at those widths' measured ms per round (``lab.stopping``, along the
target's greedy outputs with the draft's confidences and verdicts from the
engine's own rounds). The rule is ``AdaptiveConfig``'s fields as flags.

  python scripts/adaptive_replay.py --rule=cumulative --threshold=0.5 --gammas=7 \
      --temperatures=0 --num_examples=24 --repeats=4
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional, Sequence

from specdec_jax.decoding import AdaptiveConfig
from specdec_jax.scripting import script_args

sys.path.append(str(Path(__file__).resolve().parents[1]))  # lab/, beside scripts/ (not installed)
from lab import common, replay  # noqa: E402


def main(argv: Optional[Sequence[str]] = None) -> None:
  p = common.study_parser(__doc__)
  script_args.dataclass_flags(p, AdaptiveConfig)
  args = script_args.parse(p, argv)
  replay.replay_report(args, script_args.dataclass_from_flags(AdaptiveConfig, args))


if __name__ == "__main__":
  script_args.run_main(main)
