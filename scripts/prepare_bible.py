r"""Build the demo task: verse-aligned King James Version -> World English Bible.

The logic is ``lab/prepare_bible.py``; ``--help`` describes the flags.
"""

from __future__ import annotations

import sys
from pathlib import Path

from specdec_jax.scripting import script_args

sys.path.append(str(Path(__file__).resolve().parents[1]))  # lab/, beside scripts/ (not installed)
from lab.prepare_bible import main  # noqa: E402

if __name__ == "__main__":
  script_args.run_main(main)
