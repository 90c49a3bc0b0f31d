"""gamma='auto''s rule on given measurements (no model runs): plain decoding
unless the best γ's predicted gain exceeds its own standard error."""

from __future__ import annotations

import pytest

from lab import theory as lab_theory
from specdec_jax import theory
from specdec_jax.run import autogamma
from specdec_jax.theory import RoundCost


def _costs(gamma: int, c: float, v: float, round_se: float, interplay: float = 1.0
           ) -> RoundCost:
  return RoundCost(gamma, c, v, step_ms=1.0, interplay=interplay, round_se=round_se)


def _round_se_for(target_se: float, alpha: float, alpha_se: float, gamma: int, c: float,
                  v: float) -> float:
  """The round's s.e. that makes S(γ)'s standard error ``target_se``."""
  from_alpha = theory.improvement_se(alpha, gamma, c, v, alpha_se)
  s = theory.walltime_improvement(alpha, gamma, c, v)
  return (target_se ** 2 - from_alpha ** 2) ** 0.5 * (gamma * c + v) / s


@pytest.mark.parametrize("ratio, want", [(0.9, 2), (1.1, 0)])
def test_plain_unless_the_best_gain_exceeds_its_standard_error(ratio, want):
  """α 0.6 ± 0.01, c 0.2, v 1: S = 1.33, 1.40, 1.36 for γ = 1, 2, 3. With the
  round's timing error set so that se(S(2)) is 0.9 × its gain the choice is
  γ = 2 (γ = 1 is within its gap's s.e. of the best but its own gain is
  below its s.e.); at 1.1 × the gain, with every γ's gain below its own
  s.e., it is plain decoding."""
  alpha, alpha_se, c, v = 0.6, 0.01, 0.2, 1.0
  gain = theory.walltime_improvement(alpha, 2, c, v) - 1
  rse = _round_se_for(ratio * gain, alpha, alpha_se, 2, c, v)
  choice = autogamma.decide(alpha, 1000, alpha_se, {g: _costs(g, c, v, rse) for g in (1, 2, 3)}, 3)
  assert choice.argmax == 2 and choice.predicted_se[2] == pytest.approx(ratio * gain)
  if want == 0:
    assert all(choice.predicted[g] - 1 < choice.predicted_se[g] for g in (1, 2, 3))
  else:
    assert choice.predicted[2] - choice.predicted[1] <= choice.gap_se[1]
    assert choice.predicted[1] - 1 < choice.predicted_se[1]
  assert choice.gamma == want and choice.plain == (want == 0)
  rec = choice.as_record()
  assert rec["gamma"] == want and rec["predicted_se"]["2"] == pytest.approx(ratio * gain)
  assert rec["round_se"]["2"] == pytest.approx(rse)
  # A resumed run reads the choice back from its record (its costs it times anew).
  back = autogamma.GammaChoice.from_record(rec)
  assert back.as_record() == rec and back == choice and back.costs == {}


def test_costs_in_context_and_the_smallest_gamma_within_the_gap():
  """The prediction uses the in-context costs (c and v times the interplay),
  and among the γ that pay, the smallest within one s.e. of the best's gap."""
  alpha = 0.8
  costs = {g: _costs(g, 0.2, 1.0, 0.0, interplay=1.5) for g in (1, 2, 3, 4)}
  exact = autogamma.decide(alpha, 1000, 0.0, costs, 4)
  for g in (1, 2, 3, 4):
    assert exact.predicted[g] == pytest.approx(theory.walltime_improvement(alpha, g, 0.3, 1.5))
  assert exact.gamma == exact.argmax == lab_theory.optimal_gamma(alpha, 0.3, 1.5, max_gamma=4) == 4
  # A large α error widens the gaps: a shorter γ is chosen, still a gain beyond its s.e.
  loose = autogamma.decide(alpha, 1000, 0.05, costs, 4)
  assert loose.gamma < loose.argmax
  assert loose.predicted[loose.gamma] - 1 > loose.predicted_se[loose.gamma]


def test_a_one_call_draft_is_priced_by_its_calls_and_its_acceptance_by_position():
  """A block draft (one call a round): c per call, so γ c + v of a chain
  would overprice it; with α falling by position the choice stops where the
  next position no longer pays, though one α would go on."""
  block = {g: RoundCost(g, 0.1, 1.0, draft_calls=1) for g in range(1, 9)}
  flat = autogamma.decide(0.8, 1000, 0.0, block, 8)
  assert flat.argmax == 8        # one call whatever γ: the longest round wins at one α
  for g in range(1, 9):          # the round is c + v, not γ c + v
    assert flat.predicted[g] == pytest.approx(
        float(theory.expected_tokens(0.8, g)) / 1.1, rel=1e-6)
  falling = [0.8, 0.6, 0.3, 0.05, 0.01, 0.0, 0.0, 0.0]
  choice = autogamma.decide(0.8, 1000, 0.0, block, 8, falling)
  assert choice.alpha_by_position == falling
  assert choice.predicted[3] == pytest.approx((1 + 0.8 + 0.48 + 0.144) / 1.1)
  assert choice.argmax < 8 and choice.gamma == choice.argmax
  assert autogamma.GammaChoice.from_record(choice.as_record()).alpha_by_position == falling
