r"""Our speculative decoding vs Hugging Face assisted generation, side by side.

The logic is ``lab/bench_vs_hf.py``; ``--help`` describes the flags.
"""

from __future__ import annotations

import sys
from pathlib import Path

from specdec_jax.scripting import script_args

sys.path.append(str(Path(__file__).resolve().parents[1]))  # lab/, beside scripts/ (not installed)
from lab.bench_vs_hf import main  # noqa: E402

if __name__ == "__main__":
  script_args.run_main(main)
