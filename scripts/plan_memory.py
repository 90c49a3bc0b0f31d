r"""Per-device memory of Table 2's target/draft pairs on common accelerator meshes.

The logic is ``lab/plan_memory.py``; ``--help`` describes the flags.
"""

from __future__ import annotations

import sys
from pathlib import Path

from specdec_jax.scripting import script_args

sys.path.append(str(Path(__file__).resolve().parents[1]))  # lab/, beside scripts/ (not installed)
from lab.plan_memory import main  # noqa: E402

if __name__ == "__main__":
  script_args.run_main(main)
