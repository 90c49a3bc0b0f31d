r"""The acceptance kernel and the sampler of a git revision against the current
ones (interleaved, one process, same inputs): µs per standardize p + kernel at
each (T, γ) and per softmax + sample_any draw, and whether the kernel's outputs
are identical (``lab.revisions``). Run inside a git checkout.

  python scripts/compare_revision.py --rev=HEAD~1 --gammas=1,3,5 --temperatures=0,1
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional, Sequence

from specdec_jax.scripting import script_args

sys.path.append(str(Path(__file__).resolve().parents[1]))  # lab/, beside scripts/ (not installed)
from lab import common, revisions  # noqa: E402


def main(argv: Optional[Sequence[str]] = None) -> None:
  p = script_args.new_parser(__doc__)
  p.add_argument("--rev", required=True, help="git revision to compare the kernel with")
  p.add_argument("--vocab_size", type=int, default=8000, help="V of the random logits")
  common.add_decoding_arguments(p, gammas="1,3,5", input_buckets=False, seed=False)
  args = script_args.parse(p, argv)
  revisions.report(args.rev, args.vocab_size, script_args.comma_list(args.gammas, int),
                   script_args.comma_list(args.temperatures, float))


if __name__ == "__main__":
  script_args.run_main(main)
