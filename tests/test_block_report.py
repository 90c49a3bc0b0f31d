"""summary.json's acceptance by position and draft calls per round
(``run.report.summarize``) from examples.jsonl-style lines, for a chain of
a one-call (block) draft and for a tree."""

from __future__ import annotations

import pytest

from specdec_jax import theory
from specdec_jax.run import report
from specdec_jax.run.settings import Experiment

COSTS = {"c": 0.1, "v": 1.2, "target_step_ms": 2.0, "verify_ms": 2.4, "draft_token_ms": 0.2,
         "interplay": 1.0}


def line(**kw) -> dict:
  base = dict(gamma=3, accepted=0, rejected=0, tokens=10, target_calls=4, draft_calls=4,
              baseline_s=1.0, speculative_s=0.5, baseline_tokens=10, matches_baseline=True,
              **COSTS)
  return {**base, **kw}


def test_chain_lines_give_alpha_by_position_and_one_call_pricing():
  # Two lines: position 1 accepted 6 of 8, position 2 3 of 6, position 3 1 of 3.
  records = [line(accepted=4, rejected=3, accepted_at=[3, 1, 0], evaluated_at=[4, 3, 1]),
             line(accepted=6, rejected=4, accepted_at=[3, 2, 1], evaluated_at=[4, 3, 2])]
  s = report.summarize(Experiment(gamma=3), records)
  assert s["alpha_by_position"] == pytest.approx([6 / 8, 3 / 6, 1 / 3])
  assert s["draft_calls_per_round"] == 1.0
  tokens = 1 + 0.75 + 0.75 * 0.5 + 0.75 * 0.5 / 3
  assert s["tokens_per_round_by_position"] == pytest.approx(tokens)
  # One call: the round costs c + v, not 3 c + v.
  assert s["expected_speedup_by_position"] == pytest.approx(tokens / (0.1 + 1.2))
  assert s["tokens_per_target_call_eq1"] == pytest.approx(
      float(theory.expected_tokens(s["alpha"], 3)))
  assert s["expected_speedup_v"] == pytest.approx(s["tokens_per_target_call_eq1"] / 1.3)


def test_tree_lines_give_alpha_by_depth():
  # depth_hist: rounds that accepted 0, 1, 2 levels.
  records = [line(depth_hist=[2, 3, 5], rank_hist=[8, 0], draft_calls=10, target_calls=10,
                  accepted=13, rejected=5)]
  s = report.summarize(Experiment(tree="full:2,1"), records)
  assert s["alpha_by_position"] == pytest.approx([8 / 10, 5 / 8])
  assert s["draft_calls_per_round"] == 1.0
  assert s["tokens_per_round_by_position"] == pytest.approx(1 + 0.8 + 0.5)
