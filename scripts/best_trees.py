"""Per Table 2 row, the best token tree of at most 64 nodes under the dry
run's calibrated cost model, on one TPU v4 chip (the paper's setting) and on
a v5e-8 (target split 8 ways, draft replicated), beside the chain at the
paper's γ (``lab.trees.best_tree``).

  python scripts/best_trees.py [--max_nodes=64]

A model, not a measurement: the steps are the stored one-chip pieces
(``dryrun.calibration.PIECES``) priced by ``dryrun.costs`` (roofline,
collectives, the calibrated fixed cost per operation); the rank acceptance
rates are an assumption made from the paper's α: by default α times the demo
pair's measured fall-off (``trees.scaled_rates``), or ``--rates=geometric``
(the k-th choice wins with α (1 - α)^(k-1), ``trees.geometric_rates``), in
the positional model of ``TreeShape.from_acceptance``. Prints a markdown
table.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from specdec_jax import paper  # noqa: E402
from specdec_jax.dryrun.chips import CHIPS  # noqa: E402
from specdec_jax.tree import TreeShape  # noqa: E402

sys.path.append(str(Path(__file__).resolve().parents[1]))  # lab/, beside scripts/ (not installed)
from lab import trees  # noqa: E402

HARDWARE = (("one v4 chip", "v4", 1), ("v5e-8", "v5e", 8))


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--max_nodes", type=int, default=64)
  p.add_argument("--rates", choices=("scaled", "geometric"), default="scaled",
                 help="rank rates from the paper's α: 'scaled' (the demo pair's measured "
                      "fall-off, trees.scaled_rates) or 'geometric' (trees.geometric_rates)")
  args = p.parse_args()
  make_rates = trees.scaled_rates if args.rates == "scaled" else trees.geometric_rates
  head = ["row", "α", "γ", "paper"]
  for label, _, _ in HARDWARE:
    head += [f"{label}: chain", f"{label}: best tree (N, depth)", f"{label}: ms/token"]
  print("| " + " | ".join(head) + " |")
  print("|" + "---|" * len(head))
  for row in paper.TABLE2:
    rates = make_rates(row.alpha)
    cells = [f"{row.task} {row.draft} T={row.temperature}", f"{row.alpha}", f"{row.gamma}",
             f"{row.speedup}x"]
    for _, chip, devices in HARDWARE:
      model = trees.step_model(CHIPS[chip], devices, row.draft)
      chain = model.speedup(TreeShape.chain(row.gamma), rates)
      tree, speedup = trees.best_tree(model, rates, args.max_nodes)
      cells += [f"{chain:.2f}x", f"{speedup:.2f}x ({tree.num_nodes}, {tree.max_depth})",
                f"{model.ms_per_token(tree, rates):.2f}"]
    print("| " + " | ".join(cells) + " |", flush=True)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
