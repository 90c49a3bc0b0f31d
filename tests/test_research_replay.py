"""Adaptive rounds' machinery and a rule's rounds replayed
(lab.replay)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from specdec_jax import drafts
from specdec_jax.decoding import AdaptiveConfig
from specdec_jax.drafts.base import init_draft
from lab.replay import (WidthSchedule, adaptive_pieces, adaptive_pieces_markdown,
                        adaptive_replay, adaptive_replay_markdown)
from specdec_jax.sampling import SamplingConfig


def test_adaptive_pieces_times_both_paths(tiny_target, tiny_draft):
  """``scripts/adaptive_pieces.py``: one row per k with all four pieces timed; the
  switch branch computes what ``decode`` does (checked in test_model), so here
  only that every piece ran and was timed."""
  model, params = tiny_target
  dm, dp = tiny_draft
  draft = drafts.T5Draft(params=dp, model=dm)
  x = jax.random.randint(jax.random.PRNGKey(2), (1, 10), 2, 64)
  rows = adaptive_pieces(model, params, draft, x, [1, 3], 3, SamplingConfig(), cache_len=48,
                         inner=2, repeats=2)
  assert [r.k for r in rows] == [1, 3]
  assert all(v > 0 for r in rows for v in r[1:])
  table = adaptive_pieces_markdown(rows)
  assert table.count("\n") == 3 and "switch branch + write ms" in table


def test_adaptive_replay_reproduces_the_rules_rounds(tiny_target, tiny_draft):
  """``scripts/adaptive_replay.py``: the rule's recorded widths, replayed as a fixed
  schedule, give the same tokens and widths (``adaptive_replay`` raises
  otherwise; checked here against a schedule that is *not* the rule's, so the
  check can fail), and every setting is timed."""
  model, params = tiny_target
  dm, dp = tiny_draft
  draft = drafts.T5Draft(params=dp, model=dm)
  x = jax.random.randint(jax.random.PRNGKey(3), (2, 10), 2, 64)
  # skip_below: rounds that propose nothing (width 0) are replayed too.
  rule = AdaptiveConfig("cumulative", threshold=0.7, skip_below=0.8)
  result = adaptive_replay(model, params, draft, x, jax.random.PRNGKey(0), rule, 3,
                           SamplingConfig(temperature=1.0), max_decode_len=12, repeats=1)
  names = [r.setting for r in result.rows]
  assert names == ["rule", "replay", "shuffled", "width 0", "width 1", "width 2", "width 3",
                   "fixed 1", "fixed 2", "fixed 3"]
  # ms per round is a setting's time less the prefill's: with these tiny
  # models its sign is up to the machine's load, so only its presence is checked.
  assert all(math.isfinite(r.ms_per_round) and r.tokens_per_call >= 1 for r in result.rows)
  hist = result.gamma_hist
  assert sum(hist) > 0 and math.isfinite(result.predicted_ms)
  # The rule's tokens per call equal the replay's (same rounds).
  assert result.rows[0].tokens_per_call == result.rows[1].tokens_per_call
  assert "predicted" in adaptive_replay_markdown(result)
  # The rule's rounds used at least two widths, so reproducing them by a
  # schedule is not the trivial constant case.
  assert sum(h > 0 for h in hist) >= 2, hist


def test_round_counting_drafts_reuse_the_targets_encoding():
  """``WidthSchedule`` (and the other round-counting wrappers) hand the
  engine's target encoding to the inner draft: before, they had only
  ``init``, so a bridged draft ran the target's encoder a second time in
  every replayed example and the replay timed it as rounds."""

  class Inner:
    def init(self, inputs, cache_len):
      raise AssertionError("init called: the target's encoding was dropped")

    def init_with_target(self, inputs, cache_len, target_encoded):
      return ("state", cache_len, target_encoded)

  state = init_draft(WidthSchedule(Inner(), jnp.ones((3,), jnp.int32)), jnp.ones((1, 4)), 9,
                     "encoded")
  assert state[0] == ("state", 9, "encoded") and int(state[1]) == 0
