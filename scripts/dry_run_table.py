r"""The dry run of every Table 2 row on one TPU v4 chip (the paper's setting),
v5e-8, v4-8 and v6e-8 (v5p-8 on request), as markdown tables that make up
docs/dry_run_tables.md (the file is written whole), with the draft the model
predicts fastest per topology.

The logic is ``lab/dry_run_table.py``; ``--help`` describes the flags.
"""

from __future__ import annotations

import sys
from pathlib import Path

from specdec_jax.scripting import script_args

sys.path.append(str(Path(__file__).resolve().parents[1]))  # lab/, beside scripts/ (not installed)
from lab.dry_run_table import main  # noqa: E402

if __name__ == "__main__":
  script_args.run_main(main)
