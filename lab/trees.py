"""Token trees against chains on one pair of models: tokens per target call,
measured, and the accelerator speedup that acceptance would buy under a
roofline model of the target's pass (paper §3.3-3.4: a round costs the draft's
calls plus one target pass whose price v grows with the positions scored).

``compare`` decodes the same inputs with each chain γ and each tree (batched,
every row's own counts), ``roofline_speedup`` prices a round on a TPU chip
from the two models' shapes. Used by ``scripts/bench_tree.py``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from specdec_jax.decoding import (speculative_decode, temperature_sample,
                                  tree_speculative_decode)
from specdec_jax.dryrun import calibration
from specdec_jax.dryrun.chips import Chip
from specdec_jax.dryrun.costs import Piece
from specdec_jax.models.t5 import get_config
from specdec_jax.measured import DEMO_RANK_PROFILE
from specdec_jax.models.t5 import T5Config
from specdec_jax.sampling import SamplingConfig
from specdec_jax.theory import RoundCost
from specdec_jax.timing import timed
from specdec_jax import tree as tree_lib
from specdec_jax.tree import TreeShape

from lab import common

Shape = Union[int, TreeShape]  # an int is the chain of that γ (the chain engine)


@dataclasses.dataclass
class Row:
  """One shape's totals over the inputs (``compare``)."""

  label: str
  width: int                # positions the target scores per call (N, or γ + 1)
  depth: int                # most proposals one round can accept (D, or γ)
  tokens: int               # output tokens
  target_calls: int
  draft_calls: int
  sibling_wins: int         # accepted nodes that were not a first child (trees)
  accepted: int             # accepted proposals
  seconds: float            # one timed call over all inputs (compiled beforehand)

  @property
  def tokens_per_call(self) -> float:
    return self.tokens / max(self.target_calls, 1)

  @property
  def draft_per_call(self) -> float:
    return self.draft_calls / max(self.target_calls, 1)


def _run(target, params, draft, inputs, key, shape: Shape, sampling: SamplingConfig,
         max_decode_len: int, eos_id: int):
  if isinstance(shape, TreeShape):
    return tree_speculative_decode(target, params, draft, inputs, key, tree=shape,
                                   max_decode_len=max_decode_len, sampling=sampling,
                                   eos_id=eos_id)
  return speculative_decode(target, params, draft, inputs, key, gamma=shape,
                            max_decode_len=max_decode_len, sampling=sampling, eos_id=eos_id)


def compare(target, params, draft, inputs: np.ndarray, shapes: Mapping[str, Shape],
            sampling: SamplingConfig, max_decode_len: int, eos_id: int = 1,
            seed: int = 0) -> tuple[list[Row], float]:
  """Every shape over the same batch of inputs [B, S] (one call each, after
  a compiling call), and the baseline's seconds over them. -> (rows,
  baseline seconds). At temperature 0 every row's tokens equal the
  baseline's (checked here: a mismatch raises)."""
  inputs = jnp.asarray(inputs)
  key = jax.random.PRNGKey(seed)
  base = lambda: temperature_sample(target, params, inputs, key, max_decode_len=max_decode_len,
                                    sampling=sampling, eos_id=eos_id)
  want = jax.block_until_ready(base())
  base_s = timed(base)[1]
  rows = []
  for label, shape in shapes.items():
    call = lambda: _run(target, params, draft, inputs, key, shape, sampling, max_decode_len,
                        eos_id)
    out = jax.block_until_ready(call())
    secs = timed(call)[1]
    if sampling.greedy and not np.array_equal(np.asarray(out.tokens), np.asarray(want.tokens)):
      raise AssertionError(f"{label}: output differs from the baseline's at temperature 0")
    st = out.stats
    if isinstance(shape, TreeShape):
      width, depth = shape.num_nodes, shape.max_depth
      wins = int(np.asarray(st.rank_hist)[:, 1:].sum())
    else:
      width, depth, wins = shape + 1, shape, 0
    rows.append(Row(label, width, depth, int(np.asarray(out.length).sum()),
                    int(np.asarray(st.target_calls).sum()), int(np.asarray(st.draft_calls).sum()),
                    wins, int(np.asarray(st.accepted).sum()), secs))
  return rows, base_s


