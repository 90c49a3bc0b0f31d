r"""Trees chosen per round against static trees of the same node count (the
measuring code: lab/bench_trees_dynamic.py, whose docstring describes the columns).

  python scripts/bench_trees_dynamic.py                    # the demo pair
  python scripts/bench_trees_dynamic.py --dynamic="5,5,5;3,4,4,4" --temperatures=0,1
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))  # lab/, beside scripts/ (not installed)
from lab.bench_trees_dynamic import main  # noqa: E402
from specdec_jax.scripting import script_args  # noqa: E402

if __name__ == "__main__":
  script_args.run_main(main)
