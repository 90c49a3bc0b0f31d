"""Choosing γ by measurement (§3.5): maximize Theorem 3.8 generalized by v,
S(γ) = (1 - α^(γ+1)) / ((1 - α)(γ c(γ) + v(γ))), over γ = 1..γ_max, α from
Corollary 3.6 and γ c + v a round timed whole. The choice is γ = 0 (the target
alone) unless the best prediction beats 1 by more than its standard error;
else the smallest γ within one standard error of the best whose own gain
exceeds its error."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import jax
import numpy as np
from absl import logging

from specdec_jax import theory
from specdec_jax.alpha import alpha_by_position_in_rounds, estimate_alpha
from specdec_jax.decoding import cache_length
from specdec_jax.drafts.base import capabilities
from specdec_jax.models.t5 import T5Model
from specdec_jax.sampling import SamplingConfig
from specdec_jax.theory import RoundCost
from specdec_jax.timing import measure_costs_many

Array = jax.Array

# Below this many target tokens α is too noisy to choose γ on a flat curve.
MIN_ALPHA_TOKENS = 500


@dataclasses.dataclass(frozen=True)
class GammaChoice:
  """The outcome of ``choose_gamma``: what was measured and what it implies."""

  gamma: int                         # the choice; 0: plain decoding
  alpha: float                       # Σmin(p, q) / tokens on the warm-up outputs
  tokens: int                        # tokens α was estimated on
  alpha_se: float                    # its standard error (``alpha.alpha_standard_error``)
  c: dict[int, float]                # in context (``RoundCost.c_in_context``)
  v: dict[int, float]                # in context (``RoundCost.v_in_context``)
  round_se: dict[int, float]         # s.e. of γ c + v, the round timed whole
  predicted: dict[int, float]        # v-generalized Theorem 3.8 per γ
  predicted_se: dict[int, float]     # its standard error (``theory.improvement_se``)
  gap_se: dict[int, float]           # s.e. of predicted[argmax] - predicted[γ]
  argmax: int                        # the curve's argmax
  # The one cost measurement behind the choice, per γ: the run's costs too.
  costs: dict[int, RoundCost] = dataclasses.field(default_factory=dict, compare=False, repr=False)
  # A one-call draft's acceptance by position in rounds at γ_max (``decide``).
  alpha_by_position: Optional[list[float]] = None

  @property
  def plain(self) -> bool:
    return self.gamma == 0

  def as_record(self) -> dict:
    """JSON-ready (string keys), for examples.jsonl and summary.json."""
    per = lambda d: {str(g): float(x) for g, x in sorted(d.items())}
    return {"gamma": self.gamma, "plain": self.plain, "alpha_warmup": self.alpha,
            "alpha_tokens": self.tokens, "alpha_se": self.alpha_se, "c": per(self.c),
            "v": per(self.v), "round_se": per(self.round_se), "predicted": per(self.predicted),
            "predicted_se": per(self.predicted_se), "argmax": self.argmax,
            "gap_se": per(self.gap_se), "alpha_by_position": self.alpha_by_position}

  @classmethod
  def from_record(cls, record: dict) -> GammaChoice:
    """A recorded choice (``as_record``), without its costs."""
    per = lambda key: {int(g): float(x) for g, x in record.get(key, {}).items()}
    return cls(record["gamma"], record["alpha_warmup"], record["alpha_tokens"],
               record["alpha_se"], per("c"), per("v"), per("round_se"), per("predicted"),
               per("predicted_se"), per("gap_se"), record["argmax"],
               alpha_by_position=record.get("alpha_by_position"))


def in_context_costs(costs: dict[int, RoundCost], gammas: Sequence[int]
                     ) -> tuple[dict[int, float], dict[int, float], dict[int, float]]:
  """(c, v, round_se) per γ, timed as a round runs them (γ c + v the round
  in one-token steps); c is per proposed token, draft_calls · c / γ."""
  c = {g: costs[g].c_in_context * costs[g].draft_calls / g for g in gammas}
  v = {g: costs[g].v_in_context for g in gammas}
  return c, v, {g: costs[g].round_se for g in gammas}


def decide(alpha: float, tokens: int, alpha_se: float, costs: dict[int, RoundCost], gamma_max: int,
           alpha_by_position: Optional[Sequence[float]] = None) -> GammaChoice:
  """The choice by this module's rule. With ``alpha_by_position`` (a one-call
  draft's α_1..α_γmax) tokens per round are 1 + Σ_{i≤γ} Π_{j≤i} α_j in
  place of Eq. (1)."""
  gammas = range(1, gamma_max + 1)
  c, v, round_se = in_context_costs(costs, gammas)
  # The round is timed whole: its error is the denominator's, which S takes as v's.
  _, argmax, curve, gap_se = theory.gamma_curve(alpha, c, v, alpha_se, {}, round_se)
  if alpha_by_position is not None:
    curve = {g: theory.expected_tokens_by_position(alpha_by_position[:g]) / (g * c[g] + v[g])
             for g in gammas}
    argmax = max(gammas, key=lambda g: (curve[g], -g))
  se = {g: theory.improvement_se(alpha, g, c[g], v[g], alpha_se, 0.0, round_se[g])
        for g in gammas}
  pays = lambda g: curve[g] - 1.0 > se[g]
  gamma = 0
  if pays(argmax):
    gamma = min(g for g in gammas if pays(g) and curve[argmax] - curve[g] <= gap_se[g])
  return GammaChoice(gamma, alpha, tokens, alpha_se, c, v, round_se, curve, se, gap_se, argmax,
                     dict(costs), None if alpha_by_position is None else
                     [float(a) for a in alpha_by_position])


def choose_gamma(target: T5Model, params: Any, draft: Any,
                 batches: Sequence[tuple[Array, int]], key: Array, sampling: SamplingConfig,
                 max_decode_len: int, gamma_max: int, partitioner: Any = None,
                 costs: Optional[dict[int, RoundCost]] = None, repeats: int = 15) -> GammaChoice:
  """α on ``batches``, c(γ) and v(γ) for γ = 1..γ_max (``costs``: those
  already measured) and the choice (``decide``), which carries its costs."""
  if gamma_max < 1:
    raise ValueError(f"gamma_max must be >= 1, got {gamma_max}")
  # A state-reading draft's α depends a little on γ: measured in rounds at γ_max.
  alpha, tokens, alpha_se = estimate_alpha(target, params, draft, batches, key, sampling,
                                           max_decode_len, partitioner, rounds_gamma=gamma_max)
  costs = dict(costs or {})
  missing = [g for g in range(1, gamma_max + 1) if g not in costs]
  if missing:
    costs.update(measure_costs_many(target, params, draft, batches[0][0], missing, sampling,
                                    cache_len=cache_length(max_decode_len, gamma_max),
                                    repeats=repeats, partitioner=partitioner))
  by_position = None
  if capabilities(draft).proposal_steps:
    # A one-call draft's acceptance falls with the position.
    by_position = alpha_by_position_in_rounds(target, params, draft, batches, key, gamma_max,
                                              sampling, max_decode_len, partitioner)
  choice = decide(alpha, tokens, alpha_se, costs, gamma_max, by_position)
  if tokens < MIN_ALPHA_TOKENS:
    # Tokens of one sequence are correlated, so the true error is larger still.
    logging.warning("gamma='auto': alpha estimated on only %d target tokens (standard error "
                    "at least %.3f); the choice may be off on a flat curve. Raise "
                    "Experiment.num_warmup (>= %d tokens recommended)", tokens,
                    float(np.sqrt(alpha * (1 - alpha) / max(tokens, 1))), MIN_ALPHA_TOKENS)
  curve, se, best = choice.predicted, choice.predicted_se, choice.argmax
  logging.info("gamma='auto': alpha %.3f +- %.3f on %d warm-up tokens; predicted "
               "improvement by gamma (+- its s.e.): %s -> argmax %d, chosen %d", alpha,
               alpha_se, tokens, ", ".join(f"{g}: {s:.2f}x +- {se[g]:.2f}"
                                           for g, s in curve.items()), best, choice.gamma)
  if choice.plain:
    logging.warning("gamma='auto' chose plain decoding (gamma 0): no gamma in 1..%d is "
                    "predicted to beat it by more than the prediction's standard error "
                    "(best %.2fx +- %.2f at gamma %d with alpha %.3f, c %.3f and v %.2f in "
                    "context); the run decodes with the target alone", gamma_max, curve[best],
                    se[best], best, alpha, choice.c[best], choice.v[best])
  return choice