def pass_seconds(cfg: T5Config, chip: Chip, devices: int, width: int, cache_len: int,
                 input_len: int, param_dtype: str = "bfloat16") -> float:
  """A roofline model of one decoder pass over ``width`` positions at batch 1,
  the weights split over ``devices`` chips: max(flops / peak, bytes / HBM
  bandwidth), bytes = what a decoding step reads (``common.step_bytes``: the
  decoder and output-layer weights and the decoder cache, at
  ``param_dtype``); flops = 2 per weight read per position. A model, not a
  measurement: no collectives, no launch latency."""
  nbytes = common.step_bytes(cfg, None, param_dtype, param_dtype, 1, input_len,
                             cache_len) / devices
  flops = 2.0 * common.step_params(cfg) * width / devices
  return max(flops / chip.peak_flops, nbytes / chip.hbm_bandwidth)


def roofline_speedup(row: Row, target_cfg: T5Config, draft_cfg: T5Config, chip: Chip,
                     devices: int, cache_len: int = 256, input_len: int = 512) -> dict[str, float]:
  """The speedup a row's measured acceptance would give on ``chip`` under
  ``pass_seconds``: tokens per call / (draft calls per call · c + v(width)),
  with c = a one-position draft pass over a one-position target pass and
  v(width) = the target's pass over ``width`` positions over a one-position
  one (Theorem 3.8's accounting with v, §3.4). The target is split over
  ``devices`` chips, the draft replicated on each (as the engine runs them).
  A T5 draft's tree call feeds a whole depth of nodes: priced as one pass of
  that draft."""
  target_pass = lambda k: pass_seconds(target_cfg, chip, devices, k, cache_len, input_len)
  # The engine replicates the draft (partitioning.DATA_PARALLEL_RULES): each
  # chip reads all of its weights per step, however many chips there are.
  step = target_pass(1)
  model = RoundCost(row.width - 1,
                    pass_seconds(draft_cfg, chip, 1, 1, cache_len, input_len) / step,
                    target_pass(row.width) / step, draft_calls=row.draft_per_call)
  return {"c": model.c, "v": model.v, "speedup": model.speedup(row.tokens_per_call)}


def trim_padding(inputs: np.ndarray) -> np.ndarray:
  """Drops the columns that are padding in every row (fewer positions to encode)."""
  used = np.nonzero(np.any(np.asarray(inputs) != 0, axis=0))[0]
  return np.asarray(inputs)[:, :int(used.max()) + 1 if used.size else 1]


def summary(rows: list[Row], chains: Mapping[int, str]) -> list[dict[str, Any]]:
  """Each row with its gain in tokens per call over the chain of the same
  depth (``chains``: depth -> that chain's label), where there is one."""
  by_label = {r.label: r for r in rows}
  out = []
  for r in rows:
    ref = by_label.get(chains.get(r.depth, ""))
    gain = r.tokens_per_call / ref.tokens_per_call - 1 if ref is not None else float("nan")
    out.append({"row": r, "gain_vs_chain": gain})
  return out


def rank_rates(target, params, draft, inputs: np.ndarray, max_decode_len: int, ranks: int = 8,
               eos_id: int = 1) -> list[float]:
  """At temperature 0, how often the target's next token is the draft's k-th
  choice (k = 1..``ranks``): decode ``inputs`` with the one-level tree of
  ``ranks`` children (``TreeShape.spine((ranks,))``), where every round tests
  exactly the draft's top ``ranks`` tokens after the committed prefix, and
  count which rank won per round. Any draft that fills trees works (its own
  logits, shortlist and bridges as it decodes). The rates
  ``TreeShape.from_acceptance`` builds a tree from; estimate them on held-out
  inputs, never on the ones a benchmark reports."""
  out = tree_speculative_decode(target, params, draft, jnp.asarray(inputs),
                                jax.random.PRNGKey(0), tree=TreeShape.spine((ranks,)),
                                max_decode_len=max_decode_len, eos_id=eos_id)
  wins = np.asarray(out.stats.rank_hist).sum(0)
  calls = max(int(np.asarray(out.stats.target_calls).sum()), 1)
  return [float(w) / calls for w in wins]


