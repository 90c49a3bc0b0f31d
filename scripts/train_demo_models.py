r"""Train the demo T5 target/draft pair on KJV -> WEB verse modernization.

The logic is ``lab/train_demo_models.py``; ``--help`` describes the flags.
"""

from __future__ import annotations

import sys
from pathlib import Path

from specdec_jax.scripting import script_args

sys.path.append(str(Path(__file__).resolve().parents[1]))  # lab/, beside scripts/ (not installed)
from lab.train_demo_models import main  # noqa: E402

if __name__ == "__main__":
  script_args.run_main(lambda: main(sys.argv[1:]))
