"""Stopping rules replayed offline (lab.stopping), worked by hand."""

from __future__ import annotations

import numpy as np
import pytest

from lab.stopping import simulate_stopping


def test_simulate_stopping_by_hand():
  """Two examples worked by hand (γ_max 3, round costs 1, 2, 3 ms)."""
  ms = {1: 1.0, 2: 2.0, 3: 3.0}
  ok = [np.array([1, 1, 0, 1, 1, 1, 1], bool)]
  conf = [np.array([0.9, 0.8, 0.3, 0.9, 0.9, 0.2, 0.9])]
  # fixed 3: rounds at n=0 (run 2 -> 3 tokens), n=3 (run 3 -> 4 tokens, bonus), n=7 ends.
  r = simulate_stopping(conf, ok, ms, "fixed", 3)
  assert r == (6.0 / 7, 3.5, 3.0)
  # threshold 0.5: n=0: conf 0.9, 0.8 > 0.5 -> width 3; run 2 -> 3 tokens, 3 ms.
  # n=3: conf 0.9 go, 0.9 go -> width 3, run 3 -> 4 tokens, 3 ms. Same as fixed.
  assert simulate_stopping(conf, ok, ms, "threshold", 3, 0.5) == r
  # cumulative 0.75: n=0: 0.9 > 0.75 go, 0.72 stop -> width 2, run 2 -> 3 tokens (bonus), 2 ms.
  # n=3: 0.9 go, 0.81 go -> width 3, run 3 -> 4 tokens, 3 ms.
  assert simulate_stopping(conf, ok, ms, "cumulative", 3, 0.75) == (5.0 / 7, 3.5, 2.5)
  # oracle: n=0 width 2 (run 2), 3 tokens; n=3 width 3, 4 tokens.
  assert simulate_stopping(conf, ok, ms, "oracle", 3) == (5.0 / 7, 3.5, 2.5)
  # a rejection first: oracle width 1, one token.
  assert simulate_stopping([np.array([0.5])], [np.array([False])], ms, "oracle", 3) == (
      1.0, 1.0, 1.0)
  # skip_below: a round whose first confidence is <= 0.2 is a plain target step
  # (width 0, 0.5 ms, one token); then n=1: 0.9 > 0.5 twice, but only 2
  # positions remain -> width 2, run 2 -> 3 tokens, 2 ms.
  ms0 = {0: 0.5, **ms}
  ok2, conf2 = [np.array([0, 1, 1], bool)], [np.array([0.1, 0.9, 0.9])]
  assert simulate_stopping(conf2, ok2, ms0, "threshold", 3, 0.5, skip_below=0.2) == (
      2.5 / 4, 2.0, 1.0)
  # With a width-0 cost the oracle skips the round it knows is rejected: same here.
  assert simulate_stopping(conf2, ok2, ms0, "oracle", 3) == (2.5 / 4, 2.0, 1.0)
  with pytest.raises(ValueError, match="no cost for widths"):
    simulate_stopping(conf2, ok2, ms, "threshold", 3, 0.5, skip_below=0.2)
  with pytest.raises(ValueError, match="skip_below applies"):
    simulate_stopping(conf2, ok2, ms0, "fixed", 3, skip_below=0.2)
  with pytest.raises(ValueError, match="no cost for widths"):
    simulate_stopping(conf, ok, {1: 1.0}, "fixed", 3)
  with pytest.raises(ValueError, match="unknown stopping rule"):
    simulate_stopping(conf, ok, ms, "greedy", 3)