# ------------------------------------------------- best trees under the model


def geometric_rates(alpha: float, ranks: int = 8) -> list[float]:
  """Rank rates α (1 - α)^(k - 1) from one α: an ASSUMPTION, generous to low ranks."""
  return [alpha * (1 - alpha) ** k for k in range(ranks)]


def scaled_rates(alpha: float, profile: Sequence[float] = DEMO_RANK_PROFILE) -> list[float]:
  """``tree.scaled_rank_rates`` (kept under this name for the studies)."""
  return tree_lib.scaled_rank_rates(alpha, profile)


def expected_tokens(tree: TreeShape, rates: Sequence[float]) -> float:
  """``TreeShape.expected_tokens`` (kept under this name for the studies)."""
  return tree.expected_tokens(rates)


@dataclasses.dataclass(frozen=True)
class StepModel:
  """One decoding step's cost on a topology (``dryrun.costs``' terms) from
  one chip's compiled one-position pieces (``dryrun.calibration.PIECES``):
  the target split over ``devices`` chips (flops and bytes divided, an
  all-reduce of [width, d_model] bf16 per attention block and MLP per
  decoder layer over the chips), the draft replicated."""

  chip: Chip
  devices: int
  target: Piece              # one chip, one position
  draft: Piece               # one chip, one position
  target_layers: int
  d_model: int

  def target_seconds(self, width: int) -> float:
    t, n = self.target, self.devices
    piece = Piece(t.flops * width / n, t.bytes / n, t.ops,
                  ((("all-reduce", 2 * width * self.d_model, n), 3 * self.target_layers),)
                  if n > 1 else ())
    return piece.seconds(self.chip)

  def draft_seconds(self) -> float:
    return self.draft.seconds(self.chip)

  def round_cost(self, tree: TreeShape) -> RoundCost:
    """A round of ``tree`` (a chain is ``TreeShape.chain``) at these prices
    (``theory.RoundCost``: one draft call per depth, one pass over the N
    nodes)."""
    step = self.target_seconds(1)
    return RoundCost.for_tree(tree, self.draft_seconds() / step,
                              self.target_seconds(tree.num_nodes) / step, step_ms=1e3 * step)

  def ms_per_token(self, tree: TreeShape, rates: Sequence[float]) -> float:
    """Milliseconds per token: a round over its expected tokens."""
    return self.round_cost(tree).ms_per_token(expected_tokens(tree, rates))

  def speedup(self, tree: TreeShape, rates: Sequence[float]) -> float:
    """Tokens per round over the round's cost in target steps; Theorem 3.8's
    accounting with v (§3.4)."""
    return float(self.round_cost(tree).speedup(expected_tokens(tree, rates)))


def step_model(chip: Chip, devices: int, draft: str) -> StepModel:
  """The ``StepModel`` for T5 1.1 XXL with a T5 1.1 draft (``draft``:
  'small', 'base' or 'large') from the stored one-chip pieces, at ``chip``'s
  figures (its fixed cost per operation included)."""
  got = calibration.pieces()
  cfg = get_config("t5_1_1_xxl")
  return StepModel(chip, devices, got["target"], got[draft], cfg.num_decoder_layers,
                   cfg.d_model)


def best_tree(model: StepModel, rates: Sequence[float],
              max_nodes: int = 64) -> tuple[TreeShape, float]:
  """The tree of at most ``max_nodes`` nodes with the largest modelled
  speedup under rank acceptance ``rates`` (for each N and depth cap,
  ``TreeShape.from_acceptance``'s tree) -> (tree, speedup)."""
  best: tuple[Optional[TreeShape], float] = (None, 0.0)
  for n in range(2, max_nodes + 1):
    for depth in range(1, n):
      try:
        tree = TreeShape.from_acceptance(rates, n, depth)
      except ValueError:
        continue
      got = model.speedup(tree, rates)
      if got > best[1]:
        best = (tree, got)
  assert best[0] is not None
  return best[0], best[1]
