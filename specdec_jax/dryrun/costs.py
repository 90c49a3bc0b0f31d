"""The dry run's cost model (a model, not a measurement). A compiled piece (a
target pass over k positions, a draft step) costs per device its roofline,
max(flops / peak, bytes accessed / HBM bandwidth), plus its collectives (hops
x per-hop latency + wire bytes / ICI ring bandwidth) and launched operations x
``Chip.op_seconds`` (the one calibrated parameter); from those c (Definition
3.7), v(k) and a round's ``theory.RoundCost``. Pieces compile at depths 1 and 2
and are extrapolated linearly (the layers are identical)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

from specdec_jax.dryrun.chips import Chip
from specdec_jax.theory import RoundCost
from specdec_jax.tree import TreeShape

# XLA's fast-compile setting (no VMEM staging of weights, so 'bytes
# accessed' is HBM traffic) and the decoder depths extrapolated from.
PIECE_OPTIONS = {"exec_time_optimization_effort": -1.0}
PIECE_DEPTHS = (1, 2)


def ring_hops(kind: str, group: int) -> int:
  """Ring steps of a collective over ``group`` chips on a bidirectional ring:
  all-reduce 2 (group // 2), permute 1, the others group // 2."""
  if group <= 1:
    return 0
  if kind == "collective-permute":
    return 1
  return (2 if kind == "all-reduce" else 1) * (group // 2)


def wire_bytes(kind: str, nbytes: float, group: int) -> float:
  """Bytes each chip sends for a collective of result ``nbytes`` (ring volumes)."""
  n = group
  if n <= 1:
    return 0.0
  return nbytes * {"all-reduce": 2 * (n - 1) / n, "reduce-scatter": n - 1,
                   "collective-permute": 1.0}.get(kind, (n - 1) / n)


def collective_seconds(kind: str, nbytes: float, group: int, chip: Chip) -> float:
  """One collective's time: hops x latency + wire bytes over one ICI link both ways."""
  if group <= 1:
    return 0.0
  wire = wire_bytes(kind, nbytes, group)
  bandwidth = 2 * chip.ici_link_bandwidth
  return ring_hops(kind, group) * chip.hop_latency + (wire / bandwidth if bandwidth else 0.0)


@dataclasses.dataclass(frozen=True)
class Piece:
  """One piece's per-device cost inputs."""

  flops: float
  bytes: float
  ops: float = 0.0             # launched operations (hlo.op_count)
  collectives: tuple = ()      # ((kind, bytes per device, group size), count) pairs

  def roofline_seconds(self, chip: Chip) -> float:
    return max(self.flops / chip.peak_flops, self.bytes / chip.hbm_bandwidth)

  def collective_seconds(self, chip: Chip) -> float:
    return sum(n * collective_seconds(kind, nb, group, chip)
               for (kind, nb, group), n in self.collectives)

  def fixed_seconds(self, chip: Chip) -> float:
    return self.ops * chip.op_seconds

  def seconds(self, chip: Chip) -> float:
    """Roofline + collectives + the fixed cost per operation."""
    return self.roofline_seconds(chip) + self.collective_seconds(chip) + \
        self.fixed_seconds(chip)

  def bound(self, chip: Chip) -> str:
    """The largest of the terms: 'compute', 'memory', 'collectives' or 'fixed'."""
    terms = {"compute": self.flops / chip.peak_flops,
             "memory": self.bytes / chip.hbm_bandwidth,
             "collectives": self.collective_seconds(chip), "fixed": self.fixed_seconds(chip)}
    return max(terms, key=terms.get)


def collective_counts(program: Any, devices: int) -> dict:
  """(kind, bytes per device, group size) -> how many, for a compiled program."""
  out: dict = {}
  for c in program.collectives:
    key = (c.kind, c.nbytes, c.group or devices)
    out[key] = out.get(key, 0) + 1
  return out


def extrapolate(got: dict, role: str, k: int, depth: int, devices: int = 1) -> Piece:
  """The piece at ``depth`` layers: X(L) = X(1) + (L - 1)(X(2) - X(1)) from
  ``got``'s (role, depth, k) compiles."""
  one, two = got[(role, 1, k)], got[(role, 2, k)]
  line = lambda a, b: a + (depth - 1) * (b - a)
  c1, c2 = collective_counts(one, devices), collective_counts(two, devices)
  counts = {key: line(c1.get(key, 0), c2.get(key, 0)) for key in sorted(set(c1) | set(c2))}
  return Piece(line(one.flops, two.flops), line(one.bytes, two.bytes),
               line(getattr(one, "ops", 0), getattr(two, "ops", 0)),
               tuple((key, n) for key, n in counts.items() if n > 0))


def calibrate_op_seconds(target: Piece, draft: Piece, chip: Chip, c: float) -> float:
  """Solves (D + n_d t) / (T + n_t t) = c for the fixed cost per operation t
  (D, T: the steps without it; n: operation counts); t >= 0 or ValueError."""
  free = dataclasses.replace(chip, op_seconds=0.0)
  d, t = draft.seconds(free), target.seconds(free)
  denominator = draft.ops - c * target.ops
  if denominator <= 0 or c * t - d < 0:
    raise ValueError(f"no fixed cost per operation gives c = {c:.4g}: without one c = {d / t:.4f}, "
                     f"and it tends to {draft.ops / max(target.ops, 1):.4f} as the cost grows")
  return (c * t - d) / denominator


@dataclasses.dataclass
class Roofline:
  """Predicted costs per device, each piece priced by ``Piece.seconds``."""

  chip: Chip
  target: dict          # k (positions scored) -> Piece
  draft: Optional[Piece]
  floor: int            # decoder + output-layer weight bytes per device
  draft_floor: int = 0  # the same for the draft
  block: Optional[Piece] = None   # a block draft's one proposal call

  def round_cost(self, gamma: int, draft_calls: Optional[int] = None) -> RoundCost:
    """A round: ``draft_calls`` draft steps (default γ; a block draft's one
    call) and a target pass over γ + 1 positions (v nan if not compiled)."""
    v = self.v(gamma + 1) if gamma + 1 in self.target else math.nan
    if self.block is not None:
      return RoundCost(gamma, self.block_c(), v, 1, step_ms=self.baseline_ms_per_token())
    return RoundCost(gamma, self.c(), v, draft_calls, step_ms=self.baseline_ms_per_token())

  def tree_round_cost(self, tree: TreeShape) -> RoundCost:
    """A tree's round: a draft step per depth (or one block call) and the pass over its N nodes."""
    if self.block is not None:
      return RoundCost(tree.num_nodes - 1, self.block_c(), self.v(tree.num_nodes), 1,
                       step_ms=self.baseline_ms_per_token())
    return RoundCost.for_tree(tree, self.c(), self.v(tree.num_nodes),
                              step_ms=self.baseline_ms_per_token())

  def block_c(self) -> float:
    """A block draft's one call over one target step (its proposal's c)."""
    return self.block.seconds(self.chip) / self.target[1].seconds(self.chip)

  def c(self) -> float:
    """Definition 3.7: one draft step over one target step."""
    if self.draft is None:
      return 0.0
    return self.draft.seconds(self.chip) / self.target[1].seconds(self.chip)

  def v(self, k: int) -> float:
    """A pass over k positions over a one-position pass."""
    return self.target[k].seconds(self.chip) / self.target[1].seconds(self.chip)

  def baseline_ms_per_token(self) -> float:
    """The baseline's milliseconds per token: one one-position target pass."""
    return 1e3 * self.target[1].seconds(self.chip)
