r"""Token trees against chains on one pair, side by side in one run.

The logic is ``lab/bench_tree.py``; ``--help`` describes the flags.
"""

from __future__ import annotations

import sys
from pathlib import Path

from specdec_jax.scripting import script_args

sys.path.append(str(Path(__file__).resolve().parents[1]))  # lab/, beside scripts/ (not installed)
from lab.bench_tree import main  # noqa: E402

if __name__ == "__main__":
  script_args.run_main(main)
