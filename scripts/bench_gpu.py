r"""The GPU tables of docs/benchmarks.md, one section per call.

  python scripts/bench_gpu.py --section=loops --out=DIR          # on the GPU
  python scripts/bench_gpu.py --section=loops --out=DIR --smoke  # toy sizes, CPU
  python scripts/bench_gpu.py --list                             # the default order

``scripts/bench_accelerator.sh`` runs the default sections in this order (the
order of value), each in its own process under a time limit, so that one
that fails or runs out of time (or memory) does not stop the next. Each
section prints its markdown table as soon as it is measured and adds its rows
to DIR/bench_gpu.json (one key per section) and DIR/bench_gpu.md.

Default sections (``lab.bench``; each module says more):

  loops          Table 2's EnDe rows at T = 0 with the real compiled loops:
                 an XXL-sized target, small/base/large-sized drafts steered
                 to the row's α, the chain at the paper's γ and the row's best
                 tree, each against our baseline; Theorem 3.8 with the
                 measured α, c and v beside them (``bench.loops``).
  variant_NAME   one per kernel variant (``bench.variants.VARIANTS``): the
                 XXL- and XL-sized targets' step and 8-position pass and the
                 drafts' steps with and without it, interleaved; T = 0
                 mismatches in bfloat16 with and without it.
  hf             an XXL-sized target on Hugging Face transformers: our
                 baseline against HF generate (dynamic cache; static cache,
                 compiled), our speculative loop against HF assisted
                 generation with a small-sized assistant (``bench.hf``).
  demo           the demo pair end to end against HF generate and HF
                 assisted generation with the same draft.
  loops_cnndm    Table 2's CNN/DM rows at T = 0, as loops (last: a tight
                 budget cuts it first).

More (``--section`` by name; ``bench_accelerator.sh --sections=...``):
bandwidth (the card's copy bandwidth, the floors' rate), targets (v(k) for
k = 1..16, c, % of floor, a kernel profile), exactness (T = 0 mismatches by
matmul precision), profile (per-kernel profiles with and without min_rows 2).

Timing: every piece is compiled and run once before it is timed; pieces run
``inner`` times inside one jitted loop (no per-call dispatch), loops are
timed whole; all timed interleaved, medians (``specdec_jax.timing``).

--smoke runs a section at toy sizes (small random models, a few examples)
so that a CPU test covers every code path; its numbers mean nothing.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Optional

# torch shares the card with JAX in some sections: JAX must not take 75% of
# its memory up front. Set before jax is imported, so that nothing can start
# the GPU client first; XLA's pool still grows and is reused after warm-up.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

from specdec_jax.scripting import script_args  # noqa: E402

sys.path.append(str(Path(__file__).resolve().parents[1]))  # lab/, beside scripts/ (not installed)
from lab.bench import sections  # noqa: E402


def main(argv: Optional[list[str]] = None) -> None:
  p = script_args.new_parser(__doc__)
  p.add_argument("--section", choices=list(sections.SECTIONS))
  p.add_argument("--list", action="store_true",
                 help="print the default sections in order, then the others, and exit")
  p.add_argument("--out", default=None,
                 help="where bench_gpu.json and bench_gpu.md go (default: a temporary folder)")
  p.add_argument("--smoke", action="store_true", help="toy sizes (a CPU test of every path)")
  args = script_args.parse(p, argv)
  if args.list:
    print(" ".join(sections.DEFAULT))
    print(" ".join(sections.MORE))
    return
  if not args.section:
    p.error("--section is required (or --list)")
  sections.run_section(args.section, args.smoke,
                       Path(args.out or tempfile.mkdtemp(prefix="bench_gpu_")))


if __name__ == "__main__":
  script_args.run_main(main)
