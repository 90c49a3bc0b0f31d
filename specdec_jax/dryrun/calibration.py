"""The cost model's one calibrated parameter: the fixed cost per launched
operation on TPU v4, from the paper's c = 0.02 for T5-small (Table 4) alone.
``PIECES`` stores the one-position steps it needs (T5 1.1 XXL and each draft
on ``v4:1x1x1`` at the EnDe rows' settings), so nothing is compiled;
``predicted_c`` then gives base's and large's c with no further fitting.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from specdec_jax import paper
from specdec_jax.dryrun.chips import CHIPS, Chip
from specdec_jax.dryrun.costs import Piece, calibrate_op_seconds

TOPOLOGY = "v4:1x1x1"
CALIBRATED_ON = "small"   # the only draft whose paper c is used
DRAFTS = ("small", "base", "large")

# One-position steps on one TPU v4 chip, full depth (flops, bytes accessed,
# launched operations), written by ``scripts/calibrate_costs.py --recompile``.
PIECES: dict[str, dict[str, float]] = {
    "target": {"flops": 26548506112.0, "bytes": 11792595456.0, "ops": 1227},  # T5 1.1 XXL
    "small": {"flops": 201377512.0, "bytes": 98406912.0, "ops": 412},
    "base": {"flops": 634858688.0, "bytes": 310788608.0, "ops": 604},
    "large": {"flops": 1968929056.0, "bytes": 947034624.0, "ops": 1180},
}


def pieces(stored: Optional[dict] = None) -> dict[str, Piece]:
  """The stored steps as ``costs.Piece`` (no collectives: one chip)."""
  stored = PIECES if stored is None else stored
  return {name: Piece(v["flops"], v["bytes"], v["ops"]) for name, v in stored.items()}


def calibrate(stored: Optional[dict] = None, chip: Chip = CHIPS["v4"]) -> float:
  """Seconds per operation making the model's c for T5-small the paper's."""
  got = pieces(stored)
  return calibrate_op_seconds(got["target"], got[CALIBRATED_ON], chip, paper.DRAFT_C[CALIBRATED_ON])


def predicted_c(op_seconds: float, stored: Optional[dict] = None,
                chip: Chip = CHIPS["v4"]) -> dict[str, float]:
  """Each draft's c (Definition 3.7) at ``op_seconds`` per operation."""
  got = pieces(stored)
  at = dataclasses.replace(chip, op_seconds=op_seconds)
  target = got["target"].seconds(at)
  return {d: got[d].seconds(at) / target for d in DRAFTS if d in got}


def table(stored: Optional[dict] = None) -> str:
  """The calibration as text: per draft c without and with the fixed cost vs the paper's."""
  t = calibrate(stored)
  before, after = predicted_c(0.0, stored), predicted_c(t, stored)
  lines = [f"fixed cost per operation on TPU v4, calibrated on T5-{CALIBRATED_ON} only: "
           f"{t * 1e6:.3f} µs",
           f"{'draft':8s} {'c roofline':>11s} {'c model':>8s} {'paper c':>8s} {'error':>7s}"]
  for d in DRAFTS:
    if d in after:
      want = paper.DRAFT_C[d]
      note = "  (calibrated: equal by construction)" if d == CALIBRATED_ON else ""
      lines.append(f"T5-{d:5s} {before[d]:11.4f} {after[d]:8.4f} {want:8.2f} "
                   f"{100 * (after[d] / want - 1):+6.0f}%{note}")
  return "\n".join(lines)
