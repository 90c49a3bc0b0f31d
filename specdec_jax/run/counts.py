"""A batch's per-row counts for every kind of run (chain, tree, plain), as one
line of ``examples.jsonl`` holds them. α (§3.1) is accepted over accepted +
rejected; a tree round rejects when it accepts fewer than its D levels.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from specdec_jax.decoding import SpecStats, TreeStats
from specdec_jax.tree import TreeShape


@dataclasses.dataclass(frozen=True)
class RowCounts:
  """Per-row counts of one batch, host arrays ([B] unless noted).

  kind: 'chain' (fixed or adaptive γ), 'tree' or 'plain'. target_calls,
  draft_calls: serial forward passes of M_p / M_q. accepted: proposals committed;
  rejected: rejections (see the module). target_positions: positions the target
  scored. min_pq_sum: Σ_x min(p, q) over evaluated positions (Corollary 3.6; None
  for trees and plain decoding). histograms: name -> [B, H] (``SpecStats``' or
  ``TreeStats``'; plain decoding's ``gamma_hist`` [B, 1]).
  """

  kind: str
  target_calls: np.ndarray
  draft_calls: np.ndarray
  accepted: np.ndarray
  rejected: np.ndarray
  target_positions: np.ndarray
  min_pq_sum: np.ndarray | None
  histograms: dict[str, np.ndarray]

  @classmethod
  def of_chain(cls, st: SpecStats) -> "RowCounts":
    """A chain (or adaptive) run's ``SpecStats``, on the host."""
    return cls("chain", st.target_calls, st.draft_calls, st.accepted, st.rejected,
               st.target_positions, st.min_pq_sum,
               {"accepted_at": st.accepted_at, "evaluated_at": st.evaluated_at,
                "gamma_hist": st.gamma_hist})

  @classmethod
  def of_tree(cls, st: TreeStats, tree: TreeShape) -> "RowCounts":
    """A tree run's ``TreeStats``, on the host."""
    rejected = st.target_calls - st.depth_hist[:, tree.max_depth]
    return cls("tree", st.target_calls, st.draft_calls, st.accepted, rejected,
               st.target_positions, None, {"depth_hist": st.depth_hist, "rank_hist": st.rank_hist})

  @classmethod
  def of_plain(cls, length: np.ndarray) -> "RowCounts":
    """Plain decoding of length [B] tokens: one target step per token, no draft."""
    length = np.asarray(length)
    zero = np.zeros_like(length)
    return cls("plain", length, zero, zero, zero, length, None, {"gamma_hist": length[:, None]})

  def line(self, j: int) -> dict[str, Any]:
    """Row ``j``'s fields of an ``examples.jsonl`` line."""
    evaluated = int(self.accepted[j]) + int(self.rejected[j])
    out: dict[str, Any] = {
        "target_calls": int(self.target_calls[j]), "draft_calls": int(self.draft_calls[j]),
        "accepted": int(self.accepted[j]), "rejected": int(self.rejected[j]),
        "target_positions": int(self.target_positions[j]),
        # α of the row (None for plain decoding, which proposes nothing).
        "alpha": None if self.kind == "plain" else int(self.accepted[j]) / max(evaluated, 1)}
    if self.min_pq_sum is not None:
      out["min_pq_sum"] = float(self.min_pq_sum[j])
      out["alpha_min_pq"] = float(self.min_pq_sum[j]) / max(evaluated, 1)
    out.update({name: h[j].tolist() for name, h in self.histograms.items()})
    return out
