"""The dry run's roofline cost model: what one decoding step costs on a TPU
chip, predicted from XLA's cost analysis of a compiled piece. A model, not a
measurement.

A piece (one target pass over k positions, one draft step) is priced as
max(flops / peak, bytes accessed / HBM bandwidth) with the chip's published
figures (``chips.CHIPS``). From those: c = draft step / target step
(Definition 3.7), v(k) = pass over k positions / one-position pass, and
Theorem 3.8's speedup at an α and γ. Collective and launch latencies are not
priced.

The pieces are compiled with XLA's ``exec_time_optimization_effort`` = -1
(``PIECE_OPTIONS``), at decoder depths 1 and 2 (``PIECE_DEPTHS``), and
extrapolated linearly to the model's depth (``extrapolate``: the layers are
identical, so flops and bytes are affine in the depth). At that effort the
TPU compiler does not stage weights through on-chip VMEM, so 'bytes
accessed' counts HBM traffic.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from specdec_jax import theory
from specdec_jax.dryrun.chips import Chip

# XLA's fast-compile setting (no VMEM staging of weights, so 'bytes
# accessed' is HBM traffic) and the decoder depths extrapolated from.
PIECE_OPTIONS = {"exec_time_optimization_effort": -1.0}
PIECE_DEPTHS = (1, 2)


@dataclasses.dataclass(frozen=True)
class Piece:
  """One roofline piece's per-device cost (XLA's cost analysis)."""

  flops: float
  bytes: float

  def seconds(self, chip: Chip) -> float:
    return max(self.flops / chip.peak_flops, self.bytes / chip.hbm_bandwidth)

  def bound(self, chip: Chip) -> str:
    return "compute" if self.flops / chip.peak_flops > self.bytes / chip.hbm_bandwidth \
        else "memory"


def extrapolate(got: dict, role: str, k: int, depth: int) -> Piece:
  """Flops and bytes at ``depth`` layers from the depth-1 and depth-2
  compiles (``got``: (role, depth, k) -> anything with flops and bytes):
  X(L) = X(1) + (L - 1)(X(2) - X(1))."""
  one, two = got[(role, 1, k)], got[(role, 2, k)]
  return Piece(one.flops + (depth - 1) * (two.flops - one.flops),
               one.bytes + (depth - 1) * (two.bytes - one.bytes))


@dataclasses.dataclass
class Roofline:
  """Predicted costs on one chip (a model, not a measurement)."""

  chip: Chip
  target: dict          # k (positions scored) -> Piece
  draft: Optional[Piece]
  floor: int            # decoder + output-layer weight bytes per device
  draft_floor: int = 0  # the same for the draft

  def c(self) -> float:
    """Definition 3.7: one draft step over one target step."""
    return 0.0 if self.draft is None else self.draft.seconds(self.chip) / \
        self.target[1].seconds(self.chip)

  def v(self, k: int) -> float:
    """A pass over k positions over a one-position pass."""
    return self.target[k].seconds(self.chip) / self.target[1].seconds(self.chip)

  def speedup(self, alpha: float, gamma: int, with_v: bool = False) -> float:
    """Theorem 3.8 (v = 1), or with ``with_v`` its v-generalized form
    (``theory.walltime_improvement``), at the model's c."""
    return float(theory.walltime_improvement(alpha, gamma, self.c(),
                                             self.v(gamma + 1) if with_v else 1.0))

  def baseline_ms_per_token(self) -> float:
    """The baseline's milliseconds per token: one one-position target pass."""
    return 1e3 * self.target[1].seconds(self.chip)

  def speculative_ms_per_token(self, alpha: float, gamma: int) -> Optional[float]:
    """Milliseconds per token of speculative decoding at α and γ: a round
    (γ draft steps and one target pass over γ + 1 positions) over the tokens
    it yields, (1 - α^(γ+1)) / (1 - α) (Corollary 3.6 / Theorem 3.8)."""
    if self.draft is None or gamma + 1 not in self.target:
      return None
    per_round = gamma * self.draft.seconds(self.chip) + self.target[gamma + 1].seconds(self.chip)
    return 1e3 * per_round / float(theory.expected_tokens(alpha, gamma))
