"""Choosing γ by measurement: the paper's §3.5 with this machine's costs.

Section 3.5 picks the γ that maximizes Theorem 3.8's expected improvement
given α and c. On real hardware the target's pass over γ + 1 tokens is not
free (its cost relative to a one-token step is v(γ), see ``timing``), so the
choice maximizes the v-generalized form

    (1 - α^(γ+1)) / ((1 - α)(γ c(γ) + v(γ)))

over γ = 1..γ_max, with α estimated on the warm-up examples or a held-out
source (``specdec_jax.alpha``: Corollary 3.6's E[Σ_x min(p(x), q(x))] along
the target's own outputs) and c(γ), v(γ) timed with the jitted pieces the loop
runs, scaled by what the two cost together when they alternate as in a round
(``timing.Costs.interplay``). Where no γ is predicted to beat plain decoding
the choice is γ = 0, and the run decodes with the target alone.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import jax
import numpy as np
from absl import logging

from specdec_jax import theory
from specdec_jax.alpha import estimate_alpha
from specdec_jax.decoding import cache_length
from specdec_jax.models.t5 import T5Model
from specdec_jax.sampling import SamplingConfig
from specdec_jax.timing import Costs, measure_costs_many

Array = jax.Array

# Below this many target tokens the α estimate is too noisy to choose γ on a
# flat curve: on the demo pair, 80 warm-up tokens gave α 0.725 against 0.63 on
# 100 examples, and 'auto' chose γ = 5 (0.75X) over γ = 1 (0.92X).
MIN_ALPHA_TOKENS = 500


@dataclasses.dataclass(frozen=True)
class GammaChoice:
  """The outcome of ``choose_gamma``: what was measured and what it implies.

  ``gamma`` 0 is plain decoding: the prediction is below 1 for every γ
  considered, so the run decodes with the target alone (``plain``)."""

  gamma: int                         # the choice; 0: plain decoding
  alpha: float                       # Σmin(p, q) / tokens on the warm-up outputs
  tokens: int                        # tokens α was estimated on
  alpha_se: float                    # its standard error (``alpha.alpha_standard_error``)
  c: dict[int, float]                # in context (``timing.Costs.c_in_context``)
  v: dict[int, float]                # in context (``timing.Costs.v_in_context``)
  predicted: dict[int, float]        # v-generalized Theorem 3.8 per γ
  gap_se: dict[int, float]           # s.e. of predicted[best] - predicted[γ]
  argmax: int                        # the curve's argmax (gamma is within gap_se of it)

  @property
  def plain(self) -> bool:
    """No γ ≤ γ_max is predicted to beat plain decoding: decode without a draft."""
    return self.gamma == 0

  def as_record(self) -> dict:
    """JSON-ready (string keys), for examples.jsonl and summary.json."""
    per = lambda d: {str(g): float(x) for g, x in sorted(d.items())}
    return {"gamma": self.gamma, "plain": self.plain, "alpha_warmup": self.alpha,
            "alpha_tokens": self.tokens, "alpha_se": self.alpha_se, "c": per(self.c),
            "v": per(self.v), "predicted": per(self.predicted), "argmax": self.argmax,
            "gap_se": per(self.gap_se)}


def in_context_costs(costs: dict[int, Costs], gammas: Sequence[int]
                     ) -> tuple[dict[int, float], ...]:
  """(c, v, c_se, v_se) per γ with the two models timed alternating, as a
  round runs them (``timing.Costs.interplay``). The interplay grows with γ
  where the draft's steps evict the target's weights, so ignoring it favours
  long γ."""
  c = {g: costs[g].c_in_context for g in gammas}
  v = {g: costs[g].v_in_context for g in gammas}
  c_se = {g: costs[g].c_se * costs[g].interplay for g in gammas}
  v_se = {g: costs[g].v_se * costs[g].interplay for g in gammas}
  return c, v, c_se, v_se


def choose_gamma(target: T5Model, params: Any, draft: Any,
                 batches: Sequence[tuple[Array, int]], key: Array, sampling: SamplingConfig,
                 max_decode_len: int, gamma_max: int, partitioner: Any = None,
                 costs: Optional[dict[int, Costs]] = None) -> GammaChoice:
  """α on ``batches`` (the warm-up examples, see ``alpha.estimate_alpha``),
  c(γ) and v(γ) for γ = 1..γ_max (timed on the first batch), and the γ that
  maximizes the v-generalized Theorem 3.8 (``theory.gamma_curve``) — the
  smallest γ within one standard error of the maximum, the errors being α's
  (over warm-up sequences) and the timings' (over repeats). Where the
  prediction is below 1 for every γ (a slow verification, an expensive or
  poorly aligned draft), the choice is γ = 0: plain decoding, which no γ
  considered is predicted to beat.

  ``costs`` reuses measurements already made (e.g. by a sweep; pass all of
  1..γ_max from one ``measure_costs_many`` so they are comparable); missing γ
  are measured here together, in one interleaved measurement.
  """
  if gamma_max < 1:
    raise ValueError(f"gamma_max must be >= 1, got {gamma_max}")
  # A state-reading draft's α depends a little on γ (the staleness of what it
  # reads); it is measured in rounds at γ_max, the longest rounds considered.
  alpha, tokens, alpha_se = estimate_alpha(target, params, draft, batches, key, sampling,
                                           max_decode_len, partitioner, rounds_gamma=gamma_max)
  costs = dict(costs or {})
  missing = [g for g in range(1, gamma_max + 1) if g not in costs]
  if missing:
    costs.update(measure_costs_many(target, params, draft, batches[0][0], missing, sampling,
                                    cache_len=cache_length(max_decode_len, gamma_max),
                                    partitioner=partitioner))
  c, v, c_se, v_se = in_context_costs(costs, range(1, gamma_max + 1))
  gamma, argmax, curve, gap_se = theory.gamma_curve(alpha, c, v, alpha_se, c_se, v_se)
  if tokens < MIN_ALPHA_TOKENS:
    # Tokens of one sequence are correlated, so the true error is larger still.
    logging.warning("gamma='auto': alpha estimated on only %d target tokens (standard error "
                    "at least %.3f); the choice may be off on a flat curve. Raise "
                    "Experiment.num_warmup (>= %d tokens recommended)", tokens,
                    float(np.sqrt(alpha * (1 - alpha) / max(tokens, 1))), MIN_ALPHA_TOKENS)
  logging.info("gamma='auto': alpha %.3f +- %.3f on %d warm-up tokens; predicted "
               "improvement by gamma (+- s.e. of its gap to the best): %s -> argmax %d, "
               "best within one s.e. %d", alpha, alpha_se, tokens,
               ", ".join(f"{g}: {s:.2f}x +- {gap_se[g]:.2f}" for g, s in curve.items()),
               argmax, gamma)
  if curve[argmax] < 1.0:
    gamma = 0
    logging.warning("gamma='auto' chose plain decoding (gamma 0): no gamma in 1..%d is "
                    "predicted to beat it (best %.2fx at gamma %d with alpha %.3f, c %.3f and "
                    "v %.2f in context); the run decodes with the target alone",
                    gamma_max, curve[argmax], argmax, alpha, c[argmax], v[argmax])
  return GammaChoice(gamma, alpha, tokens, alpha_se, c, v, curve, gap_se, argmax)
